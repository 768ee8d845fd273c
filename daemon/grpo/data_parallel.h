// The trainer's data-parallel steps (not a public API): what each rank shares with the others
// through its dist::ProcessGroup, following TRL's split of a GRPO step over processes.
//
//   each rank      takes whole groups: the global generation batch is drawn by every rank
//                  from the same seeded order (the dataset position stays global), and rank r
//                  keeps prompts [r * P/W, (r+1) * P/W); it samples them with a seed of the
//                  run's seed, the step and the rank
//   gathered       the rewards (advantages and their statistics over the whole batch, as
//                  with scale_rewards "batch"), each completion's length, truncation and
//                  prompt length (the completions/* metrics, num_tokens), dapo's token count,
//                  bnpo's per micro-batch; the step's other metrics are averaged (min / max
//                  for those TRL reduces so)
//   all-reduced    the LoRA gradients, flattened into buckets of at most kGradientBucketBytes,
//                  summed and divided by W before clipping and AdamW: every rank applies the
//                  same update
//   all-gathered   the snapshot id each rank's generator acknowledged, every step (a rank
//                  that differs stops the run naming it and both ids), and every check_every
//                  steps a digest of each rank's adapter parameters
//   broadcast      at the start, rank 0's state (restored from its newest verified
//                  checkpoint, or fresh): adapter, optimizer state, step, dataset position,
//                  the random state
// Rank 0 alone writes: the store, metrics.jsonl, checkpoints, run_config.json.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/grpo/trainer_internal.h"
#include "store/store.h"

namespace ferry::grpo {

inline constexpr int64_t kGradientBucketBytes = int64_t{32} << 20;

// Rank 0's start state onto every rank (see the top). REQUIRES: s.group.
[[nodiscard]] Status ShareStartState(Trainer::State& s);

// The collectives of a step; `what` names the operation in errors (Trainer::Step puts the
// step's number in front).
// Every rank's rows of `local` ([n, ...], equal shapes), in rank order: [W * n, ...]. Without
// a group: `local`.
[[nodiscard]] Result<at::Tensor> GatherRows(Trainer::State& s, const at::Tensor& local, const std::string& what);

// Sums `value` over the ranks. Without a group: `value`.
[[nodiscard]] Result<int64_t> SumOverRanks(Trainer::State& s, int64_t value, const std::string& what);

// Averages the adapter's gradients over the ranks (undefined gradients count as zeros and are
// then defined). Without a group: nothing.
[[nodiscard]] Status AverageGradients(Trainer::State& s);

// The end of a step (or, `at_start`, the start, with no metrics), in one gather: each rank's word on
// whether the ranks wait for rank 0's before the next step (s.ask_before_step, into s.await_word, and a
// rank other than 0 that asked to stop into s.stop_asked_by); the snapshot id each
// rank's generator acknowledged (`acked`, this rank's) into s.rank_versions, kCorruption naming
// the rank, its host and both ids when one differs from rank 0's; the names of the metrics
// (kInternal when they differ); and `metrics` combined over the ranks: the mean, or the min /
// max of those whose last name part starts or ends with min / max. With check_adapter, a
// second gather compares the ranks' adapter digests (kCorruption likewise). Without a group:
// s.rank_versions = {acked}, `metrics` unchanged. Errors begin "at the start: " at the start;
// a step's name no step (Trainer::Step puts its number in front, as for every error of a step).
[[nodiscard]] Status ShareStepEnd(Trainer::State& s, const store::Digest& acked, Metrics& metrics, bool check_adapter,
                                  bool at_start = false);

// Whether the run's step `step` is one whose adapter digests the ranks compare.
bool AdapterCheckDue(const Trainer::State& s, int64_t step);

}  // namespace ferry::grpo
