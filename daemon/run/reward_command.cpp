// The external reward command's process and protocol (rewards.h).
#include "daemon/run/reward_command.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/text.h"
#include "daemon/run/rewards.h"

extern char** environ;

namespace ferry::run {
namespace {

using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;
constexpr auto kReplace = Json::error_handler_t::replace;

// `s` quoted, escaped, cut at 100 bytes.
std::string Snippet(std::string_view s) { return QuoteForMessage(s, 100); }

bool IsIdentChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Python's json.dumps writes NaN / Infinity / -Infinity as bare words, which JSON lacks.
// Returns the line with bare NaN replaced by null; sets *infinity when a bare Infinity is
// present (a reward must be finite).
std::string ReplaceBareNaN(std::string_view line, bool* infinity) {
  std::string out;
  out.reserve(line.size());
  bool in_string = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < line.size()) {
        out += line[++i];
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    const bool word_start = i == 0 || !IsIdentChar(line[i - 1]);
    if (word_start && line.substr(i, 3) == "NaN" && (i + 3 == line.size() || !IsIdentChar(line[i + 3]))) {
      out += "null";
      i += 2;
      continue;
    }
    if (word_start && line.substr(i, 8) == "Infinity") *infinity = true;
    out += c;
  }
  return out;
}

// The reward of one reply line, or what is wrong with it.
Result<double> ParseReply(std::string_view line) {
  if (line.empty()) return Status::Corruption("an empty line");
  bool infinity = false;
  const std::string text = ReplaceBareNaN(line, &infinity);
  if (infinity) return Status::Corruption("the reward is Infinity; it must be a finite number, null or NaN");
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Corruption("not JSON");
  if (!j.is_object()) return Status::Corruption("not a JSON object {\"reward\": ...}");
  auto it = j.find("reward");
  if (it == j.end()) return Status::Corruption("no \"reward\" key");
  if (it->is_null()) return std::nan("");
  if (!it->is_number()) return Status::Corruption("\"reward\" is not a number, null or NaN");
  const double r = it->get<double>();
  if (!std::isfinite(r)) return Status::Corruption("the reward is not finite");
  return r;
}

std::string RequestLine(const RewardInput& in, size_t index, bool last_in_batch) {
  // Field order as documented; the example is the dataset line's own JSON text.
  std::string line = "{\"index\":" + std::to_string(index) + ",\"prompt_index\":" + std::to_string(in.prompt_index) +
                     ",\"completion_tokens\":" + std::to_string(in.completion_tokens) +
                     ",\"last_in_batch\":" + (last_in_batch ? "true" : "false") +
                     ",\"prompt\":" + Json(in.prompt).dump(-1, ' ', false, kReplace) +
                     ",\"completion\":" + Json(in.completion).dump(-1, ' ', false, kReplace) + ",\"example\":";
  line += in.example != nullptr ? in.example->json : "null";
  line += "}\n";
  return line;
}

std::string Describe(int wstatus) {
  if (WIFEXITED(wstatus)) return "exited with status " + std::to_string(WEXITSTATUS(wstatus));
  if (WIFSIGNALED(wstatus)) {
    const int sig = WTERMSIG(wstatus);
    const char* name = strsignal(sig);
    return "was killed by signal " + std::to_string(sig) + (name ? " (" + std::string(name) + ")" : "");
  }
  return "ended (wait status " + std::to_string(wstatus) + ")";
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

RewardCommand::RewardCommand(RewardSpec spec, size_t max_reply_bytes, double stop_grace_seconds)
    : spec_(std::move(spec)), max_reply_bytes_(max_reply_bytes), stop_grace_seconds_(stop_grace_seconds) {
  std::string argv;
  for (const std::string& a : spec_.command) {
    if (!argv.empty()) argv += ' ';
    argv += a;
  }
  if (argv.size() > 200) argv = argv.substr(0, 200) + "...";
  label_ = "reward '" + spec_.name + "' (" + argv + ")";
}

RewardCommand::~RewardCommand() { Stop(); }

Result<std::unique_ptr<RewardCommand>> RewardCommand::Start(const RewardSpec& spec, size_t max_reply_bytes,
                                                            double stop_grace_seconds) {
  if (spec.type != RewardType::kCommand || spec.command.empty()) {
    return Status::InvalidArgument("reward '" + spec.name + "': not a command reward");
  }
  std::unique_ptr<RewardCommand> c(new RewardCommand(spec, max_reply_bytes, stop_grace_seconds));
  FERRY_RETURN_IF_ERROR(c->Spawn());
  return c;
}

Status RewardCommand::Spawn() {
  int in_sv[2] = {-1, -1};
  int out_p[2] = {-1, -1};
  int err_fd = -1;
  auto close_all = [&] {
    CloseFd(in_sv[0]);
    CloseFd(in_sv[1]);
    CloseFd(out_p[0]);
    CloseFd(out_p[1]);
    CloseFd(err_fd);
  };
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, in_sv) != 0 || ::pipe2(out_p, O_CLOEXEC) != 0) {
    const int e = errno;
    close_all();
    return Status::IOError(label_ + ": cannot create its pipes: " + std::strerror(e));
  }
  if (!spec_.stderr_file.empty()) {
    err_fd = ::open(spec_.stderr_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (err_fd < 0) {
      const int e = errno;
      close_all();
      return Status::IOError(label_ + ": cannot open stderr_file " + spec_.stderr_file.string() + ": " +
                             std::strerror(e));
    }
  }
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&fa);
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_adddup2(&fa, in_sv[1], 0);
  posix_spawn_file_actions_adddup2(&fa, out_p[1], 1);
  if (err_fd >= 0) posix_spawn_file_actions_adddup2(&fa, err_fd, 2);
  if (!spec_.working_dir.empty()) posix_spawn_file_actions_addchdir_np(&fa, spec_.working_dir.c_str());
  posix_spawn_file_actions_addclosefrom_np(&fa, 3);
  sigset_t empty, defaults;
  sigemptyset(&empty);
  sigemptyset(&defaults);
  for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD}) sigaddset(&defaults, sig);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  std::vector<char*> argv;
  for (std::string& a : spec_.command) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, argv[0], &fa, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  CloseFd(in_sv[1]);
  CloseFd(out_p[1]);
  CloseFd(err_fd);
  if (rc != 0) {
    close_all();
    const std::string why = label_ + ": cannot start it" +
                            (spec_.working_dir.empty() ? "" : " in " + spec_.working_dir.string()) + ": " +
                            std::strerror(rc);
    return rc == ENOENT ? Status::NotFound(why) : Status::IOError(why);
  }
  pid_ = pid;
  in_fd_ = in_sv[0];
  out_fd_ = out_p[0];
  ::fcntl(in_fd_, F_SETFL, ::fcntl(in_fd_, F_GETFL) | O_NONBLOCK);
  ::fcntl(out_fd_, F_SETFL, ::fcntl(out_fd_, F_GETFL) | O_NONBLOCK);
  failed_ = false;
  pending_.clear();
  return Status::OK();
}

