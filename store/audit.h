// The post-run audit (`ferry audit`): what a store says happened during a run.
//
// From the version records and events of a store it builds the report's data (presentation is
// the CLI's: text and JSON in cli/audit_text.h, the HTML page in cli/audit_html.h):
//   - a timeline: each version with its run, sequence, step, id, parent, kind, metrics, size,
//     the delta norm of adapter versions and the receivers that activated it;
//   - receivers: every acknowledged/activated event, with whether the manifest digest the
//     receiver computed matched the version it claimed to load;
//   - gaps: sequence numbers missing between the first and last version of a run;
//   - published versions never acknowledged by any receiver (only when some receiver exists;
//     an adapter counts as acknowledged when a merged version made from it was; an engine
//     proven to serve a version, a valid kEngine event, acknowledged it);
//   - anomalies, by these rules (each names the version, and the tensor where there is one):
//       merged_equals_base   a merged version whose tensors present in its base_version all
//                            have the base's digests, although its adapter_version is non-zero
//                            (some lora_B / lora_embedding_B tensor with l2_norm > 0; for an
//                            adapter without B tensors, any tensor with l2_norm > 0). The
//                            flat-reward failure: the generator was handed base weights.
//       zero_adapter         an adapter version whose lora_B / lora_embedding_B tensors are all
//                            all-zero (merging it changes nothing). Not flagged at step 0,
//                            where PEFT initialises B to zero.
//       nonfinite            a tensor with NaN or Inf values (nonfinite > 0).
//       delta_jump           adapter versions of a run in sequence order: d_k = ||theta_k -
//                            theta_{k-1}||_2 over all tensors (the size of the update between
//                            consecutive adapter versions). Flagged when d_k > jump_factor x the
//                            median of d_1 .. d_{k-1}, once min_history previous deltas exist
//                            and that median is > 0.
//       unpublished_ack      an acknowledged/activated event for a version with no version
//                            record, or with no published event.
//       digest_mismatch      an acknowledged/activated event whose computed digest differs from
//                            the version id.
//       recorded             an event of type anomaly recorded by sync or the daemon.
//
// A training run (AuditOptions::run names it) also gets its steps: every step N that the run
// recorded (ferryd records per step an adapter version and the merged version derived from
// it, both with step = N and the step's metrics, TRL's names) with its adapter version, merged
// version, metrics and the acknowledged/activated events of either version (in-process or
// remote receivers alike: the event's receiver names the generator), and the engine proofs of
// either (a vLLM proven to serve it: a valid kEngine event, StepAck::type kEngine). The run's
// base version is step 0 when a receiver acknowledged it (the generator's weights before the
// first step).
// A step recorded more than once (a resumed run repeating steps after its last checkpoint)
// shows its newest record (highest sequence); `records` counts the step's recordings: the
// most versions of one kind recorded with step N (a step's adapter and the merged version
// derived from it are one recording: 1; a step recorded again by a resumed run: 2).
//   lag of an acknowledgement = max(0, S - N): N the acknowledged version's step, S the
//   trainer's step at the event's time: the step of the latest commit of a step's version or
//   published event of one at or before it (a resumed run publishes its checkpoint's step
//   again: it is back there). The in-process generator acknowledges step N right after it
//   was published: lag 0; a remote one acknowledging N once N + 1 is out: lag 1.
// And these anomalies, each naming its step (Anomaly::step):
//       generator_behind     a receiver's acknowledgement with lag > lag_threshold (flagged
//                            when the receiver falls behind, again only after it caught up);
//                            or, at the run's last step S, a receiver whose newest
//                            acknowledged step L has S - L > lag_threshold.
//       reward_collapse      (a) the moving mean of metric "reward" over the last reward_window
//                            steps falls more than reward_drop below the best moving mean seen
//                            before (flagged at the first such step; again only after a new
//                            best); (b) every group's rewards are identical (metric
//                            frac_reward_zero_std == 1, or reward_std == 0 where the former is
//                            absent: every advantage is zero, the step learns nothing) for
//                            zero_std_steps consecutive steps (flagged at the step the streak
//                            reaches that length, naming its first step).
//       nonfinite_loss       metric "loss" is NaN or Inf (the store records both as null).
//       grad_norm_spike      metric "grad_norm" (before clipping) > grad_spike_factor x the
//                            median of the previous up to 100 steps' grad norms, once
//                            grad_min_history of them exist and that median is > 0; or NaN/Inf.
//   digest_mismatch and recorded anomalies about a step's version carry that step too.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "store/store.h"

