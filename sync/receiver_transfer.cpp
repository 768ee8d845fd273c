// One version into DIR/versions/<id> (sync/receiver_internal.h): the safetensors file laid
// out from the manifest, each chunk written at its place and hashed as it arrives, tensors
// the receiver already holds copied locally, every digest checked, renamed when whole.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>
#include <utility>

#include "core/file_util.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "sync/receiver_internal.h"

namespace ferry::sync::receiver_internal {
namespace {

namespace fs = std::filesystem;

const PieceSink kDiscard = [](std::span<const std::byte>, uint64_t) { return Status::OK(); };

// Copies tensor `row` from the reuse source (its tensor `name`) into `fd` at `offset`,
// hashing as it goes. True when the copied bytes have the row's digest (false: fetch it).
Result<bool> CopyLocal(const ReuseSource& src, const std::string& name, const store::TensorRow& row, int fd,
                       uint64_t offset, const fs::path& path, std::vector<std::byte>& piece) {
  const auto range = src.checkpoint.RangeOf(name);
  if (range.fd < 0 || range.length != row.nbytes) return false;
  return ReadAndHash(range.fd, range.offset, row, piece, [&](std::span<const std::byte> bytes, uint64_t done) {
    return PwriteAll(fd, bytes, offset + done, path);
  });
}

// Receives every tensor of `man` into `model` (laid out, or taken over from a partial
// transfer when `resuming`), then every aux file into `tmp`.
Result<Outcome> ReceiveFiles(Session& s, const ReceiverOptions& o, const Manifest& man, const ReuseSource* reuse,
                             SyncResult* result, const fs::path& tmp, const std::string& header, bool resuming) {
  const fs::path model = tmp / "model.safetensors";
  FdGuard fd(resuming ? ::open(model.c_str(), O_RDWR | O_CLOEXEC)
                      : ::open(model.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0) return Status::IOError(model.string() + ": cannot create: " + std::strerror(errno));
  if (!resuming) {
    uint64_t total = header.size();
    for (const auto& t : man.tensors) total += t.nbytes;
    FERRY_RETURN_IF_ERROR(
        PwriteAll(fd.get(), {reinterpret_cast<const std::byte*>(header.data()), header.size()}, 0, model));
    if (::ftruncate(fd.get(), static_cast<off_t>(total)) != 0) {
      return Status::IOError(model.string() + ": cannot size to " + std::to_string(total) +
                             " bytes: " + std::strerror(errno));
    }
  }
  std::vector<std::byte> piece;
  // What is not held or reused locally is fetched in one run (Session::FetchRun), each
  // tensor hashed as it arrives; a tensor that fails its digest is fetched again on its own.
  struct Wanted {
    uint32_t tensor;
    uint64_t at;     // file offset of the tensor
    uint64_t start;  // bytes held from a killed transfer, already hashed
    store::TensorDigester digester;
  };
  std::deque<Wanted> wanted;  // a deque: digesters stay in place
  std::vector<Session::RunItem> items;
  uint64_t begin = header.size();
  for (uint32_t i = 0; i < man.tensors.size(); ++i) {
    const auto& row = man.tensors[i];
    const uint64_t at = begin;
    begin += row.nbytes;
    uint64_t held = 0;  // bytes of this tensor a killed transfer left (see HeldPrefix)
    if (resuming && row.nbytes > 0) {
      held = HeldPrefix(fd.get(), row, at, o.chunk_bytes, piece);
      if (held == row.nbytes) {
        result->bytes_resumed += row.nbytes;
        continue;
      }
    }
    if (reuse != nullptr) {
      if (const std::optional<std::string> name = reuse->Find(row)) {
        FERRY_ASSIGN_OR_RETURN(bool same, CopyLocal(*reuse, *name, row, fd.get(), at, model, piece));
        if (same) {
          result->bytes_reused += row.nbytes;
          continue;
        }
      }
    }
    Wanted& w = wanted.emplace_back(Wanted{i, at, 0, store::TensorDigester(row.dtype, row.shape)});
    if (held > 0) {  // hash the prefix already on disk, fetch the rest
      FERRY_ASSIGN_OR_RETURN(bool read, HashRange(fd.get(), at, held, w.digester, piece, kDiscard));
      if (read) {
        w.start = held;
      } else {  // unreadable: fetch the whole tensor, as if nothing were held
        w.digester = store::TensorDigester(row.dtype, row.shape);
      }
    }
    items.push_back({ItemKind::kTensor, i, w.start, row.nbytes});
  }
  std::vector<uint32_t> failed;
  std::optional<WriteBehind> writer;  // destroyed before `fd` is closed
  if (!items.empty()) writer.emplace(fd.get(), model, o.credit);
  auto write = [&](size_t k, zmq::message_t& chunk, uint64_t offset) {
    wanted[k].digester.Update(Bytes(chunk));
    FERRY_RETURN_IF_ERROR(writer->Submit(std::move(chunk), wanted[k].at + offset));
    // The test hook sees every chunk it is told of on disk (kill tests count on it).
    return o.on_chunk_for_testing ? writer->Drain() : Status::OK();
  };
  auto check = [&](size_t k) {
    if (wanted[k].digester.Finish() == man.tensors[wanted[k].tensor].digest) {
      result->bytes_resumed += wanted[k].start;
    } else {
      failed.push_back(static_cast<uint32_t>(k));
    }
    return Status::OK();
  };
  FERRY_ASSIGN_OR_RETURN(Outcome run, s.FetchRun(man, items, write, check));
  if (run == Outcome::kNewer) return run;
  if (writer) FERRY_RETURN_IF_ERROR(writer->Drain());  // a refetch below overwrites what it wrote
  for (uint32_t k : failed) {
    const auto& row = man.tensors[wanted[k].tensor];
    for (int attempt = 1;; ++attempt) {
      if (attempt > o.max_retries || row.nbytes == 0) {
        return Status::Corruption("sync: tensor " + row.name + " of version " + man.version.Hex() +
                                  " still fails its digest after " + std::to_string(attempt - 1) + " refetches");
      }
      ++result->refetches;
      store::TensorDigester digester(row.dtype, row.shape);
      if (row.nbytes > 0) {
        FERRY_ASSIGN_OR_RETURN(Outcome oc, s.Fetch(man, ItemKind::kTensor, wanted[k].tensor, 0, row.nbytes,
                                                   [&](std::span<const std::byte> bytes, uint64_t offset) {
                                                     digester.Update(bytes);
                                                     return PwriteAll(fd.get(), bytes, wanted[k].at + offset, model);
                                                   }));
        if (oc == Outcome::kNewer) return oc;
      }
      if (digester.Finish() == row.digest) break;
    }
  }
  if (::fsync(fd.get()) != 0) return Status::IOError(model.string() + ": fsync failed: " + std::strerror(errno));

  std::string aux;
  for (uint32_t i = 0; i < man.aux.size(); ++i) {
    const auto& file = man.aux[i];
    for (int attempt = 0;; ++attempt) {
      aux.assign(file.size, '\0');
      if (!aux.empty()) {
        FERRY_ASSIGN_OR_RETURN(Outcome oc, s.Fetch(man, ItemKind::kAux, i, 0, aux.size(),
                                                   [&](std::span<const std::byte> bytes, uint64_t offset) {
                                                     std::memcpy(aux.data() + offset, bytes.data(), bytes.size());
                                                     return Status::OK();
                                                   }));
        if (oc == Outcome::kNewer) return oc;
      }
      if (store::AuxDigest(aux) == file.digest) break;
      if (attempt >= o.max_retries || aux.empty()) {
        return Status::Corruption("sync: aux file " + file.name + " of version " + man.version.Hex() +
                                  " still fails its digest after " + std::to_string(attempt) + " refetches");
      }
      ++result->refetches;
    }
    // The directory is fsynced and renamed as a whole once every file is in.
    FERRY_RETURN_IF_ERROR(LocalIO(WriteFileAtomic(tmp / file.name, aux, /*sync=*/true)));
  }
  return Outcome::kDone;
}

// ReceiveVersion's transfer into the temporary directory `tmp`, renamed into place when verified.
Result<Outcome> ReceiveInto(Session& s, const ReceiverOptions& o, const Manifest& man, const ReuseSource* reuse,
                            SyncResult* result, const fs::path& tmp) {
  const fs::path versions = o.dir / "versions";
  std::vector<TensorSpec> specs;
  for (const auto& t : man.tensors) specs.push_back({t.name, t.dtype, t.shape});
  FERRY_ASSIGN_OR_RETURN(std::string header, SerializeSafetensorsHeader(specs, {{"format", "pt"}}));
  uint64_t total = header.size();
  for (const auto& t : man.tensors) {
    if (t.nbytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) - total) {
      return Status::Corruption("sync MANIFEST of version " + man.version.Hex() + ": tensor " + t.name +
                                " makes the file larger than a file offset can address");
    }
    total += t.nbytes;
  }
  const bool resuming = TakeOverPartial(versions, man.version, header, total, tmp);
  FERRY_ASSIGN_OR_RETURN(Outcome oc, ReceiveFiles(s, o, man, reuse, result, tmp, header, resuming));
  if (oc == Outcome::kNewer) return oc;
  // Every tensor and aux file written was hashed as it was written and matched its manifest
  // digest, and the safetensors header was laid out from the manifest, so the manifest
  // digest over those verified rows is the id of exactly these files (what store::HashPath
  // would compute, without reading everything a second time).
  const store::Digest computed = store::ManifestDigest(man.tensors, man.aux);
  if (!(computed == man.version)) {
    return Status::Corruption("sync: received files of version " + man.version.Hex() + " hash to " + computed.Hex() +
                              " (the manifest is inconsistent with its tensors)");
  }
  FERRY_RETURN_IF_ERROR(LocalIO(SyncDirectory(tmp)));
  FERRY_RETURN_IF_ERROR(RenameIntoPlace(tmp, versions / man.version.Hex()));
  return Outcome::kDone;
}

}  // namespace

WriteBehind::WriteBehind(int fd, std::filesystem::path path, size_t depth)
    : fd_(fd), path_(std::move(path)), depth_(std::max<size_t>(depth, 1)), thread_([this] { Run(); }) {}

WriteBehind::~WriteBehind() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  work_.notify_one();
  thread_.join();
}

