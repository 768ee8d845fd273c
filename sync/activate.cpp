// Receiver-side activation (sync/activate.h): adapter merge onto a local base, hf -> fused.
#include "sync/activate.h"

#include <memory>
#include <utility>
#include <vector>

#include "convert/peft_config.h"
#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/file_util.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "core/text.h"
#include "store/store.h"
#include "sync/activate_merge.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

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

// Adapter mode: merges `received` onto plan.base_dir into `out` in plan.want_layout (the
// snapshot builder's arithmetic, bit for bit, streamed tensor by tensor and hashed as it is
// written: see sync/activate_merge.h), proving the merge: its manifest id in the hf layout
// must be the publisher's merged version. On any error nothing is left at `out`.
Result<activate_internal::MergedAdapter> MergeAdapterInto(const fs::path& received, const ActivationPlan& plan,
                                                          const fs::path& out) {
  const fs::path& base_dir = *plan.base_dir;
  std::error_code ec;
  if (!fs::is_directory(base_dir, ec)) {
    return Status::FailedPrecondition("adapter activation of " + received.string() + ": base directory " +
                                      base_dir.string() + " (ActivationPlan.base_dir) does not exist");
  }
  return activate_internal::WriteMergedAdapter(received, base_dir, *plan.merged_version, plan.threads, plan.want_layout,
                                               out);
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

std::string LayoutQ(Layout layout) { return Quote(LayoutName(layout)); }

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
  if (plan.served_kind == store::VersionKind::kAdapter) {
    FERRY_ASSIGN_OR_RETURN(activate_internal::MergedAdapter merged, MergeAdapterInto(received, plan, out));
    prepared.id = merged.id;
    prepared.proven = merged.proven;
    return prepared;
  }
  FERRY_ASSIGN_OR_RETURN(Plan p, Relayout(received));
  FERRY_ASSIGN_OR_RETURN(std::vector<LaidOutTensor> outputs,
                         activate_internal::PlanLayout(p.tensors(), plan.want_layout, p.tensors().path().string()));
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(out, /*replace_existing=*/false));
  // Each received tensor copied from its mapping a piece at a time, hashed on the way (a fused
  // tensor as its parts one after the other): nothing is read back.
  const Checkpoint& tensors = p.tensors();
  const activate_internal::PartWriter copy_part = [&](const std::string& part, const activate_internal::PieceSink& sink,
                                                      std::vector<uint16_t>&) -> Result<store::Digest> {
    FERRY_ASSIGN_OR_RETURN(const Tensor t, tensors.Get(part));
    FERRY_ASSIGN_OR_RETURN(const store::Digest d, activate_internal::HashAndWrite(t, sink));
    tensors.Release(part);
    return d;
  };
  // One worker: a copy is all writing, which the file's inode lock serialises (a second
  // worker only spun on it: 12 % of all cycles in a profile).
  const int workers = 1;
  FERRY_ASSIGN_OR_RETURN(
      activate_internal::LaidOutDigests written,
      activate_internal::WriteLaidOut(outputs, workers, copy_part, staging.path() / "model.safetensors"));
  FERRY_RETURN_IF_ERROR(WriteAux(p.aux, staging.path()));
  prepared.id = store::ManifestDigest(written.rows, store::AuxFileRows(p.aux));
  FERRY_RETURN_IF_ERROR(SyncDirectory(staging.path()));
  FERRY_RETURN_IF_ERROR(staging.Commit());
  return prepared;
}

}  // namespace ferry::sync
