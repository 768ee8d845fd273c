#include "store/object_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "core/file_util.h"
#include "store/internal.h"

namespace ferry::store::internal {
namespace {

// Writeback is started after every this many bytes of an object, so that the disk is busy
// from the first large tensor on rather than from the end of the copy.
constexpr uint64_t kWritebackBytes = uint64_t{64} << 20;
// Objects kept open (written, not yet fdatasynced) per batch; beyond this the oldest is
// completed at once, so a checkpoint of many thousand tensors stays within the fd limit.
constexpr size_t kMaxPending = 128;

void StartWriteback(int fd, uint64_t offset, uint64_t length) {
  // Only a hint: errors surface at the fdatasync in Finish.
  (void)::sync_file_range(fd, static_cast<off64_t>(offset), static_cast<off64_t>(length), SYNC_FILE_RANGE_WRITE);
}

// Copies [offset, offset + length) of `src` to the start of `dst` inside the kernel. Returns
// false (nothing written) when this pair of files does not support copy_file_range.
Result<bool> CopyRange(int src, uint64_t offset, uint64_t length, int dst, bool writeback,
                       const std::filesystem::path& dst_path) {
  loff_t in = static_cast<loff_t>(offset), out = 0;
  uint64_t done = 0, kicked = 0;
  while (done < length) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(length - done, kWritebackBytes));
    ssize_t n = ::copy_file_range(src, &in, dst, &out, want, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && done == 0 && (errno == EXDEV || errno == ENOSYS || errno == EOPNOTSUPP || errno == EINVAL)) {
      return false;
    }
    if (n < 0) return ErrnoStatus(dst_path.string() + ": copy_file_range", errno);
    if (n == 0) return Status::IOError(dst_path.string() + ": copy_file_range: source ended early (truncated?)");
    done += static_cast<uint64_t>(n);
    if (writeback && done - kicked >= kWritebackBytes) {
      StartWriteback(dst, kicked, done - kicked);
      kicked = done;
    }
  }
  return true;
}

}  // namespace

std::filesystem::path ObjectStore::PathOf(Kind kind, const Digest& d) const {
  const std::string hex = d.Hex();
  return TopDir(kind) / hex.substr(0, 2) / hex.substr(2);
}

bool ObjectStore::Present(Kind kind, const Digest& d, uint64_t size) const {
  struct stat st;
  const auto p = PathOf(kind, d);
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && static_cast<uint64_t>(st.st_size) == size;
}

Status ObjectStore::CheckTensor(const TensorRow& row) const {
  const auto path = PathOf(Kind::kTensor, row.digest);
  FERRY_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  if (file->size() != row.nbytes) {
    return Status::Corruption("object " + path.string() + " has " + std::to_string(file->size()) + " bytes, expected " +
                              std::to_string(row.nbytes));
  }
  TensorDigester digester(row.dtype, row.shape);
  auto bytes = file->bytes();
  for (size_t off = 0; off < bytes.size(); off += kChunkBytes) {
    const size_t n = std::min(kChunkBytes, bytes.size() - off);
    file->AdviseSequential(off, n);
    digester.Update(bytes.subspan(off, n));
    file->Release(off, n);
  }
  Digest got = digester.Finish();
  if (got != row.digest) {
    return Status::Corruption("object " + path.string() + " hashes to " + got.Hex() + ", expected " + row.digest.Hex());
  }
  return Status::OK();
}

Status ObjectStore::CheckAux(const AuxFile& aux) const {
  const auto path = PathOf(Kind::kAux, aux.digest);
  FERRY_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  if (file->size() != aux.size) {
    return Status::Corruption("object " + path.string() + " has " + std::to_string(file->size()) + " bytes, expected " +
                              std::to_string(aux.size));
  }
  Digest got = HashBytes(file->bytes());
  if (got != aux.digest) {
    return Status::Corruption("object " + path.string() + " hashes to " + got.Hex() + ", expected " + aux.digest.Hex());
  }
  return Status::OK();
}

// ---- ObjectBatch ---------------------------------------------------------------------------

