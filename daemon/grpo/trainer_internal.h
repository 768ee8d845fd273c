// The trainer's state and the pieces its files share (not a public API).
#pragma once

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/grpo/colocated.h"
#include "daemon/grpo/grpo_math.h"
#include "daemon/grpo/lr_schedule.h"
#include "daemon/grpo/trainer.h"
#include "daemon/grpo/vllm_generator.h"
#include "daemon/run/config.h"
#include "daemon/run/dataset.h"
#include "daemon/run/rewards.h"
#include "daemon/runtime/generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/text/chat_format.h"
#include "daemon/text/tokenizer.h"
#include "store/store.h"
#include "sync/handoff.h"

namespace ferry::grpo {

using Metrics = std::map<std::string, double>;

// One generation batch (TRL: the buffered inputs of steps_per_generation micro-batches), rows
// ordered prompt by prompt (G completions each) until split into micro-batches.
struct Rollout {
  at::Tensor prompt_ids;       // long [N, P], left-padded with the pad id
  at::Tensor prompt_mask;      // long [N, P]
  at::Tensor completion_ids;   // long [N, C], right-padded
  at::Tensor completion_mask;  // long [N, C]: 1 up to and including EOS (0 for masked truncations)
  at::Tensor sampling_logps;   // float [N, C]: the generator's, 0 at padding
  at::Tensor old_logps;        // float [N, C] or undefined (= the first forward's, detached)
  at::Tensor ref_logps;        // float [N, C] or undefined (beta == 0)
  at::Tensor advantages;       // float [N]
  at::Tensor is_ratio;         // mismatch ratio [N, C] or [N, 1], or undefined
  int64_t num_items = 0;       // completion_mask.sum() over the whole batch (dapo)
  Metrics metrics;             // rewards/..., completions/..., sampling/..., num_tokens
  std::vector<std::vector<int64_t>> rows_of_micro_batch;  // row indices of each micro-batch
};

// A generation batch's prompts, drawn from the dataset, with the sampling settings of its step.
struct DrawnPrompts {
  std::vector<const run::Example*> examples;
  std::vector<std::string> texts;         // as the rewards see them
  std::vector<std::vector<int32_t>> ids;  // as the generator and the trainer see them
  runtime::SamplingParams sampling;
};

// use_vllm with max_staleness 1: the next generation batch being sampled by the server while
// the trainer trains on the current one.
struct InFlight {
  DrawnPrompts prompts;
  std::future<Result<std::vector<runtime::Completion>>> completions;
  int64_t version_step = 0;   // optimizer steps of the version sampling it
  std::string version;        // that version (hex)
  run::DatasetPosition from;  // the sampler's position before these prompts were drawn
};

class StepRecorder;

struct Trainer::State {
  TrainOptions options;
  run::RunConfig config;
  std::filesystem::path dir;
  int64_t total_steps = 0;
  int64_t warmup_steps = 0;
  LrSchedule schedule = LrSchedule::kLinear;
  LossOptions loss_options;
  AdvantageOptions advantage_options;
  MismatchOptions mismatch_options;
  bool fast_old_logps = false;  // old log-probs = the first forward's, detached
  // The trainer's forward computes each distinct prompt of a micro-batch once and runs only
  // the completions per row (MicroBatchLogProbs). Off: every row's prompt is recomputed
  // (the plain forward; tests compare the two).
  bool share_prompt_forward = true;

  std::optional<text::Tokenizer> tokenizer;  // set by Create
  std::optional<text::ChatFormat> chat_format;
  std::vector<int64_t> eos_ids;
  int64_t pad_id = 0;

  std::unique_ptr<runtime::CausalLM> model;  // the trainer's: frozen base + LoRA
  std::unique_ptr<runtime::LoraAdapter> adapter;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  std::shared_ptr<const run::Dataset> dataset;
  std::unique_ptr<run::DatasetSampler> sampler;
  std::unique_ptr<run::RewardScorer> rewards;

  std::filesystem::path store_dir;
  std::unique_ptr<store::Store> store;
  store::Digest base_version;
  std::unique_ptr<sync::SnapshotChannel> channel;
  std::unique_ptr<WeightPublisher> publisher;
  std::unique_ptr<ColocatedGenerator> generator;             // use_vllm = false
  std::unique_ptr<VllmGenerator> vllm;                       // use_vllm = true
  std::string generator_version;                             // hex id the generator acknowledged last
  int64_t generator_step = 0;                                // optimizer steps of that version
  std::optional<InFlight> inflight;                          // max_staleness 1
  std::shared_ptr<const sync::Snapshot> generator_snapshot;  // the snapshot of that id

  int64_t step = 0;        // optimizer steps taken
  int64_t micro_step = 0;  // micro-batches taken (TRL's _step)
  double num_tokens = 0;   // prompt + completion tokens seen (TRL's num_input_tokens_seen)
  std::optional<Rollout> buffer;
  std::map<std::string, std::vector<double>> pending;  // metrics since the last log line
  int64_t last_logged = 0;
  int64_t last_saved = 0;
  std::vector<std::filesystem::path> created_by_start;  // Trainer::created_by_start

