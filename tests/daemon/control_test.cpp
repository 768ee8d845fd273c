// ferryd's control protocol, socket, run lock, launcher and run-directory readers (daemon/control/).
// No LibTorch.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <vector>
#include <zmq.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/control/client.h"
#include "daemon/control/launcher.h"
#include "daemon/control/metrics.h"
#include "daemon/control/protocol.h"
#include "daemon/control/run_dir.h"
#include "daemon/control/run_lock.h"
#include "daemon/control/server.h"
#include "sync/keys.h"
#include "tests/temp_dir.h"

namespace ferry::control {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using ferry::testing::ScopedTempDir;
using std::chrono::milliseconds;

// ---------------------------------------------------------------- protocol

TEST(ControlProtocol, RequestRoundTripsEveryCommand) {
  for (ControlCommand c : {ControlCommand::kStatus, ControlCommand::kPause, ControlCommand::kResume,
                           ControlCommand::kSnapshot, ControlCommand::kStop}) {
    const std::string text = SerializeRequest({42, c});
    auto back = ParseRequest(text);
    ASSERT_TRUE(back.ok()) << text << ": " << back.status().ToString();
    EXPECT_EQ(back->id, 42u);
    EXPECT_EQ(back->command, c);
  }
  EXPECT_EQ(SerializeRequest({7, ControlCommand::kSnapshot}), R"({"v":1,"id":7,"command":"snapshot"})");
}

struct Refusal {
  std::string message;
  StatusCode code;
  std::string field;
  std::optional<uint64_t> id;
};

TEST(ControlProtocol, EveryRefusalNamesItsField) {
  const std::string deep = std::string(20000, '[') + std::string(20000, ']');
  const std::vector<Refusal> cases = {
      {std::string(kMaxControlMessageBytes + 1, ' '), StatusCode::kInvalidArgument, "message", std::nullopt},
      {"not json", StatusCode::kInvalidArgument, "message", std::nullopt},
      {"", StatusCode::kInvalidArgument, "message", std::nullopt},
      {"[1,2]", StatusCode::kInvalidArgument, "message", std::nullopt},
      {"\"status\"", StatusCode::kInvalidArgument, "message", std::nullopt},
      {"{\"v\":1,\"id\":1,\"command\":\"st\xff\"}", StatusCode::kInvalidArgument, "message", std::nullopt},
      {R"({"v":1,"id":3,"command":"status","extra":1})", StatusCode::kInvalidArgument, "extra", 3},
      {R"({"v":1,"id":3,"command":"status","":1})", StatusCode::kInvalidArgument, "", 3},
      {R"({"v":1,"id":3,"command":"status","extra":{"a":[1]}})", StatusCode::kInvalidArgument, "extra", 3},
      {R"({"v":1,"id":3,"command":"status","x":)" + deep + "}", StatusCode::kInvalidArgument, "x", 3},
      {R"({"v":1,"id":3,"command":"status","command":"stop"})", StatusCode::kInvalidArgument, "command", 3},
      {R"({"v":1,"id":3,"command":"status","id":4})", StatusCode::kInvalidArgument, "id", std::nullopt},
      {R"({"id":3,"command":"status"})", StatusCode::kInvalidArgument, "v", 3},
      {R"({"v":"1","id":3,"command":"status"})", StatusCode::kInvalidArgument, "v", 3},
      {R"({"v":[1],"id":3,"command":"status"})", StatusCode::kInvalidArgument, "v", 3},
      {R"({"v":2,"id":3,"command":"status"})", StatusCode::kUnsupported, "v", 3},
      {R"({"v":1.0,"id":3,"command":"status"})", StatusCode::kUnsupported, "v", 3},
      {R"({"v":1,"command":"status"})", StatusCode::kInvalidArgument, "id", std::nullopt},
      {R"({"v":1,"id":-1,"command":"status"})", StatusCode::kInvalidArgument, "id", std::nullopt},
      {R"({"v":1,"id":1.5,"command":"status"})", StatusCode::kInvalidArgument, "id", std::nullopt},
      {R"({"v":1,"id":"1","command":"status"})", StatusCode::kInvalidArgument, "id", std::nullopt},
      {R"({"v":1,"id":[1],"command":"status"})", StatusCode::kInvalidArgument, "id", std::nullopt},
      {R"({"v":1,"id":3})", StatusCode::kInvalidArgument, "command", 3},
      {R"({"v":1,"id":3,"command":5})", StatusCode::kInvalidArgument, "command", 3},
      {R"({"v":1,"id":3,"command":["status"]})", StatusCode::kInvalidArgument, "command", 3},
      {R"({"v":1,"id":3,"command":"jump"})", StatusCode::kInvalidArgument, "command", 3},
      {R"({"v":1,"id":3,"command":"STATUS"})", StatusCode::kInvalidArgument, "command", 3},
  };
  for (const Refusal& r : cases) {
    RequestFault fault;
    auto got = ParseRequest(r.message, &fault);
    const std::string shown = r.message.substr(0, 80);
    ASSERT_FALSE(got.ok()) << shown;
    EXPECT_EQ(got.status().code(), r.code) << shown << ": " << got.status().ToString();
    EXPECT_EQ(fault.field, r.field) << shown << ": " << got.status().ToString();
    EXPECT_EQ(fault.id, r.id) << shown;
    if (r.field != "message") {
      EXPECT_NE(got.status().message().find("\"" + r.field + "\""), std::string::npos) << got.status().message();
    }
  }
}

TEST(ControlProtocol, RefusalMessagesQuoteHostileTextCut) {
  const std::string name(5000, 'z');
  auto got = ParseRequest(R"({"v":1,"id":3,"command":"status",")" + name + R"(":1})");
  ASSERT_FALSE(got.ok());
  EXPECT_LT(got.status().message().size(), 300u) << got.status().message();
}

TEST(ControlProtocol, ReplyRoundTrips) {
  ControlReply ok;
  ok.id = 9;
  ok.fields = Json{{"state", "paused"}, {"step", 12}};
  auto text = SerializeReply(ok);
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  EXPECT_TRUE(text->starts_with(R"({"v":1,"id":9,"ok":true,)")) << *text;
  auto back = ParseReply(*text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->id, 9u);
  EXPECT_TRUE(back->ok);
  EXPECT_EQ(back->fields, ok.fields);

  ControlReply err;
  err.ok = false;
  err.error = Status::InvalidArgument("control request: field \"command\": no");
  err.error_field = "command";
  text = SerializeReply(err);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, R"({"v":1,"id":null,"ok":false,"error":{"code":"invalid_argument","field":"command",)"
                   R"("message":"control request: field \"command\": no"}})");
  back = ParseReply(*text);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->id.has_value());
  EXPECT_FALSE(back->ok);
  EXPECT_EQ(back->error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(back->error.message(), err.error.message());
  EXPECT_EQ(back->error_field, "command");
}

