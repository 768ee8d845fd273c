// The GRPO trainer: TRL's GRPOTrainer loop on the runtime, with a co-located generator that
// is handed every new version of the weights as a verified snapshot.
//
// One optimizer step (TRL's names; see docs/daemon.md):
//   1. When the buffered generation is used up (every steps_per_generation * num_iterations
//      micro-batches): the next prompts_per_generation prompts from the dataset (seeded
//      order, epochs counted), formatted (chat template for conversational prompts) and
//      tokenized; the co-located generator samples num_generations completions of each from
//      the snapshot it acknowledged, with per-token log-probabilities; rewards (built-ins and
//      commands; NaN = missing), advantages per group; old log-probabilities (the trainer's,
//      before any update) when num_iterations > 1, steps_per_generation > 1 or LoRA dropout is
//      on (otherwise they equal the first forward's, detached), reference log-probabilities
//      with the adapter disabled when beta > 0, and the generator/trainer mismatch correction.
//   2. gradient_accumulation_steps micro-batches of per_device_train_batch_size completions:
//      trainer log-probabilities (chunked LM head, logits / temperature), the clipped loss of
//      loss_type, backward.
//   3. Gradient clipping (max_grad_norm), AdamW with the scheduled learning rate.
//   4. The merged snapshot of base + adapter is built into new buffers and published; the
//      generator takes it, recomputes its digest, acknowledges; the step ends only when the
//      acknowledged digest equals the snapshot's id (a mismatch is kCorruption naming both).
//   5. The step is recorded in the run's store: the adapter version (its bytes), the merged
//      version (its digests only: rebuilt bit-identically from base + adapter), the metrics.
//   6. Every logging_steps a line of metrics.jsonl; every save_steps a checkpoint-N/.
//
// Run directory (output_dir, or --dir):
//   metrics.jsonl      one JSON object per logged step: step, TRL's metric names averaged over
//                      the logging interval, generator_version (the id the generator
//                      acknowledged after that step)
//   checkpoint-N/      adapter_model.safetensors + adapter_config.json (PEFT's format), and the
//                      training state (optimizer.safetensors, trainer_state.json); written under
//                      a temporary name and renamed when whole
//   store/             the run's Ferry store (unless the config names another)
//   run_config.json    the resolved configuration
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/run/config.h"
#include "store/store.h"

namespace ferry::sync {
class Snapshot;
}  // namespace ferry::sync
namespace ferry::dist {
class ProcessGroup;
}  // namespace ferry::dist
namespace ferry::runtime {
struct Completion;
}  // namespace ferry::runtime

