#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ferry {

Result<std::shared_ptr<MappedFile>> MappedFile::Open(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoStatus(path.string(), errno);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return ErrnoStatus(path.string(), e);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path.string() + ": not a regular file");
  }
  std::shared_ptr<MappedFile> mf(new MappedFile());
  mf->path_ = path;
  mf->size_ = static_cast<size_t>(st.st_size);
  if (mf->size_ > 0) {
    void* p = ::mmap(nullptr, mf->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      return ErrnoStatus(path.string() + ": mmap", e);
    }
    mf->addr_ = p;
  }
  mf->fd_ = fd;  // kept for in-kernel copies (copy_file_range) of whole ranges
  return mf;
}

MappedFile::~MappedFile() {
  if (addr_ != nullptr) ::munmap(addr_, size_);
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::AdviseSequential(size_t offset, size_t length) const {
  if (addr_ == nullptr || offset >= size_) return;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t start = offset / page * page;
  const size_t end = std::min(size_, offset + length);
  ::madvise(static_cast<char*>(addr_) + start, end - start, MADV_SEQUENTIAL);
  ::madvise(static_cast<char*>(addr_) + start, end - start, MADV_WILLNEED);
}

void MappedFile::Release(size_t offset, size_t length) const {
  if (addr_ == nullptr || offset >= size_) return;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t start = offset / page * page;
  const size_t end = std::min(size_, offset + length);
  ::madvise(static_cast<char*>(addr_) + start, end - start, MADV_DONTNEED);
}

}  // namespace ferry
