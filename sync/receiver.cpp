#include "sync/receiver.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>
#include <zmq.hpp>

#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "sync/activate.h"
#include "sync/protocol.h"

namespace ferry::sync {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

// Delta copies read the local file in pieces of this size.
constexpr size_t kCopyPieceBytes = size_t{1} << 20;
// Epochs of publishers this receiver moved away from, remembered so that their stale
// announcements (still queued, or from a publisher that did not really die) are ignored.
constexpr size_t kRetiredEpochsKept = 16;

std::span<const std::byte> Bytes(const zmq::message_t& m) {
  return {static_cast<const std::byte*>(m.data()), m.size()};
}
zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

Status FsyncDir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Status::IOError(dir.string() + ": cannot open directory to fsync: " + std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return Status::IOError(dir.string() + ": fsync failed: " + std::strerror(errno));
  return Status::OK();
}

Status PwriteAll(int fd, std::span<const std::byte> bytes, uint64_t offset, const fs::path& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status::IOError(path.string() + ": write at offset " + std::to_string(offset + done) +
                                       " failed: " + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  return Status::OK();
}

Status WriteNewFile(const fs::path& path, std::span<const std::byte> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path.string() + ": cannot create: " + std::strerror(errno));
  Status st = PwriteAll(fd, bytes, 0, path);
  if (st.ok() && ::fsync(fd) != 0) st = Status::IOError(path.string() + ": fsync failed: " + std::strerror(errno));
  ::close(fd);
  return st;
}

// Closes a descriptor when destroyed.
class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  ~FdGuard() {
    if (fd_ >= 0) ::close(fd_);
  }
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Removes a temporary version directory unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(fs::path p) : path_(std::move(p)) {}
  ~TempDirGuard() {
    if (!path_.empty()) {
      std::error_code ec;
      fs::remove_all(path_, ec);
    }
  }
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  void Release() { path_.clear(); }

 private:
  fs::path path_;
};

std::string RandomHex() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[i] = kHex[(v >> (60 - 4 * i)) & 0xf];
  return s;
}

bool IsTempName(const std::string& name) { return name.find(".tmp-") != std::string::npos; }

constexpr std::string_view kPartialSuffix = ".partial";

// "<32 hex>.tmp-XXXXXX": a transfer's temporary directory (not a ".prepare.tmp-" one).
// Returns the version hex, or "" for any other name.
std::string TransferTempVersion(const std::string& name) {
  if (name.size() != 32 + 11 || name.compare(32, 5, ".tmp-") != 0) return "";
  const std::string hex = name.substr(0, 32);
  return store::Digest::FromHex(hex).ok() ? hex : "";
}

// Removes what a killed receiver may have left: temporary version directories, manifest
// temp files and symlink temp names. The newest transfer directory of each version that
// holds model.safetensors is kept as versions/<id>.partial (its complete tensors are
// verified and kept by the next Receive of that version instead of being fetched again).
// REQUIRES: the caller holds DIR/.lock.
void RemoveStaleTemporaries(const fs::path& dir) {
  for (const fs::path& sub : {dir / "versions", dir / "manifests", dir}) {
    std::error_code ec;
    std::vector<fs::path> stale;
    std::map<std::string, std::pair<fs::file_time_type, fs::path>> newest;  // version hex -> partial
    for (fs::directory_iterator it(sub, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!IsTempName(name)) continue;
      const std::string hex = sub == dir / "versions" ? TransferTempVersion(name) : "";
      std::error_code fec;
      if (!hex.empty() && fs::is_regular_file(it->path() / "model.safetensors", fec)) {
        const auto t = fs::last_write_time(it->path() / "model.safetensors", fec);
        auto [n, inserted] = newest.try_emplace(hex, t, it->path());
        if (inserted) continue;
        if (!fec && t > n->second.first) {
          stale.push_back(n->second.second);
          n->second = {t, it->path()};
          continue;
        }
      }
      stale.push_back(it->path());
    }
    for (const auto& p : stale) fs::remove_all(p, ec);
    for (const auto& [hex, partial] : newest) {
      const fs::path to = sub / (hex + std::string(kPartialSuffix));
      fs::remove_all(to, ec);
      if (::rename(partial.second.c_str(), to.c_str()) != 0) fs::remove_all(partial.second, ec);
    }
  }
}

// Deletes what DIR no longer needs after an activation: every version directory except the
// `keep` most recently activated versions (by the "activated_ns" their manifests record) and
// the received directories they were prepared from, and the manifests of deleted versions.
// The active version is always kept. Best effort: what cannot be deleted now is tried again
// after the next activation. REQUIRES: the caller holds DIR/.lock.
void PruneVersions(const fs::path& dir, int keep, const store::Digest& active) {
  if (keep <= 0) return;
  struct Activated {
    int64_t at = 0;
    std::string id, served;
    fs::path manifest;
  };
  std::vector<Activated> all;
  std::error_code ec;
  for (fs::directory_iterator it(dir / "manifests", ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() != ".json" || IsTempName(p.filename().string())) continue;
    Activated a;
    a.manifest = p;
    a.id = p.stem().string();
    auto text = ReadSmallFile(p);
    if (text.ok()) {
      const auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) {
        if (auto t = j.find("activated_ns"); t != j.end() && t->is_number_integer()) a.at = t->get<int64_t>();
        if (auto v = j.find("version"); v != j.end() && v->is_string()) a.served = v->get<std::string>();
      }
    }
    all.push_back(std::move(a));
  }
  std::sort(all.begin(), all.end(), [](const Activated& x, const Activated& y) { return x.at > y.at; });
  std::set<std::string> kept = {active.Hex()};
  for (size_t i = 0; i < all.size() && i < static_cast<size_t>(keep); ++i) {
    kept.insert(all[i].id);
    if (!all[i].served.empty()) kept.insert(all[i].served);
  }
  for (const auto& a : all) {
    if (kept.count(a.id) == 0) fs::remove(a.manifest, ec);
  }
  std::vector<fs::path> doomed;
  for (fs::directory_iterator it(dir / "versions", ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!IsTempName(name) && kept.count(name) == 0) doomed.push_back(it->path());
  }
  for (const auto& p : doomed) fs::remove_all(p, ec);
}

}  // namespace

