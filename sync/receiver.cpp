// The sync receiver (sync/receiver.h): options, Connect, one SyncLatest from HELLO to ACK
// (receive, prepare, record, switch, prune, acknowledge) and WaitForNewer. The transport,
// the transfer, resuming and the directory are in the receiver_*.cpp files
// (sync/receiver_internal.h).
#include "sync/receiver.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <random>

#include "sync/activate.h"
#include "sync/receiver_internal.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;
using namespace receiver_internal;  // NOLINT: this part's own internals

std::string RandomHex() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 0; i < 16; ++i) s[i] = kHex[(v >> (60 - 4 * i)) & 0xf];
  return s;
}

// Whether `man` serves a base model: kind base, or in adapter mode the base the adapters
// apply to (served before the first adapter).
bool ServesBase(const Manifest& man) {
  return man.kind == store::VersionKind::kBase ||
         (man.mode == PublishMode::kAdapter && man.kind != store::VersionKind::kAdapter);
}

ActivationPlan PlanFor(const Manifest& man, const ReceiverOptions& o) {
  ActivationPlan plan;
  plan.served_kind = man.kind;
  plan.served_layout = man.layout;
  plan.merged_version = man.merged_version;
  plan.want_layout = o.layout;
  plan.base_dir = o.base_dir;
  if (man.kind == store::VersionKind::kAdapter && man.base_version) {
    // The publisher's base as this receiver received it (verified, served before the
    // first adapter) is exactly the base the adapter applies to: preferred to --base.
    std::error_code ec;
    const fs::path received = o.dir / "versions" / man.base_version->Hex();
    if (fs::is_directory(received, ec)) plan.base_dir = received;
  }
  return plan;
}

// Adapter mode: receives the base that adapter `man` applies to into DIR/versions/<base>,
// not activated, when this receiver holds no base to merge onto (none received earlier, no
// ReceiverOptions::base_dir): a receiver that joins after the first adapter gets it this way.
// The publisher keeps serving that base while its adapters are served.
Result<Outcome> ReceiveMissingBase(Session& s, const ReceiverOptions& o, const Manifest& man, SyncResult* result) {
  if (man.mode != PublishMode::kAdapter || man.kind != store::VersionKind::kAdapter || !man.base_version ||
      o.base_dir) {
    return Outcome::kDone;
  }
  const store::Digest& want = *man.base_version;
  std::error_code ec;
  if (fs::is_directory(o.dir / "versions" / want.Hex(), ec)) return Outcome::kDone;
  std::string json;
  Result<Manifest> base = s.Hello(&json, want);
  if (!base.ok()) {
    if (base.status().code() != StatusCode::kNotFound) return base.status();
    return Status::FailedPrecondition("sync receiver " + o.id + ": adapter " + man.version.Hex() + " applies to base " +
                                      want.Hex() +
                                      ", which this receiver has not received and the publisher does not serve (" +
                                      base.status().message() + "); it needs a local base (ReceiverOptions::base_dir)");
  }
  if (base->epoch != man.epoch) return Outcome::kNewer;  // a restarted publisher: start over
  if (!ServesBase(*base)) {
    return Status::Corruption("sync receiver " + o.id + ": asked " + o.endpoints.requests + " for base " + want.Hex() +
                              ", got a manifest of kind " + std::string(store::KindName(base->kind)));
  }
  s.Pin(want);
  Result<Outcome> received = ReceiveVersion(s, o, *base, nullptr, result);
  s.Pin(std::nullopt);
  return received;
}

// Applies the socket options every receiver socket shares.
void SetCommonOptions(zmq::socket_t& s, const ReceiverOptions& o) {
  s.set(zmq::sockopt::maxmsgsize, kMaxFrameBytes);
  s.set(zmq::sockopt::linger, 0);
  if (o.heartbeat_ivl_ms > 0) {
    s.set(zmq::sockopt::heartbeat_ivl, o.heartbeat_ivl_ms);
    s.set(zmq::sockopt::heartbeat_timeout, o.heartbeat_ivl_ms * 5);
  }
}

}  // namespace

struct Receiver::Sockets {
  zmq::context_t ctx;
  zmq::socket_t dealer;
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
};

