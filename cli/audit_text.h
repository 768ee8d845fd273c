// `ferry audit` and `ferry audit --json`: the audit report (store/audit.h) as terminal text and
// as JSON. Presentation only; the store computes the report (the HTML page: cli/audit_html.h).
#pragma once

#include <string>

#include "store/audit.h"

namespace ferry::cli {

// The report as JSON (keys: run, timeline, receivers, gaps, never_acknowledged, anomalies,
// steps, generators; each anomaly with its step or null; times as FormatTimeMillis writes
// them beside their time_ns). Never throws: bytes that are not UTF-8 (a run filter as the
// user typed it) become U+FFFD.
std::string AuditToJson(const store::AuditReport& report);

// The report as plain text for a terminal: the timeline, receiver events, sequence gaps,
// versions never acknowledged, a training run's steps and generators, and the anomalies.
std::string AuditToText(const store::AuditReport& report);

}  // namespace ferry::cli
