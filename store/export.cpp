// Export: a stored version written out as a loadable directory, atomically.
#include <unistd.h>

#include "core/safetensors.h"
#include "store/internal.h"
#include "store/rocks_store.h"

namespace ferry::store::internal {
namespace {

// Hugging Face's default shard limit ("5GB").
constexpr uint64_t kExportShardBytes = 5'000'000'000ull;

// Removes a directory tree unless released.
class DirGuard {
 public:
  explicit DirGuard(std::filesystem::path p) : path_(std::move(p)) {}
  ~DirGuard() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  DirGuard(const DirGuard&) = delete;
  DirGuard& operator=(const DirGuard&) = delete;
  void Release() { path_.clear(); }

 private:
  std::filesystem::path path_;
};

}  // namespace

Status RocksStore::Export(const Digest& version, const std::filesystem::path& out, bool force) {
  FERRY_ASSIGN_OR_RETURN(VersionRecord rec, LoadVersion(version));
  const std::string what = "export of version " + rec.id.Hex() + " to " + out.string();
  std::error_code ec;
  const bool out_exists = std::filesystem::exists(std::filesystem::symlink_status(out, ec));
  if (out_exists && !force) {
    return Status::AlreadyExists(Where(what + ": " + out.string() + " exists (pass force to replace it)"));
  }
  std::filesystem::path parent = out.parent_path();
  if (parent.empty()) parent = ".";
  if (!std::filesystem::is_directory(parent, ec)) {
    return Status::NotFound(Where(what + ": directory " + parent.string() + " does not exist"));
  }
  const auto tmp = TempNameFor(out);
  if (!std::filesystem::create_directory(tmp, ec) || ec) {
    return Status::IOError(Where(what + ": cannot create " + tmp.string() + ": " + ec.message()));
  }
  DirGuard guard(tmp);

  std::vector<TensorSpec> specs;
  for (const TensorRow& row : rec.tensors) specs.push_back(TensorSpec{row.name, row.dtype, row.shape});
  WriterOptions wo;
  wo.basename = rec.kind == VersionKind::kAdapter ? "adapter_model" : "model";
  wo.max_shard_bytes = rec.total_bytes > kExportShardBytes ? kExportShardBytes : 0;
  auto writer = SafetensorsWriter::CreateInDirectory(tmp, std::move(specs), wo);
  if (!writer.ok()) return Status(writer.status().code(), Where(what + ": " + writer.status().message()));

  for (const TensorRow& row : rec.tensors) {
    const std::string tensor = "tensor '" + row.name + "'";
    const auto path = objects_.PathOf(ObjectStore::Kind::kTensor, row.digest);
    auto file = MappedFile::Open(path);
    if (!file.ok()) {
      return Status(file.status().code(), Where(what + ": " + tensor + ": object " + file.status().message()));
    }
    if ((*file)->size() != row.nbytes) {
      return Status::Corruption(Where(what + ": " + tensor + " is corrupted: object " + path.string() + " has " +
                                      std::to_string((*file)->size()) + " bytes, expected " +
                                      std::to_string(row.nbytes)));
    }
    TensorDigester digester(row.dtype, row.shape);
    auto bytes = (*file)->bytes();
    for (size_t off = 0; off < bytes.size(); off += kChunkBytes) {
      const size_t n = std::min(kChunkBytes, bytes.size() - off);
      (*file)->AdviseSequential(off, n);
      auto piece = bytes.subspan(off, n);
      digester.Update(piece);
      Status s = (*writer)->Append(piece);
      if (!s.ok()) return Status(s.code(), Where(what + ": " + tensor + ": " + s.message()));
      (*file)->Release(off, n);
    }
    Digest got = digester.Finish();
    if (got != row.digest) {
      return Status::Corruption(Where(what + ": " + tensor + " is corrupted: object " + path.string() +
                                      " hashes to " + got.Hex() + ", expected " + row.digest.Hex()));
    }
  }
  if (Status s = (*writer)->Finish(); !s.ok()) return Status(s.code(), Where(what + ": " + s.message()));
  writer->reset();

  for (const AuxFile& a : rec.aux) {
    auto contents = ReadAux(a);
    if (!contents.ok()) return Status(contents.status().code(), what + ": " + contents.status().message());
    if (Status s = WriteFileAtomic(tmp / a.name, *contents); !s.ok()) {
      return Status(s.code(), Where(what + ": " + s.message()));
    }
  }
  if (Status s = SyncDirectory(tmp); !s.ok()) return Status(s.code(), Where(what + ": " + s.message()));

  if (out_exists) {
    // Replace: move the old tree aside, move the new one in, then delete the old one.
    const auto old = TempNameFor(out);
    if (::rename(out.c_str(), old.c_str()) != 0) return ErrnoStatus(Where(what + ": rename " + out.string()), errno);
    if (::rename(tmp.c_str(), out.c_str()) != 0) {
      int e = errno;
      (void)::rename(old.c_str(), out.c_str());
      return ErrnoStatus(Where(what + ": rename " + tmp.string()), e);
    }
    guard.Release();
    std::filesystem::remove_all(old, ec);
  } else {
    if (::rename(tmp.c_str(), out.c_str()) != 0) return ErrnoStatus(Where(what + ": rename " + tmp.string()), errno);
    guard.Release();
  }
  return SyncDirectory(parent);
}

}  // namespace ferry::store::internal
