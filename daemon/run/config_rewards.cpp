// The [[rewards]] tables of the run config (what each type means: daemon/run/rewards.h).
#include <algorithm>
#include <set>

#include "daemon/run/config_internal.h"

namespace ferry::run {
namespace {

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
}

Result<RewardType> ParseType(Reader& rd, const toml::node& v) {
  FERRY_ASSIGN_OR_RETURN(std::string s, rd.String(v));
  for (RewardType t : {RewardType::kAnswerMatch, RewardType::kDigitMatch, RewardType::kRegex, RewardType::kLength,
                       RewardType::kCommand}) {
    if (s == RewardTypeName(t)) return t;
  }
  return rd.Error("must be \"answer_match\", \"digit_match\", \"regex\", \"length\" or \"command\" (got " +
                  Reader::Show(s) + ")");
}

// The keys each type accepts besides name, type and weight.
std::set<std::string_view> KeysOf(RewardType t) {
  switch (t) {
    case RewardType::kAnswerMatch: return {"field", "pattern", "group", "normalize"};
    case RewardType::kDigitMatch: return {"field", "pattern", "group", "align"};
    case RewardType::kRegex: return {"pattern", "match"};
    case RewardType::kLength: return {"target"};
    case RewardType::kCommand: return {"command", "timeout_seconds", "batch_size", "stderr_file"};
  }
  return {};
}

std::string KeyList(const std::set<std::string_view>& keys) {
  std::string out;
  for (std::string_view k : keys) {
    if (!out.empty()) out += ", ";
    out += k;
  }
  return out;
}

}  // namespace

