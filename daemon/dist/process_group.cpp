#include "daemon/dist/process_group.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL  // a LibTorch built with NCCL (PyPI's CUDA torch)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

namespace ferry::dist {
namespace {

using Clock = std::chrono::steady_clock;

#ifdef USE_C10D_NCCL
using Collectives = c10d::Backend;  // ProcessGroupGloo's and ProcessGroupNCCL's base (torch >= 2)

// A collective that times out throws from wait() (as Gloo's do) instead of NCCL's watchdog
// ending the process, so that the rank at fault can be named. Set while the program starts,
// before any thread could read the environment (setenv beside a getenv is a data race); a
// user's own setting stays.
[[maybe_unused]] const bool kNcclBlockingWait = [] {
  ::setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  return true;
}();
#else
using Collectives = c10d::ProcessGroupGloo;
#endif

std::string FirstLine(const std::string& s) {
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

Result<int> IntVar(const std::function<const char*(const char*)>& getenv, const char* name, int lo, int hi,
                   std::optional<int> fallback) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') {
    if (fallback) return *fallback;
    return Status::InvalidArgument(std::string("environment variable ") + name + " is not set (torchrun sets it)");
  }
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi) {
    return Status::InvalidArgument(std::string("environment variable ") + name + "=\"" + v +
                                   "\": not a whole number in " + std::to_string(lo) + ".." + std::to_string(hi));
  }
  return static_cast<int>(x);
}

std::string HostName() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

// The local address this host reaches `master` from (a UDP socket "connected" to it sends
// nothing): the address Gloo binds, so that ranks on other hosts can reach it.
Result<std::string> AddressTowards(const std::string& master, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(master.c_str(), service.c_str(), &hints, &res); rc != 0 || res == nullptr) {
    return Status::InvalidArgument("MASTER_ADDR \"" + master + "\": " + ::gai_strerror(rc));
  }
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  std::string out;
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char text[INET_ADDRSTRLEN] = {};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr) {
      out = text;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  if (out.empty()) return Status::Unavailable("no route from this host to MASTER_ADDR \"" + master + "\"");
  return out;
}

// The rendezvous store: a FileStore at the launch's file (numWorkers -1: it never deletes the
// file; the launcher removes its directory), or a TCPStore that rank 0 hosts (`server`), or
// torchrun's agent's, under this attempt's prefix.
c10::intrusive_ptr<c10d::Store> ConnectStore(const Launch& l, bool server, std::chrono::milliseconds timeout) {
  if (!l.rendezvous_file.empty()) {
    auto file = c10::make_intrusive<c10d::FileStore>(l.rendezvous_file, -1);
    file->setTimeout(timeout);
    return file;
  }
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(l.master_port);
  so.isServer = server && !l.agent_store;
  so.numWorkers = so.isServer ? c10::optional<std::size_t>(static_cast<size_t>(l.world_size)) : c10::nullopt;
  so.waitWorkers = false;
  so.timeout = timeout;
  auto tcp = c10::make_intrusive<c10d::TCPStore>(l.master_addr, so);
  if (!l.agent_store) return tcp;
  return c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(l.restart_count), tcp);
}

// With a rendezvous file, rank r's heartbeat is a counter overwritten in place in a file beside
// it (c10d's FileStore appends every add, so heartbeats in it would grow the file without end).
std::string HeartbeatFile(const Launch& l, int r) { return l.rendezvous_file + ".hb" + std::to_string(r); }

// The counter in `path`; 0 while the file is missing or short.
int64_t ReadHeartbeatFile(const std::string& path) {
  int64_t n = 0;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  if (::pread(fd, &n, sizeof(n), 0) != static_cast<ssize_t>(sizeof(n))) n = 0;
  ::close(fd);
  return n;
}

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string String(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

}  // namespace

