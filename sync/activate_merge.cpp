// The receiver's adapter merge, streamed and hashed as it is written (sync/activate_merge.h).
#include "sync/activate_merge.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

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

// Bytes of merged rows per kernel call and merge thread in the fast path, each piece hashed
// right after it is merged, while it is still in L2 (reading a 10 MB tensor back once it is
// all merged cost as much again).
constexpr size_t kPieceBytes = size_t{256} << 10;
// Merged tensors waiting for the writer (bounds memory to a few tensors).
constexpr size_t kQueueDepth = 4;

// Output buffers of the fused merge, recycled: a fresh buffer per tensor would cost a page
// fault and the zeroing of every page, as much as the merge itself.
class BufferPool {
 public:
  using Buffer = std::shared_ptr<std::vector<uint16_t>>;
  Buffer Acquire(size_t elements) {
    Buffer b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        b = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!b) b = std::make_shared<std::vector<uint16_t>>();
    if (b->size() < elements) b->resize(elements);  // grows only; never re-zeroed
    return b;
  }
  void Return(Buffer b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
  }

 private:
  std::mutex mu_;
  std::vector<Buffer> free_;
};

// One tensor for the writer: its bytes (kept alive by the Tensor) and where they go.
struct Job {
  Tensor tensor;
  uint64_t offset = 0;
  std::string release;                  // the base tensor whose pages to drop once written ("" for none)
  std::optional<store::Digest> digest;  // the tensor's digest when the merge computed it
  BufferPool::Buffer recycle;           // the pool buffer `tensor` views, returned once written
};

// Writes jobs on one thread while the caller merges and hashes the next tensor. One, not
// more: buffered writes into one file take its inode lock (tmpfs and ext4 alike), so a second
// writer only waits for the first, spinning on the lock on the cores the merge needs. On two
// cores the page-cache write of the whole model (~0.35 s per GiB here) and the merge plus
// hashing (~0.3 s) then overlap instead of queueing.
class Writer {
 public:
  Writer(int fd, fs::path path, const Checkpoint& base, BufferPool* pool)
      : fd_(fd), path_(std::move(path)), base_(base), pool_(pool), thread_([this] { Loop(); }) {}
  ~Writer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // Queues a job (waits while kQueueDepth are queued); the writer's first error, if any.
  Status Push(Job job) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.size() < kQueueDepth || !error_.ok(); });
    if (!error_.ok()) return error_;
    queue_.push_back(std::move(job));
    cv_.notify_all();
    return Status::OK();
  }
  // Waits until every queued job is written; the first error.
  Status Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return (queue_.empty() && !busy_) || !error_.ok(); });
    return error_;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Job job = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      const bool skip = !error_.ok();
      lock.unlock();
      Status s = skip ? Status::OK() : PwriteAll(fd_, job.tensor.bytes(), job.offset, path_);
      if (s.ok() && !skip && !job.release.empty()) base_.Release(job.release);
      job.tensor = Tensor();  // frees a merged buffer outside the lock
      if (job.recycle) pool_->Return(std::move(job.recycle));
      lock.lock();
      busy_ = false;
      if (!s.ok() && error_.ok()) error_ = s;
      cv_.notify_all();
    }
  }

  const int fd_;
  const fs::path path_;
  const Checkpoint& base_;
  BufferPool* pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool busy_ = false;  // a job is being written
  bool closing_ = false;
  Status error_;
  std::thread thread_;  // last: started once everything it uses exists
};

// Closes a descriptor when destroyed.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

// The common case, one plain LoRA delta on a 16-bit weight (MergePlan::FusableDelta), made
// here with the fused kernel into a recycled buffer exactly as the snapshot builder makes it
// (a divergence could only fail the proof, never pass it); unchanged tensors are the base's
// own mapped bytes. Null for anything else (the caller asks the LazySnapshot).
Result<std::optional<Job>> FastTensor(const MergePlan& plan, const Checkpoint& base, const Checkpoint& adapter,
                                      const std::string& name, const TensorInfo& out, int threads, BufferPool& pool) {
  const std::string source = plan.SourceOf(name);
  const TensorInfo* in = base.Info(source);
  if (in == nullptr || in->dtype != out.dtype || in->shape != out.shape) return std::optional<Job>();
  Job job;
  job.release = source;
  if (!plan.Changes(name)) {
    FERRY_ASSIGN_OR_RETURN(job.tensor, base.Get(source));
    return std::optional<Job>(std::move(job));
  }
  const LoraModule* m = plan.FusableDelta(name, in->dtype, in->shape);
  if (m == nullptr) return std::optional<Job>();
  FERRY_ASSIGN_OR_RETURN(Tensor w, base.Get(source));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter, m->a_key));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, m->b_key));
  const size_t n = static_cast<size_t>(m->out * m->in);
  job.recycle = pool.Acquire(n);
  // Merged a piece of rows at a time (the same bits as in one call), each piece hashed at once.
  const kernels::Float16Kind kind =
      w.dtype() == DType::kBF16 ? kernels::Float16Kind::kBF16 : kernels::Float16Kind::kF16;
  const int64_t piece_rows = std::max<int64_t>(
      1, static_cast<int64_t>(kPieceBytes) * std::max(threads, 1) / (m->in * static_cast<int64_t>(sizeof(uint16_t))));
  const kernels::LoraRowMerger16 merger(kind, a.data(), b.data(), m->out, m->in, m->rank,
                                        static_cast<float>(m->scaling));
  store::TensorDigester digester(out.dtype, out.shape);
  for (int64_t r0 = 0; r0 < m->out; r0 += piece_rows) {
    const int64_t r1 = std::min(m->out, r0 + piece_rows);
    merger.Merge(w.data_as<uint16_t>(), job.recycle->data(), r0, r1, threads);
    digester.Update(std::as_bytes(
        std::span<const uint16_t>(job.recycle->data() + r0 * m->in, static_cast<size_t>((r1 - r0) * m->in))));
  }
  job.digest = digester.Finish();
  adapter.Release(m->a_key);
  adapter.Release(m->b_key);
  FERRY_ASSIGN_OR_RETURN(
      job.tensor, Tensor::Wrap(out.dtype, out.shape, std::as_bytes(std::span<const uint16_t>(job.recycle->data(), n)),
                               job.recycle));
  return std::optional<Job>(std::move(job));
}

}  // namespace

