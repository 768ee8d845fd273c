// The factories the run config's key tables are written with (config_internal.h's KeyInfoT):
// one per kind of value, each giving a row for a member `m` of the struct T the table fills.
// A row's read checks the value as the factory says and stores it in `m`; its value is `m` as
// JSON; it is at its default when `m` equals a default-constructed T's.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "daemon/run/config_internal.h"

namespace ferry::run {

template <typename T>
const T& Defaults() {
  static const T* d = new T();
  return *d;
}

template <typename R, typename U>
Status Into(Result<R> r, U& out) {
  if (!r.ok()) return r.status();
  out = std::move(r).value();
  return Status::OK();
}

template <typename T, typename M>
typename KeyInfoT<T>::AtDefault SameAsDefault(M T::*m) {
  return [m](const T& x) { return x.*m == Defaults<T>().*m; };
}

// A member as the resolved JSON writes it: an enum as its spelling, a path as its string, an
// unset optional as null.
template <typename M>
nlohmann::ordered_json MemberJson(const M& v) {
  if constexpr (std::is_enum_v<M>) {
    return std::string(NameOf(v));
  } else {
    return v;
  }
}
template <typename M>
nlohmann::ordered_json MemberJson(const std::optional<M>& v) {
  return v ? MemberJson(*v) : nlohmann::ordered_json(nullptr);
}
inline nlohmann::ordered_json MemberJson(const std::filesystem::path& p) { return p.string(); }
inline nlohmann::ordered_json MemberJson(const DeviceSpec& d) { return d.Name(); }
inline nlohmann::ordered_json MemberJson(sync::PublishMode m) { return std::string(sync::PublishModeName(m)); }

// A row that stores what `read(Parse&, const toml::node&)` returns (a Result<M>) in `m`.
template <typename T, typename M, typename F>
KeyInfoT<T> MemberKey(std::string_view name, M T::*m, F read) {
  return {name,
          Record::kAlways,
          {},
          [m, read](Parse& p, T& x, const toml::node& v) { return Into(read(p, v), x.*m); },
          [m](const T& x) { return MemberJson(x.*m); },
          SameAsDefault(m)};
}

template <typename T>
KeyInfoT<T> FloatKey(std::string_view name, double T::*m, Reader::Range range) {
  return MemberKey(name, m, [range](Parse& p, const toml::node& v) { return p.rd.Float(v, range); });
}

// An integer in [min, max], stored in an int or int64_t member.
template <typename T, typename I>
KeyInfoT<T> IntKey(std::string_view name, I T::*m, int64_t min, int64_t max) {
  return MemberKey(name, m, [min, max](Parse& p, const toml::node& v) -> Result<I> {
    FERRY_ASSIGN_OR_RETURN(int64_t x, p.rd.Int(v, min, max));
    return static_cast<I>(x);
  });
}

template <typename T>
KeyInfoT<T> BoolKey(std::string_view name, bool T::*m) {
  return MemberKey(name, m, [](Parse& p, const toml::node& v) { return p.rd.Bool(v); });
}

// Unset (JSON null) unless the key is given.
template <typename T>
KeyInfoT<T> OptIntKey(std::string_view name, std::optional<int64_t> T::*m, int64_t min, int64_t max) {
  return MemberKey(name, m, [min, max](Parse& p, const toml::node& v) -> Result<std::optional<int64_t>> {
    FERRY_ASSIGN_OR_RETURN(int64_t x, p.rd.Int(v, min, max));
    return std::optional<int64_t>(x);
  });
}

template <typename T>
KeyInfoT<T> OptFloatKey(std::string_view name, std::optional<double> T::*m, Reader::Range range) {
  return MemberKey(name, m, [range](Parse& p, const toml::node& v) -> Result<std::optional<double>> {
    FERRY_ASSIGN_OR_RETURN(double x, p.rd.Float(v, range));
    return std::optional<double>(x);
  });
}

// A path, resolved against the config file's directory.
template <typename T>
KeyInfoT<T> PathKey(std::string_view name, std::filesystem::path T::*m) {
  return MemberKey(name, m, [](Parse& p, const toml::node& v) { return ResolvePath(p.rd, v, p.base); });
}

// One of `choices` (a string member).
template <typename T>
KeyInfoT<T> ChoiceKey(std::string_view name, std::string T::*m, std::vector<std::string_view> choices) {
  return MemberKey(name, m, [choices](Parse& p, const toml::node& v) -> Result<std::string> {
    FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v));
    if (std::find(choices.begin(), choices.end(), s) == choices.end()) {
      return p.rd.Error("must be " + ListOf(choices, "\"", " or ") + " (got " + Reader::Show(s) + ")");
    }
    return s;
  });
}

// One of E's spellings (config.h). `refused` are spellings of features ferryd does not
// implement: kUnsupported "\"x\" is <refused_what> (it has ...)".
template <typename T, typename E>
KeyInfoT<T> EnumKey(std::string_view name, E T::*m, std::vector<std::string_view> refused = {},
                    std::string_view refused_what = "") {
  return MemberKey(name, m, [refused, refused_what](Parse& p, const toml::node& v) -> Result<E> {
    FERRY_ASSIGN_OR_RETURN(std::string s, p.rd.String(v));
    if (std::optional<E> e = FromName<E>(s)) return *e;
    const std::string names = QuotedSpellings<E>();
    if (std::find(refused.begin(), refused.end(), s) != refused.end()) {
      return p.rd.Unsupported("\"" + s + "\" is " + std::string(refused_what) + " (it has " + names + ")");
    }
    return p.rd.Error("must be " + names + " (got " + Reader::Show(s) + ")");
  });
}

inline nlohmann::ordered_json NeutralJson(const NeutralValue& n) {
  switch (n.kind) {
    case NeutralValue::Kind::kBool: return n.b;
    case NeutralValue::Kind::kFloat: return n.f;
    case NeutralValue::Kind::kString: return std::string(n.s);
    case NeutralValue::Kind::kNone:
    case NeutralValue::Kind::kNoneOrFloat: return nullptr;
  }
  return nullptr;
}

// A TRL or PEFT key accepted only at the value that turns its feature off; `why` completes
// "ferryd ...". Its resolved value is always that one.
template <typename T>
KeyInfoT<T> NeutralKey(std::string_view name, NeutralValue neutral, std::string_view why) {
  return {name,
          Record::kAlways,
          {},
          [neutral, why](Parse& p, T&, const toml::node& v) { return p.rd.Neutral(v, neutral, why); },
          [neutral](const T&) { return NeutralJson(neutral); },
          [](const T&) { return true; }};
}

template <typename T>
KeyInfoT<T> Recorded(KeyInfoT<T> k, Record record) {
  k.record = record;
  return k;
}

}  // namespace ferry::run
