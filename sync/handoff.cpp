// In-process hand-off of snapshots (sync/handoff.h).
#include "sync/handoff.h"

#include <chrono>
#include <utility>
#include <vector>

#include "sync/protocol.h"

namespace ferry::sync {

Result<store::Digest> ComputeManifestId(const Snapshot& snapshot) {
  const Checkpoint& ckpt = snapshot.checkpoint();
  std::vector<store::TensorRow> rows;
  rows.reserve(ckpt.size());
  for (const std::string& name : ckpt.names()) {  // sorted by name
    auto t = ckpt.Get(name);
    if (!t.ok()) return Status::Internal("snapshot " + snapshot.manifest_id().Hex() + ": " + t.status().message());
    store::TensorRow row;
    row.name = name;
    row.dtype = t->dtype();
    row.shape = t->shape();
    row.digest = store::TensorDigest(*t);
    rows.push_back(std::move(row));
  }
  return store::ManifestDigest(rows, store::AuxFileRows(snapshot.aux_files()));  // aux_files() is sorted by name
}

SnapshotChannel::SnapshotChannel(store::Store* store, std::string run, bool sync_events)
    : store_(store), run_(std::move(run)), sync_events_(sync_events) {}

SnapshotChannel::~SnapshotChannel() { Close(); }

Result<uint64_t> SnapshotChannel::Publish(std::shared_ptr<const Snapshot> snapshot) {
  if (!snapshot) return Status::InvalidArgument("snapshot channel '" + run_ + "': cannot publish a null snapshot");
  const store::Digest id = snapshot->manifest_id();
  uint64_t sequence = 0;
  {
    std::lock_guard lock(mu_);
    if (closed_) return Status::FailedPrecondition("snapshot channel '" + run_ + "' is closed");
    sequence = latest_.sequence + 1;
    latest_ = Handoff{sequence, std::move(snapshot)};
    ids_.push_back(Published{sequence, id});
    if (ids_.size() > kAcknowledgeable) ids_.pop_front();
  }
  cv_.notify_all();
  if (store_ != nullptr) {
    store::Event e;
    e.type = store::Event::Type::kPublished;
    e.version = id;
    e.detail = "in-process sequence " + std::to_string(sequence) + " on channel '" + run_ + "'";
    (void)store_->AddEvent(e, sync_events_);  // history only; the hand-off does not depend on it
  }
  return sequence;
}

std::optional<Handoff> SnapshotChannel::Latest() const {
  std::lock_guard lock(mu_);
  if (latest_.sequence == 0) return std::nullopt;
  return latest_;
}

Result<Handoff> SnapshotChannel::WaitForNewer(uint64_t after_sequence, int timeout_ms) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(0, timeout_ms));
  std::unique_lock lock(mu_);
  cv_.wait_until(lock, deadline, [&] { return latest_.sequence > after_sequence || closed_; });
  if (latest_.sequence > after_sequence) return latest_;
  if (closed_) {
    return Status::FailedPrecondition("snapshot channel '" + run_ + "' was closed while waiting for a sequence after " +
                                      std::to_string(after_sequence));
  }
  return Status::NotFound("snapshot channel '" + run_ + "': nothing newer than sequence " +
                          std::to_string(after_sequence) + " was published within the timeout of " +
                          std::to_string(timeout_ms) + " ms");
}

void SnapshotChannel::Close() {
  {
    std::lock_guard lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

Status SnapshotChannel::Acknowledge(std::string_view receiver_id, uint64_t sequence, const store::Digest& computed) {
  if (!IsValidReceiverId(receiver_id)) {
    return Status::InvalidArgument("snapshot channel '" + run_ + "': receiver id '" + std::string(receiver_id) +
                                   "' does not match [A-Za-z0-9._-]{1,64}");
  }
  std::optional<store::Digest> version;
  uint64_t latest = 0;
  {
    std::lock_guard lock(mu_);
    latest = latest_.sequence;
    for (const Published& p : ids_) {
      if (p.sequence == sequence) version = p.id;
    }
  }
  if (!version) {
    return Status::NotFound("snapshot channel '" + run_ + "': sequence " + std::to_string(sequence) +
                            " acknowledged by '" + std::string(receiver_id) + "' is not one of the last " +
                            std::to_string(kAcknowledgeable) + " published (latest: " + std::to_string(latest) + ")");
  }
  const bool match = computed == *version;
  if (store_ != nullptr) {
    store::Event e;
    e.type = store::Event::Type::kAcknowledged;
    e.receiver = std::string(receiver_id);
    e.version = *version;
    e.computed = computed;
    e.detail = match ? "receiver verified the manifest digest" : "MISMATCH: receiver computed " + computed.Hex();
    FERRY_RETURN_IF_ERROR(store_->AddEvent(e, sync_events_));
  }
  if (!match) {
    return Status::Corruption("snapshot channel '" + run_ + "': receiver '" + std::string(receiver_id) +
                              "' computed manifest " + computed.Hex() + " for sequence " + std::to_string(sequence) +
                              " but the snapshot's manifest is " + version->Hex());
  }
  return Status::OK();
}

}  // namespace ferry::sync