TEST(ControlProtocol, ReplyRefusals) {
  ControlReply reserved;
  reserved.fields = Json{{"ok", false}};
  auto s = SerializeReply(reserved);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("\"ok\""), std::string::npos);

  ControlReply not_object;
  not_object.fields = Json::array();
  EXPECT_EQ(SerializeReply(not_object).status().code(), StatusCode::kInvalidArgument);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[]", "JSON object"},
      {R"({"v":2,"id":1,"ok":true})", "\"v\""},
      {R"({"v":1,"id":-1,"ok":true})", "\"id\""},
      {R"({"v":1,"id":1,"ok":1})", "\"ok\""},
      {R"({"v":1,"id":1,"ok":false})", "\"error\""},
      {R"({"v":1,"id":1,"ok":false,"error":{"code":"nope","message":"m"}})", "\"error.code\""},
      {R"({"v":1,"id":1,"ok":false,"error":{"code":"ok","message":"m"}})", "\"error.code\""},
      {R"({"v":1,"id":1,"ok":false,"error":{"code":"internal"}})", "\"error.message\""},
      {R"({"v":1,"id":1,"ok":true,"x":)" + std::string(5000, '[') + std::string(5000, ']') + "}", "nested deeper"},
  };
  for (const auto& [text, field] : bad) {
    auto r = ParseReply(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << text;
    EXPECT_NE(r.status().message().find(field), std::string::npos) << text << ": " << r.status().message();
  }
}

TEST(ControlProtocol, StatusCodeNamesRoundTrip) {
  for (int i = 1; i <= static_cast<int>(StatusCode::kUnavailable); ++i) {
    const auto code = static_cast<StatusCode>(i);
    EXPECT_EQ(StatusCodeFromName(StatusCodeName(code)), code);
  }
  EXPECT_EQ(StatusCodeFromName("ok"), std::nullopt);
  EXPECT_EQ(StatusCodeFromName("bogus"), std::nullopt);
}

// ---------------------------------------------------------------- server and client

// A handler that records what it was asked and answers like a small ferryd.
struct FakeDaemon {
  std::mutex mu;
  std::vector<ControlCommand> calls;
  std::string state = "running";

  ControlHandler Handler() {
    return [this](const ControlRequest& r) -> Result<Json> {
      std::lock_guard lock(mu);
      calls.push_back(r.command);
      switch (r.command) {
        case ControlCommand::kStatus: return Json{{"state", state}, {"step", 5}};
        case ControlCommand::kPause: state = "paused"; return Json{{"state", state}};
        case ControlCommand::kResume: state = "running"; return Json{{"state", state}};
        case ControlCommand::kSnapshot: return Status::FailedPrecondition("no step finished yet");
        case ControlCommand::kStop: throw std::runtime_error("boom");
      }
      return Status::Internal("unreachable");
    };
  }
};

