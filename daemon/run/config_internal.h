// Internal to daemon/run's config reader: typed access to toml++ nodes with messages in the
// format config.h promises ("FILE: key 'NAME': what is wrong"), and the pieces of the parser
// that live in their own files. Not part of ferry_run's interface.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <toml++/toml.h>

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

struct NeutralKey {
  std::string_view name;
  NeutralValue neutral;
  std::string_view why;  // completes "ferryd ..."
};

// TRL keys accepted only at their neutral value, in the order ToJson writes them.
std::span<const NeutralKey> NeutralKeys();

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
