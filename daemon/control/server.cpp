// The control socket's server side (daemon/control/server.h).
#include "daemon/control/server.h"

#include <atomic>
#include <exception>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>
#include <zmq.hpp>

namespace ferry::control {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kZapDomain = "ferry-control";
// Frames beyond the envelope that are counted but not kept (a multipart flood).
constexpr size_t kKeptFrames = 3;

zmq::message_t Frame(std::string_view s) { return zmq::message_t(s.data(), s.size()); }

}  // namespace

struct ControlServer::Impl {
  ControlHandler handler;
  std::string endpoint;
  std::string ipc_path;  // the socket file to remove on Stop; "" for tcp/inproc
  zmq::context_t ctx;
  std::unique_ptr<sync::ZapAllowList> zap;  // with CURVE; declared after ctx (closed before it)
  zmq::socket_t router, stop_in, stop_out;
  std::thread thread;
  static std::atomic<uint64_t> next_instance;

  Status Bind(const ControlServerOptions& o) {
    try {
      if (o.curve) {
        FERRY_ASSIGN_OR_RETURN(zap, sync::ZapAllowList::Bind(ctx.handle(), o.curve->allowed_keys, o.on_rejected_key));
      }
      const std::string stop_ep = "inproc://ferry-control-stop-" + std::to_string(next_instance++);
      stop_in = zmq::socket_t(ctx, zmq::socket_type::pair);
      stop_in.bind(stop_ep);
      stop_out = zmq::socket_t(ctx, zmq::socket_type::pair);
      stop_out.connect(stop_ep);
      router = zmq::socket_t(ctx, zmq::socket_type::router);
      router.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxTransportBytes));
      // Replies already queued when Stop() closes the socket (the reply to `stop` itself) still go
      // out: with linger 0 a loaded machine's I/O thread could drop them and the client waited its
      // whole timeout. Bounded, so a client that stopped reading cannot hold the daemon's exit.
      router.set(zmq::sockopt::linger, 1000);
      if (o.curve) FERRY_RETURN_IF_ERROR(sync::SecureServerSocket(router.handle(), *o.curve, kZapDomain));
      router.bind(endpoint);
      endpoint = router.get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Status::IOError("control socket: cannot bind " + endpoint + ": " + e.what());
    }
    if (endpoint.starts_with("ipc://")) ipc_path = endpoint.substr(6);
    return Status::OK();
  }

  void Loop() {
    for (;;) {
      std::vector<zmq::pollitem_t> items = {{stop_in.handle(), 0, ZMQ_POLLIN, 0}, {router.handle(), 0, ZMQ_POLLIN, 0}};
      if (zap) items.push_back({zap->socket(), 0, ZMQ_POLLIN, 0});
      try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(-1));
        if (items.size() > 2 && (items[2].revents & ZMQ_POLLIN)) zap->HandlePending();
        if (items[0].revents & ZMQ_POLLIN) return;
        if (items[1].revents & ZMQ_POLLIN) ServePending();
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        // Anything else concerns one peer; keep serving the others.
      }
    }
  }

  // Answers every message waiting on the ROUTER.
  void ServePending() {
    for (;;) {
      std::vector<zmq::message_t> parts;
      size_t frames = 0;
      for (;;) {
        zmq::message_t part;
        if (!router.recv(part, zmq::recv_flags::dontwait)) break;
        const bool more = part.more();
        ++frames;
        if (parts.size() < kKeptFrames) parts.push_back(std::move(part));
        if (!more) break;
      }
      if (frames == 0) return;
      if (frames < 2) continue;  // no identity frame: not from a peer
      Answer(parts, frames);
    }
  }

  void Answer(std::vector<zmq::message_t>& parts, size_t frames) {
    // [identity, body] from a DEALER, [identity, "", body] from a REQ.
    const bool delimited = frames == 3 && parts[1].size() == 0;
    const size_t body_frames = frames - 1 - (delimited ? 1 : 0);
    ControlReply reply;
    if (body_frames != 1) {
      reply.ok = false;
      reply.error = Status::InvalidArgument("control request: message has " + std::to_string(body_frames) +
                                            " frames; expected one JSON object in one frame");
      reply.error_field = "message";
    } else {
      const zmq::message_t& body = parts[delimited ? 2 : 1];
      RequestFault fault;
      auto request = ParseRequest(std::string_view(static_cast<const char*>(body.data()), body.size()), &fault);
      if (!request.ok()) {
        reply.ok = false;
        reply.id = fault.id;
        reply.error = request.status();
        reply.error_field = fault.field;
      } else {
        reply.id = request->id;
        Result<nlohmann::json> answer = Status::Internal("control handler did not answer");
        try {
          answer = handler(*request);
        } catch (const std::exception& e) {
          answer = Status::Internal(std::string("control handler failed: ") + e.what());
        } catch (...) {
          answer = Status::Internal("control handler failed");
        }
        if (answer.ok()) {
          reply.fields = std::move(*answer);
        } else {
          reply.ok = false;
          reply.error = answer.status();
        }
      }
    }
    Result<std::string> text = SerializeReply(reply);
    if (!text.ok()) {
      // The handler's fields were not a valid reply: tell the client instead.
      ControlReply internal;
      internal.id = reply.id;
      internal.ok = false;
      internal.error = Status::Internal(text.status().message());
      text = SerializeReply(internal);
      if (!text.ok()) return;
    }
    try {
      router.send(parts[0], zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      if (delimited) router.send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
      router.send(Frame(*text), zmq::send_flags::dontwait);
    } catch (const zmq::error_t&) {
      // The peer is gone or not reading; its reply is dropped.
    }
  }
};

std::atomic<uint64_t> ControlServer::Impl::next_instance{0};

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ControlServer::~ControlServer() { Stop(); }

Result<std::unique_ptr<ControlServer>> ControlServer::Start(const ControlServerOptions& options,
                                                            ControlHandler handler) {
  if (!handler) return Status::InvalidArgument("control server: no handler");
  auto impl = std::make_unique<Impl>();
  impl->handler = std::move(handler);
  if (options.endpoint.empty()) {
    if (options.run_dir.empty()) return Status::InvalidArgument("control server: neither run_dir nor endpoint given");
    FERRY_ASSIGN_OR_RETURN(impl->endpoint, ControlEndpoint(options.run_dir));
  } else {
    impl->endpoint = options.endpoint;
  }
  if (Status s = sync::CheckEndpoint(impl->endpoint, options.curve.has_value()); !s.ok()) {
    return s.WithContext("control server");
  }
  if (options.curve) {
    if (Status s = sync::CheckCurve(*options.curve, sync::CurveRole::kServer); !s.ok()) {
      return s.WithContext("control server");
    }
  }
  FERRY_RETURN_IF_ERROR(impl->Bind(options));
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<ControlServer>(new ControlServer(std::move(impl)));
}

void ControlServer::Stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  try {
    impl_->stop_out.send(Frame("S"), zmq::send_flags::none);
  } catch (const zmq::error_t&) {
  }
  impl_->thread.join();
  impl_->router.close();
  impl_->stop_in.close();
  impl_->stop_out.close();
  impl_->zap.reset();
  if (!impl_->ipc_path.empty()) {
    std::error_code ec;
    fs::remove(impl_->ipc_path, ec);
  }
}

const std::string& ControlServer::endpoint() const { return impl_->endpoint; }

}  // namespace ferry::control