  // Data-parallel ranks (data_parallel.h); null: one process.
  dist::ProcessGroup* group = nullptr;
  int rank = 0;
  int world = 1;
  std::vector<std::string> rank_versions;  // the last ids the ranks acknowledged
  // Whether to ask for rank 0's word before the next step (Run sets it; null: never): on rank 0,
  // whether hooks.before_step would do anything; on the others, whether this rank was asked to
  // stop (hooks.pending: a signal).
  std::function<bool()> ask_before_step;
  // Whether the ranks wait for rank 0's word before the next step (some rank's ask_before_step at
  // the last step's end; at the start: yes).
  bool await_word = true;
  // The first rank other than 0 that asked to stop at the last step's end (-1: none): rank 0's
  // word is then to stop, for every rank, after the final checkpoint.
  int stop_asked_by = -1;
  bool broken = false;  // a step failed with a group: the ranks are out of step

  // Seconds spent in each phase of the step being taken (its timing/<phase> metrics).
  std::map<std::string, double> timing;
  // While Run() runs: where each step's record goes (null: Step() records before it returns).
  StepRecorder* recorder = nullptr;
};

// Runs jobs in order on a thread of its own (Trainer::Run's step records: the store's versions
// and the metrics.jsonl line of a step, written while the next step computes). The first
// error is kept and later jobs are dropped. Thread-safe.
class StepRecorder {
 public:
  StepRecorder();
  // Waits for the jobs queued (errors dropped: call Drain first to see them).
  ~StepRecorder();
  StepRecorder(const StepRecorder&) = delete;
  StepRecorder& operator=(const StepRecorder&) = delete;

  void Add(std::function<Status()> job);
  // Waits until every job added so far has run; the first error of any.
  [[nodiscard]] Status Drain();
  // The first error so far, without waiting.
  [[nodiscard]] Status error() const;
  // Seconds the last job took (0 before the first).
  double last_seconds() const;

 private:
  void Loop();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<Status()>> jobs_;
  bool busy_ = false;
  bool stopping_ = false;
  Status error_;
  double last_seconds_ = 0;
  std::thread thread_;
};

// Adds the seconds between its construction and its destruction to s.timing[phase]. On CUDA the
// device is waited for at both ends, so that a phase's kernels count in that phase and not in
// the next one that happens to wait for them.
class PhaseTimer {
 public:
  PhaseTimer(Trainer::State& s, const char* phase) : s_(s), phase_(phase) {
    WaitForDevice();
    start_ = std::chrono::steady_clock::now();
  }
  ~PhaseTimer() {
    WaitForDevice();
    s_.timing[phase_] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  void WaitForDevice() const {
    if (s_.model && s_.model->device().is_cuda()) torch::cuda::synchronize(s_.model->device().index());
  }

  Trainer::State& s_;
  const char* phase_;
  std::chrono::steady_clock::time_point start_;
};

// The seed of step `step`'s sampling (SplitMix64 of the run seed and the step): a resumed run
// samples exactly what an uninterrupted one does, with no generator state to save.
// Rank r > 0 of a data-parallel run mixes its rank in.
uint64_t SamplingSeed(int64_t run_seed, int64_t step, int rank = 0);

// Draws the next generation batch: prompts, completions, rewards, advantages, the mismatch
// correction, old/ref log-probs where needed.
Result<Rollout> MakeRollout(Trainer::State& s);

// Per-token log-probabilities and entropies of `rows` of `r` under the trainer's model (with
// the adapter when `lora`), the LM head chunked. `training`: dropout on and autograd recorded.
// The num_generations completions of a prompt share it: when s.share_prompt_forward is on and
// rows repeat a prompt, each distinct prompt runs through the model once (into a KV cache that
// autograd tracks) and every row then runs only its completion against that prompt's keys and
// values. The same sums as the plain forward over prompt + completion, so the results differ
// from it in rounding only (and gradients reach the prompt's tokens from every row through
// the cache). Not used with LoRA dropout in training (each row must draw its own dropout on
// its prompt) nor with activation checkpointing.
struct MicroBatchLogps {
  at::Tensor logps;    // [n, C]
  at::Tensor entropy;  // [n, C]
  at::Tensor mask;     // [n, C] long
  at::Tensor rows;     // long [n]
  // Distinct prompts run once each (0: the plain forward ran, every row's prompt recomputed).
  int64_t distinct_prompts = 0;
};
Result<MicroBatchLogps> MicroBatchLogProbs(const Trainer::State& s, const Rollout& r, const std::vector<int64_t>& rows,
                                           bool lora, bool training);

// checkpoint-N/: save and restore (training_state.cpp; its top says what is proven how).
Result<std::filesystem::path> WriteCheckpoint(Trainer::State& s);
// What RestoreNewestCheckpoint resumed.
struct Restored {
  int64_t step = 0;  // the checkpoint's step (0 with no checkpoint, or from checkpoint-0)
  // The merged snapshot of the restored adapter, its id the checkpoint's generator_version
  // (to be published); null when there was no checkpoint.
  std::shared_ptr<const sync::Snapshot> snapshot;
};
// Restores the newest checkpoint of s.dir that verifies, skipping (and, once one verifies,
// moving aside) those that do not; metrics.jsonl is cut back to its step. REQUIRES: s.store,
// s.base_version, s.publisher, the model, adapter and optimizer set. Errors: kFailedPrecondition
// for a checkpoint of another configuration or dataset; kCorruption listing every checkpoint
// and why when none verifies (nothing is changed then).
Result<Restored> RestoreNewestCheckpoint(Trainer::State& s);

}  // namespace ferry::grpo
