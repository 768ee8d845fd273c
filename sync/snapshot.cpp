#include "sync/snapshot.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <thread>

#include <nlohmann/json.hpp>

#include "convert/bnb4.h"
#include "convert/fused_layout.h"
#include "convert/merge_plan.h"
#include "convert/model_config.h"
#include "core/aux_files.h"
#include "core/text.h"

namespace ferry::sync {
namespace {

constexpr std::string_view kPeftPrefix = "base_model.model.";
constexpr std::string_view kSourceOrigin = "<snapshot source>";
constexpr std::string_view kAdapterOrigin = "<snapshot adapter>";

// Removes every ".<segment>." occurrence of `segment`, keeping one dot.
void DropSegment(std::string& name, std::string_view segment) {
  const std::string needle = "." + std::string(segment) + ".";
  for (size_t pos = name.find(needle); pos != std::string::npos; pos = name.find(needle, pos)) {
    name.erase(pos, needle.size() - 1);
  }
}

bool IsLoraKind(AdapterKey::Kind kind) {
  switch (kind) {
    case AdapterKey::kLoraA:
    case AdapterKey::kLoraB:
    case AdapterKey::kLoraBBias:
    case AdapterKey::kEmbeddingA:
    case AdapterKey::kEmbeddingB:
    case AdapterKey::kMagnitude:
    case AdapterKey::kModulesToSave:
    case AdapterKey::kTrainableTokens: return true;
    case AdapterKey::kBaseLayer:
    case AdapterKey::kOther: return false;
  }
  return false;
}

// A copy of `t` in a new buffer owned by the copy.
Result<Tensor> CopyTensor(const Tensor& t) {
  FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(t.dtype(), t.shape()));
  if (t.nbytes() > 0) std::memcpy(out.mutable_data(), t.data(), t.nbytes());
  return out;
}

Result<std::map<std::string, Tensor>> CopyAll(const std::map<std::string, Tensor>& in) {
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : in) {
    auto copy = CopyTensor(t);
    if (!copy.ok()) return copy.status().WithContext("tensor " + Quote(name));
    out.emplace(name, std::move(copy).value());
  }
  return out;
}

// Source tensors under generator names, and the LoRA tensors found among them.
struct Normalised {
  std::map<std::string, Tensor> base;
  std::map<std::string, Tensor> adapter;
};

Result<Normalised> Normalise(const SnapshotSource& source) {
  Normalised n;
  n.adapter = source.adapter_tensors;
  std::map<std::string, std::string> origin;  // normalised name -> source name
  for (const auto& [name, t] : source.tensors) {
    auto key = ParseAdapterKey(name);
    if (!key.ok()) return Status(key.status().code(), "snapshot source: " + key.status().message());
    if (IsLoraKind(key->kind)) {
      if (!source.adapter_config) {
        return Status::InvalidArgument("snapshot source: tensor " + Quote(name) + " is a " +
                                       std::string(AdapterKeyKindName(key->kind)) +
                                       " tensor but no adapter config was given");
      }
      if (!n.adapter.emplace(name, t).second) {
        return Status::InvalidArgument("snapshot source: tensor " + Quote(name) +
                                       " is given both as a source and as an adapter tensor");
      }
      continue;
    }
    std::string out = name;
    if (out.rfind(kPeftPrefix, 0) == 0) out.erase(0, kPeftPrefix.size());
    DropSegment(out, "base_layer");
    DropSegment(out, "original_module");
    auto [it, inserted] = origin.emplace(out, name);
    if (!inserted) {
      return Status::InvalidArgument("snapshot source: tensors " + Quote(it->second) + " and " + Quote(name) +
                                     " both normalise to " + Quote(out));
    }
    n.base.emplace(out, t);
  }
  return n;
}

// Executes a merge plan into new buffers: the converter's merge (MergedF32, MergeFusable16:
// convert/merge_plan.h), in memory.
class Merger {
 public:
  Merger(const Checkpoint& base, const Checkpoint& adapter, const MergePlan& plan, int threads)
      : base_(base), adapter_(adapter), plan_(plan), threads_(threads) {}