namespace ferry::store {

struct AuditOptions {
  // Only versions of this run (and events about them or about unknown versions). Default: all.
  std::optional<std::string> run;
  // delta_jump: flagged when d_k > jump_factor x median(previous deltas). Default: 10.
  double jump_factor = 10.0;
  // delta_jump: previous deltas needed before the rule applies. Default: 2.
  int min_history = 2;
  // generator_behind: a receiver more than this many steps behind the trainer. An in-process
  // generator is never behind; a remote one a step behind is the usual one-step-off-policy
  // pipeline. Default: 2.
  int64_t lag_threshold = 2;
  // reward_collapse (a): the moving mean's window in steps, and the drop below its best that
  // is flagged (in reward units; the default suits rewards in [0, 1], as TRL's accuracy and
  // format rewards are). Default: 10 and 0.2.
  int reward_window = 10;
  double reward_drop = 0.2;
  // reward_collapse (b): consecutive steps with every group's reward std zero. Default: 5.
  int zero_std_steps = 5;
  // grad_norm_spike: flagged above this many times the running median. Default: 10.
  double grad_spike_factor = 10.0;
  // grad_norm_spike: previous steps needed before the rule applies. Default: 5.
  int grad_min_history = 5;
};

enum class AnomalyKind {
  kMergedEqualsBase,
  kZeroAdapter,
  kNonFinite,
  kDeltaJump,
  kUnpublishedAck,
  kDigestMismatch,
  kRecorded,
  kGeneratorBehind,
  kRewardCollapse,
  kNonFiniteLoss,
  kGradNormSpike,
};
// "merged_equals_base", "zero_adapter", "nonfinite", "delta_jump", "unpublished_ack",
// "digest_mismatch", "recorded", "generator_behind", "reward_collapse", "nonfinite_loss",
// "grad_norm_spike".
std::string_view AnomalyKindName(AnomalyKind kind);

struct Anomaly {
  AnomalyKind kind = AnomalyKind::kRecorded;
  Digest version;
  std::string tensor;           // "" when not about one tensor
  std::string message;          // one line, names the version (and tensor, and step)
  std::optional<int64_t> step;  // the training step concerned, when the version has one
};

// One acknowledgement of a step's version by a receiver (a generator).
struct StepAck {
  std::string receiver;
  Event::Type type = Event::Type::kAcknowledged;
  int64_t time_ns = 0;
  Digest version;               // the step's adapter or merged version
  bool digest_matched = false;  // the receiver's computed digest equals `version`
  bool digest_reported = false;
  int64_t lag = 0;  // in steps (the rule at the top of this file)
};

// One training step of the audited run.
struct StepEntry {
  int64_t step = 0;
  std::optional<Digest> adapter_version;
  std::optional<Digest> merged_version;   // for step 0: the base version
  int64_t time_ns = 0;                    // commit time of the step's newest record
  std::map<std::string, double> metrics;  // the step's metrics (NaN where recorded as null)
  std::vector<StepAck> acks;              // by time
  int records = 0;                        // recordings of this step (1; more after a resume)
};

// One receiver's acknowledgements over the audited run's steps.
struct GeneratorSummary {
  std::string receiver;
  int64_t acks = 0;
  std::optional<int64_t> last_step;  // the newest step it acknowledged
  int64_t max_lag = 0;
};

struct TimelineEntry {
  VersionRecord version;                  // tensors and aux are kept (reports count them)
  std::optional<double> delta_norm;       // adapters after the run's first adapter version
  std::vector<std::string> activated_by;  // receivers with an activated event for it
  std::vector<std::string> acknowledged_by;
  std::vector<std::string> served_by;  // engines proven to serve it: "vllm URL as MODEL"
};

struct ReceiverEvent {
  std::string receiver;
  Event::Type type = Event::Type::kAcknowledged;
  int64_t time_ns = 0;
  Digest version;
  std::optional<Digest> computed;
  bool digest_matched = false;  // computed present and equal to version
  bool known_version = false;   // a version record exists
  std::string run;              // of the version, when known
  uint64_t sequence = 0;        // of the version, when known
};

// An inference engine proven to serve a version (a kEngine event: its detail's fields).
struct EngineProof {
  std::string receiver;  // the receiver that drove the engine
  int64_t time_ns = 0;
  Digest version;
  std::string engine, url, model;  // "vllm", its URL, the name it serves the version under
  double max_diff = 0, tolerance = 0, seconds = 0;
  std::optional<double> previous_diff;
  int64_t tokens = 0;
};

struct SequenceGap {
  std::string run;
  uint64_t first_missing = 0;
  uint64_t last_missing = 0;
};

struct AuditReport {
  std::optional<std::string> run;        // the filter used
  std::vector<TimelineEntry> timeline;   // by run, then sequence
  std::vector<ReceiverEvent> receivers;  // by time
  std::vector<EngineProof> engines;      // by time
  std::vector<SequenceGap> gaps;
  std::vector<Digest> never_acknowledged;  // empty when no receiver exists
  std::vector<Anomaly> anomalies;
  std::vector<std::string> metric_names;  // every metric key of the timeline, sorted
  // Only when options.run is set: the run's steps (ascending) and its receivers (by name).
  std::vector<StepEntry> steps;
  std::vector<GeneratorSummary> generators;
};

// Computes d_k for a pair of consecutive adapter versions (previous, current).
using DeltaNormFn = std::function<Result<double>(const VersionRecord& previous, const VersionRecord& current)>;

// The analysis itself, over records already loaded. `all_versions` is every version of the
// store (base/adapter lookups cross runs); `events` every event. `delta_norm` may be empty
// (no delta norms, no delta_jump rule). Errors from `delta_norm` are returned.
Result<AuditReport> AnalyzeAudit(const std::vector<VersionRecord>& all_versions, const std::vector<Event>& events,
                                 const DeltaNormFn& delta_norm, const AuditOptions& options);

// Loads everything from `store` and analyses it; delta norms are computed from the stored
// adapter tensors (read back from object files, floating-point tensors only). kNotFound
// naming the run when options.run names no run of the store.
Result<AuditReport> RunAudit(Store& store, const AuditOptions& options);

// ||b - a||_2 over the tensors of two versions (tensors present in only one count with their
// full norm; tensors with equal digests contribute 0 without being read).
Result<double> VersionDeltaNorm(Store& store, const VersionRecord& a, const VersionRecord& b);

}  // namespace ferry::store