Result<int> FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Status::IOError(std::string("choosing a free port: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) return Status::IOError(std::string("choosing a free port: ") + std::strerror(err));
  return static_cast<int>(ntohs(a.sin_port));
}

std::string Launch::Rendezvous() const {
  if (!rendezvous_file.empty()) return "the file " + rendezvous_file;
  return "MASTER_ADDR:MASTER_PORT " + master_addr + ":" + std::to_string(master_port) +
         (agent_store ? " (torchrun's store)" : "");
}

Result<Launch> LaunchFromEnv(const std::function<const char*(const char*)>& getenv_fn) {
  const std::function<const char*(const char*)> getenv =
      getenv_fn ? getenv_fn : [](const char* name) -> const char* { return std::getenv(name); };
  Launch l;
  const char* rank = getenv("RANK");
  const char* world = getenv("WORLD_SIZE");
  if ((rank == nullptr || *rank == '\0') && (world == nullptr || *world == '\0')) return l;
  FERRY_ASSIGN_OR_RETURN(l.world_size, IntVar(getenv, "WORLD_SIZE", 1, 1 << 16, std::nullopt));
  FERRY_ASSIGN_OR_RETURN(l.rank, IntVar(getenv, "RANK", 0, l.world_size - 1, std::nullopt));
  FERRY_ASSIGN_OR_RETURN(l.local_world_size, IntVar(getenv, "LOCAL_WORLD_SIZE", 1, l.world_size, 1));
  FERRY_ASSIGN_OR_RETURN(l.local_rank, IntVar(getenv, "LOCAL_RANK", 0, l.world_size - 1, 0));
  if (!l.distributed()) return l;
  if (const char* file = getenv("FERRY_RENDEZVOUS_FILE"); file != nullptr && *file != '\0') {
    if (l.local_world_size != l.world_size) {
      return Status::InvalidArgument(
          "FERRY_RENDEZVOUS_FILE is for ranks of one host, but LOCAL_WORLD_SIZE=" + std::to_string(l.local_world_size) +
          " is not WORLD_SIZE=" + std::to_string(l.world_size) + " (ranks on several hosts meet at MASTER_ADDR)");
    }
    l.rendezvous_file = file;
    return l;
  }
  const char* addr = getenv("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0') {
    return Status::InvalidArgument("environment variable MASTER_ADDR is not set (WORLD_SIZE=" +
                                   std::to_string(l.world_size) + "; torchrun sets it)");
  }
  l.master_addr = addr;
  FERRY_ASSIGN_OR_RETURN(l.master_port, IntVar(getenv, "MASTER_PORT", 1, 65535, std::nullopt));
  const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
  l.agent_store = agent != nullptr && std::string(agent) == "True";  // torch compares with str(True)
  if (l.agent_store) {
    FERRY_ASSIGN_OR_RETURN(l.restart_count, IntVar(getenv, "TORCHELASTIC_RESTART_COUNT", 0, 1 << 30, 0));
  }
  return l;
}

struct ProcessGroup::Impl {
  Launch launch;
  GroupOptions options;
  c10::intrusive_ptr<c10d::Store> store;  // the main thread's connection
  c10::intrusive_ptr<c10d::Store> keys;   // store under "<prefix>/ferry/"
  c10::intrusive_ptr<Collectives> pg;
  // NCCL's collectives take tensors on the rank's device: a host tensor travels through it.
  std::optional<at::Device> device;
  std::vector<RankInfo> ranks;

  at::Tensor ToGroup(const at::Tensor& t) const { return device && !t.is_cuda() ? t.to(*device) : t; }

  std::thread heartbeat;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::atomic<bool> failed{false};  // a collective failed: NCCL's communicators are aborted, not flushed

  c10::intrusive_ptr<c10d::Store> Prefixed(const c10::intrusive_ptr<c10d::Store>& s) const {
    return c10::make_intrusive<c10d::PrefixStore>(options.prefix + "/ferry", s);
  }

  // Beats once here (a rank's first beat is in place before it joins any collective: a count
  // never seen means "never beat", not "stopped"), then every kHeartbeatInterval from a thread.
  // Errors: kIOError naming this rank's heartbeat file when it cannot be written.
  Status StartHeartbeat() {
    // A beat adds to "hb/<rank>" in the store, or (rendezvous file) counts in this rank's file.
    c10::intrusive_ptr<c10d::Store> store;
    int fd = -1;
    const std::string key = "hb/" + std::to_string(launch.rank);
    if (launch.rendezvous_file.empty()) {
      store = Prefixed(ConnectStore(launch, /*server=*/false, std::chrono::seconds(10)));  // throws: Join's
      store->add(key, 1);
    } else {
      const std::string path = HeartbeatFile(launch, launch.rank);
      // Not through a link someone else placed there: its target would be truncated.
      fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
      const int64_t first = 1;
      if (fd < 0 || ::pwrite(fd, &first, sizeof(first), 0) != static_cast<ssize_t>(sizeof(first))) {
        const int err = errno;
        if (fd >= 0) ::close(fd);
        return Status::IOError("rank " + std::to_string(launch.rank) + ": writing its heartbeat file " + path + ": " +
                               std::strerror(err));
      }
    }
    heartbeat = std::thread([this, store, fd, key] {
      int64_t count = 1;
      std::unique_lock<std::mutex> lock(mu);
      while (!cv.wait_for(lock, kHeartbeatInterval, [this] { return stopping; })) {
        lock.unlock();
        if (fd >= 0) {
          ++count;
          if (::pwrite(fd, &count, sizeof(count), 0) != static_cast<ssize_t>(sizeof(count))) --count;
        } else {
          try {
            store->add(key, 1);
          } catch (const std::exception&) {
            // The store (rank 0) is gone: the collectives will say so.
          }
        }
        lock.lock();
      }
      if (fd >= 0) ::close(fd);
    });
    return Status::OK();
  }

  // Rank r's heartbeat count, read through `s` (a connection to the store) or from its file.
  int64_t Beats(c10d::Store& s, int r) const {
    if (!launch.rendezvous_file.empty()) return ReadHeartbeatFile(HeartbeatFile(launch, r));
    return s.add("hb/" + std::to_string(r), 0);
  }

  std::string DescribeRank(int r) const {
    if (r >= 0 && static_cast<size_t>(r) < ranks.size()) {
      return "rank " + std::to_string(r) + " (host " + ranks[static_cast<size_t>(r)].host + ", pid " +
             std::to_string(ranks[static_cast<size_t>(r)].pid) + ")";
    }
    return "rank " + std::to_string(r);
  }

  // Why a collective failed, from the store: a posted error, a heartbeat that stopped, or the
  // store itself gone. Empty when nothing points at a rank.
  std::string Diagnose() const {
    try {
      c10::intrusive_ptr<c10d::Store> s = Prefixed(ConnectStore(launch, false, std::chrono::seconds(5)));
      auto posted = [&]() -> std::string {
        for (int r = 0; r < launch.world_size; ++r) {
          if (r == launch.rank) continue;
          const std::string k = "err/" + std::to_string(r);
          if (s->check({k})) return DescribeRank(r) + " failed: " + String(s->get(k));
        }
        return "";
      };
      if (std::string p = posted(); !p.empty()) return p;
      std::vector<int64_t> before(static_cast<size_t>(launch.world_size));
      for (int r = 0; r < launch.world_size; ++r) before[static_cast<size_t>(r)] = Beats(*s, r);
      std::this_thread::sleep_for(kHeartbeatInterval * 5);
      if (std::string p = posted(); !p.empty()) return p;
      std::string stopped;
      for (int r = 0; r < launch.world_size; ++r) {
        if (r == launch.rank || Beats(*s, r) != before[static_cast<size_t>(r)]) continue;
        stopped += (stopped.empty() ? "" : ", ") + DescribeRank(r);
      }
      if (!stopped.empty()) return stopped + " stopped answering (killed, crashed or hung)";
      return "";
    } catch (const std::exception& e) {
      if (!launch.rendezvous_file.empty()) {
        return "the rendezvous file " + launch.rendezvous_file + " can no longer be read (" + FirstLine(e.what()) + ")";
      }
      if (launch.agent_store) {
        return "torchrun's rendezvous store at " + launch.master_addr + ":" + std::to_string(launch.master_port) +
               " no longer answers (its agent is gone)";
      }
      return DescribeRank(0) + " is gone (the rendezvous store it hosts at " + launch.master_addr + ":" +
             std::to_string(launch.master_port) + " no longer answers)";
    }
  }

  Status Failed(const std::string& what, const std::exception& e) const {
    const std::string why = Diagnose();
    const std::string cause = FirstLine(e.what());
    if (why.empty()) {
      return Status::Unavailable(what + ": the ranks did not meet within " +
                                 std::to_string(options.timeout.count() / 1000) + " s (" + cause + ")");
    }
    return Status::Unavailable(what + ": " + why + " (" + DescribeRank(launch.rank) + " saw: " + cause + ")");
  }

  template <typename Fn>
  Status Run(const std::string& what, Fn&& fn) {
    try {
      fn();
      return Status::OK();
    } catch (const std::exception& e) {
      failed = true;
      return Failed(what, e);
    }
  }

  // A step of this rank alone, a copy to or from its device (`step`: "moving the tensor to",
  // "copying the result back from"): its failure is this rank's, not a peer's. The message is
  // built only then.
  template <typename Fn>
  Status Local(const std::string& what, const char* step, Fn&& fn) const {
    try {
      fn();
      return Status::OK();
    } catch (const std::exception& e) {
      return Status::Internal(what + ": " + step + " " + DescribeDevice() + ": " + FirstLine(e.what()));
    }
  }

  // `op` on `t` in place, through the rank's device on NCCL.
  template <typename Op>
  Status InPlace(at::Tensor& t, const std::string& what, Op&& op) {
    std::vector<at::Tensor> v(1);
    FERRY_RETURN_IF_ERROR(Local(what, "moving the tensor to", [&] { v[0] = ToGroup(t); }));
    FERRY_RETURN_IF_ERROR(Run(what, [&] { op(v); }));
    if (v[0].is_same(t)) return Status::OK();
    return Local(what, "copying the result back from", [&] { t.copy_(v[0]); });
  }

  std::string DescribeDevice() const { return device ? device->str() : "the CPU"; }
};

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ProcessGroup::~ProcessGroup() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  if (impl_->heartbeat.joinable()) impl_->heartbeat.join();
#ifdef USE_C10D_NCCL
  // NCCL's communicators end cleanly (torch warns when a group is destroyed without this):
  // flushed after a run that went well, aborted after a failed collective (a flush could wait
  // for a peer that is gone).
  if (impl_->device && impl_->pg) {
    try {
      if (impl_->failed) {
        impl_->pg->abort();
      } else {
        impl_->pg->shutdown();
      }
    } catch (const std::exception&) {
    }
  }
#endif
}

