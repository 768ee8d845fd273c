#include "daemon/ferryd/local_ranks.h"

#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace ferry::ferryd {
namespace {

std::atomic<int> g_forward_signal{0};

// A signal the kernel sent (SI_KERNEL: a terminal's Ctrl-C, Ctrl-\\ or hang-up, which go to the
// whole foreground process group) reached the ranks too: passing it on would make it their
// second (a second SIGINT exits at once, with no final checkpoint). One a process sent to the
// launcher (kill, a supervisor) is passed on.
void OnSignal(int sig, siginfo_t* info, void*) {
  if (info != nullptr && info->si_code == SI_KERNEL) return;
  g_forward_signal.store(sig);
}

int ExitCode(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The ranks' rendezvous: c10d's FileStore in a directory of its own (mkdtemp: mode 0700), so
// that no socket listens for it; removed with its file when the ranks have ended.
class RendezvousDir {
 public:
  static Result<RendezvousDir> Create() {
    const char* tmp = std::getenv("TMPDIR");
    const std::string parent = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    std::string path = parent + "/ferryd-ranks-XXXXXX";
    if (::mkdtemp(path.data()) == nullptr) {
      return Status::IOError("creating the ranks' rendezvous directory in " + parent +
                             " (TMPDIR): " + std::strerror(errno));
    }
    return RendezvousDir(path);
  }
  RendezvousDir(RendezvousDir&& o) noexcept : dir_(std::move(o.dir_)) { o.dir_.clear(); }
  RendezvousDir& operator=(RendezvousDir&&) = delete;
  ~RendezvousDir() {  // the store and the ranks' heartbeat files, then the directory
    if (dir_.empty()) return;
    if (DIR* d = ::opendir(dir_.c_str()); d != nullptr) {
      while (const dirent* e = ::readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          ::unlinkat(::dirfd(d), e->d_name, 0);
        }
      }
      ::closedir(d);
    }
    ::rmdir(dir_.c_str());
  }
  std::string file() const { return dir_ + "/store"; }

 private:
  explicit RendezvousDir(std::string dir) : dir_(std::move(dir)) {}
  std::string dir_;
};

}  // namespace

Result<int> RunLocalRanks(int nproc, const std::vector<std::string>& argv, std::chrono::seconds grace) {
  FERRY_ASSIGN_OR_RETURN(RendezvousDir rendezvous, RendezvousDir::Create());
  const std::string store = rendezvous.file();
  struct sigaction sa {};
  sa.sa_sigaction = OnSignal;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  // Passed on to the ranks; the launcher itself stays to reap them and remove the rendezvous.
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) ::sigaction(sig, &sa, nullptr);
  std::fprintf(stderr, "ferryd: starting %d local ranks (rendezvous file %s)\n", nproc, store.c_str());
  std::fflush(nullptr);
  std::vector<pid_t> pids;
  const pid_t launcher = ::getpid();
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      return Status::IOError(std::string("starting rank ") + std::to_string(r) + ": fork: " + std::strerror(err));
    }
    if (pid == 0) {
      // The ranks stop (SIGTERM: at a step's end, with a checkpoint) if the launcher dies
      // (SIGKILL) without passing anything on.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) ::_exit(1);  // it died before prctl
      const std::string n = std::to_string(nproc), rank = std::to_string(r);
      ::setenv("RANK", rank.c_str(), 1);
      ::setenv("LOCAL_RANK", rank.c_str(), 1);
      ::setenv("WORLD_SIZE", n.c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", n.c_str(), 1);
      ::setenv("FERRY_RENDEZVOUS_FILE", store.c_str(), 1);
      // NCCL's bootstrap sockets on loopback too (it would take the first other interface);
      // a user's own choice stays.
      ::setenv("NCCL_SOCKET_IFNAME", "lo", /*overwrite=*/0);
      for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT}) ::signal(sig, SIG_DFL);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::fprintf(stderr, "ferryd: rank %d: cannot run %s: %s\n", r, args[0], std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  int exit_code = 0;
  int failed_rank = -1;
  size_t running = pids.size();
  std::chrono::steady_clock::time_point deadline{};
  bool killed = false;
  while (running > 0) {
    if (const int sig = g_forward_signal.exchange(0); sig != 0) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, sig);
      }
    }
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (pids[r] != done) continue;
        pids[r] = -1;
        --running;
        const int code = ExitCode(status);
        if (code != 0 && failed_rank < 0) {
          failed_rank = static_cast<int>(r);
          exit_code = code;
          deadline = std::chrono::steady_clock::now() + grace;
          std::fprintf(stderr, "ferryd: rank %zu (pid %d) ended with %s %d; the others get %lld s to end\n", r,
                       static_cast<int>(done), WIFSIGNALED(status) ? "signal" : "exit code",
                       WIFSIGNALED(status) ? WTERMSIG(status) : code, static_cast<long long>(grace.count()));
        }
      }
      continue;
    }
    if (failed_rank >= 0 && !killed && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "ferryd: killing the ranks still running after rank %d failed\n", failed_rank);
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return exit_code;
}

}  // namespace ferry::ferryd
