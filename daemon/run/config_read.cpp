// Typed reads of toml++ nodes for the run config (config_internal.h).
#include <charconv>
#include <cmath>
#include <memory>

#include <re2/re2.h>

#include "core/text.h"
#include "daemon/run/config_internal.h"

namespace ferry::run {
namespace {

std::string RangeText(const Reader::Range& r) {
  const bool has_min = r.min > -std::numeric_limits<double>::max();
  const bool has_max = !r.allow_inf && r.max < std::numeric_limits<double>::max();
  if (has_min && has_max) {
    return std::string(r.min_open ? "(" : "[") + Reader::Num(r.min) + ", " + Reader::Num(r.max) +
           (r.max_open ? ")" : "]");
  }
  if (has_min) return std::string(r.min_open ? "> " : ">= ") + Reader::Num(r.min);
  if (has_max) return std::string(r.max_open ? "< " : "<= ") + Reader::Num(r.max);
  return "finite";
}

}  // namespace

bool IsPrintableUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) return false;
      ++i;
      continue;
    }
    size_t n;
    uint32_t cp;
    if ((c & 0xe0) == 0xc0) {
      n = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    const uint32_t min_cp = n == 2 ? 0x80 : n == 3 ? 0x800 : 0x10000;
    if (cp < min_cp || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    if (cp >= 0x80 && cp < 0xa0) return false;  // C1 controls
    i += n;
  }
  return true;
}

std::string ListOf(std::span<const std::string_view> names, std::string_view quote, std::string_view last) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += i + 1 == names.size() ? last : ", ";
    out.append(quote).append(names[i]).append(quote);
  }
  return out;
}

Status Reader::Error(const std::string& what) const {
  return Status::InvalidArgument(source_ + ": key '" + key_ + "': " + what);
}

Status Reader::Unsupported(const std::string& what) const {
  return Status::Unsupported(source_ + ": key '" + key_ + "': " + what);
}

void Reader::Warn(const std::string& what) {
  if (warnings_ != nullptr) warnings_->push_back(source_ + ": key '" + key_ + "': " + what);
}

std::string Reader::TypeName(const toml::node& v) {
  switch (v.type()) {
    case toml::node_type::table: return "a table";
    case toml::node_type::array: return "an array";
    case toml::node_type::string: return "a string";
    case toml::node_type::integer: return "an integer";
    case toml::node_type::floating_point: return "a float";
    case toml::node_type::boolean: return "a boolean";
    case toml::node_type::date: return "a date";
    case toml::node_type::time: return "a time";
    case toml::node_type::date_time: return "a date-time";
    default: return "nothing";
  }
}

std::string Reader::Show(std::string_view s) { return QuoteForMessage(s, 80); }

std::string Reader::Num(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), x);
  return std::string(buf, r.ptr);
}

Result<double> Reader::Float(const toml::node& v, const Range& range) const {
  double x;
  if (v.is_integer()) {
    x = static_cast<double>(v.as_integer()->get());
  } else if (v.is_floating_point()) {
    x = v.as_floating_point()->get();
  } else {
    return Error("must be a number (got " + TypeName(v) + ")");
  }
  if (std::isnan(x)) return Error("must be a number (got nan)");
  if (std::isinf(x)) {
    if (range.allow_inf && x > 0) return x;
    return Error("must be " + RangeText(range) + " (got " + Num(x) + ")");
  }
  const bool low = range.min_open ? !(x > range.min) : !(x >= range.min);
  const bool high = range.max_open ? !(x < range.max) : !(x <= range.max);
  if (low || (high && !(range.allow_inf && range.max == std::numeric_limits<double>::infinity()))) {
    return Error("must be " + RangeText(range) + " (got " + Num(x) + ")");
  }
  return x;
}

Result<int64_t> Reader::Int(const toml::node& v, int64_t min, int64_t max) const {
  if (v.is_floating_point()) return Error("must be an integer (got " + Num(v.as_floating_point()->get()) + ")");
  if (!v.is_integer()) return Error("must be an integer (got " + TypeName(v) + ")");
  const int64_t x = v.as_integer()->get();
  if (x < min || x > max) {
    return Error("must be in [" + std::to_string(min) + ", " + std::to_string(max) + "] (got " + std::to_string(x) +
                 ")");
  }
  return x;
}

Result<bool> Reader::Bool(const toml::node& v) const {
  if (!v.is_boolean()) return Error("must be true or false (got " + TypeName(v) + ")");
  return v.as_boolean()->get();
}