namespace {

// Why this ferryd cannot run `launch` on NCCL, said plainly; empty when it can.
std::string NcclRefusal(const Launch& launch) {
  const std::string head = "backend \"nccl\": ";
  const at::CUDAHooksInterface& cuda = at::detail::getCUDAHooks();
  if (!cuda.hasCUDART()) {
    return head +
           "this LibTorch is a CPU build (Debian's libtorch-dev is), so it has no CUDA and no NCCL; use \"gloo\"";
  }
#ifndef USE_C10D_NCCL
  static_cast<void>(launch);
  return head + "this LibTorch was built without NCCL (no USE_C10D_NCCL); use \"gloo\"";
#else
  const int devices = cuda.getNumGPUs();
  if (devices == 0) return head + "this host has no CUDA device; use \"gloo\"";
  if (launch.local_world_size > devices) {
    return head + std::to_string(launch.local_world_size) + " ranks on this host but " + std::to_string(devices) +
           " CUDA device(s): NCCL runs one rank per device and refuses two ranks on one GPU (\"Duplicate GPU "
           "detected\"); use \"gloo\", or one device per local rank";
  }
  if (launch.local_rank >= devices) {
    return head + "LOCAL_RANK=" + std::to_string(launch.local_rank) + " but this host has " + std::to_string(devices) +
           " CUDA device(s) (cuda:0 to cuda:" + std::to_string(devices - 1) +
           "): NCCL runs rank r of a host on device r; check LOCAL_RANK and LOCAL_WORLD_SIZE";
  }
  return "";
#endif
}

// The process group of `options.backend`, on the store under "<prefix>/pg".
c10::intrusive_ptr<Collectives> NewGroup(const Launch& launch, const GroupOptions& options, const std::string& bind,
                                         const c10::intrusive_ptr<c10d::Store>& store) {
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(options.prefix + "/pg", store);
#ifdef USE_C10D_NCCL
  if (options.backend == "nccl") {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options.timeout;
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, launch.rank, launch.world_size, opts);
  }
#endif
  auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  opts->devices.push_back(bind.empty() ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                       : c10d::ProcessGroupGloo::createDeviceForHostname(bind));
  opts->threads = 1;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, launch.rank, launch.world_size, opts);
}

}  // namespace