  // The output tensor `name` (base space: hf names): changed tensors in a new buffer, an
  // unchanged one copied when `copy_unchanged`, else the source tensor itself.
  Result<Tensor> Make(const std::string& name, bool copy_unchanged) {
    const std::string source = plan_.SourceOf(name);
    if (auto q = plan_.quantized.find(name); q != plan_.quantized.end()) {
      // A 4-bit weight: dequantised as the converter does (convert/bnb4.h), merged, rounded
      // once to the quant state's dtype.
      FERRY_ASSIGN_OR_RETURN(std::vector<float> w, MergedF32(plan_, base_, adapter_, name, q->second.shape, threads_));
      FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(q->second.dtype, q->second.shape));
      Status s = WriteFromF32(w, q->second.dtype, std::span<std::byte>(out.mutable_data(), out.nbytes()));
      if (!s.ok()) return s.WithContext("snapshot: tensor " + Quote(name));
      return out;
    }
    FERRY_ASSIGN_OR_RETURN(Tensor base, base_.Get(source));
    if (!plan_.Changes(name)) return copy_unchanged ? CopyTensor(base) : Result<Tensor>(std::move(base));
    if (const LoraModule* m = plan_.FusableDelta(name, base.dtype(), base.shape())) {
      FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(base.dtype(), base.shape()));
      FERRY_RETURN_IF_ERROR(MergeFusable16(
          base, adapter_, *m, std::span<uint16_t>(out.mutable_data_as<uint16_t>(), out.nbytes() / sizeof(uint16_t)),
          threads_));
      return out;
    }
    if (!CanWriteFromF32(base.dtype())) {
      return Status::Unsupported("snapshot source: tensor " + Quote(source) + " is " +
                                 std::string(DTypeName(base.dtype())) +
                                 " and cannot be merged (only F32, F16, BF16 and F64 weights can)");
    }
    FERRY_ASSIGN_OR_RETURN(std::vector<float> w, MergedF32(plan_, base_, adapter_, name, base.shape(), threads_));
    FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(base.dtype(), base.shape()));
    Status s = WriteFromF32(w, base.dtype(), std::span<std::byte>(out.mutable_data(), out.nbytes()));
    if (!s.ok()) return s.WithContext("snapshot: tensor " + Quote(name));
    return out;
  }

 private:
  const Checkpoint& base_;
  const Checkpoint& adapter_;
  const MergePlan& plan_;
  int threads_;
};

// The fused layout (convert/fused_layout.h, the converter's own planner) over `outputs`
// (name -> info): rewrites it and returns fused name -> member names, in order.
Result<std::map<std::string, std::vector<std::string>>> PlanFusedLayout(std::map<std::string, TensorInfo>& outputs) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, info] : outputs) specs.push_back({name, info.dtype, info.shape});
  FERRY_ASSIGN_OR_RETURN(std::vector<LaidOutTensor> laid_out, FuseLayout(specs, "snapshot source"));
  std::map<std::string, std::vector<std::string>> fused_members;
  for (LaidOutTensor& t : laid_out) {
    if (t.parts.size() == 1 && t.parts.front() == t.spec.name) continue;
    TensorInfo info = outputs.at(t.parts.front());
    info.name = t.spec.name;
    info.shape = t.spec.shape;
    FERRY_ASSIGN_OR_RETURN(const uint64_t nbytes, CheckedByteSize(info.dtype, info.shape));
    info.begin = 0;
    info.end = nbytes;
    for (const auto& part : t.parts) outputs.erase(part);
    outputs.emplace(t.spec.name, std::move(info));
    fused_members.emplace(t.spec.name, std::move(t.parts));
  }
  return fused_members;
}

