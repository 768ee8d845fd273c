#include "sync/engine/reference.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "core/text.h"

extern char** environ;

namespace ferry::engine {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kMaxAnswerBytes = size_t{64} << 20;

// write(2) of the whole buffer to a pipe whose reader may be gone: SIGPIPE is blocked for the
// call and a pending one consumed, so a dead child is an error, not the end of this process.
bool WriteAllNoSignal(int fd, std::string_view data) {
  sigset_t pipe_set, old;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
  bool ok = true;
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ok = false;
      break;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  if (!ok) {
    const timespec zero{0, 0};
    while (sigtimedwait(&pipe_set, nullptr, &zero) == SIGPIPE) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return ok;
}

}  // namespace

ReferenceProber::ReferenceProber(ReferenceOptions options) : options_(std::move(options)) {}

ReferenceProber::~ReferenceProber() { Stop(); }

Result<std::unique_ptr<ReferenceProber>> ReferenceProber::Start(ReferenceOptions options) {
  if (options.ferryd.empty()) return Status(StatusCode::kInvalidArgument, "ReferenceOptions.ferryd is required");
  std::unique_ptr<ReferenceProber> p(new ReferenceProber(std::move(options)));
  if (Status s = p->Spawn(); !s.ok()) return s;
  return p;
}

Status ReferenceProber::Spawn() {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return Status(StatusCode::kIOError, std::string("pipe: ") + std::strerror(errno));
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    return Status(StatusCode::kIOError, std::string("pipe: ") + std::strerror(errno));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  const std::string exe = options_.ferryd.string(), threads = std::to_string(options_.threads);
  std::vector<char*> argv = {const_cast<char*>(exe.c_str()),     const_cast<char*>("probe"),
                             const_cast<char*>("--serve"),       const_cast<char*>("--threads"),
                             const_cast<char*>(threads.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(in[0]);
  ::close(out[1]);
  if (rc != 0) {
    ::close(in[1]);
    ::close(out[0]);
    return Status(StatusCode::kIOError, "cannot run " + exe + " probe --serve: " + std::strerror(rc));
  }
  pid_ = pid;
  to_child_ = in[1];
  from_child_ = out[0];
  pending_.clear();
  return Status();
}

void ReferenceProber::Stop() {
  if (to_child_ >= 0) ::close(to_child_);
  if (from_child_ >= 0) ::close(from_child_);
  to_child_ = from_child_ = -1;
  if (pid_ <= 0) return;
  // EOF on its stdin ends the child; give it a moment, then kill it.
  for (int i = 0; i < 50; ++i) {
    if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    ::usleep(10000);
  }
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

Result<LogProbs> ReferenceProber::Compute(const std::filesystem::path& model_dir,
                                          const std::optional<std::filesystem::path>& adapter_dir,
                                          const Sequences& sequences) {
  if (pid_ <= 0) {
    if (Status s = Spawn(); !s.ok()) return s;
  }
  json request = {{"model", model_dir.string()}, {"sequences", sequences}};
  if (adapter_dir) request["adapter"] = adapter_dir->string();
  const std::string who = options_.ferryd.string() + " probe --serve (pid " + std::to_string(pid_) + ")";
  if (!WriteAllNoSignal(to_child_, request.dump() + "\n")) {
    Stop();
    return Status(StatusCode::kUnavailable, who + " has exited");
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
  size_t newline;
  while ((newline = pending_.find('\n')) == std::string::npos) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      Stop();
      return Status(StatusCode::kUnavailable,
                    who + " did not answer within " + std::to_string(options_.timeout_ms) + " ms");
    }
    pollfd pfd{from_child_, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buf[65536];
    const ssize_t n = ::read(from_child_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      Stop();
      return Status(StatusCode::kUnavailable, who + " has exited");
    }
    pending_.append(buf, static_cast<size_t>(n));
    if (pending_.size() > kMaxAnswerBytes) {
      Stop();
      return Status(StatusCode::kCorruption,
                    who + ": an answer longer than " + std::to_string(kMaxAnswerBytes >> 20) + " MiB");
    }
  }
  const std::string line = pending_.substr(0, newline);
  pending_.erase(0, newline + 1);
  auto j = json::parse(line, nullptr, false);
  if (!j.is_object() || !j.contains("ok") || !j["ok"].is_boolean()) {
    return Status(StatusCode::kCorruption,
                  who + ": an answer that is not {\"ok\": ...}: " + QuoteForMessage(line, 120));
  }
  if (!j["ok"].get<bool>()) {
    const std::string error = j.contains("error") && j["error"].is_string() ? j["error"].get<std::string>() : line;
    return Status(StatusCode::kFailedPrecondition, "the reference for " + model_dir.string() + ": " + error);
  }
  if (!j.contains("logprobs") || !j["logprobs"].is_array() || j["logprobs"].size() != sequences.size()) {
    return Status(StatusCode::kCorruption,
                  who + ": \"logprobs\" is not an array of " + std::to_string(sequences.size()));
  }
  LogProbs out(sequences.size());
  for (size_t i = 0; i < sequences.size(); ++i) {
    const auto& row = j["logprobs"][i];
    if (!row.is_array() || row.size() + 1 != sequences[i].size()) {
      return Status(StatusCode::kCorruption, who + ": logprobs[" + std::to_string(i) + "] is not an array of " +
                                                 std::to_string(sequences[i].size() - 1));
    }
    for (const auto& v : row) {
      if (!v.is_number())
        return Status(StatusCode::kCorruption, who + ": logprobs[" + std::to_string(i) + "] holds a non-number");
      out[i].push_back(v.get<double>());
    }
  }
  return out;
}

}  // namespace ferry::engine