Result<std::unique_ptr<ProcessGroup>> ProcessGroup::Join(const Launch& launch, const GroupOptions& options) {
  const bool nccl = options.backend == "nccl";
  if (!nccl && options.backend != "gloo") {
    return Status::InvalidArgument("backend \"" + options.backend + "\": not \"gloo\" or \"nccl\"");
  }
  if (nccl) {
    if (std::string why = NcclRefusal(launch); !why.empty()) return Status::Unsupported(why);
  }
  auto impl = std::make_unique<Impl>();
  impl->launch = launch;
  impl->options = options;
  if (nccl) impl->device = at::Device(at::kCUDA, static_cast<at::DeviceIndex>(launch.local_rank));
  std::string bind;
  if (!launch.rendezvous_file.empty()) {
    bind = "127.0.0.1";  // ranks of one host: loopback, whatever GLOO_SOCKET_IFNAME says
  } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); !nccl && (ifname == nullptr || *ifname == '\0')) {
    FERRY_ASSIGN_OR_RETURN(bind, AddressTowards(launch.master_addr, launch.master_port));
  }
  Status heartbeat;
  try {
    impl->store = ConnectStore(launch, launch.rank == 0, options.timeout);
    impl->keys = impl->Prefixed(impl->store);
    impl->pg = NewGroup(launch, options, bind, impl->store);
    heartbeat = impl->StartHeartbeat();
  } catch (const std::exception& e) {
    std::string hint;
    if (launch.agent_store && TORCH_VERSION_MAJOR < 2) {
      // torch >= 2's TCPStore servers first ask a client to validate itself; 1.13's cannot.
      hint = "; if torchrun comes from torch >= 2, its store does not talk to this LibTorch " +
             std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) +
             ": run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and its c10d rendezvous (--standalone, or "
             "--rdzv-backend c10d), so that rank 0 hosts the store, or start local ranks with `ferryd train "
             "--nproc-per-node N`";
    }
    return Status::Unavailable("rank " + std::to_string(launch.rank) + " of " + std::to_string(launch.world_size) +
                               ": the rendezvous at " + launch.Rendezvous() + " did not complete (" +
                               FirstLine(e.what()) + ")" + hint);
  }
  FERRY_RETURN_IF_ERROR(heartbeat);
  auto group = std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> who,
                         group->AllGatherBytes(HostName() + " " + std::to_string(::getpid()), "the rendezvous"));
  for (int r = 0; r < launch.world_size; ++r) {
    const std::string& w = who[static_cast<size_t>(r)];
    const size_t sp = w.rfind(' ');
    RankInfo info;
    info.rank = r;
    info.host = w.substr(0, sp);
    info.pid = sp == std::string::npos ? 0 : std::atoll(w.c_str() + sp + 1);
    group->impl_->ranks.push_back(info);
  }
  return group;
}