struct Receiver::Sockets {
  zmq::context_t ctx;
  zmq::socket_t dealer;
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
};

namespace receiver_detail {

// What the receiver knows about its publisher link.
struct Link {
  Clock::time_point last_heard;         // last message of any kind from the publisher
  std::deque<uint64_t> retired_epochs;  // at most kRetiredEpochsKept

  bool Retired(uint64_t epoch) const {
    return std::find(retired_epochs.begin(), retired_epochs.end(), epoch) != retired_epochs.end();
  }
  void Retire(uint64_t epoch) {
    if (epoch == 0 || Retired(epoch)) return;
    retired_epochs.push_back(epoch);
    if (retired_epochs.size() > kRetiredEpochsKept) retired_epochs.pop_front();
  }
};

}  // namespace receiver_detail

// What DIR/current holds and how it came to be (from DIR/manifests/<active>.json).
struct Receiver::ActiveState {
  std::optional<store::Digest> active;  // DIR/current
  std::optional<store::Digest> served;  // the served version it was activated from
  std::string layout;                   // the layout it was activated in
  std::optional<store::Digest> proven;  // adapter mode
  receiver_detail::Link link;
};

// One thing that arrived: an announcement or a reply. `msg.bytes` views `payload`.
struct Incoming {
  bool announce = false;
  Message msg;
  zmq::message_t header, payload;
};

namespace {

enum class Outcome { kDone, kNewer };

// Where delta mode may copy tensors from: the active version's received file.
struct ReuseSource {
  std::shared_ptr<SafetensorsFile> file;
  std::map<store::Digest, const TensorInfo*> by_digest;
};

class Session {
 public:
  Session(const ReceiverOptions& o, zmq::socket_t& dealer, zmq::socket_t& sub, receiver_detail::Link* link)
      : o_(o), dealer_(dealer), sub_(sub), link_(link) {}

  Status Send(const Message& m, std::span<const std::byte> payload) {
    try {
      const bool has = HasPayload(m.type);
      dealer_.send(Frame(EncodeHeader(m)), has ? zmq::send_flags::sndmore : zmq::send_flags::none);
      if (has) dealer_.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
    } catch (const zmq::error_t& e) {
      return Status::IOError("sync receiver " + o_.id + ": cannot send to " + o_.endpoints.requests + ": " + e.what());
    }
    return Status::OK();
  }
  Status SendWithId(MsgType type, const Message& base) {
    Message m = base;
    m.type = type;
    return Send(m, {reinterpret_cast<const std::byte*>(o_.id.data()), o_.id.size()});
  }

