// Starting ferryd, in the foreground or detached (daemon/control/launcher.h).
#include "daemon/control/launcher.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <system_error>
#include <thread>
#include <utility>

#include "daemon/control/client.h"
#include "daemon/control/run_dir.h"

namespace ferry::control {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Lines of the log an early exit's error quotes.
constexpr size_t kLogTailLines = 10;

std::string Errno(int err) { return std::strerror(err); }

// The last `lines` lines of `log`, each indented by two spaces and ending in a newline.
std::string LogTail(const fs::path& log, size_t lines) {
  std::ifstream in(log);
  std::deque<std::string> last;
  std::string line;
  while (std::getline(in, line)) {
    last.push_back(line);
    if (last.size() > lines) last.pop_front();
  }
  std::string out;
  for (const auto& l : last) out += "  " + l + "\n";
  return out;
}

// "120 s", or "1500 ms" when not whole seconds.
std::string DurationText(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return std::to_string(d.count() / 1000) + " s";
  return std::to_string(d.count()) + " ms";
}

// The integer `key` of a status reply; -1 when absent or not an integer.
int64_t IntField(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : -1;
}

// A file descriptor closed with its owner.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { Close(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  void Close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

// One status request to DIR's control socket; nullopt when nothing answered.
std::optional<nlohmann::json> Probe(const fs::path& run_dir, std::chrono::milliseconds timeout) {
  ControlClientOptions o;
  o.run_dir = run_dir;
  auto client = ControlClient::Connect(o);
  if (!client.ok()) return std::nullopt;
  auto reply = (*client)->Call(ControlCommand::kStatus, timeout);
  if (!reply.ok()) return std::nullopt;
  return std::move(*reply);
}

// Fills in how the process ended from its wait status, and the error saying so.
void Exited(int wait_status, DetachedStart& start) {
  start.state = DetachedState::kExited;
  std::string how;
  if (WIFEXITED(wait_status)) {
    start.exit_code = WEXITSTATUS(wait_status);
    how = "with code " + std::to_string(start.exit_code);
  } else {
    start.signal = WTERMSIG(wait_status);
    how = "on signal " + std::to_string(start.signal);
  }
  start.error = Status::Unavailable("ferryd pid " + std::to_string(start.pid) + " exited " + how +
                                    " before its control socket answered; " + start.log.string() + " ends with:\n" +
                                    LogTail(start.log, kLogTailLines));
}

}  // namespace

std::vector<std::string> FerrydTrainArgv(const FerrydTrainOptions& o) {
  std::vector<std::string> args = {o.ferryd.string(), "train", "--config",
                                   o.config.string(), "--dir", o.run_dir.string()};
  if (o.max_steps > 0) {
    args.push_back("--max-steps");
    args.push_back(std::to_string(o.max_steps));
  }
  if (!o.publish.empty()) {
    args.push_back("--publish");
    args.push_back(o.publish);
  }
  if (o.nproc_per_node > 1) {
    args.push_back("--nproc-per-node");
    args.push_back(std::to_string(o.nproc_per_node));
  }
  return args;
}

Status ExecFerrydTrain(const FerrydTrainOptions& options) {
  std::vector<std::string> args = FerrydTrainArgv(options);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  ::execv(options.ferryd.c_str(), argv.data());
  return Status::IOError("cannot run " + options.ferryd.string() + ": " + Errno(errno));
}

Result<DetachedStart> StartDetached(const FerrydTrainOptions& train, const DetachOptions& options) {
  const fs::path& dir = train.run_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": cannot create the run directory: " + ec.message());
  DetachedStart start;
  start.log = dir / kLogFileName;
  Fd log(::open(start.log.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644));
  if (log.get() < 0) return Status::IOError(start.log.string() + ": cannot open: " + Errno(errno));
  Fd null_in(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  int report_fds[2];
  if (null_in.get() < 0 || ::pipe2(report_fds, O_CLOEXEC) != 0) {
    return Status::IOError("cannot start ferryd: " + Errno(errno));
  }
  Fd report_in(report_fds[0]), report_out(report_fds[1]);

  std::vector<std::string> args = FerrydTrainArgv(train);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);  // nothing buffered is written twice
  start.pid = ::fork();
  if (start.pid < 0) return Status::IOError("cannot fork: " + Errno(errno));
  if (start.pid == 0) {
    // The child: only async-signal-safe calls until exec.
    ::setsid();
    ::dup2(null_in.get(), STDIN_FILENO);
    ::dup2(log.get(), STDOUT_FILENO);
    ::dup2(log.get(), STDERR_FILENO);
    ::execv(argv[0], argv.data());
    const int err = errno;
    (void)!::write(report_out.get(), &err, sizeof(err));
    ::_exit(127);
  }
  report_out.Close();
  log.Close();
  null_in.Close();
  // exec closes the pipe (close-on-exec) without writing: then this read returns 0.
  int exec_errno = 0;
  ssize_t n;
  while ((n = ::read(report_in.get(), &exec_errno, sizeof(exec_errno))) < 0 && errno == EINTR) {
  }
  report_in.Close();
  if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
    ::waitpid(start.pid, nullptr, 0);
    return Status::IOError("cannot run " + train.ferryd.string() + ": " + Errno(exec_errno));
  }

  const auto deadline = Clock::now() + options.wait;
  for (;;) {
    int wait_status = 0;
    if (::waitpid(start.pid, &wait_status, WNOHANG) == start.pid) {
      Exited(wait_status, start);
      return start;
    }
    if (!start.last_step) {
      if (auto status = Probe(dir, options.probe_timeout)) {
        const int64_t step = IntField(*status, "step"), total = IntField(*status, "total_steps");
        if (total <= 0 || step < total) {
          start.state = DetachedState::kAnswering;
          start.status = std::move(*status);
          return start;
        }
        start.last_step = total;  // nothing to do: wait for the exit
      }
    }
    if (Clock::now() >= deadline) {
      start.state = DetachedState::kTimedOut;
      start.error =
          Status::Unavailable("ferryd pid " + std::to_string(start.pid) +
                              (start.last_step ? " is at the run's last step but did not exit within "
                                               : " is running but its control socket did not answer within ") +
                              DurationText(options.wait) + " (see " + start.log.string() + ")");
      return start;
    }
    std::this_thread::sleep_for(options.poll_interval);
  }
}

}  // namespace ferry::control