// A raw DEALER for sending what a well-behaved client never would.
class RawClient {
 public:
  explicit RawClient(const std::string& endpoint) : socket_(ctx_, zmq::socket_type::dealer) {
    socket_.set(zmq::sockopt::linger, 0);
    socket_.connect(endpoint);
  }
  void Send(const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      socket_.send(zmq::buffer(frames[i]), i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  // The reply's frames; empty when none came within `timeout`.
  std::vector<std::string> Receive(milliseconds timeout) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, timeout) == 0) return {};
    std::vector<std::string> frames;
    for (;;) {
      zmq::message_t m;
      if (!socket_.recv(m, zmq::recv_flags::none)) break;
      frames.push_back(m.to_string());
      if (!m.more()) break;
    }
    return frames;
  }
  // The parsed error reply to one message.
  ControlReply ErrorReplyTo(const std::vector<std::string>& frames) {
    Send(frames);
    const auto got = Receive(milliseconds(5000));
    EXPECT_EQ(got.size(), 1u);
    if (got.empty()) return {};
    auto r = ParseReply(got.back());
    EXPECT_TRUE(r.ok()) << got.back();
    if (!r.ok()) return {};
    EXPECT_FALSE(r->ok) << got.back();
    return *r;
  }

 private:
  zmq::context_t ctx_;
  zmq::socket_t socket_;
};

class ControlSocketTest : public ::testing::Test {
 protected:
  std::unique_ptr<ControlServer> StartServer(ControlServerOptions o = {}) {
    if (o.run_dir.empty() && o.endpoint.empty()) o.run_dir = dir_.path();
    auto s = ControlServer::Start(o, daemon_.Handler());
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }
  std::unique_ptr<ControlClient> Connect(ControlClientOptions o = {}) {
    if (o.run_dir.empty()) o.run_dir = dir_.path();
    auto c = ControlClient::Connect(o);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(*c) : nullptr;
  }
  ScopedTempDir dir_{"ferry_control_"};
  FakeDaemon daemon_;
};

TEST_F(ControlSocketTest, ClientAndServerRoundTripOverThePrivateIpcSocket) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->endpoint(), "ipc://" + fs::absolute(ControlSocketPath(dir_.path())).string());
  struct stat st {};
  ASSERT_EQ(::stat((dir_.path() / ".ferryd").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);

  auto client = Connect();
  ASSERT_NE(client, nullptr);
  auto status = client->Call(ControlCommand::kStatus, milliseconds(5000));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ(*status, (Json{{"state", "running"}, {"step", 5}}));
  auto paused = client->Call(ControlCommand::kPause, milliseconds(5000));
  ASSERT_TRUE(paused.ok()) << paused.status().ToString();
  EXPECT_EQ((*paused)["state"], "paused");
  EXPECT_EQ((*client->Call(ControlCommand::kStatus, milliseconds(5000)))["state"], "paused");

  // A handler's Status travels with its code and message.
  auto snap = client->Call(ControlCommand::kSnapshot, milliseconds(5000));
  ASSERT_FALSE(snap.ok());
  EXPECT_EQ(snap.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(snap.status().message(), "ferryd: no step finished yet");
  // A handler that throws is an internal error, and the server goes on.
  auto stop = client->Call(ControlCommand::kStop, milliseconds(5000));
  ASSERT_FALSE(stop.ok());
  EXPECT_EQ(stop.status().code(), StatusCode::kInternal);
  EXPECT_NE(stop.status().message().find("boom"), std::string::npos);
  EXPECT_TRUE(client->Call(ControlCommand::kResume, milliseconds(5000)).ok());
  EXPECT_EQ(daemon_.calls.size(), 6u);

  server->Stop();
  EXPECT_FALSE(fs::exists(ControlSocketPath(dir_.path())));
  server->Stop();  // idempotent
}

TEST_F(ControlSocketTest, BadMessagesGetErrorRepliesWhileAGoodClientIsServed) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  RawClient raw(server->endpoint());
  auto good = Connect();
  ASSERT_NE(good, nullptr);

  ControlReply r = raw.ErrorReplyTo({std::string(100 * 1024, '{')});
  EXPECT_EQ(r.error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.error_field, "message");
  EXPECT_NE(r.error.message().find("102400 bytes"), std::string::npos) << r.error.message();
  EXPECT_TRUE(good->Call(ControlCommand::kStatus, milliseconds(5000)).ok());

  r = raw.ErrorReplyTo({"\x01\x02garbage"});
  EXPECT_EQ(r.error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.error_field, "message");
  EXPECT_FALSE(r.id.has_value());

  r = raw.ErrorReplyTo({R"({"v":1,"id":77,"command":"jump"})"});
  EXPECT_EQ(r.error.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.error_field, "command");
  EXPECT_EQ(r.id, 77u);

  r = raw.ErrorReplyTo({R"({"v":1,"id":78,"command":"status","x":1})"});
  EXPECT_EQ(r.error_field, "x");
  EXPECT_EQ(r.id, 78u);

  r = raw.ErrorReplyTo({R"({"v":1,"id":78,"command":"status","":1})"});
  EXPECT_EQ(r.error_field, "");  // an empty name is a field's name too

  r = raw.ErrorReplyTo({R"({"v":3,"id":79,"command":"status"})"});
  EXPECT_EQ(r.error.code(), StatusCode::kUnsupported);
  EXPECT_EQ(r.error_field, "v");

  r = raw.ErrorReplyTo({R"({"v":1,"id":80,"command":"status"})", "second frame"});
  EXPECT_EQ(r.error_field, "message");
  EXPECT_NE(r.error.message().find("2 frames"), std::string::npos) << r.error.message();

  // A REQ-style envelope (empty delimiter) is answered with the delimiter echoed.
  raw.Send({"", R"({"v":1,"id":81,"command":"status"})"});
  const auto req_style = raw.Receive(milliseconds(5000));
  ASSERT_EQ(req_style.size(), 2u);
  EXPECT_EQ(req_style[0], "");
  auto parsed = ParseReply(req_style[1]);
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(parsed->ok);
  EXPECT_EQ(parsed->id, 81u);

  // Over the transport limit: libzmq drops that connection unread; others are unaffected.
  RawClient flood(server->endpoint());
  flood.Send({std::string(kMaxTransportBytes + 1, 'x')});
  EXPECT_TRUE(flood.Receive(milliseconds(300)).empty());
  auto status = good->Call(ControlCommand::kStatus, milliseconds(5000));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ((*status)["step"], 5);
  // Refused requests never reach the handler.
  EXPECT_EQ(daemon_.calls.size(), 3u);
}