int ProcessGroup::rank() const { return impl_->launch.rank; }
int ProcessGroup::size() const { return impl_->launch.world_size; }
int ProcessGroup::local_rank() const { return impl_->launch.local_rank; }
const std::string& ProcessGroup::backend() const { return impl_->options.backend; }
const std::vector<RankInfo>& ProcessGroup::ranks() const { return impl_->ranks; }
std::string ProcessGroup::Describe(int r) const { return impl_->DescribeRank(r); }

Status ProcessGroup::AllReduceSum(at::Tensor& t, const std::string& what) {
  return impl_->InPlace(t, what, [&](std::vector<at::Tensor>& v) { impl_->pg->allreduce(v)->wait(); });
}

Result<at::Tensor> ProcessGroup::AllGather(const at::Tensor& t, const std::string& what) {
  std::vector<at::Tensor> in(1);
  std::vector<std::vector<at::Tensor>> out(1);
  FERRY_RETURN_IF_ERROR(impl_->Local(what, "moving the tensor to", [&] {
    in[0] = impl_->ToGroup(t.contiguous());
    for (int r = 0; r < size(); ++r) out[0].push_back(at::empty_like(in[0]));
  }));
  FERRY_RETURN_IF_ERROR(impl_->Run(what, [&] { impl_->pg->allgather(out, in)->wait(); }));
  at::Tensor all;
  FERRY_RETURN_IF_ERROR(
      impl_->Local(what, "copying the result back from", [&] { all = at::stack(out[0]).to(t.device()); }));
  return all;
}