// Auxiliary files sorted by name, each by the one rule (core/aux_files.h) and at most once.
Result<AuxFiles> SortedAux(const AuxFiles& aux) {
  AuxFiles out = aux;
  std::sort(out.begin(), out.end(), [](const AuxFileData& a, const AuxFileData& b) { return a.name < b.name; });
  for (size_t i = 0; i < out.size(); ++i) {
    const std::string& name = out[i].name;
    if (Status s = CheckAuxFileName(name); !s.ok()) return s.WithContext("snapshot");
    if (i > 0 && out[i - 1].name == name) {
      return Status::InvalidArgument("snapshot aux file " + Quote(name) + " is given twice");
    }
  }
  return out;
}

// The planner names the adapter's origin ("<snapshot adapter>") for in-memory tensors.
Status InMemoryContext(const Status& s) { return s.WithContext("snapshot"); }

int ThreadsOf(const SnapshotOptions& options) {
  return options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

// Everything BuildSnapshot decides before it makes a tensor; LazySnapshot's producer makes
// tensors from it on demand.
struct SnapshotPlanState {
  AuxFiles aux;
  bool merging = false;
  Layout layout = Layout::kHf;
  Checkpoint base;     // the normalised source tensors (views of the caller's)
  Checkpoint adapter;  // adapter tensors (views)
  std::optional<MergePlan> plan;
  std::unique_ptr<Merger> merger;                         // refers to base, adapter, plan
  std::map<std::string, TensorInfo> outputs;              // output name -> dtype, shape
  std::map<std::string, std::vector<std::string>> fused;  // fused name -> members, stacked
  uint64_t bytes = 0;

  Result<Tensor> MakeUnfused(const std::string& name, bool copy_unchanged) {
    if (merger) return merger->Make(name, copy_unchanged);
    FERRY_ASSIGN_OR_RETURN(Tensor t, base.Get(name));
    return copy_unchanged ? CopyTensor(t) : Result<Tensor>(std::move(t));
  }

  // Output tensor `name`: merged, stacked and (with `copy_unchanged`) copied tensors in new
  // buffers; without it an unchanged tensor is the source's own.
  Result<Tensor> Make(const std::string& name, bool copy_unchanged) {
    auto f = fused.find(name);
    if (f == fused.end()) return MakeUnfused(name, copy_unchanged);
    const TensorInfo& info = outputs.at(name);
    FERRY_ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(info.dtype, info.shape));
    size_t offset = 0;
    for (const std::string& member : f->second) {
      FERRY_ASSIGN_OR_RETURN(Tensor part, MakeUnfused(member, /*copy_unchanged=*/false));
      if (part.nbytes() > out.nbytes() - offset) {
        return Status::Internal("snapshot: " + Quote(member) + " does not fit in " + Quote(name));
      }
      if (part.nbytes() > 0) std::memcpy(out.mutable_data() + offset, part.data(), part.nbytes());
      offset += part.nbytes();
    }
    return out;
  }
};

