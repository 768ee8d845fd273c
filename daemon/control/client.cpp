// The control socket's client side (daemon/control/client.h).
#include "daemon/control/client.h"

#include <sys/stat.h>

#include <utility>
#include <zmq.hpp>

#include "daemon/control/endpoint.h"

namespace ferry::control {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

}  // namespace

struct ControlClient::Impl {
  ControlClientOptions options;
  std::string endpoint;
  bool default_endpoint = false;
  zmq::context_t ctx;
  zmq::socket_t socket;
  uint64_t next_id = 1;

  Status Open() {
    try {
      socket = zmq::socket_t(ctx, zmq::socket_type::dealer);
      socket.set(zmq::sockopt::linger, 0);
      socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxTransportBytes));
      if (options.curve) FERRY_RETURN_IF_ERROR(sync::SecureClientSocket(socket.handle(), *options.curve));
      socket.connect(endpoint);
    } catch (const zmq::error_t& e) {
      return Status::IOError("control socket: cannot connect to " + endpoint + ": " + e.what());
    }
    return Status::OK();
  }

  Status NotAnswered(std::chrono::milliseconds timeout) const {
    const std::string within = "within " + std::to_string(timeout.count()) + " ms";
    if (default_endpoint) {
      return Status::Unavailable("no ferryd is running for " + options.run_dir.string() + " (nobody answered on " +
                                 endpoint + " " + within + ")");
    }
    return Status::Unavailable("no ferryd answered on " + endpoint + " " + within +
                               (options.curve ? " (not running, or this client's key is not allowed)" : ""));
  }
};

ControlClient::ControlClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlClient::~ControlClient() = default;

Result<std::unique_ptr<ControlClient>> ControlClient::Connect(const ControlClientOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  if (options.endpoint.empty()) {
    if (options.run_dir.empty()) return Status::InvalidArgument("control client: neither run_dir nor endpoint given");
    const fs::path socket = ControlSocketPath(options.run_dir);
    struct stat st {};
    if (::lstat(socket.c_str(), &st) != 0) {
      return Status::Unavailable("no ferryd is running for " + options.run_dir.string() + " (no control socket " +
                                 socket.string() + ")");
    }
    if (!S_ISSOCK(st.st_mode)) {
      return Status::FailedPrecondition(socket.string() + ": not a socket; is this a ferryd run directory?");
    }
    // Only this user may have made the socket's directory (otherwise anyone could pose as ferryd).
    FERRY_RETURN_IF_ERROR(sync::MakePrivateDirectory(socket.parent_path()));
    FERRY_ASSIGN_OR_RETURN(impl->endpoint, ControlEndpoint(options.run_dir));
    impl->default_endpoint = true;
  } else {
    impl->endpoint = options.endpoint;
  }
  if (Status s = sync::CheckEndpoint(impl->endpoint, options.curve.has_value()); !s.ok()) {
    return s.WithContext("control client");
  }
  if (options.curve) {
    if (Status s = sync::CheckCurve(*options.curve, sync::CurveRole::kClient); !s.ok()) {
      return s.WithContext("control client");
    }
  }
  FERRY_RETURN_IF_ERROR(impl->Open());
  return std::unique_ptr<ControlClient>(new ControlClient(std::move(impl)));
}

Result<nlohmann::json> ControlClient::Call(ControlCommand command, std::chrono::milliseconds timeout) {
  Impl& m = *impl_;
  const uint64_t id = m.next_id++;
  const std::string request = SerializeRequest({id, command});
  const auto deadline = Clock::now() + timeout;
  try {
    if (!m.socket.send(zmq::buffer(request), zmq::send_flags::dontwait)) {
      // Not even queued (no connection and the queue is full): as good as no answer.
      return m.NotAnswered(timeout);
    }
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      zmq::pollitem_t item{m.socket.handle(), 0, ZMQ_POLLIN, 0};
      if (left.count() <= 0 || zmq::poll(&item, 1, left) == 0) {
        // Drop the queued request with its socket, so a ferryd that comes up later never
        // receives it (a late "stop" must not act).
        Status s = m.NotAnswered(timeout);
        FERRY_RETURN_IF_ERROR(m.Open());
        return s;
      }
      zmq::message_t msg;
      if (!m.socket.recv(msg, zmq::recv_flags::dontwait)) continue;
      while (msg.more()) {  // one frame expected; drain the rest
        zmq::message_t extra;
        if (!m.socket.recv(extra, zmq::recv_flags::dontwait)) break;
        msg = std::move(extra);
      }
      auto reply = ParseReply(msg.to_string_view());
      if (!reply.ok()) return reply.status().WithContext("ferryd on " + m.endpoint);
      if (reply->id != id) continue;  // a reply to an earlier request
      if (!reply->ok) return Status(reply->error.code(), "ferryd: " + reply->error.message());
      return std::move(reply->fields);
    }
  } catch (const zmq::error_t& e) {
    return Status::IOError("control socket " + m.endpoint + ": " + e.what());
  }
}

const std::string& ControlClient::endpoint() const { return impl_->endpoint; }

}  // namespace ferry::control