std::string RewardCommand::Reap(double seconds) {
  if (pid_ <= 0) return "is not running";
  const auto deadline = Clock::now() + std::chrono::duration<double>(std::max(seconds, 0.0));
  bool exited = false;
  while (true) {
    siginfo_t info{};
    if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid_) {
      exited = true;
      break;
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // The leader is a zombie or alive: its process group id cannot have been reused.
  ::kill(-pid_, SIGKILL);
  int wstatus = 0;
  while (::waitpid(pid_, &wstatus, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
  CloseFd(in_fd_);
  CloseFd(out_fd_);
  return exited ? Describe(wstatus) : "did not exit within " + Seconds(seconds) + " and was killed";
}

Status RewardCommand::Fail(Status status) {
  if (pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    Reap(0);
  }
  failed_ = true;
  pending_.clear();
  return status;
}

void RewardCommand::Stop() {
  if (pid_ <= 0) return;
  CloseFd(in_fd_);  // EOF on the command's stdin
  Reap(stop_grace_seconds_);
  pending_.clear();
}

Status RewardCommand::Restart() {
  Stop();
  return Spawn();
}

Result<std::vector<double>> RewardCommand::Score(const std::vector<RewardInput>& inputs) {
  if (failed_ || pid_ <= 0) {
    return Status::FailedPrecondition(label_ + ": stopped after an earlier failure; Restart() starts it again");
  }
  // Output nobody asked for (extra lines of an earlier call) is a wrong count.
  if (!pending_.empty()) {
    return Fail(Status::Corruption(label_ + ": wrote more lines than completions: " + Snippet(pending_)));
  }
  {
    char buf[4096];
    const ssize_t n = ::read(out_fd_, buf, sizeof(buf));
    if (n > 0) {
      return Fail(Status::Corruption(
          label_ + ": wrote more lines than completions: " + Snippet(std::string_view(buf, static_cast<size_t>(n)))));
    }
    if (n == 0) {
      const std::string why = Reap(stop_grace_seconds_);
      return Fail(Status::Unavailable(label_ + ": " + why + " between steps"));
    }
  }
  const size_t batch =
      spec_.batch_size > 0 ? static_cast<size_t>(spec_.batch_size) : std::max<size_t>(inputs.size(), 1);
  std::vector<double> rewards;
  rewards.reserve(inputs.size());
  for (size_t begin = 0; begin < inputs.size(); begin += batch) {
    const size_t end = std::min(inputs.size(), begin + batch);
    FERRY_ASSIGN_OR_RETURN(std::vector<double> part, ScoreBatch(inputs, begin, end));
    rewards.insert(rewards.end(), part.begin(), part.end());
  }
  return rewards;
}

Result<std::vector<double>> RewardCommand::ScoreBatch(const std::vector<RewardInput>& inputs, size_t begin,
                                                      size_t end) {
  const size_t count = end - begin;
  std::string request;
  for (size_t i = begin; i < end; ++i) request += RequestLine(inputs[i], i, i + 1 == end);
  std::vector<double> rewards;
  rewards.reserve(count);
  size_t written = 0;
  bool write_closed = false;
  const auto deadline = Clock::now() + std::chrono::duration<double>(spec_.timeout_seconds);
  auto received = [&] {
    return std::to_string(rewards.size()) + " of " + std::to_string(count) + " replies of this batch received";
  };

  while (rewards.size() < count) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return Fail(Status::Unavailable(label_ + ": no reply within timeout_seconds = " + Seconds(spec_.timeout_seconds) +
                                      " (" + received() + "; reply line " + std::to_string(begin + rewards.size() + 1) +
                                      " missing)"));
    }
    pollfd fds[2] = {{out_fd_, POLLIN, 0}, {in_fd_, POLLOUT, 0}};
    const nfds_t nfds = (written < request.size() && !write_closed) ? 2 : 1;
    const int rc = ::poll(fds, nfds, static_cast<int>(std::min<int64_t>(left + 1, INT_MAX)));
    if (rc < 0) {
      if (errno == EINTR) continue;
      return Fail(Status::IOError(label_ + ": poll: " + std::strerror(errno)));
    }
    if (nfds == 2 && fds[1].revents != 0) {
      const ssize_t n = ::send(in_fd_, request.data() + written, request.size() - written, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        written += static_cast<size_t>(n);
      } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        write_closed = true;  // it closed its stdin: read on to learn how it ends
      }
    }
    if (fds[0].revents == 0) continue;
    char buf[65536];
    const ssize_t n = ::read(out_fd_, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return Fail(Status::IOError(label_ + ": reading its stdout: " + std::strerror(errno)));
    }
    if (n == 0) {
      const std::string why = Reap(stop_grace_seconds_);
      return Fail(Status::Unavailable(label_ + ": " + why + " (" + received() + "; reply line " +
                                      std::to_string(begin + rewards.size() + 1) + " missing)"));
    }
    pending_.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    while (true) {
      const size_t nl = pending_.find('\n', start);
      if (nl == std::string::npos) break;
      std::string_view line(pending_.data() + start, nl - start);
      start = nl + 1;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      const size_t line_no = begin + rewards.size() + 1;
      if (rewards.size() == count) {
        return Fail(Status::Corruption(label_ + ": reply line " + std::to_string(line_no) +
                                       " is one more than the completions sent (" + std::to_string(end) +
                                       "): " + Snippet(line)));
      }
      if (line.size() > max_reply_bytes_) {
        return Fail(Status::Corruption(label_ + ": reply line " + std::to_string(line_no) + " has " +
                                       std::to_string(line.size()) + " bytes; at most " +
                                       std::to_string(max_reply_bytes_) + ": " + Snippet(line)));
      }
      Result<double> r = ParseReply(line);
      if (!r.ok()) {
        return Fail(Status::Corruption(label_ + ": reply line " + std::to_string(line_no) + ": " +
                                       r.status().message() + ": " + Snippet(line)));
      }
      rewards.push_back(*r);
    }
    pending_.erase(0, start);
    if (pending_.size() > max_reply_bytes_) {
      return Fail(Status::Corruption(label_ + ": reply line " + std::to_string(begin + rewards.size() + 1) +
                                     " is longer than " + std::to_string(max_reply_bytes_) +
                                     " bytes: " + Snippet(pending_)));
    }
  }
  if (!pending_.empty()) {
    return Fail(Status::Corruption(label_ + ": reply line " + std::to_string(end + 1) +
                                   " is one more than the completions sent (" + std::to_string(end) +
                                   "): " + Snippet(pending_)));
  }
  if (written < request.size()) {
    return Fail(Status::Corruption(label_ + ": answered " + std::to_string(count) +
                                   " lines before reading all of its input (a wrong count)"));
  }
  return rewards;
}

}  // namespace ferry::run