namespace {

// Plans the snapshot of `source`: every check BuildSnapshot makes, no tensor made.
Result<std::shared_ptr<SnapshotPlanState>> PlanSnapshot(const SnapshotSource& source, const SnapshotOptions& options) {
  if (!IsTensorLayout(options.layout)) {
    return Status::InvalidArgument("snapshot: layout " + std::string(LayoutName(options.layout)) +
                                   " holds no merged weights (a snapshot is hf or fused)");
  }
  auto p = std::make_shared<SnapshotPlanState>();
  FERRY_ASSIGN_OR_RETURN(p->aux, SortedAux(source.aux_files));
  FERRY_ASSIGN_OR_RETURN(Normalised in, Normalise(source));
  p->merging = source.adapter_config.has_value();
  p->layout = options.layout;
  // An output tensor: the source tensor `from`'s dtype and shape, or for a 4-bit weight the
  // dtype and shape it is dequantised to.
  auto add_output = [&](const std::string& name, const std::string& from) -> Status {
    TensorInfo info = *p->base.Info(from);
    info.name = name;
    if (p->plan) {
      if (auto q = p->plan->quantized.find(from); q != p->plan->quantized.end()) {
        info.dtype = q->second.dtype;
        info.shape = q->second.shape;
        FERRY_ASSIGN_OR_RETURN(const uint64_t nbytes, CheckedByteSize(info.dtype, info.shape));
        info.begin = 0;
        info.end = nbytes;
      }
    }
    p->outputs.emplace(name, std::move(info));
    return Status::OK();
  };
  if (!p->merging) {
    if (!in.adapter.empty()) {
      return Status::InvalidArgument("snapshot source: adapter tensor " + Quote(in.adapter.begin()->first) +
                                     " given without an adapter config");
    }
    p->base = Checkpoint::FromTensors(std::string(kSourceOrigin), std::move(in.base));
    // A 4-bit base alone is dequantised as a merge onto it would be (an empty plan but for
    // the quantised weights): the same tensors as `ferry convert` with an adapter that
    // changes nothing.
    auto quantized = FindQuantized4bit(p->base);
    if (!quantized.ok()) return InMemoryContext(quantized.status());
    if (!quantized->empty()) {
      p->plan.emplace();
      p->plan->quant_aux = QuantAuxKeys(*quantized);
      p->plan->quantized = std::move(quantized).value();
      p->adapter = Checkpoint::FromTensors(std::string(kAdapterOrigin), {});
      p->merger = std::make_unique<Merger>(p->base, p->adapter, *p->plan, ThreadsOf(options));
    }
    for (const std::string& name : p->base.names()) {
      if (!p->plan || !p->plan->quant_aux.count(name)) FERRY_RETURN_IF_ERROR(add_output(name, name));
    }
    if (p->plan) {
      for (auto& [name, contents] : p->aux) {
        if (name == "config.json") {
          ModelConfigEdits edits;
          edits.untie = p->plan->untie;
          if (!p->plan->quantized.empty()) edits.dtype = p->plan->quantized.begin()->second.dtype;
          FERRY_ASSIGN_OR_RETURN(contents, RewriteModelConfig(contents, edits, "snapshot aux file config.json"));
        }
      }
    }
  } else {
    const PeftConfig& cfg = *source.adapter_config;
    FERRY_RETURN_IF_ERROR(cfg.CheckMergeable());
    p->base = Checkpoint::FromTensors(std::string(kSourceOrigin), std::move(in.base));
    p->adapter = Checkpoint::FromTensors(std::string(kAdapterOrigin), std::move(in.adapter));
    auto planned = PlanMerge(cfg, p->adapter, p->base, options.tie_word_embeddings);
    if (!planned.ok()) return InMemoryContext(planned.status());
    p->plan = std::move(planned).value();
    const MergePlan& plan = *p->plan;
    for (const std::string& name : p->base.names()) {
      if (!plan.quant_aux.count(name)) FERRY_RETURN_IF_ERROR(add_output(name, plan.SourceOf(name)));
    }
    if (plan.untie) FERRY_RETURN_IF_ERROR(add_output(plan.lm_head_key, plan.SourceOf(plan.lm_head_key)));
    // Every tensor the plan changes can be written back in its dtype (checked before any
    // tensor is made, so a streamed snapshot fails before it writes anything).
    for (const auto& [name, info] : p->outputs) {
      if (plan.Changes(name) && !CanWriteFromF32(info.dtype)) {
        return Status::Unsupported("snapshot source: tensor " + Quote(plan.SourceOf(name)) + " is " +
                                   std::string(DTypeName(info.dtype)) +
                                   " and cannot be merged (only F32, F16, BF16 and F64 weights can)");
      }
    }
    p->merger = std::make_unique<Merger>(p->base, p->adapter, plan, ThreadsOf(options));
    for (auto& [name, contents] : p->aux) {
      if (name == "config.json") {
        ModelConfigEdits edits;
        edits.untie = plan.untie;
        if (!plan.quantized.empty()) edits.dtype = plan.quantized.begin()->second.dtype;
        FERRY_ASSIGN_OR_RETURN(contents, RewriteModelConfig(contents, edits, "snapshot aux file config.json"));
      }
    }
  }
  if (options.layout == Layout::kFused) {
    FERRY_ASSIGN_OR_RETURN(p->fused, PlanFusedLayout(p->outputs));
  }
  for (const auto& [name, info] : p->outputs) p->bytes += info.nbytes();
  return p;
}

// RecordSnapshot's adjustments of the caller's import options.
store::ImportOptions RecordOptions(bool merged, Layout layout, const store::ImportOptions& options) {
  store::ImportOptions opts = options;
  if (merged && opts.kind == store::VersionKind::kFull) opts.kind = store::VersionKind::kMerged;
  if (opts.source == store::VersionSource::kImport) opts.source = store::VersionSource::kDaemon;
  opts.layout = layout;
  return opts;
}

}  // namespace