Result<store::Digest> WriteMergedAdapter(const fs::path& received, const fs::path& base_dir,
                                         const store::Digest& expected, int threads, const fs::path& out) {
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
  // By default the merge leaves one hardware thread to the writer.
  const int kernel_threads =
      threads > 0 ? threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);

  std::vector<TensorSpec> specs;
  std::vector<store::TensorRow> rows;
  for (const std::string& name : tensors.names()) {
    const TensorInfo* info = tensors.Info(name);
    specs.push_back({name, info->dtype, info->shape});
    store::TensorRow row;
    row.name = name;
    row.dtype = info->dtype;
    row.shape = info->shape;
    FERRY_ASSIGN_OR_RETURN(row.nbytes, CheckedByteSize(info->dtype, info->shape));
    rows.push_back(std::move(row));
  }
  FERRY_ASSIGN_OR_RETURN(std::string header, SerializeSafetensorsHeader(specs, {{"format", "pt"}}));
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(out, /*replace_existing=*/false));
  const fs::path model = staging.path() / "model.safetensors";
  FdCloser fd{::open(model.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644)};
  if (fd.fd < 0) return Status::IOError(model.string() + ": cannot create: " + std::strerror(errno));
  uint64_t offset = header.size();
  for (const auto& row : rows) offset += row.nbytes;
  FERRY_RETURN_IF_ERROR(PwriteAll(fd.fd, {reinterpret_cast<const std::byte*>(header.data()), header.size()}, 0, model));
  if (::ftruncate(fd.fd, static_cast<off_t>(offset)) != 0) {
    return Status::IOError(model.string() + ": cannot size to " + std::to_string(offset) +
                           " bytes: " + std::strerror(errno));
  }

  std::vector<store::Digest> digests(rows.size());
  BufferPool pool;
  {
    Writer writer(fd.fd, model, base, &pool);
    offset = header.size();
    for (size_t i = 0; i < rows.size(); ++i) {
      const std::string& name = rows[i].name;
      auto fast = FastTensor(*plan, base, adapter, name, *tensors.Info(name), kernel_threads, pool);
      if (!fast.ok()) return fast.status().WithContext(what);
      Job job;
      if (fast->has_value()) {
        job = std::move(**fast);
      } else {
        auto t = tensors.Get(name);
        if (!t.ok()) return t.status().WithContext(what);
        job.tensor = std::move(*t);
        job.release = name;
      }
      // The fast path hashed what it merged; the base's unchanged tensors (from its mapping)
      // and what the LazySnapshot merged are hashed here.
      digests[i] = job.digest ? *job.digest : store::TensorDigest(job.tensor);
      job.offset = offset;
      FERRY_RETURN_IF_ERROR(writer.Push(std::move(job)));
      offset += rows[i].nbytes;
    }
    FERRY_RETURN_IF_ERROR(writer.Drain());
  }
  for (size_t i = 0; i < rows.size(); ++i) rows[i].digest = digests[i];
  std::vector<store::AuxFile> aux_rows;
  for (const auto& [name, contents] : merged.aux_files()) {
    aux_rows.push_back(store::AuxFile{name, store::AuxDigest(contents), contents.size()});
  }
  const store::Digest id = store::ManifestDigest(rows, aux_rows);
  if (!(id == expected)) {
    return Status::Corruption("adapter activation: merging " + received.string() + " onto the base " +
                              base_dir.string() + " gives manifest " + id.Hex() +
                              " but the publisher's merged version is " + expected.Hex() +
                              " (the local base or the adapter differs from the publisher's)");
  }
  if (::fsync(fd.fd) != 0) return Status::IOError(model.string() + ": fsync failed: " + std::strerror(errno));
  for (const auto& [name, contents] : merged.aux_files()) {
    FERRY_RETURN_IF_ERROR(WriteFileAtomic(staging.path() / name, contents));
  }
  FERRY_RETURN_IF_ERROR(SyncDirectory(staging.path()));
  FERRY_RETURN_IF_ERROR(staging.Commit());
  return id;
}

}  // namespace ferry::sync::activate_internal