struct Receiver::ActiveState {
  receiver_internal::ActiveState dir;  // what DIR/current holds
  Link link;
};

Receiver::Receiver(ReceiverOptions options) : options_(std::move(options)), state_(std::make_unique<ActiveState>()) {}

Receiver::~Receiver() {
  sockets_.reset();
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

Status Receiver::ResetDealer() {
  const ReceiverOptions& opt = options_;
  try {
    zmq::socket_t s(sockets_->ctx, zmq::socket_type::dealer);
    SetCommonOptions(s, opt);
    // "<id>/<random>": lets the publisher attribute every request to this receiver; a fresh
    // suffix per socket so a reconnect never collides with a connection being torn down.
    s.set(zmq::sockopt::routing_id, opt.id + "/" + RandomHex());
    if (opt.curve) FERRY_RETURN_IF_ERROR(SecureClientSocket(s.handle(), *opt.curve));
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
  if (!IsValidReceiverId(o.id))
    return Status::InvalidArgument("sync receiver: id \"" + o.id + "\" is not [A-Za-z0-9._-]{1,64}");
  if (o.chunk_bytes == 0 || o.chunk_bytes > kMaxChunkBytes) {
    return Status::InvalidArgument("sync receiver: chunk_bytes must be 1.." + std::to_string(kMaxChunkBytes));
  }
  if (o.credit == 0 || o.credit > kMaxCredit) {
    return Status::InvalidArgument("sync receiver: credit must be 1.." + std::to_string(kMaxCredit));
  }
  if (o.timeout_ms <= 0) return Status::InvalidArgument("sync receiver: timeout_ms must be positive");
  if (o.max_retries < 0) return Status::InvalidArgument("sync receiver: max_retries must be >= 0");
  if (o.keep_versions < 0) return Status::InvalidArgument("sync receiver: keep_versions must be >= 0");
  if (!IsTensorLayout(o.layout)) {
    return Status::InvalidArgument("sync receiver: layout \"" + std::string(LayoutName(o.layout)) +
                                   "\" must be hf or fused");
  }
  FERRY_RETURN_IF_ERROR(CheckEndpoints(o.endpoints, o.curve.has_value()));
  if (o.curve) {
    if (Status s = CheckCurve(*o.curve, CurveRole::kClient); !s.ok()) return s.WithContext("sync receiver");
  }
  std::unique_ptr<Receiver> r(new Receiver(std::move(o)));
  const ReceiverOptions& opt = r->options_;
  FERRY_ASSIGN_OR_RETURN(r->lock_fd_, LockDirectory(opt.dir, opt.id));
  RemoveStaleTemporaries(opt.dir);
  FERRY_ASSIGN_OR_RETURN(r->state_->dir, LoadActiveState(opt.dir));
  r->sockets_ = std::make_unique<Sockets>();
  try {
    zmq::socket_t& sub = r->sockets_->sub;
    SetCommonOptions(sub, opt);
    if (opt.curve) FERRY_RETURN_IF_ERROR(SecureClientSocket(sub.handle(), *opt.curve));
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

bool Receiver::heard_from_publisher() const { return state_->link.heard; }

Result<SyncResult> Receiver::SyncLatest() {
  if (reset_dealer_) FERRY_RETURN_IF_ERROR(ResetDealer());
  auto r = SyncLatestOnce();
  // After a failure, replies to requests still queued for an unreachable or restarted
  // publisher must not be taken for answers to the next ones (Lazy Pirate: new socket).
  if (!r.ok()) reset_dealer_ = true;
  return r;
}

Status Receiver::ReportEngine(const store::Digest& version, const std::string& report) {
  if (reset_dealer_) FERRY_RETURN_IF_ERROR(ResetDealer());
  Session s(options_, sockets_->dealer, sockets_->sub, &state_->link);
  Status st = s.ReportEngine(version, report);
  if (!st.ok()) reset_dealer_ = true;
  return st;
}

Result<SyncResult> Receiver::SyncLatestOnce() {
  Session s(options_, sockets_->dealer, sockets_->sub, &state_->link);
  SyncResult result;
  receiver_internal::ActiveState& st = state_->dir;
  for (int round = 0; round < 64; ++round) {
    std::string json;
    FERRY_ASSIGN_OR_RETURN(Manifest man, s.Hello(&json));
    served_mode_ = man.mode;
    result.version = man.version;
    result.sequence = man.sequence;
    result.epoch = man.epoch;
    if (st.active && st.served == man.version && st.layout == options_.layout) {
      result.already_active = true;
      if (man.kind == store::VersionKind::kAdapter && !st.adapter_base_dir) {
        st.adapter_base_dir = PlanFor(man, options_).base_dir;  // a restarted receiver
      }
    } else {
      FERRY_ASSIGN_OR_RETURN(Outcome base, ReceiveMissingBase(s, options_, man, &result));
      if (base == Outcome::kNewer) {
        ++result.skipped;
        continue;
      }
      const ActivationPlan plan = PlanFor(man, options_);
      std::unique_ptr<ReuseSource> reuse;
      if (man.mode == PublishMode::kDelta && st.active) {
        reuse = OpenActiveReuse(options_.dir, *st.active);
      } else if (ServesBase(man) && options_.base_dir) {
        reuse = OpenBaseReuse(*options_.base_dir);
      }
      FERRY_ASSIGN_OR_RETURN(Outcome oc, ReceiveVersion(s, options_, man, reuse.get(), &result));
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
                                    plan.base_dir.value_or(fs::path()).string() + " is " +
                                    (prepared->proven ? prepared->proven->Hex() : std::string("unproven")) +
                                    ", the publisher's merged version is " + man.merged_version->Hex());
        }
        FERRY_RETURN_IF_ERROR(RenameIntoPlace(tmp, versions / prepared->id.Hex()));
        if (plan.served_kind == store::VersionKind::kAdapter) st.adapter_base_dir = plan.base_dir;
        activate = prepared->id;
        proven = prepared->proven;
      }
      FERRY_RETURN_IF_ERROR(WriteActivationRecord(options_.dir, json, activate, options_.layout, proven));
      FERRY_RETURN_IF_ERROR(SwitchCurrent(options_.dir, activate));
      st.active = activate;
      PruneVersions(options_.dir, options_.keep_versions, activate);
      st.served = man.version;
      st.layout = options_.layout;
      st.proven = proven;
    }
    sequence_ = man.sequence;
    if (epoch_ != man.epoch) state_->link.Retire(epoch_);
    epoch_ = man.epoch;
    result.computed = man.version;  // ReceiveVersion checked the manifest digest of the verified files == version
    result.active = *st.active;
    result.proven = st.proven;
    result.adapter_base_dir = st.adapter_base_dir;
    result.bytes_received = s.bytes_received();
    FERRY_RETURN_IF_ERROR(s.Ack(man.version, result.computed, st.proven));
    return result;
  }
  return Status::Unavailable("sync receiver " + options_.id + ": versions kept changing mid-transfer (64 skips)");
}

Result<SyncResult> Receiver::WaitForNewer(int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto silence = std::chrono::milliseconds(options_.timeout_ms);
  Link& link = state_->link;
  // A publisher already silent for `silence` (an outage a caller is riding out) gets the whole
  // call to speak up again, so that retrying in a loop waits instead of spinning.
  const bool silent_before = Clock::now() >= link.last_heard + silence;
  for (;;) {
    const auto now = Clock::now();
    const auto wake = silent_before ? deadline : std::min(deadline, link.last_heard + silence);
    const auto wait = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count());
    zmq::pollitem_t item = {sockets_->sub.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(wait));
      if (item.revents & ZMQ_POLLIN) {
        auto a = ReadAnnouncement(sockets_->sub, link);
        if (!a) continue;
        link.Heard();
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
    if (after >= link.last_heard + silence && (!silent_before || after >= deadline)) {
      return Status::Unavailable("sync receiver " + options_.id + ": nothing heard from the publisher at " +
                                 options_.endpoints.requests + " (announcements on " + options_.endpoints.updates +
                                 ") for " + std::to_string(options_.timeout_ms) + " ms: publisher gone" +
                                 SilenceHint(options_, link));
    }
    if (after >= deadline) {
      return Status::NotFound("sync receiver " + options_.id + ": no newer version announced within " +
                              std::to_string(timeout_ms) + " ms");
    }
  }
}

}  // namespace ferry::sync
