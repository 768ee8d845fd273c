// Serving and pacing of the sync publisher (sync/publisher_internal.h): publishing a version
// (its sequence, manifest, ANNOUNCE and kPublished event; the served set bounded, in adapter
// mode with the base the newest adapter applies to), offered snapshots of derived versions,
// follow mode, HELLO answered with a MANIFEST, FETCH with a CHUNK sent without a copy from a
// mapped store object (verified against its digest once) or an offered snapshot (checked
// against its row once), and the rate cap.
#include <algorithm>
#include <thread>

#include "sync/publisher_internal.h"
#include "sync/snapshot.h"

namespace ferry::sync {
namespace {

constexpr size_t kMaxPublishedKept = 8;                  // versions served (in adapter mode the pinned base among them)
constexpr size_t kMaxCachedItems = 4;                    // tensors/aux files kept open for chunking
constexpr size_t kMaxOfferedKept = 2;                    // offered snapshots waiting to be published (Offer)
constexpr size_t kMaxSnapshotsKept = 2;                  // published versions whose offered snapshot is kept
constexpr size_t kMaxVerifiedKept = 1u << 16;            // object digests verified once, then trusted
constexpr uint64_t kPaceBurstBytes = uint64_t{1} << 20;  // credit a capped publisher may bank

// A message that sends `text` without copying it, keeping it alive until ZeroMQ is done:
// replies queued for a peer (up to kSendHwm) share the publisher's buffers, so a peer
// that asks and never reads costs references, not copies.
zmq::message_t Shared(std::shared_ptr<const std::string> text) {
  auto* keep = new std::shared_ptr<const std::string>(std::move(text));
  return zmq::message_t(
      const_cast<char*>((*keep)->data()), (*keep)->size(),
      [](void*, void* hint) { delete static_cast<std::shared_ptr<const std::string>*>(hint); }, keep);
}

}  // namespace

void Publisher::Impl::Offer(const store::Digest& version, std::shared_ptr<const Snapshot> snapshot) {
  std::lock_guard lock(offer_mu_);
  std::erase_if(offered_, [&](const auto& o) { return o.first == version; });
  offered_.emplace_back(version, std::move(snapshot));
  while (offered_.size() > kMaxOfferedKept) offered_.erase(offered_.begin());
}

std::shared_ptr<const Snapshot> Publisher::Impl::TakeOffered(const store::Digest& v) {
  std::lock_guard lock(offer_mu_);
  for (auto it = offered_.begin(); it != offered_.end(); ++it) {
    if (it->first == v) {
      std::shared_ptr<const Snapshot> s = std::move(it->second);
      offered_.erase(it);
      return s;
    }
  }
  return nullptr;
}

Status Publisher::Impl::PublishFirst() {
  if (options_.offer_first) Offer(options_.offer_first->manifest_id(), options_.offer_first);
  if (!options_.publish_first) return Status::OK();
  return DoPublish(*options_.publish_first).status();
}

void Publisher::Impl::Follow() {
  // The run's latest record first (cheap): only a change there can change what to publish.
  auto latest = store_->Latest(*options_.follow_run);
  if (!latest.ok() || !latest->has_value() || **latest == follow_latest_) return;
  follow_latest_ = **latest;
  auto newest = NewestPublishable(*store_, *options_.follow_run, options_.mode);
  if (!newest.ok() || !newest->has_value() || **newest == follow_tried_) return;
  if (!published_.empty() && published_.back().record.id == **newest) return;
  follow_tried_ = **newest;  // once: a version that fails to publish fails again
  (void)DoPublish(**newest);
}

bool Publisher::Impl::Served(const store::Digest& v) const {
  return std::any_of(published_.begin(), published_.end(), [&](const Published& p) { return p.record.id == v; });
}

Publisher::Impl::Published* Publisher::Impl::Find(const store::Digest& v) {
  for (auto& p : published_) {
    if (p.record.id == v) return &p;
  }
  return nullptr;
}

void Publisher::Impl::Seal(Published& p, store::VersionRecord rec, uint64_t seq) const {
  Manifest man = ManifestFor(rec);
  man.sequence = seq;
  man.epoch = epoch_;
  man.mode = options_.mode;
  man.merged_version = p.merged_version;
  if (p.base_itself) man.base_version = rec.id;
  p.manifest_json = std::make_shared<const std::string>(EncodeManifest(man));
  p.record = std::move(rec);
  p.sequence = seq;
}

Result<store::Digest> Publisher::Impl::FindMerged(const store::VersionRecord& rec) {
  FERRY_ASSIGN_OR_RETURN(std::vector<store::VersionRecord> all, store_->ListVersions(std::nullopt));
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->kind == store::VersionKind::kMerged && it->layout == Layout::kHf && it->adapter_version == rec.id &&
        it->base_version == rec.base_version) {
      return it->id;
    }
  }
  return Status::FailedPrecondition("version " + rec.id.Hex() + ": adapter mode needs a stored merged version of it " +
                                    "(kind merged, layout hf, adapter_version " + rec.id.Hex() + ", base_version " +
                                    rec.base_version->Hex() + "); record the merged version first");
}

