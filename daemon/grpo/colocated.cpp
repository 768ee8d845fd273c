#include "daemon/grpo/colocated.h"

#include <map>

namespace ferry::grpo {

WeightPublisher::WeightPublisher(Checkpoint base, AuxFiles aux_files, bool tie_word_embeddings,
                                 sync::SnapshotChannel* channel, int threads)
    : base_(std::move(base)),
      aux_files_(std::move(aux_files)),
      tie_word_embeddings_(tie_word_embeddings),
      channel_(channel),
      threads_(threads) {}

Result<sync::SnapshotSource> WeightPublisher::Source(const runtime::LoraAdapter* adapter) const {
  sync::SnapshotSource src;
  for (const std::string& name : base_.names()) {
    FERRY_ASSIGN_OR_RETURN(src.tensors[name], base_.Get(name));
  }
  src.aux_files = aux_files_;
  if (adapter) {
    src.adapter_config = adapter->config();
    FERRY_ASSIGN_OR_RETURN(src.adapter_tensors, adapter->ExportTensors());
  }
  return src;
}

Result<std::shared_ptr<const sync::Snapshot>> WeightPublisher::Build(const runtime::LoraAdapter* adapter) const {
  FERRY_ASSIGN_OR_RETURN(sync::SnapshotSource src, Source(adapter));
  sync::SnapshotOptions opts;
  opts.threads = threads_;
  opts.tie_word_embeddings = tie_word_embeddings_;
  opts.share_unchanged = true;  // base_ is read-only: untouched tensors stay views of it
  return sync::BuildSnapshot(src, opts);
}

Result<sync::Handoff> WeightPublisher::Publish(std::shared_ptr<const sync::Snapshot> snapshot) {
  FERRY_ASSIGN_OR_RETURN(uint64_t sequence, channel_->Publish(snapshot));
  return sync::Handoff{sequence, std::move(snapshot)};
}

Result<sync::Handoff> WeightPublisher::Publish(const runtime::LoraAdapter& adapter) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const sync::Snapshot> snapshot, Build(&adapter));
  return Publish(std::move(snapshot));
}

Result<sync::Handoff> WeightPublisher::PublishBase() {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<const sync::Snapshot> snapshot, Build(nullptr));
  return Publish(std::move(snapshot));
}

ColocatedGenerator::ColocatedGenerator(sync::SnapshotChannel* channel, ColocatedGeneratorOptions options)
    : channel_(channel), options_(std::move(options)) {}

Result<store::Digest> ColocatedGenerator::Sync() {
  FERRY_ASSIGN_OR_RETURN(sync::Handoff h, channel_->WaitForNewer(current_.sequence, options_.wait_ms));
  // The model config travels with the weights (the snapshot's config.json).
  const std::string* config_text = nullptr;
  for (const auto& [name, contents] : h.snapshot->aux_files()) {
    if (name == "config.json") config_text = &contents;
  }
  if (!config_text) {
    return Status::InvalidArgument("snapshot " + h.snapshot->manifest_id().Hex() + " carries no config.json");
  }
  FERRY_ASSIGN_OR_RETURN(
      runtime::ModelConfig config,
      runtime::ParseModelConfig(*config_text, "snapshot " + h.snapshot->manifest_id().Hex() + " config.json"));
  // Views of the snapshot's buffers; the model holds the snapshot alive. Where the model
  // converts (a compute dtype or a device other than the snapshot's), the tensors this step
  // did not change (equal digests: the base's, most of the model) are taken from the model
  // held, already converted, instead of being converted again at every step.
  runtime::WeightReuse reuse;
  if (model_ && current_.snapshot) {
    reuse.model = model_.get();
    reuse.unchanged = [&, previous = &current_.snapshot->digests(),
                       now = &h.snapshot->digests()](const std::string& name) {
      auto a = previous->find(name), b = now->find(name);
      return a != previous->end() && b != now->end() && a->second == b->second;
    };
  }
  FERRY_ASSIGN_OR_RETURN(
      std::unique_ptr<runtime::CausalLM> model,
      runtime::CausalLM::FromCheckpoint(config, h.snapshot->checkpoint(), options_.model, h.snapshot, &reuse));
  // The proof: the digest of the bytes this model runs, recomputed, acknowledged.
  FERRY_ASSIGN_OR_RETURN(store::Digest computed, sync::ComputeManifestId(*h.snapshot));
  FERRY_RETURN_IF_ERROR(channel_->Acknowledge(options_.receiver_id, h.sequence, computed));
  current_ = std::move(h);
  model_ = std::move(model);
  config_ = std::move(config);
  return computed;
}

Result<std::vector<runtime::Completion>> ColocatedGenerator::Generate(const std::vector<std::vector<int32_t>>& prompts,
                                                                      int n,
                                                                      const runtime::SamplingParams& params) const {
  if (!model_) return Status::FailedPrecondition("the generator holds no weights yet (Sync first)");
  runtime::Generator gen(*model_, options_.generator);
  return gen.Generate(prompts, n, params);
}

}  // namespace ferry::grpo
