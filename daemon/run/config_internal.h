// Internal to daemon/run's config reader: typed access to toml++ nodes with messages in the
// format config.h promises ("FILE: key 'NAME': what is wrong"), and the pieces of the parser
// that live in their own files. Not part of ferry_run's interface.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include "core/status.h"
#include "daemon/run/config.h"

namespace ferry::run {

// The value a TRL key must have when ferryd does not implement its feature.
struct NeutralValue {
  enum class Kind { kBool, kFloat, kString, kNone, kNoneOrFloat };
  Kind kind = Kind::kNone;
  bool b = false;
  double f = 0;
  std::string_view s;

  static NeutralValue Bool(bool v) { return {Kind::kBool, v, 0, {}}; }
  static NeutralValue Float(double v) { return {Kind::kFloat, false, v, {}}; }
  static NeutralValue String(std::string_view v) { return {Kind::kString, false, 0, v}; }
  // No value is accepted (TRL's default is None and TOML has no null).
  static NeutralValue None() { return {Kind::kNone, false, 0, {}}; }
  // TRL's default is None; `v` has the same effect and is accepted.
  static NeutralValue NoneOrFloat(double v) { return {Kind::kNoneOrFloat, false, v, {}}; }
};

// True when `s` is valid UTF-8 without C0/C1 control characters or DEL.
bool IsPrintableUtf8(std::string_view s);

class Reader {
 public:
  Reader(std::string source, std::vector<std::string>* warnings) : source_(std::move(source)), warnings_(warnings) {}

  // Names the key being read while alive (keys are full dotted paths).
  class Scope {
   public:
    Scope(Reader& r, std::string key) : r_(r), saved_(std::move(r.key_)) { r_.key_ = std::move(key); }
    ~Scope() { r_.key_ = std::move(saved_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Reader& r_;
    std::string saved_;
  };

  struct Range {
    double min = -std::numeric_limits<double>::max();
    bool min_open = false;
    double max = std::numeric_limits<double>::max();
    bool max_open = false;
    bool allow_inf = false;  // +inf passes (then max is ignored)
  };

  const std::string& key() const { return key_; }
  const std::string& source() const { return source_; }

  // kInvalidArgument / kUnsupported "SOURCE: key 'KEY': what".
  Status Error(const std::string& what) const;
  Status Unsupported(const std::string& what) const;
  // Appends "SOURCE: key 'KEY': what" to the warnings.
  void Warn(const std::string& what);

  Result<double> Float(const toml::node& v, const Range& range) const;  // an integer or a float
  Result<int64_t> Int(const toml::node& v, int64_t min, int64_t max) const;
  Result<bool> Bool(const toml::node& v) const;
  // A string of at most `max_len` bytes without NUL.
  Result<std::string> String(const toml::node& v, size_t max_len = 4096) const;
  Result<std::vector<double>> FloatList(const toml::node& v, const Range& range, size_t max_entries) const;
  Result<std::vector<std::string>> StringList(const toml::node& v, size_t max_entries, size_t max_len = 4096) const;
  // OK when `v` is the neutral value; kUnsupported saying "ferryd <why>" otherwise.
  Status Neutral(const toml::node& v, const NeutralValue& neutral, std::string_view why) const;

  // "a string", "an integer", "a table", ...
  static std::string TypeName(const toml::node& v);
  // `s` quoted, non-printable bytes escaped, cut at 80 bytes.
  static std::string Show(std::string_view s);
  // Shortest text that reads back as `x` ("0.2", "1e-06", "inf").
  static std::string Num(double x);

 private:
  std::string source_;
  std::string key_;
  std::vector<std::string>* warnings_;
};

// The state of one parse: the config being filled, and what top-level keys set that is
// resolved only once every key has been read (Resolve in config.cpp).
struct Parse {
  RunConfig& c;
  Reader& rd;
  std::filesystem::path base;              // the config file's directory
  std::set<std::string, std::less<>> set;  // top-level keys present
  std::optional<std::vector<double>> reward_weights;
  std::optional<double> clip_cap;  // vllm_importance_sampling_cap
  std::optional<int64_t> generation_batch_size;
  std::optional<int64_t> steps_per_generation;
  std::optional<double> epsilon_high;
  const toml::array* rewards = nullptr;
  bool have_output_dir = false;
  const toml::node* store = nullptr;
};

// One top-level key of the run config (config_keys.cpp holds the table; its top says how to
// add one). The row alone drives reading the key (with its messages), the resolved JSON
// (RunConfig::ToJson, in table order) and the fingerprint; the docs test walks it.
struct KeyInfo {
  using Read = std::function<Status(Parse&, const toml::node&)>;
  using Value = std::function<nlohmann::ordered_json(const RunConfig&)>;
  using AtDefault = std::function<bool(const RunConfig&)>;
  // How ToJson and Fingerprint treat the key.
  enum class Record {
    kAlways,         // in both
    kUnlessDefault,  // in ToJson; in Fingerprint only when set away from its default (a key
                     // added after runs were made: their checkpoints still match)
    kNever,          // in neither (operational settings, a deprecated alias)
  };
  std::string_view name;
  Record record = Record::kAlways;
  std::vector<std::string_view> subkeys;  // a table's keys ([store], [publish], [control])
  Read read;                              // checks the value and stores it (or defers it)
  Value value;                            // the resolved value
  AtDefault at_default;                   // true when the resolved value is the default
};

// Every top-level key, in the order ToJson writes them.
std::span<const KeyInfo> TopLevelKeys();

// `"a", "b" or "c"`: E's spellings as messages list them.
template <typename E>
std::string QuotedSpellings() {
  const auto names = SpellingsOf<E>();
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += i + 1 == names.size() ? " or " : ", ";
    out += '"';
    out += names[i].name;
    out += '"';
  }
  return out;
}

// A path key: not empty, no '~', relative to `base`, made lexically normal.
Result<std::filesystem::path> ResolvePath(Reader& rd, const toml::node& v, const std::filesystem::path& base);

// [publish] and [control]: endpoint, key, allow (and, for [publish], mode). `table` is the
// section name used in errors.
[[nodiscard]] Status ReadEndpointTable(Parse& p, const toml::node& v, const std::string& table, std::string& endpoint,
                                       std::filesystem::path& key, std::filesystem::path& allow,
                                       sync::PublishMode* mode);

// The resolved [lora] table and one [[rewards]] table as ToJson writes them (config_json.cpp).
nlohmann::ordered_json LoraJson(const LoraSettings& lora);
nlohmann::ordered_json RewardJson(const RewardSpec& reward);

// The [lora] table into `out` (keys "lora.*").
[[nodiscard]] Status ParseLora(Reader& rd, const toml::node& v, LoraSettings& out);

// rewards[index]; `base` is the config file's directory. Sets *has_weight when the table
// has a `weight` key.
[[nodiscard]] Result<RewardSpec> ParseReward(Reader& rd, const toml::node& v, size_t index,
                                             const std::filesystem::path& base, bool* has_weight);

// Compiles `pattern` with the options ferry_run uses for every regex (RE2, UTF-8, 1 MiB of
// program memory, longest-match off) and returns its number of capture groups, or the
// reason it does not compile (lookaround and backreferences named as such).
Result<int> CheckRegex(std::string_view pattern);

}  // namespace ferry::run