TEST_F(ControlSocketTest, TcpIsRefusedWithoutCurve) {
  ControlServerOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  auto s = ControlServer::Start(o, daemon_.Handler());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("tcp://127.0.0.1:0"), std::string::npos) << s.status().message();

  ControlClientOptions c;
  c.endpoint = "tcp://127.0.0.1:5999";
  auto client = ControlClient::Connect(c);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::kFailedPrecondition);

  o.endpoint = "udp://127.0.0.1:5999";
  EXPECT_EQ(ControlServer::Start(o, daemon_.Handler()).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(ControlSocketTest, CurveAdmitsOnlyAllowListedClients) {
  auto server_keys = sync::GenerateKeyPair();
  auto allowed = sync::GenerateKeyPair();
  auto stranger = sync::GenerateKeyPair();
  ASSERT_TRUE(server_keys.ok() && allowed.ok() && stranger.ok());
  ControlServerOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  o.curve = sync::CurveOptions{server_keys->public_key, server_keys->secret_key, "", {allowed->public_key}};
  auto server = StartServer(o);
  ASSERT_NE(server, nullptr);
  ASSERT_TRUE(server->endpoint().starts_with("tcp://127.0.0.1:")) << server->endpoint();

  ControlClientOptions c;
  c.endpoint = server->endpoint();
  c.curve = sync::CurveOptions{allowed->public_key, allowed->secret_key, server_keys->public_key, {}};
  auto ok_client = Connect(c);
  ASSERT_NE(ok_client, nullptr);
  auto status = ok_client->Call(ControlCommand::kStatus, milliseconds(5000));
  ASSERT_TRUE(status.ok()) << status.status().ToString();
  EXPECT_EQ((*status)["state"], "running");

  c.curve = sync::CurveOptions{stranger->public_key, stranger->secret_key, server_keys->public_key, {}};
  auto bad_client = Connect(c);
  ASSERT_NE(bad_client, nullptr);
  auto refused = bad_client->Call(ControlCommand::kStop, milliseconds(500));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("not allowed"), std::string::npos) << refused.status().message();
  EXPECT_EQ(daemon_.calls, std::vector<ControlCommand>{ControlCommand::kStatus});

  // A server key that is not Z85 is refused up front, naming the field.
  o.curve->secret_key = "short";
  auto s = ControlServer::Start(o, daemon_.Handler());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("secret_key"), std::string::npos) << s.status().message();
}

TEST_F(ControlSocketTest, NoDaemonIsAClearErrorNeverAHang) {
  // No socket file at all.
  auto c = ControlClient::Connect({dir_.path(), "", std::nullopt});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(c.status().message().find("no ferryd is running for " + dir_.path().string()), std::string::npos)
      << c.status().message();

  // A socket file whose owner never answers (a hung or dead daemon).
  auto endpoint = ControlEndpoint(dir_.path());
  ASSERT_TRUE(endpoint.ok());
  zmq::context_t ctx;
  zmq::socket_t silent(ctx, zmq::socket_type::router);
  silent.set(zmq::sockopt::linger, 0);
  silent.bind(*endpoint);
  auto client = Connect();
  ASSERT_NE(client, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = client->Call(ControlCommand::kStatus, milliseconds(200));
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("no ferryd is running for " + dir_.path().string()), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("within 200 ms"), std::string::npos) << r.status().message();
  EXPECT_LT(waited, std::chrono::seconds(3));
}

