// The receiver's transport session (sync/receiver_internal.h): requests over the DEALER,
// replies and announcements in, credit-based FETCH, ACK.
#include <algorithm>

#include "sync/receiver_internal.h"

namespace ferry::sync::receiver_internal {
namespace {

zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

}  // namespace

bool Link::Retired(uint64_t epoch) const {
  return std::find(retired_epochs.begin(), retired_epochs.end(), epoch) != retired_epochs.end();
}

void Link::Retire(uint64_t epoch) {
  if (epoch == 0 || Retired(epoch)) return;
  retired_epochs.push_back(epoch);
  if (retired_epochs.size() > kRetiredEpochsKept) retired_epochs.pop_front();
}

void Link::Heard() {
  last_heard = Clock::now();
  heard = true;
}

std::string SilenceHint(const ReceiverOptions& o, const Link& link) {
  if (!o.curve || link.heard) return "";
  return "; nothing has come from the publisher yet: it is not running, or it does not allow this receiver's CURVE "
         "public key " +
         o.curve->public_key + " (not in its allow-list)";
}

std::optional<Message> ReadAnnouncement(zmq::socket_t& sub, const Link& link) {
  zmq::message_t m;
  if (!sub.recv(m, zmq::recv_flags::dontwait)) return std::nullopt;
  bool more = m.more();
  while (more) {  // drain a malformed multipart announcement
    zmq::message_t extra;
    if (!sub.recv(extra, zmq::recv_flags::dontwait)) break;
    more = extra.more();
  }
  auto a = Decode(Bytes(m), nullptr);
  if (!a.ok() || a->type != MsgType::kAnnounce || link.Retired(a->epoch)) return std::nullopt;
  return std::move(*a);
}

Status Session::Send(const Message& m, std::span<const std::byte> payload) {
  try {
    const bool has = HasPayload(m.type);
    dealer_.send(Frame(EncodeHeader(m)), has ? zmq::send_flags::sndmore : zmq::send_flags::none);
    if (has) dealer_.send(zmq::message_t(payload.data(), payload.size()), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    return Status::IOError("sync receiver " + o_.id + ": cannot send to " + o_.endpoints.requests + ": " + e.what());
  }
  return Status::OK();
}

Status Session::SendWithId(MsgType type, const Message& base) {
  Message m = base;
  m.type = type;
  return Send(m, {reinterpret_cast<const std::byte*>(o_.id.data()), o_.id.size()});
}

Status Session::Next(Clock::time_point deadline, Incoming* in) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return Status::Unavailable("sync receiver " + o_.id + ": no reply from " + o_.endpoints.requests + " within " +
                                 std::to_string(o_.timeout_ms) + " ms" + SilenceHint(o_, *link_));
    }
    zmq::pollitem_t items[] = {{dealer_.handle(), 0, ZMQ_POLLIN, 0}, {sub_.handle(), 0, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, 2, std::chrono::milliseconds(left));
      if (items[1].revents & ZMQ_POLLIN) {
        if (auto a = ReadAnnouncement(sub_, *link_)) {
          link_->Heard();
          in->announce = true;
          in->msg = std::move(*a);
          return Status::OK();
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
        link_->Heard();
        if (parts.size() > 2) {
          return Status::Corruption("sync receiver " + o_.id + ": reply from " + o_.endpoints.requests +
                                    " has more than 2 frames");
        }
        if (abandoned_ > 0) {
          --abandoned_;
          continue;
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

Status Session::PublisherError(const Message& m) const {
  const uint32_t c = (m.code > 0 && m.code <= static_cast<uint32_t>(StatusCode::kUnavailable))
                         ? m.code
                         : static_cast<uint32_t>(StatusCode::kInternal);
  return Status(static_cast<StatusCode>(c), "publisher " + o_.endpoints.requests + ": " + m.payload);
}

Result<Manifest> Session::Hello(std::string* json, const std::optional<store::Digest>& wanted) {
  Message hello;
  hello.wanted = wanted;
  FERRY_RETURN_IF_ERROR(SendWithId(MsgType::kHello, hello));
  const auto deadline = Deadline();
  for (;;) {
    Incoming in;
    FERRY_RETURN_IF_ERROR(Next(deadline, &in));
    if (in.announce) continue;  // the reply names what was asked for either way
    if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
    if (in.msg.type != MsgType::kManifest) continue;  // stale reply to an abandoned request
    auto m = DecodeManifest(in.msg.payload);
    if (!m.ok()) return Status::Corruption("from " + o_.endpoints.requests + ": " + m.status().message());
    if (m->sequence != in.msg.sequence || m->epoch != in.msg.epoch) {
      return Status::Corruption("sync MANIFEST from " + o_.endpoints.requests +
                                ": header and JSON sequence or epoch differ");
    }
    if (m->tensors.empty()) return Status::Corruption("sync MANIFEST from " + o_.endpoints.requests + ": no tensors");
    if (wanted && !(m->version == *wanted)) continue;  // a reply to an earlier HELLO
    *json = std::move(in.msg.payload);
    return *m;
  }
}

Result<Outcome> Session::Fetch(const Manifest& man, ItemKind kind, uint32_t index, uint64_t start, uint64_t size,
                               const PieceSink& sink) {
  return FetchRun(
      man, {RunItem{kind, index, start, size}},
      [&](size_t, zmq::message_t& chunk, uint64_t offset) { return sink(Bytes(chunk), offset); },
      [](size_t) { return Status::OK(); });
}

Result<Outcome> Session::FetchRun(const Manifest& man, const std::vector<RunItem>& items, const RunSink& sink,
                                  const std::function<Status(size_t)>& done) {
  struct Asked {
    size_t item;
    uint64_t offset;
    uint64_t length;
  };
  std::deque<Asked> in_flight;  // in the order asked, which is the order answered
  // However the run ends, the replies still due are skipped when they come (Next).
  struct Abandon {
    size_t& abandoned;
    const std::deque<Asked>& in_flight;
    ~Abandon() { abandoned += in_flight.size(); }
  } abandon{abandoned_, in_flight};
  size_t to_ask = 0;  // the item whose next chunk is asked next
  uint64_t next = items.empty() ? 0 : items[0].start;
  size_t reported = 0;  // items before this one are complete and reported to `done`
  // Moves to_ask past items with nothing (left) to ask for.
  auto skip_asked = [&] {
    while (to_ask < items.size() && next >= items[to_ask].size) {
      if (++to_ask < items.size()) next = items[to_ask].start;
    }
  };
  skip_asked();
  const bool follow_newer = !(pinned_ && *pinned_ == man.version);
  auto deadline = Deadline();
  for (;;) {
    // An item is complete once every chunk of it was asked for and none is still in flight.
    while (reported < to_ask && (in_flight.empty() || in_flight.front().item > reported)) {
      FERRY_RETURN_IF_ERROR(done(reported++));
    }
    if (reported == items.size()) return Outcome::kDone;
    while (in_flight.size() < o_.credit && to_ask < items.size()) {
      const RunItem& item = items[to_ask];
      Message f;
      f.type = MsgType::kFetch;
      f.version = man.version;
      f.kind = item.kind;
      f.index = item.index;
      f.offset = next;
      f.length = static_cast<uint32_t>(std::min<uint64_t>(o_.chunk_bytes, item.size - next));
      FERRY_RETURN_IF_ERROR(Send(f, {}));
      in_flight.push_back({to_ask, next, f.length});
      next += f.length;
      skip_asked();
    }
    Incoming in;
    FERRY_RETURN_IF_ERROR(Next(deadline, &in));
    if (in.announce) {
      if (in.msg.epoch != man.epoch || (follow_newer && in.msg.sequence > man.sequence)) return Outcome::kNewer;
      continue;
    }
    if (in.msg.type == MsgType::kError) {
      Status error = PublisherError(in.msg);
      // The version is no longer served (newer ones replaced it, and the announcements may
      // not be in yet): take the latest.
      if (follow_newer && error.code() == StatusCode::kNotFound && !in_flight.empty()) {
        in_flight.pop_front();
        return Outcome::kNewer;
      }
      return error;
    }
    const Asked& want = in_flight.front();
    const RunItem& item = items[want.item];
    if (in.msg.type != MsgType::kChunk || !(in.msg.version == man.version) || in.msg.kind != item.kind ||
        in.msg.index != item.index || in.msg.offset != want.offset) {
      continue;  // stale
    }
    if (in.msg.epoch != man.epoch) return Outcome::kNewer;  // answered by a restarted publisher
    if (in.payload.size() != want.length) {
      return Status::Corruption("sync CHUNK from " + o_.endpoints.requests + ": " + std::to_string(in.payload.size()) +
                                " bytes at offset " + std::to_string(want.offset) + ", expected " +
                                std::to_string(want.length));
    }
    FERRY_RETURN_IF_ERROR(sink(want.item, in.payload, want.offset));
    bytes_received_ += want.length;
    in_flight.pop_front();
    deadline = Deadline();
    if (o_.on_chunk_for_testing) o_.on_chunk_for_testing(in.msg.offset);
    if (follow_newer && in.msg.sequence > man.sequence) return Outcome::kNewer;
  }
}

Status Session::ReportEngine(const store::Digest& v, const std::string& report) {
  Message m;
  m.type = MsgType::kEngine;
  m.version = v;
  FERRY_RETURN_IF_ERROR(Send(m, {reinterpret_cast<const std::byte*>(report.data()), report.size()}));
  return WaitForAcked(v);
}

Status Session::Ack(const store::Digest& v, const store::Digest& computed, const std::optional<store::Digest>& proven) {
  Message m;
  m.version = v;
  m.computed = computed;
  m.proven = proven;
  FERRY_RETURN_IF_ERROR(SendWithId(MsgType::kAck, m));
  return WaitForAcked(v);
}

Status Session::WaitForAcked(const store::Digest& v) {
  const auto deadline = Deadline();
  for (;;) {
    Incoming in;
    FERRY_RETURN_IF_ERROR(Next(deadline, &in));
    if (in.announce) continue;
    if (in.msg.type == MsgType::kError) return PublisherError(in.msg);
    if (in.msg.type == MsgType::kAcked && in.msg.version == v) return Status::OK();
  }
}

}  // namespace ferry::sync::receiver_internal
