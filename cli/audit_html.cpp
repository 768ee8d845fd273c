// The audit as an HTML page (cli/audit_html.h).
#include "cli/audit_html.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "cli/store_common.h"
#include "core/text.h"

namespace ferry::cli {
namespace {

using store::AuditReport;
using store::Digest;
using store::Event;
using store::ShortId;
using store::TimelineEntry;
using store::VersionKind;
using store::VersionRecord;

std::string EscapeHtml(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string KindColor(VersionKind k) {
  switch (k) {
    case VersionKind::kBase: return "#6b7280";
    case VersionKind::kAdapter: return "#2563eb";
    case VersionKind::kMerged: return "#7c3aed";
    case VersionKind::kFull: return "#0d9488";
  }
  return "#000";
}

// Maps [lo, hi] onto [a, b] (the middle when the range is empty).
struct Scale {
  double lo, hi, a, b;
  double operator()(double v) const { return hi > lo ? a + (v - lo) / (hi - lo) * (b - a) : (a + b) / 2; }
};

std::string TimelineSvg(const AuditReport& r) {
  constexpr double kWidth = 1100, kLeft = 150, kRight = 30, kRow = 44, kTop = 30;
  std::vector<std::string> runs;
  std::vector<std::string> receivers;
  int64_t tmin = INT64_MAX, tmax = INT64_MIN;
  for (const auto& e : r.timeline) {
    if (std::find(runs.begin(), runs.end(), e.version.run) == runs.end()) runs.push_back(e.version.run);
    tmin = std::min(tmin, e.version.time_ns);
    tmax = std::max(tmax, e.version.time_ns);
  }
  for (const auto& e : r.receivers) {
    if (std::find(receivers.begin(), receivers.end(), e.receiver) == receivers.end()) receivers.push_back(e.receiver);
    tmin = std::min(tmin, e.time_ns);
    tmax = std::max(tmax, e.time_ns);
  }
  if (tmin > tmax) return "<p>No versions.</p>\n";
  std::sort(receivers.begin(), receivers.end());
  const size_t rows = runs.size() + receivers.size();
  const double height = kTop + kRow * static_cast<double>(rows) + 40;
  Scale x{static_cast<double>(tmin), static_cast<double>(tmax), kLeft, kWidth - kRight};
  auto row_y = [&](size_t i) { return kTop + kRow * (static_cast<double>(i) + 0.5); };
  std::string s = "<svg class=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + FormatNumber(kWidth, 4) +
                  "\" height=\"" + FormatNumber(height, 4) + "\" viewBox=\"0 0 " + FormatNumber(kWidth, 4) + " " +
                  FormatNumber(height, 4) + "\">\n";
  for (size_t i = 0; i < rows; ++i) {
    const bool is_run = i < runs.size();
    const std::string label = is_run ? "run " + runs[i] : "receiver " + receivers[i - runs.size()];
    s += "<line x1=\"" + FormatNumber(kLeft, 4) + "\" x2=\"" + FormatNumber(kWidth - kRight, 4) + "\" y1=\"" +
         FormatNumber(row_y(i), 4) + "\" y2=\"" + FormatNumber(row_y(i), 4) + "\" stroke=\"#d1d5db\"/>\n";
    s += "<text x=\"8\" y=\"" + FormatNumber(row_y(i) + 4, 4) + "\" font-size=\"12\" fill=\"#111827\">" +
         EscapeHtml(label) + "</text>\n";
  }
  std::map<Digest, std::pair<double, double>> position;
  for (const auto& e : r.timeline) {
    const size_t i = static_cast<size_t>(std::find(runs.begin(), runs.end(), e.version.run) - runs.begin());
    position[e.version.id] = {x(static_cast<double>(e.version.time_ns)), row_y(i)};
  }
  // Activations: a dashed link from the version to the receiver's marker.
  for (const auto& e : r.receivers) {
    const size_t i = runs.size() +
                     static_cast<size_t>(std::find(receivers.begin(), receivers.end(), e.receiver) - receivers.begin());
    const double ex = x(static_cast<double>(e.time_ns)), ey = row_y(i);
    auto p = position.find(e.version);
    if (p != position.end()) {
      s += "<line x1=\"" + FormatNumber(p->second.first, 4) + "\" y1=\"" + FormatNumber(p->second.second, 4) +
           "\" x2=\"" + FormatNumber(ex, 4) + "\" y2=\"" + FormatNumber(ey, 4) +
           "\" stroke=\"#9ca3af\" stroke-dasharray=\"3 3\"/>\n";
    }
    const bool bad = !e.known_version || (e.computed && !e.digest_matched);
    const std::string color = bad ? "#dc2626" : "#16a34a";
    const std::string title =
        "<title>" +
        EscapeHtml(e.receiver + " " + std::string(EventTypeName(e.type)) + " " + ShortId(e.version) + " at " +
                   FormatTimeMillis(e.time_ns) +
                   (e.computed ? (e.digest_matched ? ", digest matched" : ", digest MISMATCH") : "")) +
        "</title>";
    if (e.type == Event::Type::kActivated) {
      s += "<rect x=\"" + FormatNumber(ex - 6, 4) + "\" y=\"" + FormatNumber(ey - 6, 4) +
           "\" width=\"12\" height=\"12\" fill=\"" + color + "\">" + title + "</rect>\n";
    } else {
      s += "<rect x=\"" + FormatNumber(ex - 5, 4) + "\" y=\"" + FormatNumber(ey - 5, 4) +
           "\" width=\"10\" height=\"10\" fill=\"white\" stroke=\"" + color + "\" stroke-width=\"2\">" + title +
           "</rect>\n";
    }
  }
  std::set<Digest> anomalous;
  for (const auto& a : r.anomalies) anomalous.insert(a.version);
  for (const auto& e : r.timeline) {
    const auto [px, py] = position[e.version.id];
    const bool bad = anomalous.count(e.version.id) != 0;
    s += "<circle cx=\"" + FormatNumber(px, 4) + "\" cy=\"" + FormatNumber(py, 4) + "\" r=\"7\" fill=\"" +
         KindColor(e.version.kind) + "\"" + (bad ? " stroke=\"#dc2626\" stroke-width=\"3\"" : "") + "><title>" +
         EscapeHtml("seq " + std::to_string(e.version.sequence) + " " + std::string(KindName(e.version.kind)) + " " +
                    ShortId(e.version.id) + (e.version.step ? " step " + std::to_string(*e.version.step) : "") +
                    " at " + FormatTimeMillis(e.version.time_ns)) +
         "</title></circle>\n";
    s += "<text x=\"" + FormatNumber(px, 4) + "\" y=\"" + FormatNumber(py - 11, 4) +
         "\" font-size=\"10\" text-anchor=\"middle\" fill=\"#374151\">" + std::to_string(e.version.sequence) +
         "</text>\n";
  }
  const double axis_y = kTop + kRow * static_cast<double>(rows) + 14;
  s += "<text x=\"" + FormatNumber(kLeft, 4) + "\" y=\"" + FormatNumber(axis_y, 4) +
       "\" font-size=\"11\" fill=\"#6b7280\">" + FormatTimeMillis(tmin) + "</text>\n";
  s += "<text x=\"" + FormatNumber(kWidth - kRight, 4) + "\" y=\"" + FormatNumber(axis_y, 4) +
       "\" font-size=\"11\" text-anchor=\"end\" fill=\"#6b7280\">" + FormatTimeMillis(tmax) + "</text>\n";
  s += "</svg>\n";
  return s;
}

std::string MetricSvg(const AuditReport& r, const std::string& metric) {
  constexpr double kW = 520, kH = 260, kL = 64, kR = 16, kT = 28, kB = 40;
  // x is the step when every point has one, else the sequence number.
  bool by_step = true;
  std::vector<std::tuple<double, double, const VersionRecord*>> pts;
  for (const auto& e : r.timeline) {
    auto it = e.version.metrics.find(metric);
    if (it == e.version.metrics.end() || !std::isfinite(it->second)) continue;
    by_step = by_step && e.version.step.has_value();
    pts.emplace_back(0, it->second, &e.version);
  }
  for (auto& [px, py, v] : pts) {
    px = by_step ? static_cast<double>(*v->step) : static_cast<double>(v->sequence);
  }
  std::sort(pts.begin(), pts.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  double xlo = 0, xhi = 0, ylo = 0, yhi = 0;
  if (!pts.empty()) {
    xlo = xhi = std::get<0>(pts[0]);
    ylo = yhi = std::get<1>(pts[0]);
    for (const auto& [px, py, v] : pts) {
      xlo = std::min(xlo, px), xhi = std::max(xhi, px), ylo = std::min(ylo, py), yhi = std::max(yhi, py);
    }
  }
  Scale sx{xlo, xhi, kL, kW - kR};
  Scale sy{ylo, yhi, kH - kB, kT};
  std::string s = "<svg class=\"metric\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + FormatNumber(kW, 4) +
                  "\" height=\"" + FormatNumber(kH, 4) + "\" viewBox=\"0 0 " + FormatNumber(kW, 4) + " " +
                  FormatNumber(kH, 4) + "\">\n";
  s += "<text x=\"" + FormatNumber(kW / 2, 4) +
       "\" y=\"16\" font-size=\"13\" text-anchor=\"middle\" font-weight=\"bold\">" + EscapeHtml(metric) + "</text>\n";
  s += "<rect x=\"" + FormatNumber(kL, 4) + "\" y=\"" + FormatNumber(kT, 4) + "\" width=\"" +
       FormatNumber(kW - kL - kR, 4) + "\" height=\"" + FormatNumber(kH - kT - kB, 4) +
       "\" fill=\"none\" stroke=\"#d1d5db\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double yv = ylo + (yhi - ylo) * i / 4.0;
    const double py = yhi > ylo ? sy(yv) : (i == 2 ? sy(yv) : -1);
    if (py < 0) continue;
    s += "<line x1=\"" + FormatNumber(kL - 4, 4) + "\" x2=\"" + FormatNumber(kW - kR, 4) + "\" y1=\"" +
         FormatNumber(py, 4) + "\" y2=\"" + FormatNumber(py, 4) + "\" stroke=\"#f3f4f6\"/>\n";
    s += "<text x=\"" + FormatNumber(kL - 6, 4) + "\" y=\"" + FormatNumber(py + 4, 4) +
         "\" font-size=\"10\" text-anchor=\"end\" fill=\"#6b7280\">" + FormatNumber(yv, 4) + "</text>\n";
  }
  s += "<text x=\"" + FormatNumber(kL, 4) + "\" y=\"" + FormatNumber(kH - kB + 16, 4) +
       "\" font-size=\"10\" fill=\"#6b7280\">" + FormatNumber(xlo, 4) + "</text>\n";
  s += "<text x=\"" + FormatNumber(kW - kR, 4) + "\" y=\"" + FormatNumber(kH - kB + 16, 4) +
       "\" font-size=\"10\" text-anchor=\"end\" fill=\"#6b7280\">" + FormatNumber(xhi, 4) + "</text>\n";
  s += "<text x=\"" + FormatNumber((kL + kW - kR) / 2, 4) + "\" y=\"" + FormatNumber(kH - 8, 4) +
       "\" font-size=\"11\" text-anchor=\"middle\" fill=\"#374151\">" + (by_step ? "step" : "sequence") + "</text>\n";
  if (pts.empty()) {
    s += "<text x=\"" + FormatNumber((kL + kW - kR) / 2, 4) + "\" y=\"" + FormatNumber((kT + kH - kB) / 2, 4) +
         "\" font-size=\"12\" text-anchor=\"middle\" fill=\"#9ca3af\">no values recorded</text>\n";
  }
  if (pts.size() > 1) {
    s += "<polyline fill=\"none\" stroke=\"#2563eb\" stroke-width=\"2\" points=\"";
    for (const auto& [px, py, v] : pts) s += FormatNumber(sx(px), 6) + "," + FormatNumber(sy(py), 6) + " ";
    s += "\"/>\n";
  }
  for (const auto& [px, py, v] : pts) {
    s += "<circle cx=\"" + FormatNumber(sx(px), 6) + "\" cy=\"" + FormatNumber(sy(py), 6) +
         "\" r=\"3.5\" fill=\"#1d4ed8\"><title>" +
         EscapeHtml(metric + " = " + FormatNumber(py, 6) + " at " + (by_step ? "step " : "seq ") +
                    FormatNumber(px, 10) + " (" + ShortId(v->id) + ")") +
         "</title></circle>\n";
  }
  s += "</svg>\n";
  return s;
}

// The metrics plotted per step for a training run, TRL's names.
constexpr const char* kStepPlots[] = {
    "reward", "kl", "entropy", "completions/mean_length", "sampling/sampling_logp_difference/mean", "learning_rate"};

// The steps as a timeline of one point per step (MetricSvg plots it by step).
AuditReport StepsAsTimeline(const AuditReport& r) {
  AuditReport out;
  for (const auto& e : r.steps) {
    TimelineEntry t;
    t.version.id = e.merged_version.value_or(e.adapter_version.value_or(Digest{}));
    t.version.step = e.step;
    t.version.metrics = e.metrics;
    out.timeline.push_back(std::move(t));
  }
  return out;
}

std::string StepMetric(const store::StepEntry& e, const char* name) {
  auto it = e.metrics.find(name);
  return it == e.metrics.end() ? "-" : FormatNumber(it->second, 5);
}

std::string StepsSection(const AuditReport& r) {
  std::string s = "<h2 id=\"steps\">Training steps</h2>\n<p>" + std::to_string(r.steps.size()) + " steps. Generators: ";
  if (r.generators.empty()) s += "none acknowledged a step";
  for (size_t i = 0; i < r.generators.size(); ++i) {
    const auto& g = r.generators[i];
    s += (i ? "; " : "") + EscapeHtml(g.receiver) + " (" + std::to_string(g.acks) + " acknowledgements, last step " +
         (g.last_step ? std::to_string(*g.last_step) : std::string("-")) + ", max lag " + std::to_string(g.max_lag) +
         ")";
  }
  s += ".</p>\n<div class=\"plots step-plots\">\n";
  const AuditReport points = StepsAsTimeline(r);
  for (const char* m : kStepPlots) s += MetricSvg(points, m);
  s += "</div>\n";
  std::map<int64_t, std::string> flagged;
  for (const auto& a : r.anomalies) {
    if (a.step) flagged[*a.step] += (flagged[*a.step].empty() ? "" : ", ") + std::string(AnomalyKindName(a.kind));
  }
  s += "<table class=\"steps\">\n<tr><th>step</th><th>adapter</th><th>merged</th><th>reward</th><th>kl</th>"
       "<th>entropy</th><th>length</th><th>logp diff</th><th>lr</th><th>loss</th><th>grad norm</th>"
       "<th>acknowledged by (lag in steps)</th><th>anomalies</th></tr>\n";
  for (const auto& e : r.steps) {
    std::string acks;
    for (const auto& a : e.acks) {
      const bool bad = a.digest_reported && !a.digest_matched;
      acks += std::string(acks.empty() ? "" : "<br>") + "<span class=\"" + (bad ? "bad" : "ok") + "\">" +
              EscapeHtml(a.receiver) + "</span> " + std::string(EventTypeName(a.type)) + " " +
              FormatTimeMillis(a.time_ns) + " (lag " + std::to_string(a.lag) + (bad ? ", digest MISMATCH" : "") + ")";
    }
    auto it = flagged.find(e.step);
    s += "<tr><td>" + std::to_string(e.step) + "</td><td><code>" +
         (e.adapter_version ? ShortId(*e.adapter_version) : "-") + "</code></td><td><code>" +
         (e.merged_version ? ShortId(*e.merged_version) : "-") + "</code></td>";
    for (const char* m : {"reward", "kl", "entropy", "completions/mean_length",
                          "sampling/sampling_logp_difference/mean", "learning_rate", "loss", "grad_norm"}) {
      s += "<td>" + StepMetric(e, m) + "</td>";
    }
    s += "<td>" + (acks.empty() ? std::string("-") : acks) + "</td><td class=\"bad\">" +
         (it == flagged.end() ? std::string() : it->second) + "</td></tr>\n";
  }
  s += "</table>\n";
  return s;
}

}  // namespace

std::string AuditToHtml(const AuditReport& r, std::string_view title) {
  std::string s =
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>" + EscapeHtml(title) +
      "</title>\n<style>\n"
      "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#111827;max-width:1160px}\n"
      "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #e5e7eb}\n"
      "table{border-collapse:collapse;font-size:12px}td,th{padding:3px 8px;border-bottom:1px solid #f3f4f6;"
      "text-align:left}\n"
      "code{font-family:ui-monospace,monospace;font-size:12px}.bad{color:#b91c1c}.ok{color:#15803d}\n"
      ".anomaly{background:#fef2f2;border-left:4px solid #dc2626;padding:6px 10px;margin:6px 0;font-size:13px}\n"
      ".plots{display:flex;flex-wrap:wrap;gap:12px}.legend span{margin-right:14px;font-size:12px}\n"
      "</style>\n</head>\n<body>\n<h1>" +
      EscapeHtml(title) + "</h1>\n";
  s += "<p>" + std::to_string(r.timeline.size()) + " versions, " +
       (r.steps.empty() ? std::string() : std::to_string(r.steps.size()) + " training steps, ") +
       std::to_string(r.receivers.size()) + " receiver events, <span class=\"" + (r.anomalies.empty() ? "ok" : "bad") +
       "\">" + std::to_string(r.anomalies.size()) + " anomalies</span>.</p>\n";

  s += "<h2 id=\"anomalies\">Anomalies</h2>\n";
  if (r.anomalies.empty()) s += "<p class=\"ok\">None.</p>\n";
  for (const auto& a : r.anomalies) {
    s += "<div class=\"anomaly\"><b>" + std::string(AnomalyKindName(a.kind)) + "</b>: " + EscapeHtml(a.message) +
         "</div>\n";
  }

  s += "<h2 id=\"timeline\">Timeline</h2>\n<p class=\"legend\">";
  for (auto k : {VersionKind::kBase, VersionKind::kAdapter, VersionKind::kMerged, VersionKind::kFull}) {
    s += "<span><svg width=\"12\" height=\"12\"><circle cx=\"6\" cy=\"6\" r=\"5\" fill=\"" + KindColor(k) +
         "\"/></svg> " + std::string(KindName(k)) + "</span>";
  }
  s += "<span>&#9632; activated</span><span>&#9633; acknowledged</span><span class=\"bad\">red: unknown version "
       "or digest mismatch</span></p>\n";
  s += TimelineSvg(r);

  if (!r.steps.empty()) s += StepsSection(r);
  s += "<h2 id=\"metrics\">Metrics</h2>\n";
  if (r.metric_names.empty()) s += "<p>No metrics recorded.</p>\n";
  // A training run's metrics are plotted per step above; here only the adapter delta norms.
  std::vector<std::string> plots = r.steps.empty() ? r.metric_names : std::vector<std::string>{};
  if (!r.steps.empty() && !r.metric_names.empty()) {
    s += "<p>Plotted per step above; every metric is in the table of versions below and in --json.</p>\n";
  }
  bool any_delta = false;
  for (const auto& e : r.timeline) any_delta = any_delta || e.delta_norm.has_value();
  s += "<div class=\"plots\">\n";
  for (const auto& m : plots) s += MetricSvg(r, m);
  if (any_delta) {
    AuditReport deltas;
    for (const auto& e : r.timeline) {
      if (!e.delta_norm) continue;
      TimelineEntry d = e;
      d.version.metrics = {{"adapter delta norm", *e.delta_norm}};
      deltas.timeline.push_back(std::move(d));
    }
    s += MetricSvg(deltas, "adapter delta norm");
  }
  s += "</div>\n";

  s += "<h2 id=\"versions\">Versions</h2>\n<table>\n<tr><th>run</th><th>seq</th><th>step</th><th>id</th><th>parent</th>"
       "<th>kind</th><th>tensors</th><th>bytes</th><th>metrics</th><th>activated by</th><th>served by</th></tr>\n";
  for (const auto& e : r.timeline) {
    const VersionRecord& v = e.version;
    std::string metrics;
    for (const auto& [k, value] : v.metrics)
      metrics += (metrics.empty() ? "" : ", ") + k + "=" + FormatNumber(value, 6);
    std::string by;
    for (const auto& x : e.activated_by) by += (by.empty() ? "" : ", ") + x;
    std::string served;
    for (const auto& x : e.served_by) served += (served.empty() ? "" : ", ") + x;
    s += "<tr><td>" + EscapeHtml(v.run) + "</td><td>" + std::to_string(v.sequence) + "</td><td>" +
         (v.step ? std::to_string(*v.step) : "-") + "</td><td><code>" + ShortId(v.id) + "</code></td><td><code>" +
         (v.parent ? ShortId(*v.parent) : "-") + "</code></td><td>" + std::string(KindName(v.kind)) + "</td><td>" +
         std::to_string(v.tensors.size()) + "</td><td>" + std::to_string(v.total_bytes) + "</td><td>" +
         EscapeHtml(metrics) + "</td><td>" + EscapeHtml(by) + "</td><td>" + EscapeHtml(served) + "</td></tr>\n";
  }
  s += "</table>\n";

  s += "<h2 id=\"receivers\">Receivers</h2>\n";
  if (r.receivers.empty()) {
    s += "<p>No receiver events recorded.</p>\n";
  } else {
    s += "<table>\n<tr><th>time</th><th>receiver</th><th>event</th><th>version</th><th>run / "
         "seq</th><th>digest</th></tr>\n";
    for (const auto& e : r.receivers) {
      const std::string digest = !e.computed        ? "<td>not reported</td>"
                                 : e.digest_matched ? "<td class=\"ok\">matched</td>"
                                                    : "<td class=\"bad\">MISMATCH (" + ShortId(*e.computed) + ")</td>";
      s += "<tr><td>" + FormatTimeMillis(e.time_ns) + "</td><td>" + EscapeHtml(e.receiver) + "</td><td>" +
           std::string(EventTypeName(e.type)) + "</td><td><code>" + ShortId(e.version) + "</code></td><td>" +
           (e.known_version ? EscapeHtml(e.run) + " / " + std::to_string(e.sequence)
                            : std::string("<span class=\"bad\">unknown</span>")) +
           "</td>" + digest + "</tr>\n";
    }
    s += "</table>\n";
  }

  s += "<h2 id=\"engines\">Engines</h2>\n";
  if (r.engines.empty()) {
    s += "<p>No engine proofs recorded.</p>\n";
  } else {
    s += "<table>\n<tr><th>time</th><th>engine</th><th>version</th><th>served as</th><th>receiver</th><th>largest "
         "difference</th><th>previous version</th><th>tolerance</th></tr>\n";
    for (const auto& e : r.engines) {
      s += "<tr><td>" + FormatTimeMillis(e.time_ns) + "</td><td>" + EscapeHtml(e.engine + " " + e.url) +
           "</td><td><code>" + ShortId(e.version) + "</code></td><td><code>" + EscapeHtml(e.model) +
           "</code></td><td>" + EscapeHtml(e.receiver) + "</td><td class=\"ok\">" + FormatNumber(e.max_diff, 3) +
           "</td><td>" + (e.previous_diff ? FormatNumber(*e.previous_diff, 3) : std::string("-")) + "</td><td>" +
           FormatNumber(e.tolerance, 3) + "</td></tr>\n";
    }
    s += "</table>\n";
  }

  s += "<h2 id=\"gaps\">Gaps in sequence numbers</h2>\n";
  if (r.gaps.empty()) s += "<p>None.</p>\n";
  for (const auto& g : r.gaps) {
    s += "<p>run " + EscapeHtml(g.run) + ": missing " + std::to_string(g.first_missing) +
         (g.last_missing != g.first_missing ? ".." + std::to_string(g.last_missing) : "") + "</p>\n";
  }
  s += "<h2 id=\"never-acknowledged\">Never acknowledged</h2>\n";
  if (r.receivers.empty() && r.engines.empty()) {
    s += "<p>No receiver recorded.</p>\n";
  } else if (r.never_acknowledged.empty()) {
    s += "<p>None.</p>\n";
  } else {
    s += "<p>";
    for (const auto& d : r.never_acknowledged) s += "<code>" + ShortId(d) + "</code> ";
    s += "</p>\n";
  }
  s += "</body>\n</html>\n";
  return s;
}

}  // namespace ferry::cli
