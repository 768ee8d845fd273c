// The [[rewards]] tables of the run config: one table of rows per reward type (what each type
// means: daemon/run/rewards.h), each starting with name, type and weight, and each type's rules
// across its keys. Adding a key: a member of RewardSpec (config.h), one row in its type's table
// below in the place its JSON should take, and its line in docs/daemon.md.
#include <algorithm>

#include "daemon/run/config_rows.h"

namespace ferry::run {
namespace {

using OJson = nlohmann::ordered_json;
using Row = KeyInfoT<RewardSpec>;

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.';
}

const Row& TypeKey() {
  static const Row* k = new Row(EnumKey("type", &RewardSpec::type));
  return *k;
}

Row NameKey() {
  Row k = MemberKey("name", &RewardSpec::name, [](Parse& p, const toml::node& v) -> Result<std::string> {
    FERRY_ASSIGN_OR_RETURN(std::string name, p.rd.String(v, kMaxRewardNameLength));
    if (name.empty() || !std::all_of(name.begin(), name.end(), IsNameChar)) {
      return p.rd.Error("must be 1 to " + std::to_string(kMaxRewardNameLength) +
                        " characters of A-Z a-z 0-9 _ - . (it names metrics; got " + Reader::Show(name) + ")");
    }
    return name;
  });
  k.at_default = [](const RewardSpec& r) { return r.name == RewardTypeName(r.type); };
  return k;
}

Row FieldKey() {
  return MemberKey("field", &RewardSpec::field, [](Parse& p, const toml::node& v) -> Result<std::string> {
    FERRY_ASSIGN_OR_RETURN(std::string field, p.rd.String(v, 256));
    if (field.empty() || !IsPrintableUtf8(field)) return p.rd.Error("must be a dataset field name");
    return field;
  });
}

Row PatternKey() {
  return MemberKey("pattern", &RewardSpec::pattern,
                   [](Parse& p, const toml::node& v) -> Result<std::optional<std::string>> {
                     FERRY_ASSIGN_OR_RETURN(std::string pattern, p.rd.String(v, kMaxRegexLength));
                     if (auto groups = CheckRegex(pattern); !groups.ok()) return p.rd.Error(groups.status().message());
                     return std::optional<std::string>(std::move(pattern));
                   });
}

// argv; argv[0] with a '/' is resolved against the config file's directory.
Row CommandKey() {
  return MemberKey("command", &RewardSpec::command,
                   [](Parse& p, const toml::node& v) -> Result<std::vector<std::string>> {
                     if (v.is_string()) {
                       return p.rd.Error(
                           "must be an array of strings, the program and its arguments (no shell): [\"python3\", "
                           "\"reward.py\"]");
                     }
                     FERRY_ASSIGN_OR_RETURN(std::vector<std::string> argv, p.rd.StringList(v, kMaxCommandArgs));
                     if (argv.empty() || argv[0].empty()) return p.rd.Error("must name a program");
                     const std::filesystem::path prog(argv[0]);
                     if (argv[0].find('/') != std::string::npos && prog.is_relative()) {
                       argv[0] = (p.base / prog).lexically_normal().string();
                     }
                     return argv;
                   });
}

Row StderrFileKey() {
  return {"stderr_file",
          Record::kAlways,
          {},
          [](Parse& p, RewardSpec& r, const toml::node& v) {
            if (v.is_string() && v.as_string()->get().empty()) {
              return p.rd.Error("must not be empty (leave it out for ferryd's stderr)");
            }
            return Into(ResolvePath(p.rd, v, p.base), r.stderr_file);
          },
          [](const RewardSpec& r) { return r.stderr_file.empty() ? OJson(nullptr) : OJson(r.stderr_file.string()); },
          SameAsDefault(&RewardSpec::stderr_file)};
}

struct TypeTable {
  std::vector<Row> rows;  // name, type, weight, then the type's own keys
  std::string own_keys;   // the type's own keys, sorted, as messages list them
};

// One table per RewardType, in its order.
std::vector<TypeTable> MakeTables() {
  const auto with = [](std::vector<Row> own) {
    std::vector<std::string_view> names = NamesOf(std::span<const Row>(own));
    std::sort(names.begin(), names.end());
    std::vector<Row> rows = {NameKey(), TypeKey(),
                             FloatKey("weight", &RewardSpec::weight, {.min = -1e12, .max = 1e12})};
    rows.insert(rows.end(), own.begin(), own.end());
    return TypeTable{std::move(rows), ListOf(names, "", ", ")};
  };
  const Row field = FieldKey(), pattern = PatternKey(), group = IntKey("group", &RewardSpec::group, 0, 1000);
  return {
      with({field, pattern, group, ChoiceKey("normalize", &RewardSpec::normalize, {"auto", "none"})}),  // answer_match
      with({field, pattern, group, ChoiceKey("align", &RewardSpec::align, {"left", "right"})}),         // digit_match
      with({pattern, ChoiceKey("match", &RewardSpec::match, {"full", "search"})}),                      // regex
      with({IntKey("target", &RewardSpec::target, 1, kMaxSequenceTokens)}),                             // length
      with({CommandKey(),                                                                               // command
            FloatKey("timeout_seconds", &RewardSpec::timeout_seconds, {.min = 0, .min_open = true, .max = 86400}),
            IntKey("batch_size", &RewardSpec::batch_size, 0, kMaxGenerationBatchSize), StderrFileKey()}),
  };
}

const TypeTable& TableOf(RewardType type) {
  static const std::vector<TypeTable>* tables = new std::vector<TypeTable>(MakeTables());
  return (*tables)[static_cast<size_t>(type)];
}

}  // namespace

std::span<const KeyInfoT<RewardSpec>> RewardKeys(RewardType type) { return TableOf(type).rows; }

Result<RewardSpec> ReadReward(Parse& p, const toml::node& v, size_t index) {
  Reader& rd = p.rd;
  const std::string at = "rewards[" + std::to_string(index) + "]";
  Reader::Scope whole(rd, at);
  if (!v.is_table()) return rd.Error("must be a table (write [[rewards]]), got " + Reader::TypeName(v));
  const toml::table& t = *v.as_table();
  RewardSpec spec;
  {
    Reader::Scope s(rd, at + ".type");
    const toml::node* type = t.get("type");
    if (type == nullptr) return rd.Error("is required (" + QuotedSpellings<RewardType>() + ")");
    FERRY_RETURN_IF_ERROR(TypeKey().read(p, spec, *type));  // first: it chooses the table
  }
  spec.name = std::string(RewardTypeName(spec.type));
  const TypeTable& table = TableOf(spec.type);
  FERRY_RETURN_IF_ERROR(ReadRows(p, t, at, std::span<const Row>(table.rows), spec, [&](const std::string&) {
    return rd.Error("is not a key of type \"" + std::string(RewardTypeName(spec.type)) +
                    "\" (its keys: name, type, weight, " + table.own_keys + ")");
  }));

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
      if (!t.contains("group")) {
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
      spec.working_dir = p.base;
      break;
  }
  return spec;
}

}  // namespace ferry::run