Result<uint64_t> Publisher::Impl::DoPublish(const store::Digest& v) {
  FERRY_ASSIGN_OR_RETURN(store::VersionRecord rec, store_->GetVersion(v.Hex()));
  if (rec.tensors.empty()) return Status::FailedPrecondition("version " + v.Hex() + " has no tensors to sync");
  const bool is_adapter = rec.kind == store::VersionKind::kAdapter;
  Published p;
  if (options_.mode == PublishMode::kAdapter && !is_adapter) {
    // The base the adapters apply to, served whole (receivers that hold it copy it locally).
    if (rec.kind == store::VersionKind::kMerged) {
      return Status::FailedPrecondition("version " + v.Hex() +
                                        " is of kind merged: adapter mode publishes adapter "
                                        "versions (and the base, kind base or full); publish its adapter");
    }
    p.base_itself = true;
  } else if (options_.mode == PublishMode::kAdapter) {
    if (!rec.base_version) {
      return Status::FailedPrecondition("version " + v.Hex() +
                                        ": adapter has no base_version recorded; adapter mode "
                                        "needs the base the receivers keep");
    }
    FERRY_ASSIGN_OR_RETURN(p.merged_version, FindMerged(rec));
  } else if (is_adapter) {
    return Status::FailedPrecondition("version " + v.Hex() +
                                      " is an adapter: publish it in adapter mode, or publish "
                                      "its merged version in " +
                                      std::string(PublishModeName(options_.mode)) + " mode");
  }
  if (options_.mode != PublishMode::kAdapter && rec.derived) {
    p.snapshot = TakeOffered(v);
    if (!p.snapshot) {
      return Status::FailedPrecondition("version " + v.Hex() +
                                        " is derived (recorded by its digests only) and no snapshot of it was "
                                        "offered (Publisher::Offer): its merged tensors have no bytes to serve");
    }
  }
  const uint64_t seq = sequence_.load() + 1;
  if (options_.mode == PublishMode::kAdapter && is_adapter && !Served(*rec.base_version)) {
    // The base this adapter applies to, never published here (a run followed from its
    // adapters on): served too, unannounced, for receivers without a base of their own to
    // fetch (a HELLO naming it). Left out when the store cannot serve it; such a receiver
    // is then told it needs a local base.
    auto base = store_->GetVersion(rec.base_version->Hex());
    if (base.ok() && !base->tensors.empty() && !base->derived &&
        (base->kind == store::VersionKind::kBase || base->kind == store::VersionKind::kFull)) {
      Published b;
      b.base_itself = true;
      Seal(b, std::move(*base), seq);
      published_.push_back(std::move(b));
    }
  }
  Seal(p, std::move(rec), seq);
  published_.push_back(std::move(p));
  while (published_.size() > kMaxPublishedKept) {
    // The oldest goes, but in adapter mode not the base the newest adapter applies to: a
    // receiver joining without a base fetches it (HELLO naming it) to merge onto.
    const Published& newest = published_.back();
    const std::optional<store::Digest> base = newest.base_itself ? newest.record.id : newest.record.base_version;
    auto victim = published_.begin();
    if (options_.mode == PublishMode::kAdapter && base && victim->base_itself && victim->record.id == *base) ++victim;
    published_.erase(victim);
  }
  size_t snapshots = 0;
  for (auto it = published_.rbegin(); it != published_.rend(); ++it) {
    if (it->snapshot && ++snapshots > kMaxSnapshotsKept) it->snapshot.reset();
  }
  cache_.clear();
  sequence_.store(seq);
  store::Event e;
  e.type = store::Event::Type::kPublished;
  e.version = v;
  e.detail = "sync sequence " + std::to_string(seq) + " epoch " + std::to_string(epoch_) + " mode " +
             std::string(PublishModeName(options_.mode)) + " on " + options_.endpoints.requests;
  (void)store_->AddEvent(e);  // history only; serving does not depend on it
  Announce();                 // the newest version: the one just published
  return seq;
}