TEST_F(ControlSocketTest, ClientRefusesASocketDirectoryThatIsNotASocket) {
  fs::create_directories(dir_.path() / ".ferryd");
  std::ofstream(ControlSocketPath(dir_.path())) << "x";
  auto c = ControlClient::Connect({dir_.path(), "", std::nullopt});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("not a socket"), std::string::npos) << c.status().message();
}

// ---------------------------------------------------------------- run lock

TEST(RunLockTest, OneHolderPerDirectoryInThisProcess) {
  ScopedTempDir dir("ferry_lock_");
  auto none = RunLock::Holder(dir.path());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  {
    auto lock = RunLock::Acquire(dir.path());
    ASSERT_TRUE(lock.ok()) << lock.status().ToString();
    auto holder = RunLock::Holder(dir.path());
    ASSERT_TRUE(holder.ok()) << holder.status().ToString();
    EXPECT_EQ(*holder, ::getpid());
    auto second = RunLock::Acquire(dir.path());
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(
        second.status().message().find(dir.path().string() + " is in use by ferryd pid " + std::to_string(::getpid())),
        std::string::npos)
        << second.status().message();
    RunLock moved = std::move(*lock);  // the lock travels with the object
    EXPECT_EQ(*RunLock::Holder(dir.path()), ::getpid());
  }
  EXPECT_EQ(RunLock::Holder(dir.path()).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(RunLock::Acquire(dir.path()).ok());
}

TEST(RunLockTest, AnotherProcessIsNamedAndItsDeathReleasesTheLock) {
  ScopedTempDir dir("ferry_lock_");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    auto lock = RunLock::Acquire(dir.path());
    const char byte = lock.ok() ? 'y' : 'n';
    (void)!::write(ready[1], &byte, 1);
    for (;;) ::pause();  // holds the lock until killed
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(byte, 'y');

  auto second = RunLock::Acquire(dir.path());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("is in use by ferryd pid " + std::to_string(child)), std::string::npos)
      << second.status().message();
  auto holder = RunLock::Holder(dir.path());
  ASSERT_TRUE(holder.ok()) << holder.status().ToString();
  EXPECT_EQ(*holder, child);

  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(RunLock::Holder(dir.path()).status().code(), StatusCode::kNotFound);
  auto after = RunLock::Acquire(dir.path());
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_EQ(*RunLock::Holder(dir.path()), ::getpid());
}

// ---------------------------------------------------------------- launcher

// `ferryd train --config config --dir dir`, nothing else set.
FerrydTrainOptions Train(const fs::path& ferryd, const fs::path& config, const fs::path& dir) {
  FerrydTrainOptions o;
  o.ferryd = ferryd;
  o.config = config;
  o.run_dir = dir;
  return o;
}

TEST(FerrydTrainArgvTest, PassesOnlyWhatIsSet) {
  FerrydTrainOptions o = Train("/bin/ferryd", "/c/grpo.toml", "/runs/a");
  EXPECT_EQ(FerrydTrainArgv(o),
            (std::vector<std::string>{"/bin/ferryd", "train", "--config", "/c/grpo.toml", "--dir", "/runs/a"}));
  o.max_steps = 5;
  o.publish = "ipc:///tmp/pub";
  EXPECT_EQ(FerrydTrainArgv(o),
            (std::vector<std::string>{"/bin/ferryd", "train", "--config", "/c/grpo.toml", "--dir", "/runs/a",
                                      "--max-steps", "5", "--publish", "ipc:///tmp/pub"}));
}