Status WriteBehind::Submit(zmq::message_t&& chunk, uint64_t offset) {
  std::unique_lock<std::mutex> l(mu_);
  room_.wait(l, [&] { return queue_.size() < depth_ || !error_.ok(); });
  if (!error_.ok()) return error_;
  queue_.push_back({std::move(chunk), offset});
  l.unlock();
  work_.notify_one();
  return Status::OK();
}

Status WriteBehind::Drain() {
  std::unique_lock<std::mutex> l(mu_);
  room_.wait(l, [&] { return (queue_.empty() && !writing_) || !error_.ok(); });
  return error_;
}

void WriteBehind::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    work_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    Piece p = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    l.unlock();
    Status st = PwriteAll(fd_, Bytes(p.chunk), p.offset, path_);
    p.chunk.rebuild();  // freed outside the lock
    l.lock();
    writing_ = false;
    if (!st.ok() && error_.ok()) {
      error_ = std::move(st);
      queue_.clear();
    }
    room_.notify_all();
  }
}

std::optional<std::string> ReuseSource::Find(const store::TensorRow& row) const {
  if (by_name) {
    const TensorInfo* info = checkpoint.Info(row.name);
    if (info == nullptr || info->nbytes() != row.nbytes || info->dtype != row.dtype || info->shape != row.shape) {
      return std::nullopt;
    }
    return row.name;
  }
  auto it = by_digest.find(row.digest);
  if (it == by_digest.end()) return std::nullopt;
  return it->second;
}