  // Waits (until `deadline`) for the next announcement or reply.
  Status Next(Clock::time_point deadline, Incoming* in) {
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        return Status::Unavailable("sync receiver " + o_.id + ": no reply from " + o_.endpoints.requests +
                                   " within " + std::to_string(o_.timeout_ms) + " ms");
      }
      zmq::pollitem_t items[] = {{dealer_.handle(), 0, ZMQ_POLLIN, 0}, {sub_.handle(), 0, ZMQ_POLLIN, 0}};
      try {
        zmq::poll(items, 2, std::chrono::milliseconds(left));
        if (items[1].revents & ZMQ_POLLIN) {
          zmq::message_t m;
          if (sub_.recv(m, zmq::recv_flags::dontwait)) {
            bool more = m.more();
            while (more) {  // drain a malformed multipart announcement
              zmq::message_t extra;
              if (!sub_.recv(extra, zmq::recv_flags::dontwait)) break;
              more = extra.more();
            }
            auto a = Decode(Bytes(m), nullptr);
            if (a.ok() && a->type == MsgType::kAnnounce && !link_->Retired(a->epoch)) {
              link_->last_heard = Clock::now();
              in->announce = true;
              in->msg = *a;
              return Status::OK();
            }
          }
        }
        if (items[0].revents & ZMQ_POLLIN) {
          std::vector<zmq::message_t> parts;
          for (;;) {
            zmq::message_t p;
            if (!dealer_.recv(p, zmq::recv_flags::dontwait)) break;
            const bool more = p.more();
            if (parts.size() < 3) parts.push_back(std::move(p));
            if (!more) break;
          }
          if (parts.empty()) continue;
          link_->last_heard = Clock::now();
          if (parts.size() > 2) {
            return Status::Corruption("sync receiver " + o_.id + ": reply from " + o_.endpoints.requests +
                                      " has more than 2 frames");
          }
          in->announce = false;
          in->header = std::move(parts[0]);
          if (parts.size() == 2) in->payload = std::move(parts[1]);
          const std::span<const std::byte> payload = Bytes(in->payload);
          auto m = Decode(Bytes(in->header), parts.size() == 2 ? &payload : nullptr);
          if (!m.ok()) {
            return Status::Corruption("sync receiver " + o_.id + ": from " + o_.endpoints.requests + ": " +
                                      m.status().message());
          }
          in->msg = std::move(*m);
          return Status::OK();
        }
      } catch (const zmq::error_t& e) {
        return Status::IOError("sync receiver " + o_.id + ": " + o_.endpoints.requests + ": " + e.what());
      }
    }
  }

  Status PublisherError(const Message& m) const {
    const uint32_t c = (m.code > 0 && m.code <= static_cast<uint32_t>(StatusCode::kUnavailable))
                           ? m.code
                           : static_cast<uint32_t>(StatusCode::kInternal);
    return Status(static_cast<StatusCode>(c), "publisher " + o_.endpoints.requests + ": " + m.payload);
  }

  Clock::time_point Deadline() const { return Clock::now() + std::chrono::milliseconds(o_.timeout_ms); }

  // Sends HELLO and waits for the MANIFEST; `json` receives its text.
  Result<Manifest> Hello(std::string* json) {
    FERRY_RETURN_IF_ERROR(SendWithId(MsgType::kHello, {}));
    const auto deadline = Deadline();
    for (;;) {
      Incoming in;
      FERRY_RETURN_IF_ERROR(Next(deadline, &in));
      if (in.announce) continue;  // we are asking for the latest anyway
      if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
      if (in.msg.type != MsgType::kManifest) continue;  // stale reply to an abandoned request
      auto m = DecodeManifest(in.msg.payload);
      if (!m.ok()) return Status::Corruption("from " + o_.endpoints.requests + ": " + m.status().message());
      if (m->sequence != in.msg.sequence || m->epoch != in.msg.epoch) {
        return Status::Corruption("sync MANIFEST from " + o_.endpoints.requests +
                                  ": header and JSON sequence or epoch differ");
      }
      if (m->tensors.empty()) return Status::Corruption("sync MANIFEST from " + o_.endpoints.requests + ": no tensors");
      *json = std::move(in.msg.payload);
      return *m;
    }
  }

  // Fetches bytes [start, size) of one item of `size` bytes with at most `credit` FETCHes in
  // flight, handing each chunk, in order, to `sink(bytes, offset within the item)`.
  template <typename Sink>
  Result<Outcome> Fetch(const Manifest& man, ItemKind kind, uint32_t index, uint64_t start, uint64_t size,
                        Sink&& sink) {
    uint64_t next = start, received = start;
    uint32_t in_flight = 0;
    auto deadline = Deadline();
    while (received < size) {
      while (in_flight < o_.credit && next < size) {
        Message f;
        f.type = MsgType::kFetch;
        f.version = man.version;
        f.kind = kind;
        f.index = index;
        f.offset = next;
        f.length = static_cast<uint32_t>(std::min<uint64_t>(o_.chunk_bytes, size - next));
        FERRY_RETURN_IF_ERROR(Send(f, {}));
        next += f.length;
        ++in_flight;
      }
      Incoming in;
      FERRY_RETURN_IF_ERROR(Next(deadline, &in));
      if (in.announce) {
        if (in.msg.epoch != man.epoch || in.msg.sequence > man.sequence) return Outcome::kNewer;
        continue;
      }
      if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
      if (in.msg.type != MsgType::kChunk || !(in.msg.version == man.version) || in.msg.kind != kind ||
          in.msg.index != index || in.msg.offset != received) {
        continue;  // stale
      }
      if (in.msg.epoch != man.epoch) return Outcome::kNewer;  // answered by a restarted publisher
      const uint64_t expect = std::min<uint64_t>(o_.chunk_bytes, size - received);
      const auto bytes = Bytes(in.payload);
      if (bytes.size() != expect) {
        return Status::Corruption("sync CHUNK from " + o_.endpoints.requests + ": " + std::to_string(bytes.size()) +
                                  " bytes at offset " + std::to_string(received) + ", expected " + std::to_string(expect));
      }
      FERRY_RETURN_IF_ERROR(sink(bytes, received));
      received += bytes.size();
      bytes_received_ += bytes.size();
      --in_flight;
      deadline = Deadline();
      if (o_.on_chunk_for_testing) o_.on_chunk_for_testing(in.msg.offset);
      if (in.msg.sequence > man.sequence) return Outcome::kNewer;
    }
    return Outcome::kDone;
  }

  // Reads the `row.nbytes` bytes of `in` at `in_offset` in pieces, hashing them and handing
  // each piece and its offset within the tensor to `sink` (a Status). True when the bytes
  // have the row's digest, false when they differ or cannot be read; sink errors pass through.
  template <typename Sink>
  static Result<bool> ReadAndHash(int in, uint64_t in_offset, const store::TensorRow& row, std::vector<std::byte>& piece,
                                  Sink&& sink) {
    store::TensorDigester digester(row.dtype, row.shape);
    FERRY_ASSIGN_OR_RETURN(bool read, HashRange(in, in_offset, row.nbytes, digester, piece, sink));
    return read && digester.Finish() == row.digest;
  }

  // Feeds the `length` bytes of `in` at `in_offset` to `digester` in pieces, handing each
  // piece and its offset within the range to `sink`. False when they cannot all be read.
  template <typename Sink>
  static Result<bool> HashRange(int in, uint64_t in_offset, uint64_t length, store::TensorDigester& digester,
                                std::vector<std::byte>& piece, Sink&& sink) {
    piece.resize(kCopyPieceBytes);
    for (uint64_t done = 0; done < length;) {
      const size_t want = static_cast<size_t>(std::min<uint64_t>(piece.size(), length - done));
      const ssize_t n = ::pread(in, piece.data(), want, static_cast<off_t>(in_offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      const std::span<const std::byte> bytes(piece.data(), static_cast<size_t>(n));
      digester.Update(bytes);
      FERRY_RETURN_IF_ERROR(sink(bytes, done));
      done += static_cast<uint64_t>(n);
    }
    return true;
  }

  // Copies tensor `row` from the reuse source into `fd` at `offset`, hashing as it goes.
  // True when the copied bytes have the row's digest (false: fetch it instead).
  Result<bool> CopyLocal(const ReuseSource& src, const TensorInfo& info, const store::TensorRow& row, int fd,
                         uint64_t offset, const fs::path& path, std::vector<std::byte>& piece) {
    const auto range = src.file->RangeOf(info);
    if (range.length != row.nbytes) return false;
    return ReadAndHash(range.fd, range.offset, row, piece, [&](std::span<const std::byte> bytes, uint64_t done) {
      return PwriteAll(fd, bytes, offset + done, path);
    });
  }

  // Makes a killed receiver's partial transfer of `version` (versions/<id>.partial, see
  // RemoveStaleTemporaries) the temporary directory `tmp` when its model.safetensors is laid
  // out exactly as this transfer's (same header bytes, same size): a rename, nothing is
  // copied; its other files are removed. Partial transfers of other versions are deleted.
  // True when taken over.
  static bool TakeOverPartial(const fs::path& versions, const store::Digest& version, const std::string& header,
                              uint64_t total, const fs::path& tmp) {
    const std::string mine = version.Hex() + std::string(kPartialSuffix);
    std::error_code ec;
    std::vector<fs::path> others;
    bool found = false;
    for (fs::directory_iterator it(versions, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name == mine) {
        found = true;
      } else if (name.size() == 32 + kPartialSuffix.size() && name.ends_with(kPartialSuffix)) {
        others.push_back(it->path());
      }
    }
    for (const auto& p : others) fs::remove_all(p, ec);
    if (!found) return false;
    const fs::path partial = versions / mine;
    bool usable = false;
    {
      FdGuard in(::open((partial / "model.safetensors").c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
      struct stat st;
      if (in.get() >= 0 && ::fstat(in.get(), &st) == 0 && S_ISREG(st.st_mode) &&
          static_cast<uint64_t>(st.st_size) == total) {
        std::string head(header.size(), '\0');
        usable = ::pread(in.get(), head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()) && head == header;
      }
    }
    if (usable) {
      for (fs::directory_iterator it(partial, ec), end; !ec && it != end; it.increment(ec)) {
        if (it->path().filename() != "model.safetensors") fs::remove_all(it->path(), ec);
      }
      usable = !ec && ::rmdir(tmp.c_str()) == 0 && ::rename(partial.c_str(), tmp.c_str()) == 0;
      if (!usable) fs::create_directory(tmp, ec);  // keep `tmp` for a fresh transfer
    }
    if (!usable) fs::remove_all(partial, ec);
    return usable;
  }

  // What a partial transfer `fd` holds of the tensor `row` at `offset`: all of it (its
  // range has no hole and its bytes have the row's digest: returns row.nbytes), or the
  // whole chunks a killed receiver had written before the first hole (SEEK_HOLE) in the
  // range, unverified: the caller hashes them ahead of the bytes it fetches, so a damaged
  // prefix only fails the tensor's digest and costs a refetch of the whole tensor. Chunks
  // arrive in order and each is written whole at its place, so every byte before the
  // first hole was written; the hole's offset is rounded up to the file system's block, so
  // it is rounded down to a chunk boundary here, which is exact when chunks are at least a
  // block (smaller chunks: only complete tensors are kept). 0 without holes support.
  static uint64_t HeldPrefix(int fd, const store::TensorRow& row, uint64_t offset, uint64_t chunk_bytes,
                             std::vector<std::byte>& piece) {
    const off_t hole = ::lseek(fd, static_cast<off_t>(offset), SEEK_HOLE);
    if (hole < 0 || static_cast<uint64_t>(hole) >= offset + row.nbytes) {
      Result<bool> same =
          ReadAndHash(fd, offset, row, piece, [](std::span<const std::byte>, uint64_t) { return Status::OK(); });
      return same.ok() && *same ? row.nbytes : 0;
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_blksize <= 0 || chunk_bytes < static_cast<uint64_t>(st.st_blksize)) return 0;
    const uint64_t written = static_cast<uint64_t>(hole) - offset;
    return written - written % chunk_bytes;
  }

  // Receives `man` into DIR/versions/<id> (verified). Returns kNewer when abandoned.
  Result<Outcome> Receive(const Manifest& man, const ReuseSource* reuse, SyncResult* result) {
    const fs::path versions = o_.dir / "versions";
    const fs::path final_dir = versions / man.version.Hex();
    std::error_code ec;
    if (fs::is_directory(final_dir, ec)) return Outcome::kDone;  // verified by an earlier sync
    std::string tmpl = (versions / (man.version.Hex() + ".tmp-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return Status::IOError(tmpl + ": cannot create temporary version directory: " + std::strerror(errno));
    }
    const fs::path tmp = tmpl;
    TempDirGuard guard(tmp);
    Result<Outcome> r = ReceiveInto(man, reuse, result, tmp);
    if (r.ok() && *r == Outcome::kDone) {
      guard.Release();  // renamed into place
    } else if (!r.ok()) {
      // The publisher went away or failed: keep what arrived for the next attempt (the
      // bytes are verified again before they are used).
      const fs::path partial = versions / (man.version.Hex() + std::string(kPartialSuffix));
      fs::remove_all(partial, ec);
      if (fs::is_regular_file(tmp / "model.safetensors", ec) && ::rename(tmp.c_str(), partial.c_str()) == 0) {
        guard.Release();
      }
    }
    return r;  // kNewer: the guard deletes the abandoned transfer
  }

  // Receive's transfer into the temporary directory `tmp`, renamed into place when verified.
  Result<Outcome> ReceiveInto(const Manifest& man, const ReuseSource* reuse, SyncResult* result, const fs::path& tmp) {
    const fs::path versions = o_.dir / "versions";
    const fs::path final_dir = versions / man.version.Hex();

    // Lay the safetensors file out in full, then write every chunk at its place.
    std::vector<TensorSpec> specs;
    for (const auto& t : man.tensors) specs.push_back({t.name, t.dtype, t.shape});
    FERRY_ASSIGN_OR_RETURN(std::string header, SerializeSafetensorsHeader(specs, {{"format", "pt"}}));
    const fs::path model = tmp / "model.safetensors";
    uint64_t total = header.size();
    for (const auto& t : man.tensors) {
      if (t.nbytes > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) - total) {
        return Status::Corruption("sync MANIFEST of version " + man.version.Hex() + ": tensor " + t.name +
                                  " makes the file larger than a file offset can address");
      }
      total += t.nbytes;
    }
    const bool resuming = TakeOverPartial(versions, man.version, header, total, tmp);
    FdGuard fd(resuming ? ::open(model.c_str(), O_RDWR | O_CLOEXEC)
                        : ::open(model.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (fd.get() < 0) return Status::IOError(model.string() + ": cannot create: " + std::strerror(errno));
    if (!resuming) {
      FERRY_RETURN_IF_ERROR(
          PwriteAll(fd.get(), {reinterpret_cast<const std::byte*>(header.data()), header.size()}, 0, model));
      if (::ftruncate(fd.get(), static_cast<off_t>(total)) != 0) {
        return Status::IOError(model.string() + ": cannot size to " + std::to_string(total) + " bytes: " +
                               std::strerror(errno));
      }
    }
    std::vector<std::byte> piece;
    uint64_t begin = header.size();
    for (uint32_t i = 0; i < man.tensors.size(); ++i) {
      const auto& row = man.tensors[i];
      const uint64_t at = begin;
      begin += row.nbytes;
      uint64_t held = 0;  // bytes of this tensor a killed transfer left (see HeldPrefix)
      if (resuming && row.nbytes > 0) {
        held = HeldPrefix(fd.get(), row, at, o_.chunk_bytes, piece);
        if (held == row.nbytes) {
          result->bytes_resumed += row.nbytes;
          continue;
        }
      }
      if (reuse != nullptr) {
        if (auto it = reuse->by_digest.find(row.digest); it != reuse->by_digest.end()) {
          FERRY_ASSIGN_OR_RETURN(bool same, CopyLocal(*reuse, *it->second, row, fd.get(), at, model, piece));
          if (same) {
            result->bytes_reused += row.nbytes;
            continue;
          }
        }
      }
      for (int attempt = 0;; ++attempt) {
        store::TensorDigester digester(row.dtype, row.shape);
        // First attempt of a resumed tensor: hash the prefix already on disk, fetch the rest.
        uint64_t start = 0;
        if (attempt == 0 && held > 0) {
          FERRY_ASSIGN_OR_RETURN(bool read, HashRange(fd.get(), at, held, digester, piece,
                                                      [](std::span<const std::byte>, uint64_t) { return Status::OK(); }));
          if (!read) {  // unreadable: fetch the whole tensor, as if nothing were held
            held = 0;
            --attempt;
            continue;
          }
          start = held;
        }
        if (row.nbytes > 0) {
          FERRY_ASSIGN_OR_RETURN(Outcome oc, Fetch(man, ItemKind::kTensor, i, start, row.nbytes,
                                                   [&](std::span<const std::byte> bytes, uint64_t offset) {
                                                     digester.Update(bytes);
                                                     return PwriteAll(fd.get(), bytes, at + offset, model);
                                                   }));
          if (oc == Outcome::kNewer) return oc;
        }
        if (digester.Finish() == row.digest) {
          result->bytes_resumed += start;
          break;
        }
        if (attempt >= o_.max_retries || row.nbytes == 0) {
          return Status::Corruption("sync: tensor " + row.name + " of version " + man.version.Hex() +
                                    " still fails its digest after " + std::to_string(attempt) + " refetches");
        }
        ++result->refetches;
      }
    }
    if (::fsync(fd.get()) != 0) return Status::IOError(model.string() + ": fsync failed: " + std::strerror(errno));

    std::string aux;
    for (uint32_t i = 0; i < man.aux.size(); ++i) {
      const auto& file = man.aux[i];
      for (int attempt = 0;; ++attempt) {
        aux.assign(file.size, '\0');
        if (!aux.empty()) {
          FERRY_ASSIGN_OR_RETURN(Outcome oc, Fetch(man, ItemKind::kAux, i, 0, aux.size(),
                                                   [&](std::span<const std::byte> bytes, uint64_t offset) {
                                                     std::memcpy(aux.data() + offset, bytes.data(), bytes.size());
                                                     return Status::OK();
                                                   }));
          if (oc == Outcome::kNewer) return oc;
        }
        if (store::AuxDigest(aux) == file.digest) break;
        if (attempt >= o_.max_retries || aux.empty()) {
          return Status::Corruption("sync: aux file " + file.name + " of version " + man.version.Hex() +
                                    " still fails its digest after " + std::to_string(attempt) + " refetches");
        }
        ++result->refetches;
      }
      FERRY_RETURN_IF_ERROR(
          WriteNewFile(tmp / file.name, {reinterpret_cast<const std::byte*>(aux.data()), aux.size()}));
    }
    // Every tensor and aux file written above was hashed as it was written and matched its
    // manifest digest, and the safetensors header was laid out from the manifest, so the
    // manifest digest over those verified rows is the id of exactly these files (what
    // store::HashPath would compute, without reading everything a second time).
    const store::Digest computed = store::ManifestDigest(man.tensors, man.aux);
    if (!(computed == man.version)) {
      return Status::Corruption("sync: received files of version " + man.version.Hex() + " hash to " +
                                computed.Hex() + " (the manifest is inconsistent with its tensors)");
    }
    FERRY_RETURN_IF_ERROR(FsyncDir(tmp));
    FERRY_RETURN_IF_ERROR(RenameIntoPlace(tmp, final_dir));
    return Outcome::kDone;
  }

  // Renames the directory `tmp` to `final_dir` (removing `tmp` instead when an identical,
  // verified `final_dir` already exists) and syncs the parent.
  static Status RenameIntoPlace(const fs::path& tmp, const fs::path& final_dir) {
    std::error_code ec;
    if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
      const int err = errno;
      if (!fs::is_directory(final_dir, ec)) {
        return Status::IOError(final_dir.string() + ": cannot rename the version into place: " + std::strerror(err));
      }
      fs::remove_all(tmp, ec);
    }
    return FsyncDir(final_dir.parent_path());
  }

  Status Activate(const store::Digest& v) {
    const fs::path link = o_.dir / (".current.tmp-" + std::to_string(::getpid()));
    ::unlink(link.c_str());
    const std::string target = "versions/" + v.Hex();
    if (::symlink(target.c_str(), link.c_str()) != 0) {
      return Status::IOError(link.string() + ": cannot create symlink: " + std::strerror(errno));
    }
    const fs::path current = o_.dir / "current";
    if (::rename(link.c_str(), current.c_str()) != 0) {
      const int err = errno;
      ::unlink(link.c_str());
      return Status::IOError(current.string() + ": cannot switch the active version: " + std::strerror(err));
    }
    return FsyncDir(o_.dir);
  }

  Status Ack(const store::Digest& v, const store::Digest& computed, const std::optional<store::Digest>& proven) {
    Message m;
    m.version = v;
    m.computed = computed;
    m.proven = proven;
    FERRY_RETURN_IF_ERROR(SendWithId(MsgType::kAck, m));
    const auto deadline = Deadline();
    for (;;) {
      Incoming in;
      FERRY_RETURN_IF_ERROR(Next(deadline, &in));
      if (in.announce) continue;
      if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
      if (in.msg.type == MsgType::kAcked && in.msg.version == v) return Status::OK();
    }
  }

  uint64_t bytes_received() const { return bytes_received_; }

 private:
  const ReceiverOptions& o_;
  zmq::socket_t& dealer_;
  zmq::socket_t& sub_;
  receiver_detail::Link* link_;
  uint64_t bytes_received_ = 0;
};

// The delta source for the active version `active`: DIR/manifests/<active>.json names the
// served version whose directory holds the received bytes. Null when there is none.
std::unique_ptr<ReuseSource> OpenReuseSource(const fs::path& dir, const store::Digest& active) {
  auto text = ReadSmallFile(dir / "manifests" / (active.Hex() + ".json"));
  if (!text.ok()) return nullptr;
  auto man = DecodeManifest(*text);
  if (!man.ok()) return nullptr;
  auto file = SafetensorsFile::Open(dir / "versions" / man->version.Hex() / "model.safetensors");
  if (!file.ok()) return nullptr;
  auto src = std::make_unique<ReuseSource>();
  src->file = *file;
  for (const auto& row : man->tensors) {
    const TensorInfo* info = src->file->Find(row.name);
    if (info != nullptr && info->nbytes() == row.nbytes && info->dtype == row.dtype && info->shape == row.shape) {
      src->by_digest.emplace(row.digest, info);
    }
  }
  return src;
}

ActivationPlan PlanFor(const Manifest& man, const ReceiverOptions& o) {
  ActivationPlan plan;
  plan.served_kind = man.mode == PublishMode::kAdapter ? store::VersionKind::kAdapter : man.kind;
  plan.served_layout = man.layout;
  plan.merged_version = man.merged_version;
  plan.want_layout = o.layout;
  plan.base_dir = o.base_dir;
  return plan;
}

}  // namespace

Result<std::optional<store::Digest>> ActiveVersion(const fs::path& dir) {
  std::error_code ec;
  const fs::path current = dir / "current";
  if (!fs::is_symlink(fs::symlink_status(current, ec))) return std::optional<store::Digest>();
  const fs::path target = fs::read_symlink(current, ec);
  if (ec || target.parent_path() != "versions") {
    return Status::Corruption(current.string() + ": not a link to versions/<id>");
  }
  auto d = store::Digest::FromHex(target.filename().string());
  if (!d.ok()) return Status::Corruption(current.string() + ": link target " + target.string() + " is not a version id");
  return std::optional<store::Digest>(*d);
}

Receiver::Receiver(ReceiverOptions options)
    : options_(std::move(options)), state_(std::make_unique<ActiveState>()) {}

Receiver::~Receiver() {
  sockets_.reset();
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

Status Receiver::ResetDealer() {
  const ReceiverOptions& opt = options_;
  try {
    zmq::socket_t s(sockets_->ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::maxmsgsize, kMaxFrameBytes);
    s.set(zmq::sockopt::linger, 0);
    // "<id>/<random>": lets the publisher attribute every request to this receiver; a fresh
    // suffix per socket so a reconnect never collides with a connection being torn down.
    s.set(zmq::sockopt::routing_id, opt.id + "/" + RandomHex());
    if (opt.heartbeat_ivl_ms > 0) {
      s.set(zmq::sockopt::heartbeat_ivl, opt.heartbeat_ivl_ms);
      s.set(zmq::sockopt::heartbeat_timeout, opt.heartbeat_ivl_ms * 5);
    }
    if (opt.curve) {
      s.set(zmq::sockopt::curve_serverkey, opt.curve->server_public_key);
      s.set(zmq::sockopt::curve_publickey, opt.curve->public_key);
      s.set(zmq::sockopt::curve_secretkey, opt.curve->secret_key);
    }
    s.connect(opt.endpoints.requests);
    sockets_->dealer = std::move(s);
  } catch (const zmq::error_t& e) {
    return Status::InvalidArgument("sync receiver " + opt.id + ": cannot connect to " + opt.endpoints.requests + ": " +
                                   e.what());
  }
  reset_dealer_ = false;
  return Status::OK();
}

Result<std::unique_ptr<Receiver>> Receiver::Connect(ReceiverOptions o) {
  if (!IsValidReceiverId(o.id)) return Status::InvalidArgument("sync receiver: id \"" + o.id + "\" is not [A-Za-z0-9._-]{1,64}");
  if (o.chunk_bytes == 0 || o.chunk_bytes > kMaxChunkBytes) {
    return Status::InvalidArgument("sync receiver: chunk_bytes must be 1.." + std::to_string(kMaxChunkBytes));
  }
  if (o.credit == 0 || o.credit > 1024) return Status::InvalidArgument("sync receiver: credit must be 1..1024");
  if (o.timeout_ms <= 0) return Status::InvalidArgument("sync receiver: timeout_ms must be positive");
  if (o.max_retries < 0) return Status::InvalidArgument("sync receiver: max_retries must be >= 0");
  if (o.keep_versions < 0) return Status::InvalidArgument("sync receiver: keep_versions must be >= 0");
  if (!IsTensorLayout(o.layout)) {
    return Status::InvalidArgument("sync receiver: layout \"" + std::string(LayoutName(o.layout)) + "\" must be hf or fused");
  }
  FERRY_RETURN_IF_ERROR(CheckEndpoints(o.endpoints, o.curve.has_value()));
  std::error_code ec;
  for (const char* sub : {"versions", "manifests"}) {
    fs::create_directories(o.dir / sub, ec);
    if (ec) return Status::IOError((o.dir / sub).string() + ": cannot create: " + ec.message());
  }
  std::unique_ptr<Receiver> r(new Receiver(std::move(o)));
  const ReceiverOptions& opt = r->options_;
  const fs::path lock = opt.dir / ".lock";
  r->lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (r->lock_fd_ < 0) return Status::IOError(lock.string() + ": cannot open lock file: " + std::strerror(errno));
  if (::flock(r->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      return Status::FailedPrecondition("sync receiver " + opt.id + ": directory " + opt.dir.string() +
                                        " is in use by another receiver (" + lock.string() + " is locked)");
    }
    return Status::IOError(lock.string() + ": cannot lock: " + std::strerror(err));
  }
  RemoveStaleTemporaries(opt.dir);
  FERRY_ASSIGN_OR_RETURN(r->state_->active, ActiveVersion(opt.dir));
  if (r->state_->active) {
    // How the active version came to be, for already-active checks and delta copies.
    auto text = ReadSmallFile(opt.dir / "manifests" / (r->state_->active->Hex() + ".json"));
    if (text.ok()) {
      auto man = DecodeManifest(*text);
      const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (man.ok() && j.is_object()) {
        r->state_->served = man->version;
        r->state_->layout = j.value("activated_layout", std::string());
        if (j.contains("proven") && j["proven"].is_string()) {
          auto p = store::Digest::FromHex(j["proven"].get<std::string>());
          if (p.ok()) r->state_->proven = *p;
        }
      }
    }
  }
  r->sockets_ = std::make_unique<Sockets>();
  try {
    zmq::socket_t& sub = r->sockets_->sub;
    sub.set(zmq::sockopt::maxmsgsize, kMaxFrameBytes);
    sub.set(zmq::sockopt::linger, 0);
    if (opt.heartbeat_ivl_ms > 0) {
      sub.set(zmq::sockopt::heartbeat_ivl, opt.heartbeat_ivl_ms);
      sub.set(zmq::sockopt::heartbeat_timeout, opt.heartbeat_ivl_ms * 5);
    }
    if (opt.curve) {
      sub.set(zmq::sockopt::curve_serverkey, opt.curve->server_public_key);
      sub.set(zmq::sockopt::curve_publickey, opt.curve->public_key);
      sub.set(zmq::sockopt::curve_secretkey, opt.curve->secret_key);
    }
    std::string topic(kMagic);
    topic.push_back(static_cast<char>(MsgType::kAnnounce));
    sub.set(zmq::sockopt::subscribe, topic);
    sub.connect(opt.endpoints.updates);  // subscribe first (clone pattern)
  } catch (const zmq::error_t& e) {
    return Status::InvalidArgument("sync receiver " + opt.id + ": cannot connect to " + opt.endpoints.updates + ": " +
                                   e.what());
  }
  FERRY_RETURN_IF_ERROR(r->ResetDealer());
  r->state_->link.last_heard = Clock::now();
  return r;
}

Result<SyncResult> Receiver::SyncLatest() {
  if (reset_dealer_) FERRY_RETURN_IF_ERROR(ResetDealer());
  auto r = SyncLatestOnce();
  // After a failure, replies to requests still queued for an unreachable or restarted
  // publisher must not be taken for answers to the next ones (Lazy Pirate: new socket).
  if (!r.ok()) reset_dealer_ = true;
  return r;
}

Result<SyncResult> Receiver::SyncLatestOnce() {
  Session s(options_, sockets_->dealer, sockets_->sub, &state_->link);
  SyncResult result;
  ActiveState& st = *state_;
  for (int round = 0; round < 64; ++round) {
    std::string json;
    FERRY_ASSIGN_OR_RETURN(Manifest man, s.Hello(&json));
    result.version = man.version;
    result.sequence = man.sequence;
    result.epoch = man.epoch;
    const ActivationPlan plan = PlanFor(man, options_);
    if (st.active && st.served == man.version && st.layout == LayoutName(options_.layout)) {
      result.already_active = true;
    } else {
      std::unique_ptr<ReuseSource> reuse;
      if (man.mode == PublishMode::kDelta && st.active) reuse = OpenReuseSource(options_.dir, *st.active);
      FERRY_ASSIGN_OR_RETURN(Outcome oc, s.Receive(man, reuse.get(), &result));
      if (oc == Outcome::kNewer) {
        ++result.skipped;
        continue;
      }
      store::Digest activate = man.version;
      std::optional<store::Digest> proven;
      if (NeedsPreparation(plan)) {
        const fs::path versions = options_.dir / "versions";
        static std::atomic<uint64_t> counter{0};
        const fs::path tmp = versions / (man.version.Hex() + ".prepare.tmp-" + std::to_string(::getpid()) + "-" +
                                         std::to_string(counter.fetch_add(1)));
        auto prepared = PrepareActivation(versions / man.version.Hex(), plan, tmp);
        if (!prepared.ok()) {
          std::error_code ec;
          fs::remove_all(tmp, ec);
          // Something missing locally (a tensor the adapter targets is not in the base) is
          // not the publisher lacking a version: kNotFound from SyncLatest means only that.
          if (prepared.status().code() == StatusCode::kNotFound) {
            return Status::FailedPrecondition(prepared.status().message());
          }
          return prepared.status();
        }
        if (plan.served_kind == store::VersionKind::kAdapter && !(prepared->proven == plan.merged_version)) {
          std::error_code ec;
          fs::remove_all(tmp, ec);
          return Status::Corruption("sync: the local merge of adapter " + man.version.Hex() + " onto " +
                                    options_.base_dir.value_or(fs::path()).string() + " is " +
                                    (prepared->proven ? prepared->proven->Hex() : std::string("unproven")) +
                                    ", the publisher's merged version is " + man.merged_version->Hex());
        }
        FERRY_RETURN_IF_ERROR(Session::RenameIntoPlace(tmp, versions / prepared->id.Hex()));
        activate = prepared->id;
        proven = prepared->proven;
      }
      nlohmann::json record = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
      record["activated_as"] = activate.Hex();
      record["activated_ns"] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count();
      record["activated_layout"] = std::string(LayoutName(options_.layout));
      if (proven) record["proven"] = proven->Hex();
      FERRY_RETURN_IF_ERROR(
          WriteFileAtomic(options_.dir / "manifests" / (activate.Hex() + ".json"), record.dump()));
      FERRY_RETURN_IF_ERROR(s.Activate(activate));
      st.active = activate;
      PruneVersions(options_.dir, options_.keep_versions, activate);
      st.served = man.version;
      st.layout = std::string(LayoutName(options_.layout));
      st.proven = proven;
    }
    sequence_ = man.sequence;
    if (epoch_ != man.epoch) st.link.Retire(epoch_);
    epoch_ = man.epoch;
    result.computed = man.version;  // Receive() checked the manifest digest of the verified files == version
    result.active = *st.active;
    result.proven = st.proven;
    result.bytes_received = s.bytes_received();
    FERRY_RETURN_IF_ERROR(s.Ack(man.version, result.computed, st.proven));
    return result;
  }
  return Status::Unavailable("sync receiver " + options_.id + ": versions kept changing mid-transfer (64 skips)");
}

Result<SyncResult> Receiver::WaitForNewer(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto silence = std::chrono::milliseconds(options_.timeout_ms);
  // A publisher already silent for `silence` (an outage a caller is riding out) gets the whole
  // call to speak up again, so that retrying in a loop waits instead of spinning.
  const bool silent_before = Clock::now() >= state_->link.last_heard + silence;
  for (;;) {
    const auto now = Clock::now();
    const auto wake = silent_before ? deadline : std::min(deadline, state_->link.last_heard + silence);
    const auto wait = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count());
    zmq::pollitem_t item = {sockets_->sub.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(wait));
      if (item.revents & ZMQ_POLLIN) {
        zmq::message_t m;
        if (!sockets_->sub.recv(m, zmq::recv_flags::dontwait)) continue;
        bool more = m.more();
        while (more) {
          zmq::message_t extra;
          if (!sockets_->sub.recv(extra, zmq::recv_flags::dontwait)) break;
          more = extra.more();
        }
        auto a = Decode(Bytes(m), nullptr);
        if (!a.ok() || a->type != MsgType::kAnnounce || state_->link.Retired(a->epoch)) continue;
        state_->link.last_heard = Clock::now();
        if (a->sequence == 0) continue;  // a beacon: alive, nothing published yet
        if (a->epoch != epoch_) {
          reset_dealer_ = true;  // a restarted publisher: drop anything queued for the old one
          return SyncLatest();
        }
        if (a->sequence > sequence_) return SyncLatest();
        continue;
      }
    } catch (const zmq::error_t& e) {
      return Status::IOError("sync receiver " + options_.id + ": " + options_.endpoints.updates + ": " + e.what());
    }
    const auto after = Clock::now();
    if (after >= state_->link.last_heard + silence && (!silent_before || after >= deadline)) {
      return Status::Unavailable("sync receiver " + options_.id + ": nothing heard from the publisher at " +
                                 options_.endpoints.requests + " (announcements on " + options_.endpoints.updates +
                                 ") for " + std::to_string(options_.timeout_ms) + " ms: publisher gone");
    }
    if (after >= deadline) {
      return Status::NotFound("sync receiver " + options_.id + ": no newer version announced within " +
                              std::to_string(timeout_ms) + " ms");
    }
  }
}

}  // namespace ferry::sync
