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
// versions never acknowledged. A training run's report (report.steps not empty) also gets a
// "Training steps" section: six plots per step (reward, kl, entropy, completions/mean_length,
// sampling/sampling_logp_difference/mean, learning_rate; "no values recorded" where a metric
// is absent, as kl with beta = 0) and a table of the steps (versions, those metrics, loss,
// grad norm, each acknowledgement with its lag, the anomalies of the step); the per-version
// metric plots are then left out. Every text from the store is HTML-escaped.
std::string AuditToHtml(const store::AuditReport& report, std::string_view title);

}  // namespace ferry::cli