// Detached starts of fake_ferryd (tests/daemon/fake_ferryd.cpp) and of shell scripts. Every
// child the launcher leaves running is killed and reaped at the end.
class LauncherTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (const pid_t pid : children_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
  // fake_ferryd on DIR = tmp/run, with `config` as its --config file.
  FerrydTrainOptions Fake(const Json& config) {
    FerrydTrainOptions o = Train(FAKE_FERRYD_PATH, tmp_.path() / "fake.json", tmp_.path() / "run");
    std::ofstream(o.config) << config.dump();
    return o;
  }
  // A shell script as ferryd.
  FerrydTrainOptions Script(const std::string& body) {
    const fs::path script = tmp_.path() / "ferryd.sh";
    std::ofstream(script) << "#!/bin/sh\n" << body << "\n";
    fs::permissions(script, fs::perms::owner_all);
    return Train(script, tmp_.path() / "grpo.toml", tmp_.path() / "run");
  }
  // Starts `train` and expects it to get as far as a pid; the pid is reaped at the end.
  DetachedStart Start(const FerrydTrainOptions& train, DetachOptions options = {}) {
    auto s = StartDetached(train, options);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return {};
    if (s->state != DetachedState::kExited) children_.push_back(s->pid);
    return *s;
  }
  // Asks the fake on DIR to stop and returns its wait status.
  int StopAndReap(const FerrydTrainOptions& train, pid_t pid) {
    auto client = ControlClient::Connect({train.run_dir, "", std::nullopt});
    EXPECT_TRUE(client.ok()) << client.status().ToString();
    if (client.ok()) {
      auto reply = (*client)->Call(ControlCommand::kStop, milliseconds(5000));
      EXPECT_TRUE(reply.ok()) << reply.status().ToString();
    }
    int status = -1;
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
    std::erase(children_, pid);
    return status;
  }
  std::string Log() const {
    std::ifstream in(tmp_.path() / "run" / "ferryd.log");
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ScopedTempDir tmp_{"ferry_launcher_"};
  std::vector<pid_t> children_;
};

TEST_F(LauncherTest, AnAnsweringFerrydRunsInItsOwnSessionWritingItsLog) {
  const auto train = Fake({{"status", {{"step", 1}, {"total_steps", 5}}}});
  const DetachedStart s = Start(train);
  ASSERT_EQ(s.state, DetachedState::kAnswering) << s.error.ToString();
  EXPECT_TRUE(s.error.ok());
  EXPECT_EQ(s.log, train.run_dir / "ferryd.log");
  EXPECT_EQ(s.status.value("pid", 0), s.pid);
  EXPECT_EQ(s.status.value("step", 0), 1);
  EXPECT_FALSE(s.last_step.has_value());
  EXPECT_EQ(::getsid(s.pid), s.pid);  // a session of its own
  auto holder = RunLock::Holder(train.run_dir);
  ASSERT_TRUE(holder.ok()) << holder.status().ToString();
  EXPECT_EQ(*holder, s.pid);

  const int status = StopAndReap(train, s.pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_EQ(Log(), "fake_ferryd train --config " + train.config.string() + " --dir " + train.run_dir.string() +
                       "\nfake_ferryd: stopped\n");
}

TEST_F(LauncherTest, AnEarlyExitIsReportedWithTheLogsLastLines) {
  auto train = Fake({{"exit_code", 7}});
  train.max_steps = 5;
  const DetachedStart s = Start(train);
  ASSERT_EQ(s.state, DetachedState::kExited);
  EXPECT_EQ(s.exit_code, 7);
  EXPECT_EQ(s.signal, 0);
  EXPECT_EQ(s.error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.error.message(), "ferryd pid " + std::to_string(s.pid) +
                                   " exited with code 7 before its control socket answered; " + s.log.string() +
                                   " ends with:\n  fake_ferryd train --config " + train.config.string() + " --dir " +
                                   train.run_dir.string() + " --max-steps 5\n");
}

TEST_F(LauncherTest, AnExitOnASignalIsNamed) {
  const DetachedStart s = Start(Script("echo \"started $*\"\nkill -KILL $$"));
  ASSERT_EQ(s.state, DetachedState::kExited);
  EXPECT_EQ(s.exit_code, -1);
  EXPECT_EQ(s.signal, SIGKILL);
  EXPECT_NE(s.error.message().find(" exited on signal 9 before its control socket answered"), std::string::npos)
      << s.error.message();
  EXPECT_NE(s.error.message().find("ends with:\n  started train --config "), std::string::npos) << s.error.message();
}

// ferryd answering at its run's last step had nothing to do: its exit is waited for.
TEST_F(LauncherTest, AnAnswerAtTheLastStepWaitsForTheExit) {
  const DetachedStart s = Start(Fake({{"status", {{"step", 5}, {"total_steps", 5}}}, {"exit_after_status", true}}));
  ASSERT_EQ(s.state, DetachedState::kExited) << s.error.ToString();
  EXPECT_EQ(s.exit_code, 0);
  EXPECT_EQ(s.last_step, std::optional<int64_t>(5));
}

TEST_F(LauncherTest, AnAnswerAtTheLastStepWithoutAnExitTimesOut) {
  const auto train = Fake({{"status", {{"step", 5}, {"total_steps", 5}}}});
  DetachOptions options;
  options.wait = milliseconds(1500);
  const DetachedStart s = Start(train, options);
  ASSERT_EQ(s.state, DetachedState::kTimedOut) << s.error.ToString();
  EXPECT_EQ(s.last_step, std::optional<int64_t>(5));
  EXPECT_EQ(s.error.code(), StatusCode::kUnavailable);
  EXPECT_EQ(s.error.message(), "ferryd pid " + std::to_string(s.pid) +
                                   " is at the run's last step but did not exit within 1500 ms (see " + s.log.string() +
                                   ")");
  const int status = StopAndReap(train, s.pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(LauncherTest, ASilentProcessTimesOutAndIsLeftRunning) {
  DetachOptions options;
  options.wait = std::chrono::seconds(1);
  const DetachedStart s = Start(Script("exec sleep 60"), options);
  ASSERT_EQ(s.state, DetachedState::kTimedOut);
  EXPECT_FALSE(s.last_step.has_value());
  EXPECT_EQ(s.error.message(), "ferryd pid " + std::to_string(s.pid) +
                                   " is running but its control socket did not answer within 1 s (see " +
                                   s.log.string() + ")");
  EXPECT_EQ(::kill(s.pid, 0), 0);  // not killed
}

TEST_F(LauncherTest, WhatCannotStartIsAnErrorAndLeavesNoProcess) {
  const FerrydTrainOptions absent = Train(tmp_.path() / "absent", tmp_.path() / "grpo.toml", tmp_.path() / "run");
  auto r = StartDetached(absent);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_EQ(r.status().message(), "cannot run " + absent.ferryd.string() + ": No such file or directory");
  // The child that failed to exec was reaped.
  EXPECT_EQ(::waitpid(-1, nullptr, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);

  const Status s = ExecFerrydTrain(absent);  // returns: nothing to replace this process with
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_EQ(s.message(), "cannot run " + absent.ferryd.string() + ": No such file or directory");

  std::ofstream(tmp_.path() / "file") << "x";
  const FerrydTrainOptions blocked = Train(FAKE_FERRYD_PATH, tmp_.path() / "grpo.toml", tmp_.path() / "file" / "run");
  r = StartDetached(blocked);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIOError);
  EXPECT_NE(r.status().message().find(blocked.run_dir.string() + ": cannot create the run directory"),
            std::string::npos)
      << r.status().message();
}

// ---------------------------------------------------------------- metrics and the run directory

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t nl = text.find('\n', pos);
    out.push_back(text.substr(pos, nl - pos));
    pos = nl == std::string::npos ? text.size() : nl + 1;
  }
  return out;
}

TEST(Prometheus, EveryNumericFieldIsAGaugeWithTheRunLabel) {
  const std::string line =
      R"({"step":12,"reward":0.5,"completions/mean_length":3.25,"kl":1e-06,"loss":-0.125,)"
      R"("generator_version":"00112233445566778899aabbccddeeff","note":"text","flag":true,"gone":null,)"
      R"("nested":{"a":1},"big":18446744073709551615,"neg":-3})";
  auto text = MetricsToPrometheus(line, "run-1");
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  const std::vector<std::string> want = {
      "# TYPE ferry_step gauge",
      R"(ferry_step{run="run-1"} 12)",
      "# TYPE ferry_reward gauge",
      R"(ferry_reward{run="run-1"} 0.5)",
      "# TYPE ferry_completions_mean_length gauge",
      R"(ferry_completions_mean_length{run="run-1"} 3.25)",
      "# TYPE ferry_kl gauge",
      R"(ferry_kl{run="run-1"} 1e-06)",
      "# TYPE ferry_loss gauge",
      R"(ferry_loss{run="run-1"} -0.125)",
      "# TYPE ferry_generator_info gauge",
      R"(ferry_generator_info{run="run-1",version="00112233445566778899aabbccddeeff"} 1)",
      "# TYPE ferry_big gauge",
      R"(ferry_big{run="run-1"} 18446744073709551615)",
      "# TYPE ferry_neg gauge",
      R"(ferry_neg{run="run-1"} -3)",
  };
  EXPECT_EQ(Lines(*text), want);
  EXPECT_TRUE(text->ends_with("\n"));
}

TEST(Prometheus, NamesAndLabelValuesAreEscaped) {
  EXPECT_EQ(PrometheusMetricName("completions/mean_length"), "ferry_completions_mean_length");
  EXPECT_EQ(PrometheusMetricName("rewards/digits:mean-x.y"), "ferry_rewards_digits_mean_x_y");
  EXPECT_EQ(PrometheusMetricName("Grad_Norm2"), "ferry_Grad_Norm2");
  EXPECT_EQ(EscapeLabelValue("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(EscapeLabelValue("caf\xc3\xa9"), "caf\xc3\xa9");
  EXPECT_EQ(EscapeLabelValue("x\xff"), "x\xEF\xBF\xBD");
  EXPECT_EQ(EscapeLabelValue("\xc0\xaf"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong '/'

  auto text = MetricsToPrometheus(R"({"a/b":1,"a_b":2,"generator_version":"v\"1"})", "my\"run\\");
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(Lines(*text), (std::vector<std::string>{
                              "# TYPE ferry_a_b gauge",
                              R"(ferry_a_b{run="my\"run\\"} 1)",
                              "# TYPE ferry_generator_info gauge",
                              R"(ferry_generator_info{run="my\"run\\",version="v\"1"} 1)",
                          }));
}

