// The weight path between ferryd's trainer and its co-located generator: the only way weights
// move from one to the other.
//
//   trainer:   optimizer.step() -> WeightPublisher::Publish(adapter)
//                -> sync::BuildSnapshot(base views + adapter copies): LoRA targets merged into
//                   NEW buffers, every other tensor the base mapping's own (share_unchanged:
//                   the mapping is read-only, so one copy of the base serves the trainer, the
//                   generator and every snapshot), generator names (no "base_model.model.",
//                   ".base_layer", "lora_"), hashed
//                -> sync::SnapshotChannel::Publish
//   generator: ColocatedGenerator::Sync()
//                -> SnapshotChannel::WaitForNewer -> its own CausalLM over the snapshot's buffers
//                   (views: nothing copied into a module, nothing shared with the trainer's
//                   parameters) -> sync::ComputeManifestId over the bytes it will run
//                -> SnapshotChannel::Acknowledge(digest): a digest other than the snapshot's
//                   id is kCorruption naming both, and the run stops.
//
// So the generator can neither keep stale base weights (it runs exactly the bytes whose
// digest it acknowledged, and the trainer checks that digest equals the id of the snapshot
// built after the step), nor see adapter-wrapped names (CausalLM refuses every tensor that is
// not one of its own), nor alias the trainer's live parameters (the snapshot copies them
// before the trainer moves on). The reference policy needs no object at all: it is the
// trainer's forward without the LoRA binding.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/status.h"
#include "daemon/runtime/generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "store/store.h"
#include "sync/handoff.h"
#include "sync/snapshot.h"

namespace ferry::grpo {

// Trainer side. Thread-compatible.
class WeightPublisher {
 public:
  // `base`: the trainer's frozen base checkpoint (its tensors are read, never copied: each
  // snapshot shares the tensors the adapter does not change); `aux_files`: the base
  // directory's auxiliary files (config.json, tokenizer files), recorded with every snapshot
  // as the converter writes them. REQUIRES: nothing writes `base`'s bytes (Checkpoint::Open's
  // read-only mapping); `channel` outlives the publisher.
  WeightPublisher(Checkpoint base, AuxFiles aux_files, bool tie_word_embeddings, sync::SnapshotChannel* channel,
                  int threads);

  // Builds the merged snapshot of the base and `adapter` as it is now (of the base alone when
  // `adapter` is null) without publishing it (a resume compares its id with the checkpoint's
  // record first).
  Result<std::shared_ptr<const sync::Snapshot>> Build(const runtime::LoraAdapter* adapter) const;
  // Publishes a snapshot Build made.
  Result<sync::Handoff> Publish(std::shared_ptr<const sync::Snapshot> snapshot);
  // Build(&adapter), then Publish.
  Result<sync::Handoff> Publish(const runtime::LoraAdapter& adapter);
  // Publishes the base alone (before the first step).
  Result<sync::Handoff> PublishBase();

  // The snapshot source for `adapter` (what Publish merges): the base's tensors (views) and
  // fresh copies of the adapter's parameters.
  Result<sync::SnapshotSource> Source(const runtime::LoraAdapter* adapter) const;
  // The base checkpoint the snapshots share.
  const Checkpoint& base() const { return base_; }

 private:
  Checkpoint base_;
  AuxFiles aux_files_;
  bool tie_word_embeddings_ = false;
  sync::SnapshotChannel* channel_;
  int threads_ = 0;
};

struct ColocatedGeneratorOptions {
  std::string receiver_id = "colocated";  // names the generator in acknowledgement events
  runtime::ModelOptions model;
  runtime::GeneratorOptions generator;
  int wait_ms = 600'000;  // how long Sync waits for a newer snapshot. Default: 10 minutes
};

// Generator side. Holds nothing of the trainer's: only the snapshots it takes from the
// channel. Thread-compatible (one thread generates).
class ColocatedGenerator {
 public:
  // REQUIRES: `channel` outlives the generator.
  ColocatedGenerator(sync::SnapshotChannel* channel, ColocatedGeneratorOptions options);

  // Takes the newest snapshot (waiting for one newer than the one held, up to wait_ms),
  // builds a model over its buffers, recomputes its manifest digest and acknowledges it.
  // Returns the acknowledged digest. Errors: the channel's (closed, timeout), the model's
  // refusal of the snapshot's tensors, kCorruption from Acknowledge on a digest mismatch.
  Result<store::Digest> Sync();

  // Samples from the snapshot it holds. kFailedPrecondition before the first Sync.
  Result<std::vector<runtime::Completion>> Generate(const std::vector<std::vector<int32_t>>& prompts, int n,
                                                    const runtime::SamplingParams& params) const;

  // The snapshot held (sequence 0 before the first Sync) and the model over it.
  const sync::Handoff& current() const { return current_; }
  const runtime::CausalLM* model() const { return model_.get(); }

 private:
  sync::SnapshotChannel* channel_;
  ColocatedGeneratorOptions options_;
  sync::Handoff current_;
  std::unique_ptr<runtime::CausalLM> model_;
  std::optional<runtime::ModelConfig> config_;
};

}  // namespace ferry::grpo
