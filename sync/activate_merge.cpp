// The receiver's adapter merge and its laid-out writer, streamed and hashed as they write
// (sync/activate_merge.h).
#include "sync/activate_merge.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "convert/fused_layout.h"
#include "convert/merge_plan.h"
#include "convert/peft_config.h"
#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/file_util.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "kernels/lora_merge.h"
#include "sync/snapshot.h"

namespace ferry::sync::activate_internal {
namespace {

namespace fs = std::filesystem;

// Bytes merged, hashed and written at a time: a piece goes from the merge kernel through the
// hash into the page cache while it is still in L2. (Merging a whole tensor into a buffer for
// a writer thread read every merged byte back from memory once more; on two cores the copy of
// a 0.5B model into tmpfs then took 0.4-1.3 s instead of 0.35 s.)
constexpr size_t kPieceBytes = size_t{256} << 10;
// Default workers on a machine with more hardware threads (see DefaultWorkers).
constexpr int kMaxWorkers = 4;

// The file being written and the first error of any worker.
class Output {
 public:
  Output(int fd, fs::path path) : fd_(fd), path_(std::move(path)) {}
  Status Write(std::span<const std::byte> bytes, uint64_t offset) const { return PwriteAll(fd_, bytes, offset, path_); }
  void Fail(Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.ok()) error_ = std::move(s);
    failed_.store(true, std::memory_order_relaxed);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  Status error() const {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  const int fd_;
  const fs::path path_;
  mutable std::mutex mu_;
  Status error_;
  std::atomic<bool> failed_{false};
};

// Closes a descriptor when destroyed.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// The common case, one plain LoRA delta on a 16-bit weight (MergePlan::FusableDelta), made
// here with the fused kernel exactly as the snapshot builder makes it (a divergence could only
// fail the proof, never pass it), a piece of rows at a time into `piece`, each piece hashed and
// handed to `sink` at once; unchanged tensors are hashed and handed over from the base's
// mapping. Its digest, or nullopt for anything else (nothing handed over: the caller asks the
// LazySnapshot).
Result<std::optional<store::Digest>> FastTensor(const MergePlan& plan, const Checkpoint& base,
                                                const Checkpoint& adapter, const std::string& name,
                                                const TensorInfo& out, const PieceSink& sink,
                                                std::vector<uint16_t>& piece) {
  using Digest = std::optional<store::Digest>;
  const std::string source = plan.SourceOf(name);
  const TensorInfo* in = base.Info(source);
  if (in == nullptr || in->dtype != out.dtype || in->shape != out.shape) return Digest();
  if (!plan.Changes(name)) {
    FERRY_ASSIGN_OR_RETURN(const Tensor t, base.Get(source));
    FERRY_ASSIGN_OR_RETURN(const store::Digest d, HashAndWrite(t, sink));
    base.Release(source);
    return Digest(d);
  }
  const LoraModule* m = plan.FusableDelta(name, in->dtype, in->shape);
  if (m == nullptr) return Digest();
  FERRY_ASSIGN_OR_RETURN(const Tensor w, base.Get(source));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter, m->a_key));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, m->b_key));
  const kernels::Float16Kind kind =
      w.dtype() == DType::kBF16 ? kernels::Float16Kind::kBF16 : kernels::Float16Kind::kF16;
  const kernels::LoraRowMerger16 merger(kind, a.data(), b.data(), m->out, m->in, m->rank,
                                        static_cast<float>(m->scaling));
  const int64_t row_bytes = m->in * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t piece_rows = std::max<int64_t>(1, static_cast<int64_t>(kPieceBytes) / std::max<int64_t>(row_bytes, 1));
  piece.resize(static_cast<size_t>(piece_rows * m->in));
  store::TensorDigester digester(out.dtype, out.shape);
  for (int64_t r0 = 0; r0 < m->out; r0 += piece_rows) {
    const int64_t r1 = std::min(m->out, r0 + piece_rows);
    merger.Merge(w.data_as<uint16_t>(), piece.data(), r0, r1);
    const auto bytes = std::as_bytes(std::span<const uint16_t>(piece.data(), static_cast<size_t>((r1 - r0) * m->in)));
    digester.Update(bytes);
    FERRY_RETURN_IF_ERROR(sink(bytes, static_cast<uint64_t>(r0 * row_bytes)));
  }
  adapter.Release(m->a_key);
  adapter.Release(m->b_key);
  base.Release(source);
  return Digest(digester.Finish());
}

}  // namespace

Result<std::vector<LaidOutTensor>> PlanLayout(const Checkpoint& ckpt, Layout layout, std::string_view where) {
  std::vector<TensorSpec> specs;
  for (const std::string& name : ckpt.names()) {
    const TensorInfo* info = ckpt.Info(name);
    if (info == nullptr) return Status::Internal(std::string(where) + ": tensor '" + name + "' has no metadata");
    specs.push_back({name, info->dtype, info->shape});
  }
  std::vector<LaidOutTensor> out;
  if (layout == Layout::kFused) {
    FERRY_ASSIGN_OR_RETURN(out, FuseLayout(specs, where));
  } else {
    for (auto& spec : specs) out.push_back(LaidOutTensor{spec, {spec.name}});
  }
  std::sort(out.begin(), out.end(),
            [](const LaidOutTensor& a, const LaidOutTensor& b) { return a.spec.name < b.spec.name; });
  return out;
}

