// The built-in rewards and the scorer (rewards.h says exactly how each one scores).
#include "daemon/run/rewards.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <re2/re2.h>

#include "daemon/run/reward_command.h"

namespace ferry::run {
namespace {

constexpr int64_t kRe2MaxMem = int64_t{1} << 20;

std::unique_ptr<RE2> Compile(const std::string& pattern) {
  RE2::Options opt;
  opt.set_log_errors(false);
  opt.set_max_mem(kRe2MaxMem);
  return std::make_unique<RE2>(pattern, opt);
}

std::string_view Trim(std::string_view s) {
  auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

// Group `group` of the last match of `re` in `text` (matches taken left to right without
// overlap); nullopt when nothing matches or the group did not take part in the last match.
std::optional<std::string_view> LastMatch(std::string_view text, const RE2& re, int group) {
  std::vector<re2::StringPiece> sub(static_cast<size_t>(group) + 1);
  const re2::StringPiece input(text.data(), text.size());
  std::optional<std::string_view> last;
  bool any = false;
  size_t pos = 0;
  while (pos <= text.size()) {
    if (!re.Match(input, pos, text.size(), RE2::UNANCHORED, sub.data(), group + 1)) break;
    any = true;
    const re2::StringPiece& g = sub[static_cast<size_t>(group)];
    last = g.data() != nullptr ? std::optional<std::string_view>(std::string_view(g.data(), g.size())) : std::nullopt;
    const size_t start = static_cast<size_t>(sub[0].data() - text.data());
    size_t next = start + sub[0].size();
    if (next == start) {
      // An empty match: step over one UTF-8 character.
      ++next;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xc0) == 0x80) ++next;
    }
    pos = next;
  }
  return any ? last : std::nullopt;
}

// An exact decimal value: sign, significant digits without leading or trailing zeros, and
// the power of ten of the last digit. Zero is {false, "", 0}.
struct Decimal {
  bool negative = false;
  std::string digits;
  int64_t exponent = 0;
  bool operator==(const Decimal&) const = default;
};

// Reads [+-] digits (optionally with thousands commas) [. digits] [e [+-] digits]; at least
// one digit in the mantissa. nullopt for anything else.
std::optional<Decimal> ParseDecimal(std::string_view s) {
  size_t i = 0;
  Decimal d;
  if (i < s.size() && (s[i] == '+' || s[i] == '-')) d.negative = s[i++] == '-';
  std::string mantissa;
  int64_t frac_digits = 0;
  const size_t int_start = i;
  size_t group = 0;
  bool commas = false;
  while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || s[i] == ',')) {
    if (s[i] == ',') {
      // Thousands separators: 1 to 3 digits first, then groups of exactly 3.
      if ((commas ? group != 3 : (group == 0 || group > 3))) return std::nullopt;
      commas = true;
      group = 0;
    } else {
      mantissa += s[i];
      ++group;
    }
    ++i;
  }
  if (commas && group != 3) return std::nullopt;
  const bool had_int = i > int_start;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      mantissa += s[i++];
      ++frac_digits;
    }
  }
  if (mantissa.empty() || (!had_int && frac_digits == 0)) return std::nullopt;
  int64_t exp = 0;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    bool neg = false;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) neg = s[i++] == '-';
    const size_t exp_start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      if (i - exp_start >= 9) return std::nullopt;  // |exponent| < 1e9
      exp = exp * 10 + (s[i++] - '0');
    }
    if (i == exp_start) return std::nullopt;
    if (neg) exp = -exp;
  }
  if (i != s.size()) return std::nullopt;
  // value = mantissa * 10^(exp - frac_digits)
  size_t lead = 0;
  while (lead < mantissa.size() && mantissa[lead] == '0') ++lead;
  mantissa.erase(0, lead);
  int64_t e = exp - frac_digits;
  while (!mantissa.empty() && mantissa.back() == '0') {
    mantissa.pop_back();
    ++e;
  }
  if (mantissa.empty()) return Decimal{};
  d.digits = std::move(mantissa);
  d.exponent = e;
  return d;
}

// UTF-8 code points of `s` as byte ranges; an invalid byte is one unit of its own.
std::vector<std::string_view> CodePoints(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 1;
    if (i + n > s.size()) n = 1;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) {
        n = 1;
        break;
      }
    }
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

}  // namespace

// One reward function of the scorer.
struct RewardScorer::Function {
  RewardSpec spec;
  std::unique_ptr<RE2> re;                 // answer_match, digit_match, regex
  std::unique_ptr<RewardCommand> command;  // command

  Result<double> Builtin(const RewardInput& in) const {
    switch (spec.type) {
      case RewardType::kAnswerMatch:
      case RewardType::kDigitMatch: {
        const std::string* field = in.example->Field(spec.field);
        if (field == nullptr) {
          return Status::InvalidArgument("reward '" + spec.name + "': the example of line " +
                                         std::to_string(in.example->line) + " has no string or number field '" +
                                         spec.field + "'");
        }
        const std::optional<std::string_view> answer = LastMatch(in.completion, *re, spec.group);
        if (!answer) return 0.0;
        return spec.type == RewardType::kAnswerMatch ? AnswerMatch(*answer, *field) : DigitMatch(*answer, *field);
      }
      case RewardType::kRegex: {
        const re2::StringPiece text(in.completion.data(), in.completion.size());
        const bool ok = spec.match == "full" ? RE2::FullMatch(text, *re) : RE2::PartialMatch(text, *re);
        return ok ? 1.0 : 0.0;
      }
      case RewardType::kLength: {
        const double target = static_cast<double>(spec.target);
        const double off = std::fabs(static_cast<double>(in.completion_tokens) - target) / target;
        return 1.0 - std::min(1.0, off);
      }
      case RewardType::kCommand: break;
    }
    return Status::Internal("reward '" + spec.name + "' is not a built-in");
  }