void Publisher::Impl::HandleHello(const zmq::message_t& rid, const std::optional<store::Digest>& wanted) {
  if (published_.empty()) return ReplyError(rid, Status::NotFound("sync HELLO: nothing published yet"));
  auto it = published_.rbegin();
  if (wanted) {
    it = std::find_if(published_.rbegin(), published_.rend(),
                      [&](const Published& p) { return p.record.id == *wanted; });
    if (it == published_.rend()) {
      return ReplyError(rid, Status::NotFound("sync HELLO: version " + wanted->Hex() + " is not served"));
    }
  }
  const Published& p = *it;
  Message r;
  r.type = MsgType::kManifest;
  r.sequence = p.sequence;
  r.epoch = epoch_;
  ReplyOwned(rid, r, Shared(p.manifest_json));
}

Result<Tensor> Publisher::Impl::FromSnapshot(Published& p, uint32_t index) {
  const store::TensorRow& row = p.record.tensors[index];
  const std::string what = "sync: tensor '" + row.name + "' of version " + p.record.id.Hex();
  if (!p.snapshot) {
    return Status::NotFound(what +
                            " is no longer served (its bytes were held in memory until newer versions "
                            "replaced it); take the latest version");
  }
  auto t = p.snapshot->checkpoint().Get(row.name);
  if (!t.ok()) return Status::Corruption(what + ": not in the snapshot offered for it");
  if (p.snapshot_verified.count(index) == 0) {
    if (t->dtype() != row.dtype || t->shape() != row.shape) {
      return Status::Corruption(what +
                                ": the offered snapshot's tensor has another dtype or shape than "
                                "the store records; not served");
    }
    const store::Digest d = store::TensorDigest(*t);
    if (d != row.digest) {
      return Status::Corruption(what + ": the offered bytes hash to " + d.Hex() + " but the store records " +
                                row.digest.Hex() + "; not served");
    }
    p.snapshot_verified.insert(index);
  }
  return std::move(*t);
}

