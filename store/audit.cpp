#include "store/audit.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "core/text.h"
#include "store/engine_report.h"

namespace ferry::store {
namespace {

bool IsLoraB(const std::string& name) {
  return name.find("lora_B") != std::string::npos || name.find("lora_embedding_B") != std::string::npos;
}

// "version 0123456789ab (run r, seq 3)".
std::string Describe(const VersionRecord& v) {
  return "version " + ShortId(v.id) + " (run " + v.run + ", seq " + std::to_string(v.sequence) + ")";
}

bool IsReceiverEvent(const Event& e) {
  return e.type == Event::Type::kAcknowledged || e.type == Event::Type::kActivated;
}

// An inference engine proven to serve the event's version (a valid kEngine record): the
// generator of a ferryd run with use_vllm, or a receiver's vLLM, took that version.
bool IsEngineProof(const Event& e) {
  return e.type == Event::Type::kEngine && ParseEngineReport(e.detail, /*proven=*/true).ok();
}

// A generator took the event's version: it acknowledged or activated it, or its engine was
// proven to serve it.
bool IsTaken(const Event& e) { return IsReceiverEvent(e) || IsEngineProof(e); }

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
                 "merged " + Describe(v) + " has the same tensor digests as its base version " +
                     ShortId(*v.base_version) + " although adapter version " + ShortId(*v.adapter_version) +
                     " is non-zero (tensor " + nonzero->name + " has l2_norm " + FormatNumber(nonzero->l2_norm, 4) +
                     "): the adapter never reached these weights",
                 std::nullopt});
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
                     " lora_B tensors are zero, so merging it changes nothing",
                 std::nullopt});
}

