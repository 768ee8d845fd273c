#include "store/materialize.h"

#include <cstdio>
#include <map>
#include <system_error>

#include "core/checkpoint.h"
#include "core/diff.h"
#include "core/staging_dir.h"

namespace ferry::store {
namespace {

namespace fs = std::filesystem;

// The merge's result inside its staging directory, beside the exported base and adapter.
constexpr std::string_view kResult = "result";

std::string Short(const Digest& d) { return d.Hex().substr(0, 12); }

// The staging directory (core/staging_dir.h) `out` is built in: the merge's scratch (the
// exported base and adapter) and its result, which alone is committed. kNotFound when the
// directory `out` goes into does not exist.
Result<StagingDir> StageBeside(const fs::path& out, bool force, const std::string& what) {
  std::error_code ec;
  fs::path parent = out.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec)) {
    return Status::NotFound(what + ": directory " + parent.string() + " does not exist");
  }
  auto staging = StagingDir::Create(out, force);
  if (!staging.ok()) return staging.status().WithContext(what);
  return staging;
}

// Exports versions `base` and `adapter` into `work` and merges them there with the converter
// in `layout`, into work/kResult.
Status ExportAndMerge(Store& store, const Digest& base, const Digest& adapter, Layout layout, int threads,
                      const fs::path& work, const std::string& what) {
  FERRY_RETURN_IF_ERROR(store.Export(base, work / "base", false).WithContext(what));
  FERRY_RETURN_IF_ERROR(store.Export(adapter, work / "adapter", false).WithContext(what));
  ConvertOptions c;
  c.base = work / "base";
  c.adapter = work / "adapter";
  c.out = work / kResult;
  c.layout = layout;
  c.threads = threads;
  auto summary = Convert(c);
  if (!summary.ok()) return summary.status().WithContext(what);
  return Status::OK();
}

// The newest merged version recorded for (base, adapter), if any.
Result<std::optional<VersionRecord>> FindRecordedMerge(Store& store, const Digest& base, const Digest& adapter) {
  FERRY_ASSIGN_OR_RETURN(auto versions, store.ListVersions(std::nullopt));
  std::optional<VersionRecord> best;
  for (auto& v : versions) {
    if (v.kind != VersionKind::kMerged || v.base_version != base || v.adapter_version != adapter) continue;
    if (!best || v.time_ns >= best->time_ns) best = std::move(v);
  }
  return best;
}

// Checks the merge at `dir` against `recorded` (see materialize.h).
Status CheckAgainst(Store& store, const fs::path& dir, const VersionRecord& recorded, const MaterializeOptions& options,
                    MaterializeResult& result) {
  const std::string what = "materialized merge does not match recorded merged version " + Short(recorded.id);
  FERRY_ASSIGN_OR_RETURN(VersionRecord ours, HashPath(dir));
  std::map<std::string, const TensorRow*> recorded_rows;
  for (const auto& t : recorded.tensors) recorded_rows[t.name] = &t;
  std::vector<std::string> problems;
  std::vector<std::string> to_compare;
  for (const auto& t : ours.tensors) {
    auto it = recorded_rows.find(t.name);
    if (it == recorded_rows.end()) {
      problems.push_back(t.name + " (not in the recorded version)");
      continue;
    }
    const TensorRow& r = *it->second;
    recorded_rows.erase(it);
    if (r.digest == t.digest) {
      ++result.tensors_identical;
    } else if (r.shape != t.shape || r.dtype != t.dtype) {
      problems.push_back(t.name + " (" + std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape) +
                         ", recorded " + std::string(DTypeName(r.dtype)) + " " + ShapeToString(r.shape) + ")");
    } else if (options.exact || recorded.derived) {  // a derived version IS the converter's merge
      problems.push_back(t.name + " (digest " + Short(t.digest) + ", recorded " + Short(r.digest) + ")");
    } else {
      to_compare.push_back(t.name);
    }
  }
  for (const auto& [name, row] : recorded_rows) problems.push_back(name + " (missing from the merge)");
  if (!to_compare.empty()) {
    FERRY_ASSIGN_OR_RETURN(Checkpoint merged, Checkpoint::Open(dir));
    std::map<std::string, Tensor> a, b;
    for (const auto& name : to_compare) {
      FERRY_ASSIGN_OR_RETURN(a[name], merged.Get(name));
      for (const auto& row : recorded.tensors) {
        if (row.name == name) {
          FERRY_ASSIGN_OR_RETURN(b[name], store.ReadTensor(row, true));
          break;
        }
      }
    }
    DiffOptions d;
    d.atol = options.atol;
    d.rtol = options.rtol;
    d.max_ulp = options.max_ulp;
    FERRY_ASSIGN_OR_RETURN(DiffReport report,
                           DiffCheckpoints(Checkpoint::FromTensors(dir, std::move(a)),
                                           Checkpoint::FromTensors("version " + recorded.id.Hex(), std::move(b)), d));
    for (const auto& t : report.tensors) {
      if (t.status == DiffStatus::kEqual || t.status == DiffStatus::kWithinTolerance) {
        ++result.tensors_within_tolerance;
        result.max_abs_diff = std::max(result.max_abs_diff, t.max_abs_diff);
        continue;
      }
      char buf[160];
      std::snprintf(buf, sizeof buf, " (%lld of %lld elements outside tolerance, max abs diff %.3g)",
                    static_cast<long long>(t.outside_tolerance), static_cast<long long>(t.numel), t.max_abs_diff);
      problems.push_back(t.name + buf);
    }
  }
  if (problems.empty()) {
    result.checked_against = recorded.id;
    return Status::OK();
  }
  std::string msg = what + " (atol " + std::to_string(options.atol) + ", rtol " + std::to_string(options.rtol) +
                    "): " + std::to_string(problems.size()) + " tensors differ: ";
  for (size_t i = 0; i < problems.size(); ++i) msg += (i ? ", " : "") + problems[i];
  return Status::Corruption(msg);
}

