// Receiver-side activation (sync/activate.h): adapter merge onto a local base, hf -> fused.
#include "sync/activate.h"

#include <algorithm>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "convert/fused_layout.h"
#include "convert/peft_config.h"
#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "sync/activate_merge.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

// Outputs are sharded like `Store::Export` shards (one file below this many data bytes).
constexpr uint64_t kMaxShardBytes = 5'000'000'000;

std::string Q(std::string_view s) { return "'" + std::string(s) + "'"; }

// The output tensors of `ckpt` in the hf layout (every tensor as is) or the fused one
// (convert/fused_layout.h: the converter's and the snapshot builder's own planner). Only
// metadata is read. Sorted by name.
Result<std::vector<LaidOutTensor>> PlanLayout(const Checkpoint& ckpt, bool fuse) {
  std::vector<TensorSpec> specs;
  for (const std::string& name : ckpt.names()) {
    const TensorInfo* info = ckpt.Info(name);
    if (info == nullptr) return Status::Internal(ckpt.path().string() + ": tensor " + Q(name) + " has no metadata");
    specs.push_back({name, info->dtype, info->shape});
  }
  std::vector<LaidOutTensor> out;
  if (fuse) {
    FERRY_ASSIGN_OR_RETURN(out, FuseLayout(specs, ckpt.path().string()));
  } else {
    for (auto& spec : specs) out.push_back(LaidOutTensor{spec, {spec.name}});
  }
  std::sort(out.begin(), out.end(),
            [](const LaidOutTensor& a, const LaidOutTensor& b) { return a.spec.name < b.spec.name; });
  return out;
}

// Streams the output tensors into `dir` (model.safetensors, or shards and an index): file
// ranges are copied inside the kernel, in-memory tensors appended, one tensor at a time.
Status WriteTensors(const Checkpoint& ckpt, const std::vector<LaidOutTensor>& outputs, const fs::path& dir) {
  std::vector<TensorSpec> specs;
  specs.reserve(outputs.size());
  for (const LaidOutTensor& o : outputs) specs.push_back(o.spec);
  WriterOptions options;
  options.max_shard_bytes = kMaxShardBytes;
  FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateInDirectory(dir, std::move(specs), options));
  for (const LaidOutTensor& o : outputs) {
    for (const std::string& part : o.parts) {
      const SafetensorsFile::FileRange range = ckpt.RangeOf(part);
      if (range.fd >= 0) {
        FERRY_RETURN_IF_ERROR(writer->AppendFileRange(range.fd, range.offset, range.length));
      } else {
        FERRY_ASSIGN_OR_RETURN(Tensor t, ckpt.Get(part));
        if (t.nbytes() > 0) FERRY_RETURN_IF_ERROR(writer->Append(t.bytes()));
      }
      ckpt.Release(part);
    }
  }
  return writer->Finish();
}

Status WriteAux(const AuxFiles& aux, const fs::path& dir) {
  for (const auto& [name, contents] : aux) {
    FERRY_RETURN_IF_ERROR(WriteFileAtomic(dir / name, contents));
  }
  return Status::OK();
}

// What to restack: the mapped tensors and the aux files beside them.
struct Plan {
  std::optional<Checkpoint> mapped;
  const Checkpoint& tensors() const { return *mapped; }
  AuxFiles aux;
};

// Adapter mode: merges `received` onto plan.base_dir into `hf_dir` (the snapshot builder's
// arithmetic, bit for bit, streamed tensor by tensor and hashed as it is written: see
// sync/activate_merge.h), proving the result: the manifest id of the files written must be
// the publisher's merged version. Returns that id. On any error nothing is left at `hf_dir`.
Result<store::Digest> MergeAdapterInto(const fs::path& received, const ActivationPlan& plan, const fs::path& hf_dir) {
  const fs::path& base_dir = *plan.base_dir;
  std::error_code ec;
  if (!fs::is_directory(base_dir, ec)) {
    return Status::FailedPrecondition("adapter activation of " + received.string() + ": base directory " +
                                      base_dir.string() + " (ActivationPlan.base_dir) does not exist");
  }
  return activate_internal::WriteMergedAdapter(received, base_dir, *plan.merged_version, plan.threads, hf_dir);
}

