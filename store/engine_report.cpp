#include "store/engine_report.h"

#include <cmath>
#include <cstdint>

#include <nlohmann/json.hpp>

namespace ferry::store {
namespace {

using json = nlohmann::json;

Status Bad(const std::string& field, const std::string& what) {
  return Status::Corruption("engine report: field '" + field + "' " + what);
}

Result<std::string> Text(const json& j, const char* k, bool required) {
  if (!j.contains(k)) {
    if (required) return Bad(k, "is missing");
    return std::string();
  }
  if (!j[k].is_string()) return Bad(k, "is not a string");
  std::string s = j[k].get<std::string>();
  if (s.size() > kMaxEngineTextBytes) {
    return Bad(k, "has " + std::to_string(s.size()) + " bytes; the limit is " + std::to_string(kMaxEngineTextBytes));
  }
  return s;
}

// A finite number >= 0; null is nullopt where `nullable`.
Result<std::optional<double>> Figure(const json& j, const char* k, bool nullable) {
  if (!j.contains(k) || j[k].is_null()) {
    if (nullable) return std::optional<double>();
    return Bad(k, j.contains(k) ? "is null" : "is missing");
  }
  if (!j[k].is_number()) return Bad(k, "is not a number");
  const double v = j[k].get<double>();
  if (!std::isfinite(v) || v < 0) return Bad(k, "is not a finite number >= 0");
  return std::optional<double>(v);
}

}  // namespace

Result<EngineReport> ParseEngineReport(std::string_view text, std::optional<bool> proven) {
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption("engine report: not a JSON object");
  EngineReport r;
  if (proven) {
    r.proven = *proven;
  } else {
    if (!j.contains("proven") || !j["proven"].is_boolean()) return Bad("proven", "is not a boolean");
    r.proven = j["proven"].get<bool>();
  }
  FERRY_ASSIGN_OR_RETURN(r.engine, Text(j, "engine", true));
  FERRY_ASSIGN_OR_RETURN(r.url, Text(j, "url", true));
  FERRY_ASSIGN_OR_RETURN(r.model, Text(j, "model", true));
  FERRY_ASSIGN_OR_RETURN(r.why, Text(j, "why", false));
  FERRY_ASSIGN_OR_RETURN(r.curve_key, Text(j, "curve_key", false));
  FERRY_ASSIGN_OR_RETURN(std::optional<double> tolerance, Figure(j, "tolerance", false));
  r.tolerance = *tolerance;
  FERRY_ASSIGN_OR_RETURN(r.max_diff, Figure(j, "max_diff", true));
  FERRY_ASSIGN_OR_RETURN(r.previous_diff, Figure(j, "previous_diff", true));
  FERRY_ASSIGN_OR_RETURN(std::optional<double> seconds, Figure(j, "seconds", false));
  r.seconds = *seconds;
  // tokens: optional in older records (0 then), an integer below 2^31 otherwise.
  if (j.contains("tokens")) {
    const json& t = j["tokens"];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
      return Bad("tokens", "is not an integer in [0, 2^31)");
    }
    r.tokens = t.get<int64_t>();
  }
  if (r.proven && !(r.max_diff && *r.max_diff <= r.tolerance)) {
    return Status::Corruption("engine report: a proof whose largest difference (" +
                              (r.max_diff ? std::to_string(*r.max_diff) : std::string("not finite")) +
                              ") exceeds its tolerance (" + std::to_string(r.tolerance) + ")");
  }
  return r;
}

std::string EngineReportJson(const EngineReport& r) {
  json d = {{"engine", r.engine},
            {"url", r.url},
            {"model", r.model},
            {"tolerance", r.tolerance},
            {"max_diff", r.max_diff && std::isfinite(*r.max_diff) ? json(*r.max_diff) : json()},
            {"previous_diff", r.previous_diff && std::isfinite(*r.previous_diff) ? json(*r.previous_diff) : json()},
            {"tokens", r.tokens},
            {"seconds", r.seconds}};
  if (!r.proven) d["why"] = r.why;
  if (!r.curve_key.empty()) d["curve_key"] = r.curve_key;
  return d.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

}  // namespace ferry::store