Status ProcessGroup::Broadcast(at::Tensor& t, int root, const std::string& what) {
  return impl_->InPlace(t, what, [&](std::vector<at::Tensor>& v) {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    impl_->pg->broadcast(v, o)->wait();
  });
}

namespace {

// The most bytes a rank sends in one AllGatherBytes or BroadcastBytes (the start state's header,
// a host name and pid): a length beyond it, or below 0, is a peer's corruption, not an allocation.
constexpr int64_t kMaxSharedBytes = int64_t{1} << 26;

Status CheckSharedLength(int64_t n, const std::string& who, const std::string& what) {
  if (n >= 0 && n <= kMaxSharedBytes) return Status::OK();
  return Status::Corruption(what + ": " + who + " sent a length of " + std::to_string(n) + " bytes (limit " +
                            std::to_string(kMaxSharedBytes) + ")");
}

}  // namespace

Result<std::vector<std::string>> ProcessGroup::AllGatherBytes(const std::string& bytes, const std::string& what) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  FERRY_ASSIGN_OR_RETURN(at::Tensor lens, AllGather(len, what));
  for (int r = 0; r < size(); ++r)
    FERRY_RETURN_IF_ERROR(CheckSharedLength(lens[r][0].item<int64_t>(), Describe(r), what));
  const int64_t longest = std::max<int64_t>(lens.max().item<int64_t>(), 1);
  at::Tensor buf = at::zeros({longest}, at::kByte);
  std::memcpy(buf.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  FERRY_ASSIGN_OR_RETURN(at::Tensor all, AllGather(buf, what));
  std::vector<std::string> out;
  for (int r = 0; r < size(); ++r) {
    const auto* p = all[r].data_ptr<uint8_t>();
    out.emplace_back(reinterpret_cast<const char*>(p), static_cast<size_t>(lens[r][0].item<int64_t>()));
  }
  return out;
}

Result<std::string> ProcessGroup::BroadcastBytes(const std::string& bytes, int root, const std::string& what) {
  at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  FERRY_RETURN_IF_ERROR(Broadcast(len, root, what));
  const int64_t n = len.item<int64_t>();
  FERRY_RETURN_IF_ERROR(CheckSharedLength(n, Describe(root), what));
  at::Tensor buf = at::zeros({std::max<int64_t>(n, 1)}, at::kByte);
  if (rank() == root) std::memcpy(buf.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  FERRY_RETURN_IF_ERROR(Broadcast(buf, root, what));
  return std::string(reinterpret_cast<const char*>(buf.data_ptr<uint8_t>()), static_cast<size_t>(n));
}

Status ProcessGroup::Post(const std::string& key, const std::string& value) {
  return impl_->Run("posting " + key, [&] { impl_->keys->set("post/" + key, Bytes(value)); });
}

Result<std::string> ProcessGroup::Await(const std::string& key, int poster, const std::string& what) {
  const std::string k = "post/" + key;
  int64_t last_beat = -1;
  Clock::time_point last_change = Clock::now();
  try {
    for (;;) {
      try {
        impl_->keys->wait({k}, std::chrono::milliseconds(1000));
        return String(impl_->keys->get(k));
      } catch (const c10::Error&) {
        // Not posted within a second: still waiting, as long as the poster's heartbeat goes on.
      }
      // A poster that failed cleanly said why (ReportFailure): named with its error.
      if (const std::string err = "err/" + std::to_string(poster); impl_->keys->check({err})) {
        return Status::Unavailable(what + ": " + impl_->DescribeRank(poster) +
                                   " failed: " + String(impl_->keys->get(err)));
      }
      const int64_t beat = impl_->Beats(*impl_->keys, poster);
      if (beat != last_beat) {
        last_beat = beat;
        last_change = Clock::now();
      } else if (Clock::now() - last_change > kHeartbeatInterval * 20) {
        return Status::Unavailable(what + ": " + impl_->DescribeRank(poster) +
                                   " stopped answering (killed, crashed or hung)");
      }
    }
  } catch (const std::exception& e) {
    return impl_->Failed(what, e);
  }
}

void ProcessGroup::ReportFailure(const std::string& message) {
  try {
    impl_->keys->set("err/" + std::to_string(rank()), Bytes(FirstLine(message)));
  } catch (const std::exception&) {
  }
}

}  // namespace ferry::dist