Result<std::shared_ptr<const Snapshot>> BuildSnapshot(const SnapshotSource& source, const SnapshotOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<SnapshotPlanState> p, PlanSnapshot(source, options));
  std::map<std::string, Tensor> out;
  for (const auto& [name, info] : p->outputs) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, p->Make(name, /*copy_unchanged=*/!options.share_unchanged));
    out.emplace(name, std::move(t));
  }

  auto snap = std::shared_ptr<Snapshot>(new Snapshot());
  std::vector<store::TensorRow> rows;
  for (const auto& [name, t] : out) {
    store::TensorRow row;
    row.name = name;
    row.dtype = t.dtype();
    row.shape = t.shape();
    row.digest = store::TensorDigest(t);
    row.nbytes = t.nbytes();
    snap->digests_.emplace(name, row.digest);
    snap->bytes_ += t.nbytes();
    rows.push_back(std::move(row));
  }
  snap->manifest_id_ = store::ManifestDigest(rows, store::AuxFileRows(p->aux));
  snap->checkpoint_ = Checkpoint::FromTensors("<snapshot " + snap->manifest_id_.Hex() + ">", std::move(out));
  snap->aux_files_ = std::move(p->aux);
  snap->layout_ = options.layout;
  snap->merged_ = p->merging;
  return std::shared_ptr<const Snapshot>(std::move(snap));
}

Result<std::unique_ptr<const LazySnapshot>> LazySnapshot::Plan(const SnapshotSource& source,
                                                               const SnapshotOptions& options) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<SnapshotPlanState> p, PlanSnapshot(source, options));
  std::vector<TensorInfo> infos;
  for (const auto& [name, info] : p->outputs) infos.push_back(info);
  auto lazy = std::unique_ptr<LazySnapshot>(new LazySnapshot());
  lazy->state_ = p;
  // The producer keeps the plan alive; a tensor it makes lives as long as its consumer keeps it.
  lazy->checkpoint_ = Checkpoint::FromProducer("<lazy snapshot>", std::move(infos), [p](const std::string& name) {
    return p->Make(name, /*copy_unchanged=*/false);
  });
  return std::unique_ptr<const LazySnapshot>(std::move(lazy));
}

const AuxFiles& LazySnapshot::aux_files() const { return state_->aux; }
Layout LazySnapshot::layout() const { return state_->layout; }
bool LazySnapshot::merged() const { return state_->merging; }
uint64_t LazySnapshot::bytes() const { return state_->bytes; }

Result<store::ImportResult> LazySnapshot::Record(store::Store& store, const store::ImportOptions& options) const {
  return store.ImportCheckpoint(checkpoint_, state_->aux, RecordOptions(merged(), layout(), options));
}

Result<store::ImportResult> RecordSnapshot(store::Store& store, const Snapshot& snapshot,
                                           const store::ImportOptions& options) {
  FERRY_ASSIGN_OR_RETURN(store::ImportResult result,
                         store.ImportCheckpoint(snapshot.checkpoint(), snapshot.aux_files(),
                                                RecordOptions(snapshot.merged(), snapshot.layout(), options)));
  if (result.record.id != snapshot.manifest_id()) {
    return Status::Internal("snapshot " + snapshot.manifest_id().Hex() + " was recorded as version " +
                            result.record.id.Hex() + ": the manifest digests disagree");
  }
  return result;
}

