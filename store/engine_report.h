// What an inference engine answered about a version, as recorded in a kEngine event or a
// kEngineMismatch anomaly (store.h): the one reader and writer of that JSON, so that the
// receiver's report, the publisher that records it, ferryd's own record and the commands that
// show it (`ferry audit`, `ferry sync status`) agree on its fields and check them alike.
//
// The JSON: {"engine", "url", "model" (strings), "tolerance" (number >= 0), "max_diff"
// (number >= 0, or null: not finite, a NaN or Inf in the answer or the reference),
// "previous_diff" (number >= 0 or null), "tokens" (integer >= 0), "seconds" (number >= 0),
// "why" (string, a mismatch only), "curve_key" (string: the CURVE key the publisher heard the
// report under, when it had one)}, plus, in a receiver's report, "receiver" and "proven".
// A proof must be consistent: a finite max_diff within its tolerance.
#ifndef FERRY_STORE_ENGINE_REPORT_H_
#define FERRY_STORE_ENGINE_REPORT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::store {

struct EngineReport {
  std::string engine, url, model;
  bool proven = false;
  double tolerance = 0;
  std::optional<double> max_diff;  // nullopt: not finite
  std::optional<double> previous_diff;
  int64_t tokens = 0;
  double seconds = 0;
  std::string why;        // a mismatch's reason
  std::string curve_key;  // set by the publisher that recorded it
};

// Parses and checks `text`. `proven`: the event's type says it (kEngine: true, a mismatch:
// false); nullopt reads the report's own "proven" field (a receiver's report), required then.
// kCorruption naming the field otherwise; a proof whose max_diff is not finite or exceeds its
// tolerance is one. Strings are limited to kMaxEngineTextBytes.
Result<EngineReport> ParseEngineReport(std::string_view text, std::optional<bool> proven);

// The event detail for `r` (no "receiver", no "proven": the event says them; "why" for a
// mismatch, "curve_key" when set).
std::string EngineReportJson(const EngineReport& r);

inline constexpr size_t kMaxEngineTextBytes = 4096;

}  // namespace ferry::store

#endif  // FERRY_STORE_ENGINE_REPORT_H_