namespace ferry::grpo {

struct TrainOptions {
  // The run's configuration, loaded and checked by the caller (run::LoadRunConfig): the
  // trainer opens no config file. REQUIRED
  run::RunConfig config;
  // The run directory; empty: the config's output_dir. Default: empty.
  std::filesystem::path dir;
  // Stop after this many optimizer steps in total (counting steps of a resumed run). Default:
  // none (the run's total).
  std::optional<int64_t> max_steps;
  // Called after every logged step with its metrics line (what metrics.jsonl gets), once the
  // line is written: under Run, on Run's recording thread.
  std::function<void(const std::string& json_line)> on_log;
  // Called for messages worth a person's attention (warnings, checkpoints).
  std::function<void(const std::string& message)> on_message;
  // Called on the training thread after each step's hand-off with the merged snapshot the
  // co-located generator proved and its id, before the step is recorded in the store (whose
  // merged version has that id and records only its digests). Must not block: ferryd hands
  // it to its remote publisher. Default: none.
  std::function<void(const store::Digest& version, std::shared_ptr<const sync::Snapshot> snapshot)> on_snapshot;
  // Called by Create with the run directory once everything that can be checked without
  // writing has been (ferryd takes the run lock here); an error ends Create with nothing
  // created. Default: none.
  std::function<Status(const std::filesystem::path& dir)> claim_dir;
  // The data-parallel group this trainer is one rank of (data_parallel.h says what the ranks
  // share); must outlive the trainer. The config is then resolved for the group's size
  // (run::ForWorldSize). Rank 0 alone claims and writes the run directory (store,
  // metrics.jsonl, checkpoints, run_config.json), calls on_log and on_snapshot, and decides
  // for every rank whether Run goes on (hooks.before_step); the others only train. Default:
  // none (one process).
  dist::ProcessGroup* group = nullptr;
  // Tests only: each generation's completions (num_generations per prompt of `prompts`, this
  // rank's), in place of the generator's samples; `step` is the step they are drawn for.
  // Default: none.
  std::function<std::vector<runtime::Completion>(const std::vector<std::vector<int32_t>>& prompts, int64_t step)>
      completions_for_testing;
};

struct StepResult;

// What a caller (ferryd's control loop) hooks into Trainer::Run. Each hook is optional and is
// called on the thread running Run.
struct RunHooks {
  // Called before each step; returning false ends the run early (the final checkpoint is still
  // written). May block (a paused run) and may call SaveCheckpoint (a requested snapshot).
  std::function<bool()> before_step;
  // Whether before_step would do anything now (a pause, stop, snapshot or signal is waiting);
  // must not block. A data-parallel run asks it at each step's end (rank 0): when nothing is
  // waiting, every rank goes on to the next step without waiting for rank 0's word, and
  // before_step is next called at the first step's end where something is. Default: none
  // (before_step is called before every step). On a rank other than 0 (whose before_step is
  // not called): whether it was asked to stop; rank 0 then stops every rank at that step's end.
  std::function<bool()> pending;
  // Called after each step.
  std::function<void(const StepResult&)> after_step;
  // Called after each checkpoint Run writes.
  std::function<void(const std::filesystem::path&)> on_checkpoint;
};

struct StepResult {
  int64_t step = 0;                       // optimizer steps taken so far (1 after the first)
  std::map<std::string, double> metrics;  // this step's, TRL's names
  std::string generator_version;          // the id the generator acknowledged after it
  bool logged = false;                    // a metrics.jsonl line was written
  // With a group: the id each rank's generator acknowledged, by rank (all equal, or the step
  // failed). Otherwise generator_version alone.
  std::vector<std::string> rank_versions;
};

class Trainer {
 public:
  // Loads the model, tokenizer, dataset, rewards and store of options.config; records the base; hands
  // the base (or the resumed adapter's weights) to the generator. Errors name the file, key,
  // line or tensor at fault.
  //
  // Everything that can be checked is checked before anything is created: the config, the
  // tokenizer, the dataset, the rewards (each command answers a probe line), the model's
  // config and weight files, max_completion_length against max_position_embeddings, and a
  // lower bound of a step's memory against what the machine has available. Then
  // options.claim_dir, then the run directory and its store; the store's objects of the base
  // are re-hashed once per start (in parallel with the model load) and a corrupt one stops
  // it, naming the tensor. A start that fails after creating something removes what it
  // created (the run directory when it did not exist before, else the store when that did
  // not): a refused start leaves the directory as it found it. Resuming takes the newest
  // checkpoint that verifies (training_state.cpp says how).
  static Result<std::unique_ptr<Trainer>> Create(const TrainOptions& options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One optimizer step (see the top of this file). Errors carry "step N" (N = step() + 1).
  // A failure before the optimizer update (a reward command that crashed or wrote a
  // malformed line, a failed forward) applies nothing of the step: parameters, optimizer
  // state, step(), the dataset position, metrics.jsonl, the store and the checkpoints are as
  // before the call, and the run stops with nothing half-written. A
  // failure after it (the hand-off, the store) leaves the step half done: stop the run.
  Result<StepResult> Step();
  // Steps until the run's total (or max_steps, or until hooks.before_step says stop), saving
  // checkpoints every save_steps and at the end. Unlike Step(), each step's record (the
  // store's versions, then its metrics.jsonl line and on_log) is written by a thread of Run's
  // own while the next step computes, in order; a checkpoint (Run's, or SaveCheckpoint from a
  // hook) and the return wait for the records before it, and a record that fails ends the run
  // at the next step with its error.
  Status Run(const RunHooks& hooks = {});
  // Writes checkpoint-<step>/ now; returns its path.
  Result<std::filesystem::path> SaveCheckpoint();

  int64_t step() const;
  // The id (32 hex) of the snapshot the generator acknowledged last: the merged weights after
  // step(), or the base before the first step.
  const std::string& generator_version() const;
  // The snapshot whose id generator_version() is (the generator runs its bytes): for a
  // resumed run, the rebuilt version of the step it resumed from.
  std::shared_ptr<const sync::Snapshot> generator_snapshot() const;
  // Which generator samples the run: "colocated" (ferryd's own), or "vllm" with the server's
  // URL and the name it serves generator_version() under (use_vllm).
  struct GeneratorInfo {
    std::string engine;
    std::string url;
    std::string served_as;
    // A vLLM's newest proof: when (ns since the epoch; 0: none yet) and its figures.
    int64_t proven_at_ns = 0;
    double max_diff = 0, tolerance = 0;
    std::optional<double> previous_diff;
  };
  GeneratorInfo generator_info() const;
  int64_t total_steps() const;
  const run::RunConfig& config() const;
  const std::filesystem::path& dir() const;
  // The run's store directory (DIR/store unless the config names another).
  const std::filesystem::path& store_dir() const;
  // The run's open store (thread-safe; a publisher following the run reads it). Owned by
  // the trainer: valid until it is destroyed.
  store::Store* store() const;
  // The run's base version (recorded by Create).
  const store::Digest& base_version() const;
  // What Create made that did not exist before (the run directory, or its store, and
  // run_config.json), for a caller whose own start fails before the first step: it destroys
  // the trainer, then removes these. Empty for a run that had earlier steps.
  const std::vector<std::filesystem::path>& created_by_start() const;

  struct State;
  // The trainer's state, for tests that check its models and generator directly.
  const State* state_for_testing() const { return s_.get(); }

 private:
  explicit Trainer(std::unique_ptr<State> state);
  Status RunSteps(const RunHooks& hooks);
  std::unique_ptr<State> s_;
};

}  // namespace ferry::grpo