  double AnswerMatch(std::string_view answer, std::string_view reference) const {
    if (spec.normalize == "none") return answer == reference ? 1.0 : 0.0;
    const std::string_view a = Trim(answer), r = Trim(reference);
    const std::optional<Decimal> da = ParseDecimal(a), dr = ParseDecimal(r);
    if (da && dr) return *da == *dr ? 1.0 : 0.0;
    return a == r ? 1.0 : 0.0;
  }

  double DigitMatch(std::string_view answer, std::string_view reference) const {
    const std::vector<std::string_view> a = CodePoints(Trim(answer)), r = CodePoints(Trim(reference));
    const size_t longest = std::max(a.size(), r.size());
    if (longest == 0) return 1.0;
    const size_t common = std::min(a.size(), r.size());
    size_t same = 0;
    for (size_t i = 0; i < common; ++i) {
      const bool eq = spec.align == "right" ? a[a.size() - 1 - i] == r[r.size() - 1 - i] : a[i] == r[i];
      same += eq ? 1 : 0;
    }
    return static_cast<double>(same) / static_cast<double>(longest);
  }
};

RewardScorer::~RewardScorer() = default;

Result<std::unique_ptr<RewardScorer>> RewardScorer::Create(const RunConfig& config,
                                                           const RewardScorerOptions& options) {
  return Create(config.rewards, options);
}

Result<std::unique_ptr<RewardScorer>> RewardScorer::Create(const std::vector<RewardSpec>& specs,
                                                           const RewardScorerOptions& options) {
  std::unique_ptr<RewardScorer> s(new RewardScorer());
  for (const RewardSpec& spec : specs) {
    auto f = std::make_unique<Function>();
    f->spec = spec;
    const std::string who = "reward '" + spec.name + "'";
    switch (spec.type) {
      case RewardType::kAnswerMatch:
      case RewardType::kDigitMatch:
      case RewardType::kRegex: {
        if (!spec.pattern) return Status::InvalidArgument(who + ": no pattern");
        f->re = Compile(*spec.pattern);
        if (!f->re->ok()) return Status::InvalidArgument(who + ": pattern does not compile: " + f->re->error());
        if (spec.type != RewardType::kRegex &&
            (spec.group < 0 || spec.group > f->re->NumberOfCapturingGroups() || spec.field.empty())) {
          return Status::InvalidArgument(who + ": group " + std::to_string(spec.group) + " or field is invalid");
        }
        if (spec.type == RewardType::kRegex && spec.match != "full" && spec.match != "search") {
          return Status::InvalidArgument(who + ": match must be \"full\" or \"search\"");
        }
        break;
      }
      case RewardType::kLength:
        if (spec.target < 1) return Status::InvalidArgument(who + ": target must be at least 1");
        break;
      case RewardType::kCommand: {
        FERRY_ASSIGN_OR_RETURN(f->command,
                               RewardCommand::Start(spec, options.max_reply_bytes, options.stop_grace_seconds));
        break;
      }
    }
    s->names_.push_back(spec.name);
    s->weights_.push_back(spec.weight);
    s->functions_.push_back(std::move(f));
  }
  return s;
}

Result<RewardMatrix> RewardScorer::ScoreAll(const std::vector<RewardInput>& inputs) {
  RewardMatrix m;
  m.rows = inputs.size();
  m.names = names_;
  m.weights = weights_;
  const size_t cols = functions_.size();
  m.values.assign(m.rows * cols, std::nan(""));
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].example == nullptr) {
      return Status::InvalidArgument("reward input " + std::to_string(i) + " has no dataset example");
    }
  }
  for (size_t f = 0; f < cols; ++f) {
    Function& fn = *functions_[f];
    if (fn.command) continue;
    for (size_t i = 0; i < inputs.size(); ++i) {
      FERRY_ASSIGN_OR_RETURN(m.values[i * cols + f], fn.Builtin(inputs[i]));
    }
  }
  for (size_t f = 0; f < cols; ++f) {
    Function& fn = *functions_[f];
    if (!fn.command) continue;
    FERRY_ASSIGN_OR_RETURN(std::vector<double> r, fn.command->Score(inputs));
    for (size_t i = 0; i < inputs.size(); ++i) m.values[i * cols + f] = r[i];
  }
  return m;
}

Status RewardScorer::Probe(const Example& example) {
  RewardInput in;
  in.prompt = example.conversational() ? example.messages.back().content : example.prompt;
  in.example = &example;
  auto m = ScoreAll({in});
  if (!m.ok())
    return m.status().WithContext("probing the rewards with an empty completion of dataset line " +
                                  std::to_string(example.line));
  return Status::OK();
}

Status RewardScorer::Restart(bool all) {
  for (auto& fn : functions_) {
    if (!fn->command) continue;
    if (all || fn->command->failed() || !fn->command->running()) FERRY_RETURN_IF_ERROR(fn->command->Restart());
  }
  return Status::OK();
}

}  // namespace ferry::run