int DefaultWorkers() { return std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, kMaxWorkers); }

Result<store::Digest> HashAndWrite(const Tensor& t, const PieceSink& sink) {
  store::TensorDigester digester(t.dtype(), t.shape());
  const std::span<const std::byte> bytes = t.bytes();
  for (size_t at = 0; at < bytes.size(); at += kPieceBytes) {
    const auto piece = bytes.subspan(at, std::min(kPieceBytes, bytes.size() - at));
    digester.Update(piece);
    FERRY_RETURN_IF_ERROR(sink(piece, at));
  }
  return digester.Finish();
}

Result<LaidOutDigests> WriteLaidOut(const std::vector<LaidOutTensor>& outputs, int workers,
                                    const PartWriter& write_part, const fs::path& file) {
  LaidOutDigests result;
  std::vector<TensorSpec> specs;
  for (const LaidOutTensor& o : outputs) {
    specs.push_back(o.spec);
    store::TensorRow row;
    row.name = o.spec.name;
    row.dtype = o.spec.dtype;
    row.shape = o.spec.shape;
    FERRY_ASSIGN_OR_RETURN(row.nbytes, CheckedByteSize(o.spec.dtype, o.spec.shape));
    result.rows.push_back(std::move(row));
    result.parts.emplace_back(o.parts.size());
  }
  FERRY_ASSIGN_OR_RETURN(std::string header, SerializeSafetensorsHeader(specs, {{"format", "pt"}}));
  FdCloser fd{::open(file.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
  if (fd.fd < 0) return Status::IOError(file.string() + ": cannot create: " + std::strerror(errno));
  std::vector<uint64_t> offsets(outputs.size());
  uint64_t offset = header.size();
  for (size_t i = 0; i < outputs.size(); ++i) {
    offsets[i] = offset;
    offset += result.rows[i].nbytes;
  }
  FERRY_RETURN_IF_ERROR(PwriteAll(fd.fd, {reinterpret_cast<const std::byte*>(header.data()), header.size()}, 0, file));
  if (::ftruncate(fd.fd, static_cast<off_t>(offset)) != 0) {
    return Status::IOError(file.string() + ": cannot size to " + std::to_string(offset) +
                           " bytes: " + std::strerror(errno));
  }
  Output output(fd.fd, file);
  // One output tensor: its parts one after the other, each hashed by the part writer and,
  // when stacked with others, as a piece of the output tensor too, and written in place.
  const auto make = [&](size_t i, std::vector<uint16_t>& piece) -> Status {
    const LaidOutTensor& o = outputs[i];
    std::optional<store::TensorDigester> stacked;
    if (o.parts.size() > 1) stacked.emplace(o.spec.dtype, o.spec.shape);
    uint64_t at = offsets[i];
    uint64_t written = 0;
    for (size_t k = 0; k < o.parts.size(); ++k) {
      uint64_t part_bytes = 0;
      const PieceSink sink = [&](std::span<const std::byte> bytes, uint64_t within) {
        if (stacked) stacked->Update(bytes);
        part_bytes = std::max<uint64_t>(part_bytes, within + bytes.size());
        if (written + within + bytes.size() > result.rows[i].nbytes) {
          return Status::Internal(file.string() + ": tensor '" + o.spec.name +
                                  "': its parts hold more bytes than its " + std::to_string(result.rows[i].nbytes));
        }
        return output.Write(bytes, at + within);
      };
      FERRY_ASSIGN_OR_RETURN(result.parts[i][k], write_part(o.parts[k], sink, piece));
      at += part_bytes;
      written += part_bytes;
    }
    if (written != result.rows[i].nbytes) {
      return Status::Internal(file.string() + ": tensor '" + o.spec.name + "': its parts hold " +
                              std::to_string(written) + " bytes, not " + std::to_string(result.rows[i].nbytes));
    }
    result.rows[i].digest = stacked ? stacked->Finish() : result.parts[i][0];
    return Status::OK();
  };
  std::atomic<size_t> next{0};
  const auto work = [&] {
    std::vector<uint16_t> piece;
    for (size_t i; !output.failed() && (i = next.fetch_add(1)) < outputs.size();) {
      if (Status s = make(i, piece); !s.ok()) {
        output.Fail(std::move(s));
        return;
      }
    }
  };
  {
    std::vector<std::thread> pool;
    for (int t = 1; t < workers; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  }
  FERRY_RETURN_IF_ERROR(output.error());
  if (::fsync(fd.fd) != 0) return Status::IOError(file.string() + ": fsync failed: " + std::strerror(errno));
  return result;
}

Result<MergedAdapter> WriteMergedAdapter(const fs::path& received, const fs::path& base_dir,
                                         const store::Digest& expected, int threads, Layout layout,
                                         const fs::path& out) {
  const std::string what = "adapter activation of " + received.string() + " onto " + base_dir.string();
  auto opened = Checkpoint::Open(base_dir);
  if (!opened.ok()) {
    return Status::FailedPrecondition("adapter activation of " + received.string() + ": cannot read the base " +
                                      base_dir.string() + ": " + opened.status().message());
  }
  const Checkpoint base = std::move(*opened);
  SnapshotSource source;
  for (const std::string& name : base.names()) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, base.Get(name));
    source.tensors.emplace(name, std::move(t));
  }
  auto config = LoadPeftConfig(received);
  if (!config.ok()) return config.status().WithContext(what);
  source.adapter_config = std::move(*config);
  auto opened_adapter = Checkpoint::Open(received);
  if (!opened_adapter.ok()) return opened_adapter.status().WithContext(what);
  const Checkpoint adapter = std::move(*opened_adapter);
  for (const std::string& name : adapter.names()) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, adapter.Get(name));
    source.adapter_tensors.emplace(name, std::move(t));
  }
  auto aux = CollectAuxFiles(base_dir);
  if (!aux.ok()) return aux.status().WithContext(what);
  source.aux_files = std::move(*aux);
  SnapshotOptions options;
  options.layout = Layout::kHf;
  options.threads = threads;
  options.tie_word_embeddings = TiesWordEmbeddings(source.aux_files);
  auto planned = LazySnapshot::Plan(source, options);
  if (!planned.ok()) return planned.status().WithContext(what);
  const LazySnapshot& merged = **planned;
  const Checkpoint& tensors = merged.checkpoint();
  // The same plan the LazySnapshot made (it checked it), for the fast path.
  auto plan = PlanMerge(*source.adapter_config, adapter, base, options.tie_word_embeddings);
  if (!plan.ok()) return plan.status().WithContext(what);
  // Workers, each merging, hashing and writing whole tensors (a tensor's digest is one
  // sequential hash): while one copies into the file, another merges.
  const int workers = threads > 0 ? threads : DefaultWorkers();

  // What is written: the merged tensors in the hf layout, or in the fused one with q/k/v and
  // gate/up stacked (each stacked tensor its parts' bytes one after the other). The proof is
  // over the hf rows, one per part.
  auto laid_out = PlanLayout(tensors, layout, what);
  if (!laid_out.ok()) return laid_out.status();
  const std::vector<LaidOutTensor>& outputs = *laid_out;
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(out, /*replace_existing=*/false));
  // Each part: the fast path, or else what the LazySnapshot makes (one tensor at a time).
  std::mutex lazy_mu;
  const PartWriter write_part = [&](const std::string& part, const PieceSink& sink,
                                    std::vector<uint16_t>& piece) -> Result<store::Digest> {
    FERRY_ASSIGN_OR_RETURN(std::optional<store::Digest> digest,
                           FastTensor(*plan, base, adapter, part, *tensors.Info(part), sink, piece));
    if (digest) return *digest;
    Result<Tensor> t = [&] {
      std::lock_guard<std::mutex> lock(lazy_mu);
      return tensors.Get(part);
    }();
    if (!t.ok()) return t.status();
    FERRY_ASSIGN_OR_RETURN(const store::Digest d, HashAndWrite(*t, sink));
    base.Release(part);
    return d;
  };
  auto written = WriteLaidOut(outputs, workers, write_part, staging.path() / "model.safetensors");
  if (!written.ok()) return written.status().WithContext(what);
  std::vector<store::TensorRow> rows;  // the hf rows: every part of every output tensor
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t k = 0; k < outputs[i].parts.size(); ++k) {
      const TensorInfo* info = tensors.Info(outputs[i].parts[k]);
      store::TensorRow row;
      row.name = outputs[i].parts[k];
      row.dtype = info->dtype;
      row.shape = info->shape;
      FERRY_ASSIGN_OR_RETURN(row.nbytes, CheckedByteSize(info->dtype, info->shape));
      row.digest = written->parts[i][k];
      rows.push_back(std::move(row));
    }
  }
  std::sort(rows.begin(), rows.end(),
            [](const store::TensorRow& a, const store::TensorRow& b) { return a.name < b.name; });
  const std::vector<store::AuxFile> aux_rows = store::AuxFileRows(merged.aux_files());
  MergedAdapter result;
  result.proven = store::ManifestDigest(rows, aux_rows);
  if (!(result.proven == expected)) {
    return Status::Corruption("adapter activation: merging " + received.string() + " onto the base " +
                              base_dir.string() + " gives manifest " + result.proven.Hex() +
                              " but the publisher's merged version is " + expected.Hex() +
                              " (the local base or the adapter differs from the publisher's)");
  }
  result.id = layout == Layout::kFused ? store::ManifestDigest(written->rows, aux_rows) : result.proven;
  for (const auto& [name, contents] : merged.aux_files()) {
    FERRY_RETURN_IF_ERROR(WriteFileAtomic(staging.path() / name, contents));
  }
  FERRY_RETURN_IF_ERROR(SyncDirectory(staging.path()));
  FERRY_RETURN_IF_ERROR(staging.Commit());
  return result;
}

}  // namespace ferry::sync::activate_internal