// Tensors are mapped store objects; each object is verified against its digest the first
// time it is loaded. A derived version's rows whose object the store lacks come from its
// offered snapshot.
Result<const Tensor*> Publisher::Impl::Item(Published& p, ItemKind kind, uint32_t index) {
  const auto key = std::make_tuple(p.record.id, kind, index);
  if (auto it = cache_.find(key); it != cache_.end()) return &it->second;
  if (cache_.size() >= kMaxCachedItems) cache_.clear();
  if (kind == ItemKind::kTensor) {
    if (index >= p.record.tensors.size()) {
      return Status::InvalidArgument("sync FETCH: tensor index " + std::to_string(index) + " out of range");
    }
    const store::TensorRow& row = p.record.tensors[index];
    const bool verify = verified_.count(row.digest) == 0;
    Result<Tensor> read = store_->ReadTensor(row, verify);
    if (!read.ok() && read.status().code() == StatusCode::kFailedPrecondition && p.record.derived) {
      FERRY_ASSIGN_OR_RETURN(Tensor t, FromSnapshot(p, index));
      auto& slot = cache_[key];
      slot = std::move(t);
      return &slot;
    }
    FERRY_ASSIGN_OR_RETURN(Tensor t, std::move(read));
    if (verify) {
      if (verified_.size() >= kMaxVerifiedKept) verified_.clear();
      verified_.insert(row.digest);
    }
    auto& slot = cache_[key];
    slot = std::move(t);
    return &slot;
  }
  if (index >= p.record.aux.size()) {
    return Status::InvalidArgument("sync FETCH: aux index " + std::to_string(index) + " out of range");
  }
  FERRY_ASSIGN_OR_RETURN(std::string read, store_->ReadAux(p.record.aux[index]));
  auto text = std::make_shared<const std::string>(std::move(read));
  // The tensor owns the text: a copy of it keeps the bytes alive (see HandleFetch).
  FERRY_ASSIGN_OR_RETURN(Tensor t,
                         Tensor::Wrap(DType::kU8, {static_cast<int64_t>(text->size())},
                                      {reinterpret_cast<const std::byte*>(text->data()), text->size()}, text));
  auto& slot = cache_[key];
  slot = std::move(t);
  return &slot;
}

void Publisher::Impl::HandleFetch(const zmq::message_t& rid, const Message& m) {
  Published* p = Find(m.version);
  if (p == nullptr) {
    return ReplyError(rid, Status::NotFound("sync FETCH: version " + m.version.Hex() + " is not published here"));
  }
  auto found = Item(*p, m.kind, m.index);
  if (!found.ok()) return ReplyError(rid, found.status());
  const Tensor& tensor = **found;
  const std::span<const std::byte> item = tensor.bytes();
  if (m.offset >= item.size()) {
    return ReplyError(rid, Status::InvalidArgument("sync FETCH: offset " + std::to_string(m.offset) +
                                                   " beyond the item's " + std::to_string(item.size()) + " bytes"));
  }
  const size_t n = std::min<uint64_t>(m.length, item.size() - m.offset);
  Pace(n);
  Message r;
  r.type = MsgType::kChunk;
  r.version = m.version;
  r.kind = m.kind;
  r.index = m.index;
  r.offset = m.offset;
  r.sequence = sequence_.load();
  r.epoch = epoch_;
  std::span<const std::byte> bytes = item.subspan(m.offset, n);
  std::vector<std::byte> flipped;
  if (corrupt_.load() > 0) {
    corrupt_.fetch_sub(1);
    flipped.assign(bytes.begin(), bytes.end());
    flipped[0] ^= std::byte{0x01};
    bytes = flipped;
  } else {
    // Zero-copy: ZeroMQ sends straight from the mapped store object (a tensor) or the
    // shared text (an aux file). A heap copy of the Tensor keeps the mapping or text alive
    // until ZeroMQ releases the message (the cache may drop its own reference sooner).
    auto* keep = new Tensor(tensor);
    zmq::message_t payload(
        const_cast<std::byte*>(bytes.data()), bytes.size(),
        [](void*, void* hint) { delete static_cast<Tensor*>(hint); }, keep);
    return ReplyOwned(rid, r, std::move(payload));
  }
  Reply(rid, r, bytes);
}

// A token bucket holding at most kPaceBurstBytes of credit; sending `n` bytes waits until
// they are covered.
void Publisher::Impl::Pace(size_t n) {
  if (options_.max_send_bytes_per_sec == 0) return;
  const double rate = static_cast<double>(options_.max_send_bytes_per_sec);
  const auto now = Clock::now();
  if (pace_last_ == Clock::time_point()) pace_last_ = now;
  pace_tokens_ = std::min(static_cast<double>(kPaceBurstBytes),
                          pace_tokens_ + rate * std::chrono::duration<double>(now - pace_last_).count());
  pace_last_ = now;
  pace_tokens_ -= static_cast<double>(n);
  if (pace_tokens_ < 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(-pace_tokens_ / rate));
    pace_tokens_ = 0;
    pace_last_ = Clock::now();
  }
}

}  // namespace ferry::sync
