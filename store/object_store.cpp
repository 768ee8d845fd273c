#include "store/object_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <functional>

#include "store/internal.h"

namespace ferry::store::internal {
namespace {

// Closes a descriptor and removes a temporary file unless released.
class TempFile {
 public:
  TempFile(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  int fd() const { return fd_; }
  Status Close() {
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoStatus(path_.string() + ": close", errno);
    return Status::OK();
  }
  void Release() { path_.clear(); }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

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

Status ObjectStore::WriteFile(const std::filesystem::path& final_path, std::span<const std::byte> bytes,
                              const std::function<Status(std::span<const std::byte>)>& check_piece,
                              const std::function<Status()>& check_end,
                              std::set<std::filesystem::path>& dirty_dirs) const {
  const auto dir = final_path.parent_path();
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IOError(dir.string() + ": cannot create directory: " + ec.message());
    dirty_dirs.insert(dir.parent_path());  // the new directory's entry
  }
  const auto tmp = TempNameFor(final_path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(tmp.string(), errno);
  TempFile file(tmp, fd);
  for (size_t off = 0; off < bytes.size(); off += kChunkBytes) {
    auto piece = bytes.subspan(off, std::min(kChunkBytes, bytes.size() - off));
    if (check_piece) FERRY_RETURN_IF_ERROR(check_piece(piece));
    FERRY_RETURN_IF_ERROR(WriteAll(fd, piece, tmp));
  }
  if (check_end) FERRY_RETURN_IF_ERROR(check_end());
  if (sync_ && ::fsync(fd) != 0) return ErrnoStatus(tmp.string() + ": fsync", errno);
  FERRY_RETURN_IF_ERROR(file.Close());
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    return ErrnoStatus(final_path.string() + ": rename from " + tmp.string(), errno);
  }
  file.Release();
  dirty_dirs.insert(dir);
  return Status::OK();
}

Status ObjectStore::WriteTensor(const Digest& d, DType dtype, const Shape& shape, std::span<const std::byte> bytes,
                                const std::string& tensor, std::set<std::filesystem::path>& dirty_dirs) const {
  TensorDigester digester(dtype, shape);
  const auto path = PathOf(Kind::kTensor, d);
  return WriteFile(
      path, bytes,
      [&](std::span<const std::byte> piece) {
        digester.Update(piece);
        return Status::OK();
      },
      [&]() -> Status {
        Digest got = digester.Finish();
        if (got != d) {
          return Status::Corruption("tensor '" + tensor + "' changed while it was being stored (digest " + got.Hex() +
                                    ", hashed as " + d.Hex() + "); nothing was committed");
        }
        return Status::OK();
      },
      dirty_dirs);
}

Status ObjectStore::WriteAux(const Digest& d, std::string_view contents,
                             std::set<std::filesystem::path>& dirty_dirs) const {
  return WriteFile(PathOf(Kind::kAux, d),
                   std::span<const std::byte>(reinterpret_cast<const std::byte*>(contents.data()), contents.size()),
                   nullptr, nullptr, dirty_dirs);
}

Status ObjectStore::SyncDirs(const std::set<std::filesystem::path>& dirs) const {
  if (!sync_) return Status::OK();
  for (const auto& d : dirs) FERRY_RETURN_IF_ERROR(SyncDirectory(d));
  return Status::OK();
}

Status ObjectStore::CheckTensor(const TensorRow& row) const {
  const auto path = PathOf(Kind::kTensor, row.digest);
  FERRY_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  if (file->size() != row.nbytes) {
    return Status::Corruption("object " + path.string() + " has " + std::to_string(file->size()) +
                              " bytes, expected " + std::to_string(row.nbytes));
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
    return Status::Corruption("object " + path.string() + " hashes to " + got.Hex() + ", expected " +
                              row.digest.Hex());
  }
  return Status::OK();
}

Status ObjectStore::CheckAux(const AuxFile& aux) const {
  const auto path = PathOf(Kind::kAux, aux.digest);
  FERRY_ASSIGN_OR_RETURN(auto file, MappedFile::Open(path));
  if (file->size() != aux.size) {
    return Status::Corruption("object " + path.string() + " has " + std::to_string(file->size()) +
                              " bytes, expected " + std::to_string(aux.size));
  }
  Digest got = HashBytes(file->bytes());
  if (got != aux.digest) {
    return Status::Corruption("object " + path.string() + " hashes to " + got.Hex() + ", expected " +
                              aux.digest.Hex());
  }
  return Status::OK();
}

}  // namespace ferry::store::internal
