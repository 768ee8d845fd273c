#include "store/audit.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

namespace ferry::store {
namespace {

using Json = nlohmann::ordered_json;

std::string Short(const Digest& d) { return d.Hex().substr(0, 12); }

std::string Num(double v, int digits = 4) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

bool IsLoraB(const std::string& name) {
  return name.find("lora_B") != std::string::npos || name.find("lora_embedding_B") != std::string::npos;
}

// "version 0123456789ab (run r, seq 3)".
std::string Describe(const VersionRecord& v) {
  return "version " + Short(v.id) + " (run " + v.run + ", seq " + std::to_string(v.sequence) + ")";
}

std::string IsoTime(int64_t time_ns) {
  const std::time_t secs = static_cast<std::time_t>(time_ns / 1'000'000'000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>((time_ns / 1'000'000) % 1000));
  return buf;
}

bool IsReceiverEvent(const Event& e) {
  return e.type == Event::Type::kAcknowledged || e.type == Event::Type::kActivated;
}

// The tensor that makes an adapter non-zero: a B tensor with l2_norm > 0 (any tensor when
// the adapter has no B tensors). nullptr when the adapter is zero.
const TensorRow* NonZeroAdapterTensor(const VersionRecord& adapter) {
  bool has_b = false;
  for (const auto& t : adapter.tensors) has_b = has_b || IsLoraB(t.name);
  for (const auto& t : adapter.tensors) {
    if ((!has_b || IsLoraB(t.name)) && t.l2_norm > 0) return &t;
  }
  return nullptr;
}

void CheckMergedEqualsBase(const VersionRecord& v, const std::map<Digest, const VersionRecord*>& by_id,
                           std::vector<Anomaly>& out) {
  if (v.kind != VersionKind::kMerged || !v.base_version || !v.adapter_version) return;
  auto base_it = by_id.find(*v.base_version);
  auto adapter_it = by_id.find(*v.adapter_version);
  if (base_it == by_id.end() || adapter_it == by_id.end()) return;
  std::map<std::string, Digest> base_digests;
  for (const auto& t : base_it->second->tensors) base_digests[t.name] = t.digest;
  int64_t shared = 0;
  for (const auto& t : v.tensors) {
    auto it = base_digests.find(t.name);
    if (it == base_digests.end()) continue;
    if (it->second != t.digest) return;
    ++shared;
  }
  if (shared == 0) return;
  const TensorRow* nonzero = NonZeroAdapterTensor(*adapter_it->second);
  if (nonzero == nullptr) return;
  out.push_back({AnomalyKind::kMergedEqualsBase, v.id, nonzero->name,
                 "merged " + Describe(v) + " has the same tensor digests as its base version " + Short(*v.base_version) +
                     " although adapter version " + Short(*v.adapter_version) + " is non-zero (tensor " +
                     nonzero->name + " has l2_norm " + Num(nonzero->l2_norm) +
                     "): the adapter never reached these weights"});
}

void CheckZeroAdapter(const VersionRecord& v, std::vector<Anomaly>& out) {
  if (v.kind != VersionKind::kAdapter || (v.step && *v.step == 0)) return;
  int64_t b_tensors = 0;
  for (const auto& t : v.tensors) {
    if (!IsLoraB(t.name)) continue;
    ++b_tensors;
    if (!t.all_zero) return;
  }
  if (b_tensors == 0) return;
  out.push_back({AnomalyKind::kZeroAdapter, v.id, "",
                 "adapter " + Describe(v) + " is all zero: all " + std::to_string(b_tensors) +
                     " lora_B tensors are zero, so merging it changes nothing"});
}

void CheckNonFinite(const VersionRecord& v, std::vector<Anomaly>& out) {
  for (const auto& t : v.tensors) {
    if (t.nonfinite <= 0) continue;
    out.push_back({AnomalyKind::kNonFinite, v.id, t.name,
                   Describe(v) + ": tensor " + t.name + " has " + std::to_string(t.nonfinite) + " NaN/Inf values"});
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

}  // namespace

std::string_view AnomalyKindName(AnomalyKind kind) {
  switch (kind) {
    case AnomalyKind::kMergedEqualsBase: return "merged_equals_base";
    case AnomalyKind::kZeroAdapter: return "zero_adapter";
    case AnomalyKind::kNonFinite: return "nonfinite";
    case AnomalyKind::kDeltaJump: return "delta_jump";
    case AnomalyKind::kUnpublishedAck: return "unpublished_ack";
    case AnomalyKind::kDigestMismatch: return "digest_mismatch";
    case AnomalyKind::kRecorded: return "recorded";
  }
  return "unknown";
}

Result<AuditReport> AnalyzeAudit(const std::vector<VersionRecord>& all_versions, const std::vector<Event>& events,
                                 const DeltaNormFn& delta_norm, const AuditOptions& options) {
  if (!(options.jump_factor > 0) || options.min_history < 1) {
    return Status::InvalidArgument("audit: jump_factor must be > 0 and min_history >= 1");
  }
  AuditReport report;
  report.run = options.run;
  std::map<Digest, const VersionRecord*> by_id;
  for (const auto& v : all_versions) by_id[v.id] = &v;

  std::vector<const VersionRecord*> selected;
  for (const auto& v : all_versions) {
    if (!options.run || v.run == *options.run) selected.push_back(&v);
  }
  std::sort(selected.begin(), selected.end(), [](const VersionRecord* a, const VersionRecord* b) {
    return std::tie(a->run, a->sequence) < std::tie(b->run, b->sequence);
  });
  std::set<Digest> selected_ids;
  for (const auto* v : selected) selected_ids.insert(v->id);

  std::set<Digest> published;
  for (const auto& e : events) {
    if (e.type == Event::Type::kPublished) published.insert(e.version);
  }

  // Events that concern the selection: about a selected version, or about no known version.
  std::vector<const Event*> relevant;
  for (const auto& e : events) {
    if (selected_ids.count(e.version) != 0 || by_id.count(e.version) == 0) relevant.push_back(&e);
  }
  std::stable_sort(relevant.begin(), relevant.end(),
                   [](const Event* a, const Event* b) { return a->time_ns < b->time_ns; });

  // Timeline, delta norms and per-version rules.
  std::map<std::string, std::vector<double>> deltas_by_run;
  std::map<std::string, const VersionRecord*> previous_adapter;
  std::set<std::string> metric_names;
  std::vector<Anomaly> version_anomalies;
  for (const auto* v : selected) {
    TimelineEntry entry;
    entry.version = *v;
    for (const auto& [k, value] : v->metrics) metric_names.insert(k);
    CheckMergedEqualsBase(*v, by_id, version_anomalies);
    CheckZeroAdapter(*v, version_anomalies);
    CheckNonFinite(*v, version_anomalies);
    if (v->kind == VersionKind::kAdapter && delta_norm) {
      auto prev = previous_adapter.find(v->run);
      if (prev != previous_adapter.end()) {
        FERRY_ASSIGN_OR_RETURN(double d, delta_norm(*prev->second, *v));
        entry.delta_norm = d;
        auto& history = deltas_by_run[v->run];
        if (static_cast<int>(history.size()) >= options.min_history) {
          const double median = Median(history);
          if (median > 0 && d > options.jump_factor * median) {
            version_anomalies.push_back(
                {AnomalyKind::kDeltaJump, v->id, "",
                 "adapter " + Describe(*v) + ": delta norm " + Num(d) + " from version " + Short(prev->second->id) +
                     " is " + Num(d / median, 3) + "x the median " + Num(median) + " of the " +
                     std::to_string(history.size()) + " previous deltas (rule: > " + Num(options.jump_factor, 3) +
                     "x)"});
          }
        }
        history.push_back(d);
      }
      previous_adapter[v->run] = v;
    }
    report.timeline.push_back(std::move(entry));
  }
  report.metric_names.assign(metric_names.begin(), metric_names.end());

  // Gaps in sequence numbers, per run.
  std::map<std::string, std::vector<uint64_t>> sequences;
  for (const auto* v : selected) sequences[v->run].push_back(v->sequence);
  for (auto& [run, seqs] : sequences) {
    std::sort(seqs.begin(), seqs.end());
    for (size_t i = 1; i < seqs.size(); ++i) {
      if (seqs[i] > seqs[i - 1] + 1) report.gaps.push_back({run, seqs[i - 1] + 1, seqs[i] - 1});
    }
  }

  // Receivers and event anomalies.
  std::vector<Anomaly> event_anomalies;
  std::map<Digest, size_t> timeline_index;
  for (size_t i = 0; i < report.timeline.size(); ++i) timeline_index[report.timeline[i].version.id] = i;
  std::set<Digest> acknowledged;
  bool any_receiver = false;
  for (const auto& e : events) any_receiver = any_receiver || IsReceiverEvent(e);
  for (const Event* e : relevant) {
    if (e->type == Event::Type::kAnomaly) {
      event_anomalies.push_back({AnomalyKind::kRecorded, e->version, "",
                                 "recorded" + (e->receiver.empty() ? std::string() : " by " + e->receiver) +
                                     " for version " + Short(e->version) + ": " + e->detail});
      continue;
    }
    if (!IsReceiverEvent(*e)) continue;
    ReceiverEvent r;
    r.receiver = e->receiver;
    r.type = e->type;
    r.time_ns = e->time_ns;
    r.version = e->version;
    r.computed = e->computed;
    r.digest_matched = e->computed && *e->computed == e->version;
    auto known = by_id.find(e->version);
    r.known_version = known != by_id.end();
    if (r.known_version) {
      r.run = known->second->run;
      r.sequence = known->second->sequence;
    }
    acknowledged.insert(e->version);
    const std::string verb = e->type == Event::Type::kActivated ? "activated" : "acknowledged";
    if (!r.known_version || published.count(e->version) == 0) {
      event_anomalies.push_back({AnomalyKind::kUnpublishedAck, e->version, "",
                                 "receiver " + e->receiver + " " + verb + " version " + Short(e->version) +
                                     ", which was never published (" +
                                     (r.known_version ? "no published event" : "no version record") + ")"});
    }
    if (e->computed && *e->computed != e->version) {
      event_anomalies.push_back({AnomalyKind::kDigestMismatch, e->version, "",
                                 "receiver " + e->receiver + " " + verb + " version " + Short(e->version) +
                                     " but computed digest " + Short(*e->computed) + ": it holds other weights"});
    }
    auto t = timeline_index.find(e->version);
    if (t != timeline_index.end()) {
      auto& list = e->type == Event::Type::kActivated ? report.timeline[t->second].activated_by
                                                       : report.timeline[t->second].acknowledged_by;
      if (std::find(list.begin(), list.end(), e->receiver) == list.end()) list.push_back(e->receiver);
    }
    report.receivers.push_back(std::move(r));
  }
  if (any_receiver) {
    for (const auto* v : selected) {
      if (acknowledged.count(v->id) == 0) report.never_acknowledged.push_back(v->id);
    }
  }
  report.anomalies = std::move(version_anomalies);
  report.anomalies.insert(report.anomalies.end(), event_anomalies.begin(), event_anomalies.end());
  return report;
}

Result<double> VersionDeltaNorm(Store& store, const VersionRecord& a, const VersionRecord& b) {
  std::map<std::string, const TensorRow*> rows_a;
  for (const auto& t : a.tensors) rows_a[t.name] = &t;
  double sum = 0;
  std::set<std::string> seen;
  std::vector<float> xa, xb;
  for (const auto& tb : b.tensors) {
    seen.insert(tb.name);
    auto it = rows_a.find(tb.name);
    if (it == rows_a.end()) {
      sum += tb.l2_norm * tb.l2_norm;
      continue;
    }
    const TensorRow& ta = *it->second;
    if (ta.digest == tb.digest) continue;
    if (ta.shape != tb.shape || !CanReadAsF32(ta.dtype) || !CanReadAsF32(tb.dtype)) {
      sum += ta.l2_norm * ta.l2_norm + tb.l2_norm * tb.l2_norm;
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(Tensor va, store.ReadTensor(ta, false));
    FERRY_ASSIGN_OR_RETURN(Tensor vb, store.ReadTensor(tb, false));
    xa.resize(static_cast<size_t>(va.numel()));
    xb.resize(static_cast<size_t>(vb.numel()));
    FERRY_RETURN_IF_ERROR(ReadAsF32(va, xa).WithContext("version " + Short(a.id) + " tensor " + ta.name));
    FERRY_RETURN_IF_ERROR(ReadAsF32(vb, xb).WithContext("version " + Short(b.id) + " tensor " + tb.name));
    for (size_t i = 0; i < xa.size(); ++i) {
      const double d = static_cast<double>(xb[i]) - static_cast<double>(xa[i]);
      if (std::isfinite(d)) sum += d * d;
    }
  }
  for (const auto& ta : a.tensors) {
    if (seen.count(ta.name) == 0) sum += ta.l2_norm * ta.l2_norm;
  }
  return std::sqrt(sum);
}

Result<AuditReport> RunAudit(Store& store, const AuditOptions& options) {
  if (options.run) {
    FERRY_ASSIGN_OR_RETURN(auto runs, store.ListRuns());
    if (std::find(runs.begin(), runs.end(), *options.run) == runs.end()) {
      return Status::NotFound("run '" + *options.run + "' has no versions in this store");
    }
  }
  FERRY_ASSIGN_OR_RETURN(auto versions, store.ListVersions(std::nullopt));
  FERRY_ASSIGN_OR_RETURN(auto events, store.ListEvents(std::nullopt));
  DeltaNormFn delta = [&store](const VersionRecord& a, const VersionRecord& b) { return VersionDeltaNorm(store, a, b); };
  return AnalyzeAudit(versions, events, delta, options);
}

// ---------------------------------------------------------------------------------------
// Rendering.

namespace {

Json OptDigest(const std::optional<Digest>& d) { return d ? Json(d->Hex()) : Json(); }

Json FiniteOrNull(double v) { return std::isfinite(v) ? Json(v) : Json(); }

Json VersionSummaryJson(const TimelineEntry& e) {
  const VersionRecord& v = e.version;
  Json j;
  j["id"] = v.id.Hex();
  j["run"] = v.run;
  j["sequence"] = v.sequence;
  j["step"] = v.step ? Json(*v.step) : Json();
  j["kind"] = std::string(KindName(v.kind));
  j["source"] = std::string(SourceName(v.source));
  j["parent"] = OptDigest(v.parent);
  j["base_version"] = OptDigest(v.base_version);
  j["adapter_version"] = OptDigest(v.adapter_version);
  j["time_ns"] = v.time_ns;
  j["time"] = IsoTime(v.time_ns);
  Json metrics = Json::object();
  for (const auto& [k, value] : v.metrics) metrics[k] = FiniteOrNull(value);
  j["metrics"] = std::move(metrics);
  j["tensors"] = v.tensors.size();
  j["total_bytes"] = v.total_bytes;
  j["delta_norm"] = e.delta_norm ? FiniteOrNull(*e.delta_norm) : Json();
  j["acknowledged_by"] = e.acknowledged_by;
  j["activated_by"] = e.activated_by;
  return j;
}

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
  std::string s = "<svg class=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(kWidth) +
                  "\" height=\"" + Num(height) + "\" viewBox=\"0 0 " + Num(kWidth) + " " + Num(height) + "\">\n";
  for (size_t i = 0; i < rows; ++i) {
    const bool is_run = i < runs.size();
    const std::string label = is_run ? "run " + runs[i] : "receiver " + receivers[i - runs.size()];
    s += "<line x1=\"" + Num(kLeft) + "\" x2=\"" + Num(kWidth - kRight) + "\" y1=\"" + Num(row_y(i)) + "\" y2=\"" +
         Num(row_y(i)) + "\" stroke=\"#d1d5db\"/>\n";
    s += "<text x=\"8\" y=\"" + Num(row_y(i) + 4) + "\" font-size=\"12\" fill=\"#111827\">" + EscapeHtml(label) +
         "</text>\n";
  }
  std::map<Digest, std::pair<double, double>> position;
  for (const auto& e : r.timeline) {
    const size_t i = static_cast<size_t>(std::find(runs.begin(), runs.end(), e.version.run) - runs.begin());
    position[e.version.id] = {x(static_cast<double>(e.version.time_ns)), row_y(i)};
  }
  // Activations: a dashed link from the version to the receiver's marker.
  for (const auto& e : r.receivers) {
    const size_t i = runs.size() + static_cast<size_t>(std::find(receivers.begin(), receivers.end(), e.receiver) -
                                                       receivers.begin());
    const double ex = x(static_cast<double>(e.time_ns)), ey = row_y(i);
    auto p = position.find(e.version);
    if (p != position.end()) {
      s += "<line x1=\"" + Num(p->second.first) + "\" y1=\"" + Num(p->second.second) + "\" x2=\"" + Num(ex) +
           "\" y2=\"" + Num(ey) + "\" stroke=\"#9ca3af\" stroke-dasharray=\"3 3\"/>\n";
    }
    const bool bad = !e.known_version || (e.computed && !e.digest_matched);
    const std::string color = bad ? "#dc2626" : "#16a34a";
    const std::string title = "<title>" + EscapeHtml(e.receiver + " " + std::string(EventTypeName(e.type)) + " " +
                                                     Short(e.version) + " at " + IsoTime(e.time_ns) +
                                                     (e.computed ? (e.digest_matched ? ", digest matched"
                                                                                     : ", digest MISMATCH")
                                                                 : "")) +
                              "</title>";
    if (e.type == Event::Type::kActivated) {
      s += "<rect x=\"" + Num(ex - 6) + "\" y=\"" + Num(ey - 6) + "\" width=\"12\" height=\"12\" fill=\"" + color +
           "\">" + title + "</rect>\n";
    } else {
      s += "<rect x=\"" + Num(ex - 5) + "\" y=\"" + Num(ey - 5) + "\" width=\"10\" height=\"10\" fill=\"white\" stroke=\"" +
           color + "\" stroke-width=\"2\">" + title + "</rect>\n";
    }
  }
  std::set<Digest> anomalous;
  for (const auto& a : r.anomalies) anomalous.insert(a.version);
  for (const auto& e : r.timeline) {
    const auto [px, py] = position[e.version.id];
    const bool bad = anomalous.count(e.version.id) != 0;
    s += "<circle cx=\"" + Num(px) + "\" cy=\"" + Num(py) + "\" r=\"7\" fill=\"" + KindColor(e.version.kind) + "\"" +
         (bad ? " stroke=\"#dc2626\" stroke-width=\"3\"" : "") + "><title>" +
         EscapeHtml("seq " + std::to_string(e.version.sequence) + " " + std::string(KindName(e.version.kind)) + " " +
                    Short(e.version.id) + (e.version.step ? " step " + std::to_string(*e.version.step) : "") + " at " +
                    IsoTime(e.version.time_ns)) +
         "</title></circle>\n";
    s += "<text x=\"" + Num(px) + "\" y=\"" + Num(py - 11) + "\" font-size=\"10\" text-anchor=\"middle\" fill=\"#374151\">" +
         std::to_string(e.version.sequence) + "</text>\n";
  }
  const double axis_y = kTop + kRow * static_cast<double>(rows) + 14;
  s += "<text x=\"" + Num(kLeft) + "\" y=\"" + Num(axis_y) + "\" font-size=\"11\" fill=\"#6b7280\">" +
       IsoTime(tmin) + "</text>\n";
  s += "<text x=\"" + Num(kWidth - kRight) + "\" y=\"" + Num(axis_y) +
       "\" font-size=\"11\" text-anchor=\"end\" fill=\"#6b7280\">" + IsoTime(tmax) + "</text>\n";
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
  std::string s = "<svg class=\"metric\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + Num(kW) + "\" height=\"" +
                  Num(kH) + "\" viewBox=\"0 0 " + Num(kW) + " " + Num(kH) + "\">\n";
  s += "<text x=\"" + Num(kW / 2) + "\" y=\"16\" font-size=\"13\" text-anchor=\"middle\" font-weight=\"bold\">" +
       EscapeHtml(metric) + "</text>\n";
  s += "<rect x=\"" + Num(kL) + "\" y=\"" + Num(kT) + "\" width=\"" + Num(kW - kL - kR) + "\" height=\"" +
       Num(kH - kT - kB) + "\" fill=\"none\" stroke=\"#d1d5db\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double yv = ylo + (yhi - ylo) * i / 4.0;
    const double py = yhi > ylo ? sy(yv) : (i == 2 ? sy(yv) : -1);
    if (py < 0) continue;
    s += "<line x1=\"" + Num(kL - 4) + "\" x2=\"" + Num(kW - kR) + "\" y1=\"" + Num(py) + "\" y2=\"" + Num(py) +
         "\" stroke=\"#f3f4f6\"/>\n";
    s += "<text x=\"" + Num(kL - 6) + "\" y=\"" + Num(py + 4) + "\" font-size=\"10\" text-anchor=\"end\" fill=\"#6b7280\">" +
         Num(yv) + "</text>\n";
  }
  s += "<text x=\"" + Num(kL) + "\" y=\"" + Num(kH - kB + 16) + "\" font-size=\"10\" fill=\"#6b7280\">" + Num(xlo) +
       "</text>\n";
  s += "<text x=\"" + Num(kW - kR) + "\" y=\"" + Num(kH - kB + 16) +
       "\" font-size=\"10\" text-anchor=\"end\" fill=\"#6b7280\">" + Num(xhi) + "</text>\n";
  s += "<text x=\"" + Num((kL + kW - kR) / 2) + "\" y=\"" + Num(kH - 8) +
       "\" font-size=\"11\" text-anchor=\"middle\" fill=\"#374151\">" + (by_step ? "step" : "sequence") + "</text>\n";
  if (pts.size() > 1) {
    s += "<polyline fill=\"none\" stroke=\"#2563eb\" stroke-width=\"2\" points=\"";
    for (const auto& [px, py, v] : pts) s += Num(sx(px), 6) + "," + Num(sy(py), 6) + " ";
    s += "\"/>\n";
  }
  for (const auto& [px, py, v] : pts) {
    s += "<circle cx=\"" + Num(sx(px), 6) + "\" cy=\"" + Num(sy(py), 6) + "\" r=\"3.5\" fill=\"#1d4ed8\"><title>" +
         EscapeHtml(metric + " = " + Num(py, 6) + " at " + (by_step ? "step " : "seq ") + Num(px, 10) + " (" +
                    Short(v->id) + ")") +
         "</title></circle>\n";
  }
  s += "</svg>\n";
  return s;
}

}  // namespace

std::string AuditToJson(const AuditReport& r) {
  Json j;
  j["run"] = r.run ? Json(*r.run) : Json();
  Json timeline = Json::array();
  for (const auto& e : r.timeline) timeline.push_back(VersionSummaryJson(e));
  j["timeline"] = std::move(timeline);
  Json receivers = Json::array();
  for (const auto& e : r.receivers) {
    Json x;
    x["receiver"] = e.receiver;
    x["event"] = std::string(EventTypeName(e.type));
    x["time_ns"] = e.time_ns;
    x["time"] = IsoTime(e.time_ns);
    x["version"] = e.version.Hex();
    x["known_version"] = e.known_version;
    x["run"] = e.known_version ? Json(e.run) : Json();
    x["sequence"] = e.known_version ? Json(e.sequence) : Json();
    x["computed"] = OptDigest(e.computed);
    x["digest_matched"] = e.digest_matched;
    receivers.push_back(std::move(x));
  }
  j["receivers"] = std::move(receivers);
  Json gaps = Json::array();
  for (const auto& g : r.gaps) gaps.push_back({{"run", g.run}, {"first_missing", g.first_missing}, {"last_missing", g.last_missing}});
  j["gaps"] = std::move(gaps);
  Json never = Json::array();
  for (const auto& d : r.never_acknowledged) never.push_back(d.Hex());
  j["never_acknowledged"] = std::move(never);
  Json anomalies = Json::array();
  for (const auto& a : r.anomalies) {
    anomalies.push_back({{"kind", std::string(AnomalyKindName(a.kind))},
                         {"version", a.version.Hex()},
                         {"tensor", a.tensor.empty() ? Json() : Json(a.tensor)},
                         {"message", a.message}});
  }
  j["anomalies"] = std::move(anomalies);
  // A report, not a record: text that is not UTF-8 (a --run filter given by the user, say)
  // is shown with U+FFFD rather than failing the whole report.
  return j.dump(2, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

std::string AuditToText(const AuditReport& r) {
  std::string s;
  s += "Timeline" + (r.run ? " of run " + *r.run : std::string()) + " (" + std::to_string(r.timeline.size()) +
       " versions)\n";
  char line[512];
  std::snprintf(line, sizeof line, "  %-10s %4s %8s  %-12s  %-12s  %-8s  %s\n", "run", "seq", "step", "id", "parent",
                "kind", "metrics");
  s += line;
  for (const auto& e : r.timeline) {
    const VersionRecord& v = e.version;
    std::string metrics;
    for (const auto& [k, value] : v.metrics) metrics += (metrics.empty() ? "" : " ") + k + "=" + Num(value, 6);
    if (e.delta_norm) metrics += (metrics.empty() ? "" : " ") + std::string("delta_norm=") + Num(*e.delta_norm);
    std::snprintf(line, sizeof line, "  %-10s %4llu %8s  %-12s  %-12s  %-8s  %s\n", v.run.c_str(),
                  static_cast<unsigned long long>(v.sequence), v.step ? std::to_string(*v.step).c_str() : "-",
                  Short(v.id).c_str(), v.parent ? Short(*v.parent).c_str() : "-", std::string(KindName(v.kind)).c_str(),
                  metrics.c_str());
    s += line;
  }
  s += "\nReceivers (" + std::to_string(r.receivers.size()) + " events)\n";
  if (r.receivers.empty()) s += "  none recorded\n";
  for (const auto& e : r.receivers) {
    s += "  " + IsoTime(e.time_ns) + "  " + e.receiver + " " + std::string(EventTypeName(e.type)) + " " +
         Short(e.version) +
         (e.known_version ? " (run " + e.run + ", seq " + std::to_string(e.sequence) + ")" : " (unknown version)") +
         (e.computed ? (e.digest_matched ? ", digest matched" : ", digest MISMATCH: computed " + Short(*e.computed))
                     : ", no digest reported") +
         "\n";
  }
  s += "\nGaps in sequence numbers\n";
  if (r.gaps.empty()) s += "  none\n";
  for (const auto& g : r.gaps) {
    s += "  run " + g.run + ": missing " + std::to_string(g.first_missing) +
         (g.last_missing != g.first_missing ? ".." + std::to_string(g.last_missing) : "") + "\n";
  }
  s += "\nNever acknowledged\n";
  if (r.receivers.empty()) {
    s += "  (no receiver recorded)\n";
  } else if (r.never_acknowledged.empty()) {
    s += "  none\n";
  }
  for (const auto& d : r.never_acknowledged) s += "  " + Short(d) + "\n";
  s += "\nAnomalies (" + std::to_string(r.anomalies.size()) + ")\n";
  if (r.anomalies.empty()) s += "  none\n";
  for (const auto& a : r.anomalies) s += "  [" + std::string(AnomalyKindName(a.kind)) + "] " + a.message + "\n";
  return s;
}

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
  s += "<p>" + std::to_string(r.timeline.size()) + " versions, " + std::to_string(r.receivers.size()) +
       " receiver events, <span class=\"" + (r.anomalies.empty() ? "ok" : "bad") + "\">" +
       std::to_string(r.anomalies.size()) + " anomalies</span>.</p>\n";

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

  s += "<h2 id=\"metrics\">Metrics</h2>\n";
  if (r.metric_names.empty()) s += "<p>No metrics recorded.</p>\n";
  std::vector<std::string> plots = r.metric_names;
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
       "<th>kind</th><th>tensors</th><th>bytes</th><th>metrics</th><th>activated by</th></tr>\n";
  for (const auto& e : r.timeline) {
    const VersionRecord& v = e.version;
    std::string metrics;
    for (const auto& [k, value] : v.metrics) metrics += (metrics.empty() ? "" : ", ") + k + "=" + Num(value, 6);
    std::string by;
    for (const auto& x : e.activated_by) by += (by.empty() ? "" : ", ") + x;
    s += "<tr><td>" + EscapeHtml(v.run) + "</td><td>" + std::to_string(v.sequence) + "</td><td>" +
         (v.step ? std::to_string(*v.step) : "-") + "</td><td><code>" + Short(v.id) + "</code></td><td><code>" +
         (v.parent ? Short(*v.parent) : "-") + "</code></td><td>" + std::string(KindName(v.kind)) + "</td><td>" +
         std::to_string(v.tensors.size()) + "</td><td>" + std::to_string(v.total_bytes) + "</td><td>" +
         EscapeHtml(metrics) + "</td><td>" + EscapeHtml(by) + "</td></tr>\n";
  }
  s += "</table>\n";

  s += "<h2 id=\"receivers\">Receivers</h2>\n";
  if (r.receivers.empty()) {
    s += "<p>No receiver events recorded.</p>\n";
  } else {
    s += "<table>\n<tr><th>time</th><th>receiver</th><th>event</th><th>version</th><th>run / seq</th><th>digest</th></tr>\n";
    for (const auto& e : r.receivers) {
      const std::string digest = !e.computed         ? "<td>not reported</td>"
                                 : e.digest_matched ? "<td class=\"ok\">matched</td>"
                                                    : "<td class=\"bad\">MISMATCH (" + Short(*e.computed) + ")</td>";
      s += "<tr><td>" + IsoTime(e.time_ns) + "</td><td>" + EscapeHtml(e.receiver) + "</td><td>" +
           std::string(EventTypeName(e.type)) + "</td><td><code>" + Short(e.version) + "</code></td><td>" +
           (e.known_version ? EscapeHtml(e.run) + " / " + std::to_string(e.sequence)
                            : std::string("<span class=\"bad\">unknown</span>")) +
           "</td>" + digest + "</tr>\n";
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
  if (r.receivers.empty()) {
    s += "<p>No receiver recorded.</p>\n";
  } else if (r.never_acknowledged.empty()) {
    s += "<p>None.</p>\n";
  } else {
    s += "<p>";
    for (const auto& d : r.never_acknowledged) s += "<code>" + Short(d) + "</code> ";
    s += "</p>\n";
  }
  s += "</body>\n</html>\n";
  return s;
}

}  // namespace ferry::store