std::unique_ptr<ReuseSource> OpenActiveReuse(const fs::path& dir, const store::Digest& active) {
  auto text = ReadSmallFile(dir / "manifests" / (active.Hex() + ".json"));
  if (!text.ok()) return nullptr;
  auto man = DecodeManifest(*text);
  if (!man.ok()) return nullptr;
  auto ckpt = Checkpoint::Open(dir / "versions" / man->version.Hex() / "model.safetensors");
  if (!ckpt.ok()) return nullptr;
  auto src = std::make_unique<ReuseSource>(ReuseSource{std::move(*ckpt), {}, false});
  for (const auto& row : man->tensors) {
    const TensorInfo* info = src->checkpoint.Info(row.name);
    if (info != nullptr && info->nbytes() == row.nbytes && info->dtype == row.dtype && info->shape == row.shape) {
      src->by_digest.emplace(row.digest, row.name);
    }
  }
  return src;
}

std::unique_ptr<ReuseSource> OpenBaseReuse(const fs::path& base_dir) {
  auto ckpt = Checkpoint::Open(base_dir);
  if (!ckpt.ok()) return nullptr;
  return std::make_unique<ReuseSource>(ReuseSource{std::move(*ckpt), {}, true});
}

Result<Outcome> ReceiveVersion(Session& s, const ReceiverOptions& o, const Manifest& man, const ReuseSource* reuse,
                               SyncResult* result) {
  const fs::path versions = o.dir / "versions";
  std::error_code ec;
  if (fs::is_directory(versions / man.version.Hex(), ec)) return Outcome::kDone;  // verified by an earlier sync
  std::string tmpl = (versions / (man.version.Hex() + ".tmp-XXXXXX")).string();
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return Status::IOError(tmpl + ": cannot create temporary version directory: " + std::strerror(errno));
  }
  const fs::path tmp = tmpl;
  TempDirGuard guard(tmp);
  Result<Outcome> r = ReceiveInto(s, o, man, reuse, result, tmp);
  if (r.ok() && *r == Outcome::kDone) {
    guard.Release();  // renamed into place
  } else if (!r.ok()) {
    // The publisher went away or failed: keep what arrived for the next attempt (the bytes
    // are verified again before they are used).
    if (KeepPartial(versions, man.version, tmp)) guard.Release();
  }
  return r;  // kNewer: the guard deletes the abandoned transfer
}

}  // namespace ferry::sync::receiver_internal