ObjectBatch::~ObjectBatch() {
  for (Pending& p : pending_) {
    if (p.fd >= 0) ::close(p.fd);
    ::unlink(p.tmp.c_str());
    if (p.claim) Release(p.claim, false);
  }
  // Claims of finished objects stay until here, past the commit that records them: an
  // import needing one of them meanwhile relies on this batch's write instead of repeating it.
  {
    std::lock_guard lock(objects_.claims_mu_);
    for (const Digest& d : claimed_) {
      auto it = objects_.claims_.find(d);
      if (it != objects_.claims_.end() && it->second->owner == this) objects_.claims_.erase(it);
    }
  }
  objects_.claims_cv_.notify_all();
}

void ObjectBatch::Release(const std::shared_ptr<ObjectStore::Claim>& claim, bool ok) {
  {
    std::lock_guard lock(objects_.claims_mu_);
    claim->done = true;
    claim->ok = ok;
    if (!ok) {  // free for another batch to write
      auto it = objects_.claims_.find(claim->digest);
      if (it != objects_.claims_.end() && it->second == claim) objects_.claims_.erase(it);
    }
  }
  objects_.claims_cv_.notify_all();
}

std::shared_ptr<ObjectStore::Claim> ObjectBatch::ClaimOrFind(const Digest& digest, bool& ours) {
  std::lock_guard lock(objects_.claims_mu_);
  ours = false;
  // A digest this batch wrote already (two tensors with the same bytes, dtype and shape).
  if (claimed_.count(digest)) return nullptr;
  auto [it, fresh] = objects_.claims_.try_emplace(digest);
  if (!fresh) return it->second;
  it->second = std::make_shared<ObjectStore::Claim>();
  it->second->owner = this;
  it->second->digest = digest;
  claimed_.insert(digest);
  ours = true;
  return it->second;
}

Status ObjectBatch::MakeDir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir, ec)) return Status::OK();
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": cannot create directory: " + ec.message());
  std::lock_guard lock(mu_);
  dirty_dirs_.insert(dir.parent_path());  // the new directory's entry
  return Status::OK();
}