Result<RewardSpec> ParseReward(Reader& rd, const toml::node& v, size_t index, const std::filesystem::path& base,
                               bool* has_weight) {
  const std::string at = "rewards[" + std::to_string(index) + "]";
  Reader::Scope whole(rd, at);
  if (!v.is_table()) return rd.Error("must be a table (write [[rewards]]), got " + Reader::TypeName(v));
  const toml::table& t = *v.as_table();
  RewardSpec spec;
  const toml::node* type = t.get("type");
  if (type == nullptr) {
    Reader::Scope s(rd, at + ".type");
    return rd.Error("is required (\"answer_match\", \"digit_match\", \"regex\", \"length\" or \"command\")");
  }
  {
    Reader::Scope s(rd, at + ".type");
    FERRY_ASSIGN_OR_RETURN(spec.type, ParseType(rd, *type));
  }
  spec.name = std::string(RewardTypeName(spec.type));
  const std::set<std::string_view> allowed = KeysOf(spec.type);
  bool have_group = false;
  *has_weight = false;

  for (auto&& [k, val] : t) {
    const std::string key(k.str());
    Reader::Scope s(rd, at + "." + key);
    if (key == "type") continue;
    if (key == "name") {
      FERRY_ASSIGN_OR_RETURN(spec.name, rd.String(val, kMaxRewardNameLength));
      if (spec.name.empty() || !std::all_of(spec.name.begin(), spec.name.end(), IsNameChar)) {
        return rd.Error("must be 1 to " + std::to_string(kMaxRewardNameLength) +
                        " characters of A-Z a-z 0-9 _ - . (it names metrics; got " + Reader::Show(spec.name) + ")");
      }
      continue;
    }
    if (key == "weight") {
      FERRY_ASSIGN_OR_RETURN(spec.weight, rd.Float(val, {.min = -1e12, .max = 1e12}));
      *has_weight = true;
      continue;
    }
    if (!allowed.count(key)) {
      return rd.Error("is not a key of type \"" + std::string(RewardTypeName(spec.type)) +
                      "\" (its keys: name, type, weight, " + KeyList(allowed) + ")");
    }
    if (key == "field") {
      FERRY_ASSIGN_OR_RETURN(spec.field, rd.String(val, 256));
      if (spec.field.empty() || !IsPrintableUtf8(spec.field)) return rd.Error("must be a dataset field name");
    } else if (key == "pattern") {
      FERRY_ASSIGN_OR_RETURN(std::string pattern, rd.String(val, kMaxRegexLength));
      if (auto groups = CheckRegex(pattern); !groups.ok()) return rd.Error(groups.status().message());
      spec.pattern = std::move(pattern);
    } else if (key == "group") {
      FERRY_ASSIGN_OR_RETURN(int64_t g, rd.Int(val, 0, 1000));
      spec.group = static_cast<int>(g);
      have_group = true;
    } else if (key == "normalize") {
      FERRY_ASSIGN_OR_RETURN(spec.normalize, rd.String(val));
      if (spec.normalize != "auto" && spec.normalize != "none") {
        return rd.Error("must be \"auto\" or \"none\" (got " + Reader::Show(spec.normalize) + ")");
      }
    } else if (key == "align") {
      FERRY_ASSIGN_OR_RETURN(spec.align, rd.String(val));
      if (spec.align != "left" && spec.align != "right") {
        return rd.Error("must be \"left\" or \"right\" (got " + Reader::Show(spec.align) + ")");
      }
    } else if (key == "match") {
      FERRY_ASSIGN_OR_RETURN(spec.match, rd.String(val));
      if (spec.match != "full" && spec.match != "search") {
        return rd.Error("must be \"full\" or \"search\" (got " + Reader::Show(spec.match) + ")");
      }
    } else if (key == "target") {
      FERRY_ASSIGN_OR_RETURN(spec.target, rd.Int(val, 1, kMaxSequenceTokens));
    } else if (key == "command") {
      if (val.is_string()) {
        return rd.Error(
            "must be an array of strings, the program and its arguments (no shell): [\"python3\", \"reward.py\"]");
      }
      FERRY_ASSIGN_OR_RETURN(spec.command, rd.StringList(val, kMaxCommandArgs));
      if (spec.command.empty() || spec.command[0].empty()) return rd.Error("must name a program");
      if (spec.command[0].find('/') != std::string::npos) {
        std::filesystem::path prog(spec.command[0]);
        if (prog.is_relative()) spec.command[0] = (base / prog).lexically_normal().string();
      }
    } else if (key == "timeout_seconds") {
      FERRY_ASSIGN_OR_RETURN(spec.timeout_seconds, rd.Float(val, {.min = 0, .min_open = true, .max = 86400}));
    } else if (key == "batch_size") {
      FERRY_ASSIGN_OR_RETURN(spec.batch_size, rd.Int(val, 0, kMaxGenerationBatchSize));
    } else if (key == "stderr_file") {
      FERRY_ASSIGN_OR_RETURN(std::string f, rd.String(val));
      if (f.empty()) return rd.Error("must not be empty (leave it out for ferryd's stderr)");
      if (f[0] == '~')
        return rd.Error("'~' is not expanded: write an absolute path or one relative to the config file");
      std::filesystem::path p(f);
      spec.stderr_file = (p.is_relative() ? base / p : p).lexically_normal();
    }
  }

  auto require = [&](std::string_view key, bool present, const std::string& what) -> Status {
    if (present) return Status::OK();
    Reader::Scope s(rd, at + "." + std::string(key));
    return rd.Error("is required for type \"" + std::string(RewardTypeName(spec.type)) + "\" (" + what + ")");
  };
  switch (spec.type) {
    case RewardType::kAnswerMatch:
    case RewardType::kDigitMatch: {
      FERRY_RETURN_IF_ERROR(require("field", !spec.field.empty(), "the dataset field with the reference answer"));
      const bool own_pattern = spec.pattern.has_value();
      if (!own_pattern) spec.pattern = std::string(kDefaultAnswerPattern);
      const int groups = *CheckRegex(*spec.pattern);
      if (!have_group) {
        spec.group = groups >= 1 ? 1 : 0;
      } else if (spec.group > groups) {
        Reader::Scope s(rd, at + ".group");
        return rd.Error(std::to_string(spec.group) + " but the pattern has " + std::to_string(groups) +
                        " capture group(s)" + (own_pattern ? "" : " (set pattern to use a group)"));
      }
      break;
    }
    case RewardType::kRegex:
      FERRY_RETURN_IF_ERROR(require("pattern", spec.pattern.has_value(), "the RE2 pattern the completion must match"));
      break;
    case RewardType::kLength:
      FERRY_RETURN_IF_ERROR(require("target", spec.target > 0, "the target length in tokens"));
      break;
    case RewardType::kCommand:
      FERRY_RETURN_IF_ERROR(require("command", !spec.command.empty(), "argv, e.g. [\"python3\", \"reward.py\"]"));
      spec.working_dir = base;
      break;
  }
  return spec;
}

}  // namespace ferry::run
