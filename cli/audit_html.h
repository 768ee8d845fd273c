// `ferry audit --html`: the audit report (store/audit.h) as one self-contained HTML page.
// Presentation only; the store computes the report.
#pragma once

#include <string>
#include <string_view>

#include "store/audit.h"

namespace ferry::cli {

// The report as one self-contained HTML page (inline CSS and SVG, no scripts or external
// resources): anomalies, a timeline of versions with receiver activations, one plot per
// metric (and the adapter delta norms), and tables of versions, receiver events, gaps and
// versions never acknowledged. Every text from the store is HTML-escaped.
std::string AuditToHtml(const store::AuditReport& report, std::string_view title);

}  // namespace ferry::cli
