#include "cli/audit_text.h"

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/store_common.h"
#include "core/text.h"

namespace ferry::cli {
namespace {

using Json = nlohmann::ordered_json;
using store::AnomalyKindName;
using store::AuditReport;
using store::Digest;
using store::EventTypeName;
using store::KindName;
using store::SourceName;
using store::TimelineEntry;
using store::VersionRecord;

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
  j["time"] = FormatTimeMillis(v.time_ns);
  Json metrics = Json::object();
  for (const auto& [k, value] : v.metrics) metrics[k] = FiniteOrNull(value);
  j["metrics"] = std::move(metrics);
  j["tensors"] = v.tensors.size();
  j["total_bytes"] = v.total_bytes;
  j["delta_norm"] = e.delta_norm ? FiniteOrNull(*e.delta_norm) : Json();
  j["acknowledged_by"] = e.acknowledged_by;
  j["activated_by"] = e.activated_by;
  j["served_by"] = e.served_by;
  return j;
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
    x["time"] = FormatTimeMillis(e.time_ns);
    x["version"] = e.version.Hex();
    x["known_version"] = e.known_version;
    x["run"] = e.known_version ? Json(e.run) : Json();
    x["sequence"] = e.known_version ? Json(e.sequence) : Json();
    x["computed"] = OptDigest(e.computed);
    x["digest_matched"] = e.digest_matched;
    receivers.push_back(std::move(x));
  }
  j["receivers"] = std::move(receivers);
  Json engines = Json::array();
  for (const auto& e : r.engines) {
    engines.push_back({{"receiver", e.receiver},
                       {"time_ns", e.time_ns},
                       {"time", FormatTimeMillis(e.time_ns)},
                       {"version", e.version.Hex()},
                       {"engine", e.engine},
                       {"url", e.url},
                       {"model", e.model},
                       {"max_diff", FiniteOrNull(e.max_diff)},
                       {"previous_diff", e.previous_diff ? FiniteOrNull(*e.previous_diff) : Json()},
                       {"tolerance", e.tolerance},
                       {"tokens", e.tokens},
                       {"seconds", e.seconds}});
  }
  j["engines"] = std::move(engines);
  Json gaps = Json::array();
  for (const auto& g : r.gaps)
    gaps.push_back({{"run", g.run}, {"first_missing", g.first_missing}, {"last_missing", g.last_missing}});
  j["gaps"] = std::move(gaps);
  Json never = Json::array();
  for (const auto& d : r.never_acknowledged) never.push_back(d.Hex());
  j["never_acknowledged"] = std::move(never);
  Json anomalies = Json::array();
  for (const auto& a : r.anomalies) {
    anomalies.push_back({{"kind", std::string(AnomalyKindName(a.kind))},
                         {"version", a.version.Hex()},
                         {"tensor", a.tensor.empty() ? Json() : Json(a.tensor)},
                         {"step", a.step ? Json(*a.step) : Json()},
                         {"message", a.message}});
  }
  j["anomalies"] = std::move(anomalies);
  Json steps = Json::array();
  for (const auto& e : r.steps) {
    Json x;
    x["step"] = e.step;
    x["adapter_version"] = OptDigest(e.adapter_version);
    x["merged_version"] = OptDigest(e.merged_version);
    x["time_ns"] = e.time_ns;
    x["time"] = FormatTimeMillis(e.time_ns);
    x["records"] = e.records;
    Json metrics = Json::object();
    for (const auto& [k, value] : e.metrics) metrics[k] = FiniteOrNull(value);
    x["metrics"] = std::move(metrics);
    Json acks = Json::array();
    for (const auto& a : e.acks) {
      acks.push_back({{"receiver", a.receiver},
                      {"event", std::string(EventTypeName(a.type))},
                      {"time_ns", a.time_ns},
                      {"time", FormatTimeMillis(a.time_ns)},
                      {"version", a.version.Hex()},
                      {"digest_matched", a.digest_matched},
                      {"digest_reported", a.digest_reported},
                      {"lag", a.lag}});
    }
    x["acks"] = std::move(acks);
    steps.push_back(std::move(x));
  }
  j["steps"] = std::move(steps);
  Json generators = Json::array();
  for (const auto& g : r.generators) {
    generators.push_back({{"receiver", g.receiver},
                          {"acks", g.acks},
                          {"last_step", g.last_step ? Json(*g.last_step) : Json()},
                          {"max_lag", g.max_lag}});
  }
  j["generators"] = std::move(generators);
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
    for (const auto& [k, value] : v.metrics) metrics += (metrics.empty() ? "" : " ") + k + "=" + FormatNumber(value, 6);
    if (e.delta_norm)
      metrics += (metrics.empty() ? "" : " ") + std::string("delta_norm=") + FormatNumber(*e.delta_norm, 4);
    // The run's name and the metrics (about 30 for a ferryd step) outside the fixed-size buffer.
    std::snprintf(line, sizeof line, " %4llu %8s  %-12s  %-12s  %-8s  ", static_cast<unsigned long long>(v.sequence),
                  v.step ? std::to_string(*v.step).c_str() : "-", ShortId(v.id).c_str(),
                  v.parent ? ShortId(*v.parent).c_str() : "-", std::string(KindName(v.kind)).c_str());
    std::string served;
    for (const auto& x : e.served_by) served += (served.empty() ? "  served by " : ", ") + x;
    s += "  " + v.run + std::string(v.run.size() < 10 ? 10 - v.run.size() : 0, ' ') + line + metrics + served + "\n";
  }
  s += "\nReceivers (" + std::to_string(r.receivers.size()) + " events)\n";
  if (r.receivers.empty()) s += "  none recorded\n";
  for (const auto& e : r.receivers) {
    s += "  " + FormatTimeMillis(e.time_ns) + "  " + e.receiver + " " + std::string(EventTypeName(e.type)) + " " +
         ShortId(e.version) +
         (e.known_version ? " (run " + e.run + ", seq " + std::to_string(e.sequence) + ")" : " (unknown version)") +
         (e.computed ? (e.digest_matched ? ", digest matched" : ", digest MISMATCH: computed " + ShortId(*e.computed))
                     : ", no digest reported") +
         "\n";
  }
  s += "\nEngines (" + std::to_string(r.engines.size()) + " proofs)\n";
  if (r.engines.empty()) s += "  none recorded\n";
  for (const auto& e : r.engines) {
    s += "  " + FormatTimeMillis(e.time_ns) + "  " + e.engine + " " + e.url + " serves " + ShortId(e.version) + " as " +
         e.model + " (receiver " + e.receiver + "): largest difference " + FormatNumber(e.max_diff, 3) +
         " <= " + FormatNumber(e.tolerance, 3) +
         (e.previous_diff ? ", previous version " + FormatNumber(*e.previous_diff, 3) : std::string()) + ", " +
         std::to_string(e.tokens) + " tokens\n";
  }
  s += "\nGaps in sequence numbers\n";
  if (r.gaps.empty()) s += "  none\n";
  for (const auto& g : r.gaps) {
    s += "  run " + g.run + ": missing " + std::to_string(g.first_missing) +
         (g.last_missing != g.first_missing ? ".." + std::to_string(g.last_missing) : "") + "\n";
  }
  s += "\nNever acknowledged\n";
  if (r.receivers.empty() && r.engines.empty()) {
    s += "  (no receiver recorded)\n";
  } else if (r.never_acknowledged.empty()) {
    s += "  none\n";
  }
  for (const auto& d : r.never_acknowledged) s += "  " + ShortId(d) + "\n";
  if (!r.steps.empty()) {
    s += "\nSteps (" + std::to_string(r.steps.size()) + ")\n";
    std::snprintf(line, sizeof line, "  %6s  %-12s  %-12s  %10s  %13s  %10s  %s\n", "step", "adapter", "merged",
                  "reward", "loss", "grad_norm", "acknowledged by (lag)");
    s += line;
    for (const auto& e : r.steps) {
      auto metric = [&](const char* k) {
        auto it = e.metrics.find(k);
        return it == e.metrics.end() ? std::string("-") : FormatNumber(it->second, 6);
      };
      std::string acks;
      for (const auto& a : e.acks) {
        acks += (acks.empty() ? "" : ", ") + a.receiver + (a.type == store::Event::Type::kEngine ? " proven" : "") +
                " (" + std::to_string(a.lag) + ")" + (a.digest_reported && !a.digest_matched ? " MISMATCH" : "");
      }
      std::snprintf(line, sizeof line, "  %6lld  %-12s  %-12s  %10s  %13s  %10s  ", static_cast<long long>(e.step),
                    e.adapter_version ? ShortId(*e.adapter_version).c_str() : "-",
                    e.merged_version ? ShortId(*e.merged_version).c_str() : "-", metric("reward").c_str(),
                    metric("loss").c_str(), metric("grad_norm").c_str());
      s += line + (acks.empty() ? std::string("-") : acks) + "\n";
    }
    s += "\nGenerators\n";
    if (r.generators.empty()) s += "  none acknowledged a step\n";
    for (const auto& g : r.generators) {
      s += "  " + g.receiver + ": " + std::to_string(g.acks) + " acknowledgements, last step " +
           (g.last_step ? std::to_string(*g.last_step) : std::string("-")) + ", max lag " + std::to_string(g.max_lag) +
           " steps\n";
    }
  }
  s += "\nAnomalies (" + std::to_string(r.anomalies.size()) + ")\n";
  if (r.anomalies.empty()) s += "  none\n";
  for (const auto& a : r.anomalies) s += "  [" + std::string(AnomalyKindName(a.kind)) + "] " + a.message + "\n";
  return s;
}

}  // namespace ferry::cli