// Layout mode: the received tensors, mapped, with their aux files.
Result<Plan> Relayout(const fs::path& received) {
  Plan p;
  FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(received));
  p.mapped.emplace(std::move(ckpt));
  std::error_code ec;
  const fs::path dir = fs::is_directory(received, ec) ? received : received.parent_path();
  FERRY_ASSIGN_OR_RETURN(p.aux, CollectAuxFiles(dir.empty() ? fs::path(".") : dir));
  return p;
}

std::string LayoutQ(Layout layout) { return Q(LayoutName(layout)); }

Status CheckPlan(const fs::path& received, const ActivationPlan& plan) {
  if (!IsTensorLayout(plan.want_layout)) {
    return Status::InvalidArgument("activation of " + received.string() + ": ActivationPlan.want_layout " +
                                   LayoutQ(plan.want_layout) + " is not 'hf' or 'fused'");
  }
  if (plan.served_kind == store::VersionKind::kAdapter) {
    if (!plan.base_dir) {
      return Status::InvalidArgument("adapter activation of " + received.string() +
                                     ": ActivationPlan.base_dir (the local base model) is not set");
    }
    if (!plan.merged_version) {
      return Status::InvalidArgument("adapter activation of " + received.string() +
                                     ": ActivationPlan.merged_version (the publisher's merged id) is not set");
    }
    return Status::OK();
  }
  if (!IsTensorLayout(plan.served_layout)) {
    return Status::InvalidArgument("activation of " + received.string() + ": ActivationPlan.served_layout " +
                                   LayoutQ(plan.served_layout) + " cannot be laid out as " + LayoutQ(plan.want_layout) +
                                   " (expected 'hf' or 'fused')");
  }
  if (plan.served_layout == Layout::kFused && plan.want_layout == Layout::kHf) {
    return Status::InvalidArgument("activation of " + received.string() +
                                   ": served layout 'fused' cannot be laid out as 'hf' (fused tensors are not split)");
  }
  return Status::OK();
}

}  // namespace

bool NeedsPreparation(const ActivationPlan& plan) {
  return plan.served_kind == store::VersionKind::kAdapter || plan.served_layout != plan.want_layout;
}

Result<Prepared> PrepareActivation(const fs::path& received, const ActivationPlan& plan, const fs::path& out) {
  FERRY_RETURN_IF_ERROR(CheckPlan(received, plan));
  std::error_code ec;
  if (fs::exists(fs::symlink_status(out, ec))) {
    return Status::AlreadyExists(out.string() + ": activation output already exists");
  }
  Prepared prepared;
  Plan p;
  fs::path merged_hf;  // adapter mode, fused: the proven hf merge, removed once restacked
  struct RemoveOnExit {
    fs::path* path;
    ~RemoveOnExit() {
      std::error_code e;
      if (!path->empty()) fs::remove_all(*path, e);
    }
  } remove_merged{&merged_hf};
  if (plan.served_kind == store::VersionKind::kAdapter) {
    if (plan.want_layout == Layout::kHf) {
      FERRY_ASSIGN_OR_RETURN(prepared.id, MergeAdapterInto(received, plan, out));
      prepared.proven = prepared.id;
      return prepared;
    }
    const fs::path hf_dir = TempNameFor(out).string() + ".hf";
    FERRY_ASSIGN_OR_RETURN(prepared.proven, MergeAdapterInto(received, plan, hf_dir));
    merged_hf = hf_dir;
    FERRY_ASSIGN_OR_RETURN(p, Relayout(hf_dir));
  } else {
    FERRY_ASSIGN_OR_RETURN(p, Relayout(received));
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<LaidOutTensor> outputs,
                         PlanLayout(p.tensors(), plan.want_layout == Layout::kFused));
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(out, /*replace_existing=*/false));
  FERRY_RETURN_IF_ERROR(WriteTensors(p.tensors(), outputs, staging.path()));
  FERRY_RETURN_IF_ERROR(WriteAux(p.aux, staging.path()));
  FERRY_ASSIGN_OR_RETURN(store::VersionRecord written, store::HashPath(staging.path()));
  prepared.id = written.id;
  FERRY_RETURN_IF_ERROR(staging.Commit());
  return prepared;
}

}  // namespace ferry::sync