// A derived version (store.h): its base and adapter exported into a temporary directory
// beside `out`, merged by the converter in the recorded layout, hashed; the result must be
// the version itself.
Result<MaterializeResult> MaterializeDerived(Store& store, const VersionRecord& rec, const fs::path& out,
                                             const MaterializeOptions& options, MaterializeResult& result) {
  const std::string what = "materialize derived version " + rec.id.Hex() + " (base " +
                           (rec.base_version ? rec.base_version->Hex() : "?") + " + adapter " +
                           (rec.adapter_version ? rec.adapter_version->Hex() : "?") + ")";
  if (options.layout != Layout::kHf) {
    return Status::InvalidArgument(what + ": layout " + std::string(LayoutName(options.layout)) +
                                   " applies only to adapter versions; a merged version is written as recorded "
                                   "(layout " +
                                   std::string(LayoutName(rec.layout)) + ")");
  }
  const Layout layout = rec.layout;
  if (!rec.base_version || !rec.adapter_version) {
    return Status::Corruption(what + ": the record names no base or adapter version");
  }
  FERRY_ASSIGN_OR_RETURN(StagingDir work, StageBeside(out, options.force, what));
  FERRY_RETURN_IF_ERROR(
      ExportAndMerge(store, *rec.base_version, *rec.adapter_version, layout, options.threads, work.path(), what));
  auto hashed = HashPath(work.path() / kResult);
  if (!hashed.ok()) return hashed.status().WithContext(what);
  const VersionRecord& rebuilt = *hashed;
  if (rebuilt.id != rec.id) {
    std::string differ;
    std::map<std::string, Digest> want;
    for (const auto& t : rec.tensors) want[t.name] = t.digest;
    int64_t n = 0;
    for (const auto& t : rebuilt.tensors) {
      auto it = want.find(t.name);
      if (it != want.end() && it->second == t.digest) continue;
      if (n++ < 3) differ += (differ.empty() ? "" : ", ") + t.name;
    }
    return Status::Corruption(
        what + ": the merge of its base and adapter has id " + rebuilt.id.Hex() + ", not " + rec.id.Hex() +
        (n > 0 ? " (" + std::to_string(n) + " tensors differ: " + differ + (n > 3 ? ", ..." : "") + ")"
               : " (the auxiliary files differ)"));
  }
  result.merged = true;
  result.checked_against = rec.id;
  result.tensors_identical = static_cast<int64_t>(rec.tensors.size());
  FERRY_RETURN_IF_ERROR(work.CommitPart(kResult).WithContext(what));
  return result;
}

}  // namespace

Result<MaterializeResult> Materialize(Store& store, const Digest& version, const fs::path& out,
                                      const MaterializeOptions& options) {
  FERRY_ASSIGN_OR_RETURN(VersionRecord rec, store.GetVersion(version.Hex()));
  MaterializeResult result;
  result.version = rec;
  result.out = out;
  const std::string what = "materialize version " + Short(rec.id) + " (" + std::string(KindName(rec.kind)) + ")";
  std::error_code ec;
  if (fs::exists(fs::symlink_status(out, ec)) && !options.force) {
    return Status::AlreadyExists(what + ": " + out.string() + " exists (replacing it needs MaterializeOptions.force)");
  }
  if (rec.derived) return MaterializeDerived(store, rec, out, options, result);
  if (rec.kind != VersionKind::kAdapter) {
    if (options.layout != Layout::kHf) {
      return Status::InvalidArgument(what + ": layout " + std::string(LayoutName(options.layout)) +
                                     " applies only to adapter versions (merged on the way out); a " +
                                     std::string(KindName(rec.kind)) + " version is exported as stored (layout hf)");
    }
    FERRY_RETURN_IF_ERROR(store.Export(rec.id, out, options.force).WithContext(what));
    return result;
  }
  if (!rec.base_version) {
    return Status::FailedPrecondition(what +
                                      ": the adapter version records no base_version to merge into "
                                      "(ImportOptions.base_version records it when the adapter is imported)");
  }
  auto base = store.GetVersion(rec.base_version->Hex());
  if (!base.ok()) {
    return Status(base.status().code(), what + ": base version " + Short(*rec.base_version) +
                                            " is not in the store: " + base.status().message());
  }
  FERRY_ASSIGN_OR_RETURN(StagingDir work, StageBeside(out, options.force, what));
  FERRY_RETURN_IF_ERROR(ExportAndMerge(store, base->id, rec.id, options.layout, options.threads, work.path(), what));
  result.merged = true;
  if (options.layout == Layout::kHf) {
    FERRY_ASSIGN_OR_RETURN(auto recorded, FindRecordedMerge(store, base->id, rec.id));
    if (recorded)
      FERRY_RETURN_IF_ERROR(CheckAgainst(store, work.path() / kResult, *recorded, options, result).WithContext(what));
  }
  FERRY_RETURN_IF_ERROR(work.CommitPart(kResult).WithContext(what));
  return result;
}

}  // namespace ferry::store
