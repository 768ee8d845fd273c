// Export: a stored version written out as a loadable directory, atomically.
#include <unistd.h>

#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "store/internal.h"
#include "store/rocks_store.h"

namespace ferry::store::internal {
namespace {

// Hugging Face's default shard limit ("5GB").
constexpr uint64_t kExportShardBytes = 5'000'000'000ull;

}  // namespace

Status RocksStore::Export(const Digest& version, const std::filesystem::path& out, bool force) {
  std::shared_lock gc_lock(gc_mu_);  // gc must not remove the objects being copied
  FERRY_ASSIGN_OR_RETURN(VersionRecord rec, LoadVersion(MakeView().options(), version));
  const std::string what = "export of version " + rec.id.Hex() + " to " + out.string();
  if (rec.derived) {
    for (const TensorRow& row : rec.tensors) {
      FERRY_ASSIGN_OR_RETURN(auto small, SmallObject(rocksdb::ReadOptions(), row));
      if (!small && !objects_.Present(ObjectStore::Kind::kTensor, row.digest, row.nbytes)) {
        return Status::FailedPrecondition(Where(what + ": " + DerivedMessage(rec)));
      }
    }
  }
  auto staging = StagingDir::Create(out, force);
  if (!staging.ok()) return Status(staging.status().code(), Where(what + ": " + staging.status().message()));
  const std::filesystem::path tmp = staging->path();

  std::vector<TensorSpec> specs;
  for (const TensorRow& row : rec.tensors) specs.push_back(TensorSpec{row.name, row.dtype, row.shape});
  WriterOptions wo;
  wo.basename = rec.kind == VersionKind::kAdapter ? "adapter_model" : "model";
  wo.max_shard_bytes = rec.total_bytes > kExportShardBytes ? kExportShardBytes : 0;
  auto writer = SafetensorsWriter::CreateInDirectory(tmp, std::move(specs), wo);
  if (!writer.ok()) return Status(writer.status().code(), Where(what + ": " + writer.status().message()));

  for (const TensorRow& row : rec.tensors) {
    const std::string tensor = "tensor '" + row.name + "'";
    FERRY_ASSIGN_OR_RETURN(auto small, SmallObject(rocksdb::ReadOptions(), row));
    if (small) {
      if (Status s = CheckSmallObject(row, *small); !s.ok()) {
        return Status::Corruption(Where(what + ": " + tensor + " is corrupted: " + s.message()));
      }
      Status s = (*writer)->Append(std::as_bytes(std::span<const char>(small->data(), small->size())));
      if (!s.ok()) return Status(s.code(), Where(what + ": " + tensor + ": " + s.message()));
      continue;
    }
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
      return Status::Corruption(Where(what + ": " + tensor + " is corrupted: object " + path.string() + " hashes to " +
                                      got.Hex() + ", expected " + row.digest.Hex()));
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
  if (Status s = staging->Commit(); !s.ok()) return Status(s.code(), Where(what + ": " + s.message()));
  return Status::OK();
}

}  // namespace ferry::store::internal