Status ObjectBatch::WriteTemp(const std::filesystem::path& final_path, std::span<const std::byte> bytes,
                              const SafetensorsFile::FileRange& source, const TensorRow* row, Pending& out) {
  FERRY_RETURN_IF_ERROR(MakeDir(final_path.parent_path()));
  const auto tmp = TempNameFor(final_path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(tmp.string(), errno);
  out.fd = fd;
  out.tmp = tmp;
  out.final_path = final_path;
  auto fail = [&](Status s) {
    ::close(out.fd);
    out.fd = -1;
    ::unlink(tmp.c_str());
    return s;
  };
  const bool sync = objects_.sync();
  bool copied = false;
  if (source.fd >= 0 && source.length == bytes.size()) {
    auto r = CopyRange(source.fd, source.offset, source.length, fd, sync, tmp);
    if (!r.ok()) return fail(r.status());
    copied = *r;
  }
  if (!copied) {
    uint64_t kicked = 0;
    for (size_t off = 0; off < bytes.size(); off += kChunkBytes) {
      const size_t n = std::min(kChunkBytes, bytes.size() - off);
      if (Status s = WriteAll(fd, bytes.subspan(off, n), tmp); !s.ok()) return fail(s);
      if (sync && off + n - kicked >= kWritebackBytes) {
        StartWriteback(fd, kicked, off + n - kicked);
        kicked = off + n;
      }
    }
  }
  if (sync) StartWriteback(fd, 0, 0);  // the tail (and anything not started yet)
  if (row != nullptr) {
    // The bytes as they are in the file: nothing else is renamed to the digest's name.
    auto file = MappedFile::Open(tmp);
    if (!file.ok()) return fail(file.status());
    if ((*file)->size() != row->nbytes) {
      return fail(Status::IOError(tmp.string() + ": has " + std::to_string((*file)->size()) + " bytes after writing " +
                                  std::to_string(row->nbytes)));
    }
    TensorDigester digester(row->dtype, row->shape);
    auto written = (*file)->bytes();
    for (size_t off = 0; off < written.size(); off += kChunkBytes) {
      const size_t n = std::min(kChunkBytes, written.size() - off);
      digester.Update(written.subspan(off, n));
      (*file)->Release(off, n);
    }
    const Digest got = digester.Finish();
    if (got != row->digest) {
      return fail(Status::Corruption("tensor '" + row->name + "' changed while it was being stored (digest " +
                                     got.Hex() + ", hashed as " + row->digest.Hex() + "); nothing was committed"));
    }
  }
  return Status::OK();
}

Status ObjectBatch::WriteTensor(const TensorRow& row, std::span<const std::byte> bytes,
                                const SafetensorsFile::FileRange& source) {
  bool ours = false;
  auto claim = ClaimOrFind(row.digest, ours);
  if (!claim) return Status::OK();  // this batch has it already
  if (!ours) {
    std::lock_guard lock(mu_);
    borrowed_.push_back(Borrowed{row, std::move(claim)});
    return Status::OK();
  }
  Pending p;
  p.claim = claim;
  if (Status s = WriteTemp(objects_.PathOf(ObjectStore::Kind::kTensor, row.digest), bytes, source, &row, p); !s.ok()) {
    Release(claim, false);
    return s;
  }
  bytes_written_ += row.nbytes;
  ++objects_written_;
  std::optional<Pending> oldest;
  {
    std::lock_guard lock(mu_);
    pending_.push_back(std::move(p));
    if (pending_.size() > kMaxPending) {
      oldest = std::move(pending_.front());
      pending_.erase(pending_.begin());
    }
  }
  if (oldest) return Complete(*oldest);
  return Status::OK();
}

Status ObjectBatch::WriteAux(const Digest& d, std::string_view contents) {
  if (objects_.Present(ObjectStore::Kind::kAux, d, contents.size())) return Status::OK();
  Pending p;
  FERRY_RETURN_IF_ERROR(
      WriteTemp(objects_.PathOf(ObjectStore::Kind::kAux, d),
                std::span<const std::byte>(reinterpret_cast<const std::byte*>(contents.data()), contents.size()), {},
                nullptr, p));
  bytes_written_ += contents.size();
  ++objects_written_;
  std::lock_guard lock(mu_);
  pending_.push_back(std::move(p));
  return Status::OK();
}

Status ObjectBatch::Complete(Pending& p) {
  Status s;
  if (objects_.sync() && ::fdatasync(p.fd) != 0) s = ErrnoStatus(p.tmp.string() + ": fdatasync", errno);
  if (::close(p.fd) != 0 && s.ok()) s = ErrnoStatus(p.tmp.string() + ": close", errno);
  p.fd = -1;
  if (s.ok() && ::rename(p.tmp.c_str(), p.final_path.c_str()) != 0) {
    s = ErrnoStatus(p.final_path.string() + ": rename from " + p.tmp.string(), errno);
  }
  if (!s.ok()) {
    ::unlink(p.tmp.c_str());
  } else {
    std::lock_guard lock(mu_);
    dirty_dirs_.insert(p.final_path.parent_path());
  }
  if (p.claim) Release(p.claim, s.ok());
  p.claim.reset();
  return s;
}

Result<std::vector<TensorRow>> ObjectBatch::Finish() {
  std::vector<Pending> pending;
  std::vector<Borrowed> borrowed;
  {
    std::lock_guard lock(mu_);
    pending.swap(pending_);
    borrowed.swap(borrowed_);
  }
  Status first;
  for (size_t i = 0; i < pending.size(); ++i) {
    Status s = Complete(pending[i]);
    if (!s.ok() && first.ok()) first = s;
  }
  if (!first.ok()) return first;

  std::vector<TensorRow> rewrite;
  std::unique_lock lock(objects_.claims_mu_);
  for (Borrowed& b : borrowed) {
    objects_.claims_cv_.wait(lock, [&] { return b.claim->done; });
    if (b.claim->ok) {
      std::lock_guard dirs(mu_);
      dirty_dirs_.insert(objects_.PathOf(ObjectStore::Kind::kTensor, b.row.digest).parent_path());
    } else {
      rewrite.push_back(std::move(b.row));  // its writer failed: WriteTensor claims it (or waits again)
    }
  }
  return rewrite;
}

Status ObjectBatch::SyncDirs() {
  if (!objects_.sync()) return Status::OK();
  std::set<std::filesystem::path> dirs;
  {
    std::lock_guard lock(mu_);
    dirs = dirty_dirs_;
  }
  for (const auto& d : dirs) FERRY_RETURN_IF_ERROR(SyncDirectory(d));
  return Status::OK();
}

}  // namespace ferry::store::internal
