#include "core/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

namespace ferry {

Status ErrnoStatus(const std::string& what, int err) {
  std::string msg = what + ": " + std::strerror(err);
  if (err == ENOENT) return Status::NotFound(msg);
  return Status::IOError(msg);
}

Status WriteAll(int fd, std::span<const std::byte> bytes, const std::filesystem::path& path) {
  const std::byte* p = bytes.data();
  size_t n = bytes.size();
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min(n, kMaxWriteCall));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return ErrnoStatus(path.string() + ": write", w < 0 ? errno : EIO);
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::OK();
}

Status PwriteAll(int fd, std::span<const std::byte> bytes, uint64_t offset, const std::filesystem::path& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return Status::IOError(path.string() + ": write at offset " + std::to_string(offset + done) +
                             " failed: " + std::strerror(n < 0 ? errno : EIO));
    }
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Result<std::string> ReadSmallFile(const std::filesystem::path& path, size_t limit) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // see MappedFile::Open
  if (fd < 0) return ErrnoStatus(path.string(), errno);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path.string() + ": not a regular file");
  }
  if (static_cast<uint64_t>(st.st_size) > limit) {
    ::close(fd);
    return Status::InvalidArgument(path.string() + ": file is " + std::to_string(st.st_size) +
                                   " bytes, more than the limit of " + std::to_string(limit));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    ssize_t r = ::read(fd, out.data() + got, out.size() - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int e = r < 0 ? errno : EIO;
      ::close(fd);
      return ErrnoStatus(path.string(), e);
    }
    got += static_cast<size_t>(r);
  }
  ::close(fd);
  return out;
}

std::filesystem::path TempNameFor(const std::filesystem::path& final_path) {
  static std::atomic<uint64_t> counter{0};
  std::string name = "." + final_path.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                     std::to_string(counter.fetch_add(1));
  return final_path.parent_path() / name;
}

Status SyncDirectory(const std::filesystem::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(dir.string(), errno);
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(dir.string() + ": fsync", e);
  return Status::OK();
}

Status WriteFileAtomic(const std::filesystem::path& path, std::string_view contents, bool sync) {
  const auto tmp = TempNameFor(path);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(tmp.string(), errno);
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t w = ::write(fd, contents.data() + done, contents.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoStatus(tmp.string(), e);
    }
    done += static_cast<size_t>(w);
  }
  const int sync_rc = sync ? ::fsync(fd) : 0;
  const int sync_errno = errno;
  if (::close(fd) != 0 || sync_rc != 0) {
    int e = sync_rc != 0 ? sync_errno : errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(tmp.string(), e);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(path.string(), e);
  }
  return sync ? SyncDirectory(path.parent_path()) : Status::OK();
}

Status SyncFile(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(path.string(), errno);
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(path.string() + ": fsync", e);
  return Status::OK();
}

bool IsWeightFileName(std::string_view name) {
  for (std::string_view suffix : {".safetensors", ".index.json", ".bin", ".pt", ".pth"}) {
    if (name.ends_with(suffix)) return true;
  }
  return false;
}

}  // namespace ferry