Result<std::string> Reader::String(const toml::node& v, size_t max_len) const {
  if (!v.is_string()) return Error("must be a string (got " + TypeName(v) + ")");
  const std::string& s = v.as_string()->get();
  if (s.size() > max_len)
    return Error("has " + std::to_string(s.size()) + " bytes; at most " + std::to_string(max_len));
  if (s.find('\0') != std::string::npos) return Error("must not contain NUL");
  return s;
}

Result<std::vector<double>> Reader::FloatList(const toml::node& v, const Range& range, size_t max_entries) const {
  if (!v.is_array()) return Error("must be an array of numbers (got " + TypeName(v) + ")");
  const toml::array& a = *v.as_array();
  if (a.size() > max_entries)
    return Error("has " + std::to_string(a.size()) + " entries; at most " + std::to_string(max_entries));
  std::vector<double> out;
  for (size_t i = 0; i < a.size(); ++i) {
    Reader element(source_, nullptr);
    element.key_ = key_ + "[" + std::to_string(i) + "]";
    FERRY_ASSIGN_OR_RETURN(double x, element.Float(a[i], range));
    out.push_back(x);
  }
  return out;
}

Result<std::vector<std::string>> Reader::StringList(const toml::node& v, size_t max_entries, size_t max_len) const {
  if (!v.is_array()) return Error("must be an array of strings (got " + TypeName(v) + ")");
  const toml::array& a = *v.as_array();
  if (a.size() > max_entries)
    return Error("has " + std::to_string(a.size()) + " entries; at most " + std::to_string(max_entries));
  std::vector<std::string> out;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].is_string()) return Error("[" + std::to_string(i) + "] must be a string (got " + TypeName(a[i]) + ")");
    const std::string& s = a[i].as_string()->get();
    if (s.size() > max_len)
      return Error("[" + std::to_string(i) + "] has " + std::to_string(s.size()) + " bytes; at most " +
                   std::to_string(max_len));
    if (s.find('\0') != std::string::npos) return Error("[" + std::to_string(i) + "] must not contain NUL");
    out.push_back(s);
  }
  return out;
}

Status Reader::Neutral(const toml::node& v, const NeutralValue& n, std::string_view why) const {
  const std::string tail = ": ferryd " + std::string(why);
  switch (n.kind) {
    case NeutralValue::Kind::kBool: {
      FERRY_ASSIGN_OR_RETURN(bool b, Bool(v));
      if (b != n.b) return Unsupported(std::string("only ") + (n.b ? "true" : "false") + " is accepted" + tail);
      return Status::OK();
    }
    case NeutralValue::Kind::kFloat:
    case NeutralValue::Kind::kNoneOrFloat: {
      FERRY_ASSIGN_OR_RETURN(double x, Float(v, {}));
      if (x != n.f) return Unsupported("only " + Num(n.f) + " is accepted (got " + Num(x) + ")" + tail);
      return Status::OK();
    }
    case NeutralValue::Kind::kString: {
      FERRY_ASSIGN_OR_RETURN(std::string s, String(v));
      if (s != n.s) return Unsupported("only \"" + std::string(n.s) + "\" is accepted (got " + Show(s) + ")" + tail);
      return Status::OK();
    }
    case NeutralValue::Kind::kNone: return Unsupported("cannot be set" + tail);
  }
  return Status::OK();
}

Result<int> CheckRegex(std::string_view pattern) {
  if (pattern.size() > kMaxRegexLength) {
    return Status::InvalidArgument("a pattern of " + std::to_string(pattern.size()) + " bytes; at most " +
                                   std::to_string(kMaxRegexLength));
  }
  RE2::Options opt;
  opt.set_log_errors(false);
  opt.set_max_mem(int64_t{1} << 20);
  RE2 re(re2::StringPiece(pattern.data(), pattern.size()), opt);
  if (!re.ok()) {
    std::string why = "not a valid RE2 regular expression: " + re.error();
    if (re.error_code() == RE2::ErrorBadPerlOp || re.error_code() == RE2::ErrorBadEscape) {
      why += " (RE2 has no lookaround and no backreferences)";
    } else if (re.error_code() == RE2::ErrorPatternTooLarge) {
      why = "too large for RE2 (" + re.error() + ")";
    }
    return Status::InvalidArgument(why);
  }
  return re.NumberOfCapturingGroups();
}

}  // namespace ferry::run