TEST(Prometheus, NestedValuesAreLeftOutOfAParsedLine) {
  const std::string deep = std::string(30000, '[') + std::string(30000, ']');
  auto j = ParseMetricsLine(R"({"step":1,"deep":)" + deep + R"(,"o":{"a":1},"reward":0.5})");
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  EXPECT_EQ(j->dump(), R"({"step":1,"reward":0.5})");
}

TEST(Prometheus, ALineThatIsNotAnObjectIsRefused) {
  for (const char* bad : {"", "{", "[1]", "12", "{\"a\":NaN}"}) {
    auto t = MetricsToPrometheus(bad, "r");
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), StatusCode::kCorruption) << bad;
  }
}

void Write(const fs::path& p, const std::string& text, std::ios::openmode mode = std::ios::trunc) {
  std::ofstream out(p, std::ios::binary | mode);
  out << text;
}

TEST(FileTailTest, FollowsGrowthWaitsForWholeLinesAndResumesAfterATruncation) {
  ScopedTempDir dir("ferry_tail_");
  const fs::path file = dir.path() / "metrics.jsonl";
  FileTail tail(file);
  auto u = tail.Poll();
  ASSERT_TRUE(u.ok());
  EXPECT_TRUE(u->lines.empty());  // no file yet

  Write(file, "s1\ns2\ns3\ns4-part");
  u = tail.Poll();
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->lines, (std::vector<std::string>{"s1", "s2", "s3"}));
  EXPECT_FALSE(u->rewritten);
  Write(file, "ial\n", std::ios::app);
  u = tail.Poll();
  EXPECT_EQ(u->lines, std::vector<std::string>{"s4-partial"});
  EXPECT_TRUE(tail.Poll()->lines.empty());

  // A resumed run cuts the file back to its checkpoint (s2) and logs new steps, longer
  // than before: only the new lines are returned, flagged.
  Write(file, "s1\ns2\nS3-resumed\nS4-resumed\nS5\n");
  u = tail.Poll();
  ASSERT_TRUE(u.ok());
  EXPECT_TRUE(u->rewritten);
  EXPECT_EQ(u->lines, (std::vector<std::string>{"S3-resumed", "S4-resumed", "S5"}));

  // Truncated to fewer bytes than were read.
  Write(file, "s1\n");
  u = tail.Poll();
  EXPECT_TRUE(u->rewritten);
  EXPECT_TRUE(u->lines.empty());
  Write(file, "s2b\n", std::ios::app);
  u = tail.Poll();
  EXPECT_FALSE(u->rewritten);
  EXPECT_EQ(u->lines, std::vector<std::string>{"s2b"});

  // Replaced by another file (another inode).
  const fs::path other = dir.path() / "new.jsonl";
  Write(other, "s1\nt2\n");
  fs::rename(other, file);
  u = tail.Poll();
  EXPECT_TRUE(u->rewritten);
  EXPECT_EQ(u->lines, std::vector<std::string>{"t2"});
}