void CheckNonFinite(const VersionRecord& v, std::vector<Anomaly>& out) {
  for (const auto& t : v.tensors) {
    if (t.nonfinite <= 0) continue;
    out.push_back({AnomalyKind::kNonFinite, v.id, t.name,
                   Describe(v) + ": tensor " + t.name + " has " + std::to_string(t.nonfinite) + " NaN/Inf values",
                   std::nullopt});
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

std::string StepName(int64_t step) { return "step " + std::to_string(step); }

// The run's steps (StepEntry), from its versions with a step (and its acknowledged base as
// step 0), and the acknowledgements of their versions.
void CollectSteps(const std::vector<const VersionRecord*>& selected, const std::vector<const Event*>& relevant,
                  AuditReport& report) {
  std::map<int64_t, StepEntry> steps;
  std::map<Digest, int64_t> step_of;
  std::map<std::pair<int64_t, VersionKind>, int> recorded;  // (step, kind) -> versions recorded
  std::optional<Digest> base;
  for (const VersionRecord* v : selected) {  // by sequence: a repeated step keeps its newest record
    if (!v->step) {
      if (v->kind == VersionKind::kBase && !base) base = v->id;
      continue;
    }
    StepEntry& e = steps[*v->step];
    e.step = *v->step;
    // A step's adapter and the merged version made from it are one recording of the step.
    e.records = std::max(e.records, ++recorded[{*v->step, v->kind}]);
    e.time_ns = v->time_ns;
    if (v->kind == VersionKind::kAdapter) e.adapter_version = v->id;
    if (v->kind == VersionKind::kMerged || v->kind == VersionKind::kFull) e.merged_version = v->id;
    if (!v->metrics.empty()) e.metrics = v->metrics;
    step_of[v->id] = *v->step;
  }
  if (base && steps.count(0) == 0) {
    for (const Event* ev : relevant) {
      if (ev->version == *base && IsTaken(*ev)) {
        StepEntry& e = steps[0];
        e.merged_version = base;
        step_of[*base] = 0;
        for (const VersionRecord* v : selected) {
          if (v->id != *base) continue;
          e.time_ns = v->time_ns;
          e.records = 1;
        }
        break;
      }
    }
  }
  // The trainer's progress: the step of each commit of a step's version and of each published
  // event of one, by time. At time t the trainer is at the step of the latest at or before t
  // (a resumed run publishes its checkpoint's step again, and goes back to it).
  std::vector<std::pair<int64_t, int64_t>> progress;  // (time, step)
  for (const VersionRecord* v : selected) {
    if (v->step) progress.emplace_back(v->time_ns, *v->step);
  }
  for (const Event* ev : relevant) {
    auto it = step_of.find(ev->version);
    if (ev->type == Event::Type::kPublished && it != step_of.end()) progress.emplace_back(ev->time_ns, it->second);
  }
  std::stable_sort(progress.begin(), progress.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  auto trainer_step_at = [&progress](int64_t t) -> int64_t {
    auto next = std::upper_bound(progress.begin(), progress.end(), t,
                                 [](int64_t time, const auto& p) { return time < p.first; });
    return next == progress.begin() ? 0 : std::prev(next)->second;
  };
  std::map<std::string, GeneratorSummary> generators;
  for (const Event* ev : relevant) {
    if (!IsTaken(*ev)) continue;
    auto it = step_of.find(ev->version);
    if (it == step_of.end()) continue;
    const int64_t n = it->second;
    const int64_t trainer = trainer_step_at(ev->time_ns);
    StepAck a;
    a.receiver = ev->receiver;
    a.type = ev->type;
    a.time_ns = ev->time_ns;
    a.version = ev->version;
    a.digest_reported = ev->computed.has_value();
    a.digest_matched = ev->computed && *ev->computed == ev->version;
    a.lag = std::max<int64_t>(0, trainer - n);
    GeneratorSummary& g = generators[ev->receiver];
    g.receiver = ev->receiver;
    ++g.acks;
    g.last_step = std::max(g.last_step.value_or(n), n);
    g.max_lag = std::max(g.max_lag, a.lag);
    steps[n].acks.push_back(std::move(a));
  }
  for (auto& [n, e] : steps) report.steps.push_back(std::move(e));
  for (auto& [name, g] : generators) report.generators.push_back(std::move(g));
}

// generator_behind over the acknowledgements (by time) and at the run's last step.
void CheckGeneratorsBehind(const AuditReport& report, const AuditOptions& o, std::vector<Anomaly>& out) {
  struct Ack {
    const StepAck* ack;
    int64_t step;
  };
  std::vector<Ack> acks;
  for (const auto& e : report.steps) {
    for (const auto& a : e.acks) acks.push_back({&a, e.step});
  }
  std::stable_sort(acks.begin(), acks.end(),
                   [](const Ack& a, const Ack& b) { return a.ack->time_ns < b.ack->time_ns; });
  std::map<std::string, bool> behind;
  for (const Ack& a : acks) {
    bool& is_behind = behind[a.ack->receiver];
    if (a.ack->lag > o.lag_threshold && !is_behind) {
      out.push_back({AnomalyKind::kGeneratorBehind, a.ack->version, "",
                     "receiver " + a.ack->receiver + " " + std::string(EventTypeName(a.ack->type)) + " " +
                         StepName(a.step) + " (version " + ShortId(a.ack->version) + ") when the trainer was at " +
                         StepName(a.step + a.ack->lag) + ": " + std::to_string(a.ack->lag) + " steps behind (rule: > " +
                         std::to_string(o.lag_threshold) + ")",
                     a.step + a.ack->lag});
    }
    is_behind = a.ack->lag > o.lag_threshold;
  }
  if (report.steps.empty()) return;
  const StepEntry& last = report.steps.back();
  for (const auto& g : report.generators) {
    if (!g.last_step || last.step - *g.last_step <= o.lag_threshold) continue;
    out.push_back(
        {AnomalyKind::kGeneratorBehind, last.merged_version.value_or(last.adapter_version.value_or(Digest{})), "",
         "receiver " + g.receiver + " last acknowledged " + StepName(*g.last_step) + " but the run ended at " +
             StepName(last.step) + ": " + std::to_string(last.step - *g.last_step) + " steps behind (rule: > " +
             std::to_string(o.lag_threshold) + ")",
         last.step});
  }
}

// reward_collapse, nonfinite_loss and grad_norm_spike over the steps' metrics.
void CheckStepMetrics(const AuditReport& report, const AuditOptions& o, std::vector<Anomaly>& out) {
  std::vector<double> rewards;  // the last reward_window rewards
  std::optional<double> best;
  int64_t best_step = 0;
  bool collapse_flagged = false;
  int64_t zero_streak = 0, zero_first = 0;
  std::vector<double> grad_history;
  for (const auto& e : report.steps) {
    if (e.step == 0 && e.metrics.empty()) continue;
    const Digest id = e.merged_version.value_or(e.adapter_version.value_or(Digest{}));
    auto metric = [&](const char* name) -> std::optional<double> {
      auto it = e.metrics.find(name);
      return it == e.metrics.end() ? std::nullopt : std::optional<double>(it->second);
    };
    if (auto loss = metric("loss"); loss && !std::isfinite(*loss)) {
      out.push_back({AnomalyKind::kNonFiniteLoss, id, "",
                     StepName(e.step) + " (version " + ShortId(id) + "): loss is NaN or Inf", e.step});
    }
    if (auto g = metric("grad_norm")) {
      if (!std::isfinite(*g)) {
        out.push_back({AnomalyKind::kGradNormSpike, id, "",
                       StepName(e.step) + " (version " + ShortId(id) + "): grad_norm is NaN or Inf", e.step});
      } else {
        if (static_cast<int>(grad_history.size()) >= o.grad_min_history) {
          const size_t w = std::min<size_t>(grad_history.size(), 100);
          const double median =
              Median(std::vector<double>(grad_history.end() - static_cast<std::ptrdiff_t>(w), grad_history.end()));
          if (median > 0 && *g > o.grad_spike_factor * median) {
            out.push_back({AnomalyKind::kGradNormSpike, id, "",
                           StepName(e.step) + " (version " + ShortId(id) + "): grad_norm " + FormatNumber(*g, 4) +
                               " is " + FormatNumber(*g / median, 3) + "x the median " + FormatNumber(median, 4) +
                               " of the previous " + std::to_string(w) + " steps (rule: > " +
                               FormatNumber(o.grad_spike_factor, 3) + "x)",
                           e.step});
          }
        }
        grad_history.push_back(*g);
      }
    }
    auto zero_frac = metric("frac_reward_zero_std");
    auto reward_std = metric("reward_std");
    const bool all_zero_std = zero_frac ? *zero_frac >= 1.0 : (reward_std && *reward_std == 0.0);
    if (all_zero_std) {
      if (zero_streak++ == 0) zero_first = e.step;
      if (zero_streak == o.zero_std_steps) {
        out.push_back({AnomalyKind::kRewardCollapse, id, "",
                       "reward std within every group is zero for " + std::to_string(zero_streak) +
                           " consecutive steps, " + StepName(zero_first) + " to " + StepName(e.step) + " (version " +
                           ShortId(id) + "): every advantage is zero, nothing is learnt (rule: >= " +
                           std::to_string(o.zero_std_steps) + " steps)",
                       e.step});
      }
    } else {
      zero_streak = 0;
    }
    auto reward = metric("reward");
    if (!reward || !std::isfinite(*reward)) continue;
    rewards.push_back(*reward);
    if (static_cast<int>(rewards.size()) > o.reward_window) rewards.erase(rewards.begin());
    if (static_cast<int>(rewards.size()) < o.reward_window) continue;
    double mean = 0;
    for (double r : rewards) mean += r;
    mean /= static_cast<double>(rewards.size());
    if (!best || mean > *best) {
      best = mean;
      best_step = e.step;
      collapse_flagged = false;
    } else if (!collapse_flagged && *best - mean > o.reward_drop) {
      collapse_flagged = true;
      out.push_back({AnomalyKind::kRewardCollapse, id, "",
                     StepName(e.step) + " (version " + ShortId(id) + "): the reward's " +
                         std::to_string(o.reward_window) + "-step moving mean " + FormatNumber(mean, 4) + " is " +
                         FormatNumber(*best - mean, 4) + " below its best " + FormatNumber(*best, 4) + " (at " +
                         StepName(best_step) + ") (rule: a drop > " + FormatNumber(o.reward_drop, 3) + ")",
                     e.step});
    }
  }
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
    case AnomalyKind::kGeneratorBehind: return "generator_behind";
    case AnomalyKind::kRewardCollapse: return "reward_collapse";
    case AnomalyKind::kNonFiniteLoss: return "nonfinite_loss";
    case AnomalyKind::kGradNormSpike: return "grad_norm_spike";
  }
  return "unknown";
}

Result<AuditReport> AnalyzeAudit(const std::vector<VersionRecord>& all_versions, const std::vector<Event>& events,
                                 const DeltaNormFn& delta_norm, const AuditOptions& options) {
  if (!(options.jump_factor > 0) || options.min_history < 1) {
    return Status::InvalidArgument("audit: jump_factor must be > 0 and min_history >= 1");
  }
  if (options.lag_threshold < 0 || options.reward_window < 1 || !(options.reward_drop > 0) ||
      options.zero_std_steps < 1 || !(options.grad_spike_factor > 0) || options.grad_min_history < 1) {
    return Status::InvalidArgument(
        "audit: lag_threshold must be >= 0, reward_window, zero_std_steps and grad_min_history >= 1, reward_drop and "
        "grad_spike_factor > 0");
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
            version_anomalies.push_back({AnomalyKind::kDeltaJump, v->id, "",
                                         "adapter " + Describe(*v) + ": delta norm " + FormatNumber(d, 4) +
                                             " from version " + ShortId(prev->second->id) + " is " +
                                             FormatNumber(d / median, 3) + "x the median " + FormatNumber(median, 4) +
                                             " of the " + std::to_string(history.size()) +
                                             " previous deltas (rule: > " + FormatNumber(options.jump_factor, 3) + "x)",
                                         std::nullopt});
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
  for (const auto& e : events) any_receiver = any_receiver || IsTaken(e);
  for (const Event* e : relevant) {
    if (e->type == Event::Type::kAnomaly) {
      event_anomalies.push_back({AnomalyKind::kRecorded, e->version, "",
                                 "recorded" + (e->receiver.empty() ? std::string() : " by " + e->receiver) +
                                     " for version " + ShortId(e->version) + ": " + e->detail,
                                 std::nullopt});
      continue;
    }
    if (e->type == Event::Type::kEngine) {
      Result<EngineReport> r = ParseEngineReport(e->detail, /*proven=*/true);
      if (!r.ok()) {  // not shown as a proof: a record that does not hold one is an anomaly
        event_anomalies.push_back({AnomalyKind::kRecorded, e->version, "",
                                   "an engine record" + (e->receiver.empty() ? std::string() : " by " + e->receiver) +
                                       " for version " + ShortId(e->version) + " (recorded at " +
                                       std::to_string(e->time_ns) +
                                       " ns since the epoch) is invalid: " + r.status().message(),
                                   std::nullopt});
        continue;
      }
      EngineProof p;
      p.receiver = e->receiver;
      p.time_ns = e->time_ns;
      p.version = e->version;
      p.engine = r->engine;
      p.url = r->url;
      p.model = r->model;
      p.max_diff = *r->max_diff;  // a proof's is finite
      p.tolerance = r->tolerance;
      p.seconds = r->seconds;
      p.tokens = r->tokens;
      p.previous_diff = r->previous_diff;
      auto t = timeline_index.find(e->version);
      if (t != timeline_index.end()) {
        auto& list = report.timeline[t->second].served_by;
        const std::string who = p.engine + " " + p.url + " as " + p.model;
        if (std::find(list.begin(), list.end(), who) == list.end()) list.push_back(who);
      }
      acknowledged.insert(e->version);  // served, proven: taken as surely as an acknowledgement
      report.engines.push_back(std::move(p));
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
                                 "receiver " + e->receiver + " " + verb + " version " + ShortId(e->version) +
                                     ", which was never published (" +
                                     (r.known_version ? "no published event" : "no version record") + ")",
                                 std::nullopt});
    }
    if (e->computed && *e->computed != e->version) {
      event_anomalies.push_back({AnomalyKind::kDigestMismatch, e->version, "",
                                 "receiver " + e->receiver + " " + verb + " version " + ShortId(e->version) +
                                     " but computed digest " + ShortId(*e->computed) + ": it holds other weights",
                                 std::nullopt});
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
    // A receiver in adapter mode acknowledges the merged version it proved (sync records it
    // so): its adapter counts as acknowledged too. Versions never published are not listed.
    std::set<Digest> acknowledged_adapters;
    for (const Digest& id : acknowledged) {
      auto v = by_id.find(id);
      if (v != by_id.end() && v->second->kind == VersionKind::kMerged && v->second->adapter_version) {
        acknowledged_adapters.insert(*v->second->adapter_version);
      }
    }
    for (const auto* v : selected) {
      if (published.count(v->id) != 0 && acknowledged.count(v->id) == 0 && acknowledged_adapters.count(v->id) == 0) {
        report.never_acknowledged.push_back(v->id);
      }
    }
  }
  report.anomalies = std::move(version_anomalies);
  report.anomalies.insert(report.anomalies.end(), event_anomalies.begin(), event_anomalies.end());
  for (auto& a : report.anomalies) {
    auto v = by_id.find(a.version);
    if (v == by_id.end() || !v->second->step) continue;
    a.step = v->second->step;
    if (a.kind == AnomalyKind::kDigestMismatch) a.message += " (" + StepName(*a.step) + ")";
  }
  if (options.run) {
    CollectSteps(selected, relevant, report);
    CheckGeneratorsBehind(report, options, report.anomalies);
    CheckStepMetrics(report, options, report.anomalies);
  }
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
    FERRY_RETURN_IF_ERROR(ReadAsF32(va, xa).WithContext("version " + ShortId(a.id) + " tensor " + ta.name));
    FERRY_RETURN_IF_ERROR(ReadAsF32(vb, xb).WithContext("version " + ShortId(b.id) + " tensor " + tb.name));
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
  DeltaNormFn delta = [&store](const VersionRecord& a, const VersionRecord& b) {
    return VersionDeltaNorm(store, a, b);
  };
  return AnalyzeAudit(versions, events, delta, options);
}

}  // namespace ferry::store
