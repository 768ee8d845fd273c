// Internal to daemon/run's config reader: typed access to toml++ nodes with messages in the
// format config.h promises ("FILE: key 'NAME': what is wrong"), and the pieces of the parser
// that live in their own files. Not part of ferry_run's interface.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
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
  const toml::table& root;     // the file: which top-level keys are set
  std::filesystem::path base;  // the config file's directory
  std::optional<std::vector<double>> reward_weights = {};
  std::optional<double> clip_cap = {};  // vllm_importance_sampling_cap
  std::optional<int64_t> generation_batch_size = {};
  std::optional<int64_t> steps_per_generation = {};
  std::optional<double> epsilon_high = {};
  const toml::array* rewards = nullptr;
  const toml::node* store = nullptr;
};

// How ToJson and Fingerprint treat a key.
enum class Record {
  kAlways,         // in both
  kUnlessDefault,  // in ToJson; in Fingerprint only when set away from its default (a key
                   // added after runs were made: their checkpoints still match). Top-level rows only.
  kWhenSet,        // in both only when set away from its default (a key added after runs were
                   // made whose resolved JSON should read as it did too). Top-level rows only.
  kNever,          // in neither (operational settings, a deprecated alias, a PEFT key accepted
                   // only at its neutral value)
};

// One key of one table of the run config, filling a T: RunConfig (the top level),
// LoraSettings ([lora]), RewardSpec (a [[rewards]] table), StoreSettings, PublishSettings,
// ControlSettings. As in RocksDB's option type maps, the row alone reads and checks the key
// (with its messages), gives its resolved JSON value and says whether that is the default:
// ToJson and Fingerprint write the rows in table order, and the docs test walks them. The
// tables: config_keys.cpp (top level, [store], [publish], [control]), config_lora.cpp,
// config_rewards.cpp; the factories they are written with: config_rows.h.
template <typename T>
struct KeyInfoT {
  using Read = std::function<Status(Parse&, T&, const toml::node&)>;
  using Value = std::function<nlohmann::ordered_json(const T&)>;
  using AtDefault = std::function<bool(const T&)>;
  std::string_view name;
  Record record = Record::kAlways;
  std::vector<std::string_view> subkeys;  // a small table's keys, documented as `[store]` `path`
  Read read;                              // checks the value and stores it (or defers it)
  Value value;                            // the resolved value
  AtDefault at_default;                   // true when the resolved value is the default
};
using KeyInfo = KeyInfoT<RunConfig>;

// The tables (each in the order ToJson writes its keys).
std::span<const KeyInfo> TopLevelKeys();
std::span<const KeyInfoT<LoraSettings>> LoraKeys();
// name, type and weight, then `type`'s own keys.
std::span<const KeyInfoT<RewardSpec>> RewardKeys(RewardType type);

template <typename T>
std::vector<std::string_view> NamesOf(std::span<const KeyInfoT<T>> rows) {
  std::vector<std::string_view> names;
  for (const KeyInfoT<T>& k : rows) names.push_back(k.name);
  return names;
}

// Reads every key of `t` with its row of `rows` into `out`, the key named "PREFIX.KEY" in
// messages (just "KEY" without a prefix); a key without a row is `unknown(KEY)`'s error.
template <typename T>
[[nodiscard]] Status ReadRows(Parse& p, const toml::table& t, std::string_view prefix,
                              std::span<const KeyInfoT<T>> rows, T& out,
                              const std::function<Status(const std::string&)>& unknown) {
  for (auto&& [k, v] : t) {
    const std::string key(k.str());
    Reader::Scope scope(p.rd, prefix.empty() ? key : std::string(prefix) + "." + key);
    const auto row = std::find_if(rows.begin(), rows.end(), [&](const KeyInfoT<T>& r) { return r.name == key; });
    FERRY_RETURN_IF_ERROR(row != rows.end() ? row->read(p, out, v) : unknown(key));
  }
  return Status::OK();
}

// The recorded rows' values as a JSON object, in table order; `fingerprint`: as Fingerprint
// hashes them.
template <typename T>
nlohmann::ordered_json RowsJson(std::span<const KeyInfoT<T>> rows, const T& x, bool fingerprint = false) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const KeyInfoT<T>& k : rows) {
    if (k.record == Record::kNever) continue;
    if (fingerprint && k.record == Record::kUnlessDefault && k.at_default(x)) continue;
    if (k.record == Record::kWhenSet && k.at_default(x)) continue;
    j[std::string(k.name)] = k.value(x);
  }
  return j;
}

// `names` as messages list them: each between `quote`s, separated by ", " and, before the
// last, by `last` (" or ", " and ", ", ").
std::string ListOf(std::span<const std::string_view> names, std::string_view quote, std::string_view last);

// `"a", "b" or "c"`: E's spellings as messages list them.
template <typename E>
std::string QuotedSpellings() {
  std::vector<std::string_view> names;
  for (const Spelling<E>& s : SpellingsOf<E>()) names.push_back(s.name);
  return ListOf(names, "\"", " or ");
}

// A path key: not empty, no '~', relative to `base`, made lexically normal.
Result<std::filesystem::path> ResolvePath(Reader& rd, const toml::node& v, const std::filesystem::path& base);

// The [lora] table into `out`, with PEFT's rules.
[[nodiscard]] Status ReadLora(Parse& p, const toml::node& v, LoraSettings& out);

// rewards[index], with its type's rules.
[[nodiscard]] Result<RewardSpec> ReadReward(Parse& p, const toml::node& v, size_t index);

// [store] (a table or a path string), once output_dir is known.
[[nodiscard]] Status ReadStore(Parse& p, const toml::node& v);

// Compiles `pattern` with the options ferry_run uses for every regex (RE2, UTF-8, 1 MiB of
// program memory, longest-match off) and returns its number of capture groups, or the
// reason it does not compile (lookaround and backreferences named as such).
Result<int> CheckRegex(std::string_view pattern);

}  // namespace ferry::run