Result<store::ImportResult> RecordSnapshotDigests(store::Store& store, const Snapshot& snapshot,
                                                  const store::ImportOptions& options) {
  const std::string what = "snapshot " + snapshot.manifest_id().Hex();
  if (!snapshot.merged()) {
    return Status::InvalidArgument(what + " merged no adapter: record it with RecordSnapshot (its bytes)");
  }
  if (!options.base_version) return Status::InvalidArgument(what + ": recording it by digests needs a base_version");
  if (!options.adapter_version) {
    return Status::InvalidArgument(what + ": recording it by digests needs an adapter_version");
  }
  std::vector<store::TensorRow> rows;
  rows.reserve(snapshot.digests().size());
  for (const auto& [name, digest] : snapshot.digests()) {
    const TensorInfo* info = snapshot.checkpoint().Info(name);
    if (info == nullptr) return Status::Internal(what + ": tensor " + Quote(name) + " has a digest but no tensor");
    store::TensorRow row;
    row.name = name;
    row.dtype = info->dtype;
    row.shape = info->shape;
    row.digest = digest;
    row.nbytes = info->nbytes();
    rows.push_back(std::move(row));
  }
  FERRY_ASSIGN_OR_RETURN(
      store::ImportResult result,
      store.RecordDerived(rows, snapshot.aux_files(), RecordOptions(snapshot.merged(), snapshot.layout(), options)));
  if (result.record.id != snapshot.manifest_id()) {
    return Status::Internal(what + " was recorded as version " + result.record.id.Hex() +
                            ": the manifest digests disagree");
  }
  return result;
}

Result<AdapterSnapshot> BuildAdapterSnapshot(const SnapshotSource& source, const SnapshotOptions& options) {
  if (!source.adapter_config) {
    return Status::InvalidArgument("snapshot source: adapter-only publication needs an adapter config");
  }
  FERRY_ASSIGN_OR_RETURN(Normalised in, Normalise(source));
  FERRY_ASSIGN_OR_RETURN(auto merged, BuildSnapshot(source, options));
  AdapterSnapshot a;
  a.config = *source.adapter_config;
  FERRY_ASSIGN_OR_RETURN(auto copies, CopyAll(in.adapter));
  for (const auto& [name, t] : copies) a.adapter_digests.emplace(name, store::TensorDigest(t));
  a.adapter =
      std::make_shared<const Checkpoint>(Checkpoint::FromTensors(std::string(kAdapterOrigin), std::move(copies)));
  a.expected_merged_id = merged->manifest_id();
  a.layout = options.layout;
  return a;
}

Result<std::shared_ptr<const Snapshot>> ApplyAdapterSnapshot(const AdapterSnapshot& adapter, const SnapshotSource& base,
                                                             const SnapshotOptions& options) {
  if (!adapter.adapter) return Status::InvalidArgument("adapter snapshot: holds no adapter tensors");
  SnapshotSource merged_source;
  merged_source.tensors = base.tensors;
  merged_source.aux_files = base.aux_files;
  merged_source.adapter_config = adapter.config;
  for (const std::string& name : adapter.adapter->names()) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, adapter.adapter->Get(name));
    merged_source.adapter_tensors.emplace(name, std::move(t));
  }
  SnapshotOptions opts = options;
  opts.layout = adapter.layout;
  FERRY_ASSIGN_OR_RETURN(auto snap, BuildSnapshot(merged_source, opts));
  if (snap->manifest_id() != adapter.expected_merged_id) {
    return Status::Corruption("adapter snapshot: the local merge has manifest " + snap->manifest_id().Hex() +
                              " but the publisher's merged manifest is " + adapter.expected_merged_id.Hex() +
                              " (the receiver's base or the adapter differs from the publisher's)");
  }
  return snap;
}

std::vector<std::string> MissingTensors(const Snapshot& snapshot, const std::set<store::Digest>& receiver_has) {
  std::vector<std::string> out;
  for (const auto& [name, digest] : snapshot.digests()) {
    if (!receiver_has.count(digest)) out.push_back(name);
  }
  return out;
}

}  // namespace ferry::sync