TEST(FileTailTest, WithoutMemoryARewrittenFileIsReadFromItsStart) {
  ScopedTempDir dir("ferry_tail_");
  const fs::path file = dir.path() / "ferryd.log";
  FileTail tail(file, /*remember_lines=*/false);
  Write(file, "a\nb\n");
  EXPECT_EQ(tail.Poll()->lines, (std::vector<std::string>{"a", "b"}));
  Write(file, "a\n");
  auto u = tail.Poll();
  EXPECT_TRUE(u->rewritten);
  EXPECT_EQ(u->lines, std::vector<std::string>{"a"});
}

TEST(RunDirTest, NewestCheckpointIgnoresTemporariesAndFiles) {
  ScopedTempDir dir("ferry_rundir_");
  auto none = NewestCheckpoint(dir.path());
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  EXPECT_FALSE(NewestCheckpoint(dir.path() / "absent")->has_value());
  for (const char* d : {"checkpoint-5", "checkpoint-12", "checkpoint-40.tmp", "checkpoint-", "checkpoint-x"}) {
    fs::create_directories(dir.path() / d);
  }
  Write(dir.path() / "checkpoint-99", "a file");
  auto newest = NewestCheckpoint(dir.path());
  ASSERT_TRUE(newest.ok());
  ASSERT_TRUE(newest->has_value());
  EXPECT_EQ((*newest)->name, "checkpoint-12");
  EXPECT_EQ((*newest)->step, 12u);
}

TEST(RunDirTest, LastMetricsIsTheLastCompleteLine) {
  ScopedTempDir dir("ferry_rundir_");
  EXPECT_FALSE(LastMetrics(dir.path())->has_value());
  Write(dir.path() / "metrics.jsonl", "{\"step\":1}\n{\"step\":2,\"reward\":0.5}\n\n{\"step\":3");
  auto last = LastMetrics(dir.path());
  ASSERT_TRUE(last.ok()) << last.status().ToString();
  ASSERT_TRUE(last->has_value());
  EXPECT_EQ((*last)->number, 2u);
  EXPECT_EQ((*last)->value["step"], 2);
  EXPECT_EQ((*last)->text, "{\"step\":2,\"reward\":0.5}");

  Write(dir.path() / "metrics.jsonl", "{\"step\":1}\nnot json\n");
  last = LastMetrics(dir.path());
  ASSERT_FALSE(last.ok());
  EXPECT_EQ(last.status().code(), StatusCode::kCorruption);
  EXPECT_NE(last.status().message().find("metrics.jsonl line 2"), std::string::npos) << last.status().message();
}

}  // namespace
}  // namespace ferry::control
