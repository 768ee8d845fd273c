// Data-parallel ranks on PyTorch's c10d: torchrun's environment, the rendezvous through c10d's
// TCPStore (or its FileStore, for ranks on one host), and a Gloo (CPU) or NCCL (CUDA, where
// the LibTorch has it) process group, with the few collectives the trainer needs. Whatever the
// backend, a collective that fails because a peer died, hung or gave up is turned into an error
// that names the rank, its host and pid.
//
// How a failed peer is named: every rank keeps a heartbeat in the store (a counter it adds to
// from a thread of its own, every kHeartbeatInterval) and, when it fails cleanly, posts its
// error there (ReportFailure) before it exits. A collective that throws then looks for a
// posted error, else for a heartbeat that stopped (killed, or hung: SIGSTOP stops every thread
// of a process); a TCPStore that no longer answers means rank 0, which hosts it, is gone.
//
// Store keys (under GroupOptions::prefix): rank/<r> = "<host> <pid>", hb/<r> the heartbeat
// (with a rendezvous file, a counter in the file beside it, <file>.hb<r>, overwritten in place:
// c10d's FileStore appends every write), err/<r> a posted failure, and what Post writes. The
// TCPStore and Gloo's connections are torch's own: unauthenticated TCP, as every torchrun job
// has; run ranks on a private network.
// The TCPStore of torch listens on every interface of rank 0's host; ranks that share a host
// meet through a FileStore instead (FERRY_RENDEZVOUS_FILE, what `ferryd --nproc-per-node`
// sets), and then nothing of theirs listens beyond loopback.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"

namespace ferry::dist {

// torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT (the names every PyTorch launcher sets), TORCHELASTIC_USE_AGENT_STORE and
// TORCHELASTIC_RESTART_COUNT (torchrun's own); or, in place of MASTER_ADDR and MASTER_PORT,
// FERRY_RENDEZVOUS_FILE.
struct Launch {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // torchrun's agent may host the TCPStore at MASTER_ADDR:MASTER_PORT itself, and says so with
  // TORCHELASTIC_USE_AGENT_STORE=True: every rank then connects to it (rank 0 hosts none),
  // under "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>", so that a restarted attempt never
  // reads the keys of a failed one.
  bool agent_store = false;
  int restart_count = 0;
  // When set, the ranks (of one host: LOCAL_WORLD_SIZE = WORLD_SIZE) meet through c10d's
  // FileStore at this path (a path no earlier run used, in a directory only this user can
  // enter), not a TCPStore: no socket listens for the rendezvous, and Gloo binds 127.0.0.1
  // (GLOO_SOCKET_IFNAME is not read). MASTER_ADDR and MASTER_PORT are not used.
  std::string rendezvous_file;
  bool distributed() const { return world_size > 1; }
  // Where the ranks meet, for messages: "MASTER_ADDR:MASTER_PORT host:port" or "the file PATH".
  std::string Rendezvous() const;
};

// A TCP port on 127.0.0.1 nobody listens on now (the kernel's choice): MASTER_PORT for local
// ranks. kIOError naming the system call's error.
Result<int> FreeLoopbackPort();

// Reads torchrun's variables through `getenv` (::getenv by default). With none of RANK and
// WORLD_SIZE set: one process (world size 1). Errors (kInvalidArgument) name the variable: a
// value that is not a number, a rank outside [0, WORLD_SIZE), WORLD_SIZE > 1 without
// MASTER_ADDR or MASTER_PORT (and without FERRY_RENDEZVOUS_FILE), a port outside 1..65535,
// FERRY_RENDEZVOUS_FILE with LOCAL_WORLD_SIZE < WORLD_SIZE.
Result<Launch> LaunchFromEnv(const std::function<const char*(const char*)>& getenv = nullptr);

struct GroupOptions {
  // "gloo" or "nccl". Default: gloo.
  std::string backend = "gloo";
  // How long a collective (and the rendezvous) may wait for the slowest rank. Default: 30
  // minutes, torch's default_pg_timeout.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // The store keys' prefix (the run's name). Default: "ferry".
  std::string prefix = "ferry";
};

// A rank as the others see it.
struct RankInfo {
  int rank = 0;
  std::string host;
  int64_t pid = 0;
};

class ProcessGroup {
 public:
  static constexpr std::chrono::milliseconds kHeartbeatInterval{250};

  // Joins the job `launch` describes: rank 0 hosts the TCPStore on MASTER_PORT (unless
  // torchrun's agent hosts it), every rank connects to MASTER_ADDR:MASTER_PORT (or every rank
  // opens the rendezvous file), the process
  // group is built, and the ranks exchange host and pid. Gloo binds the address this host
  // reaches MASTER_ADDR from (127.0.0.1 for a loopback MASTER_ADDR or a rendezvous file), or
  // the interface GLOO_SOCKET_IFNAME names, as torch does.
  // Errors also: kIOError when this rank's heartbeat file (with a rendezvous file) cannot be
  // written.
  // NCCL runs on device cuda:LOCAL_RANK and sets TORCH_NCCL_BLOCKING_WAIT=1 unless it is set,
  // so that a collective past the timeout fails (and names the rank) instead of NCCL's watchdog
  // ending the process.
  // Errors: kInvalidArgument for an unknown backend; kUnsupported for NCCL, saying why (a CPU
  // LibTorch or one without NCCL; no CUDA device; more local ranks than CUDA devices, which
  // NCCL refuses); kUnavailable naming MASTER_ADDR:MASTER_PORT (or the file) when the
  // rendezvous does not complete within the timeout.
  static Result<std::unique_ptr<ProcessGroup>> Join(const Launch& launch, const GroupOptions& options);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const;
  int size() const;
  int local_rank() const;
  const std::string& backend() const;
  // Every rank's host and pid, by rank.
  const std::vector<RankInfo>& ranks() const;
  // "rank R (host H, pid P)".
  std::string Describe(int rank) const;

  // The collectives. `what` names the operation in errors ("step 3: the gradients"). Each
  // returns kUnavailable naming the rank that failed (see the top of this file) when a peer died,
  // hung past the timeout or reported a failure. Tensors: contiguous; on NCCL, a host tensor goes
  // through the rank's device and comes back (results are where the input was).
  // Sums `t` over the ranks, in place.
  [[nodiscard]] Status AllReduceSum(at::Tensor& t, const std::string& what);
  // Every rank's `t` (equal shapes), stacked: [world, ...t's shape].
  [[nodiscard]] Result<at::Tensor> AllGather(const at::Tensor& t, const std::string& what);
  // `t` from `root` into every rank's `t` (equal shapes and dtypes).
  [[nodiscard]] Status Broadcast(at::Tensor& t, int root, const std::string& what);
  // Every rank's bytes (any lengths), by rank.
  [[nodiscard]] Result<std::vector<std::string>> AllGatherBytes(const std::string& bytes, const std::string& what);
  // `bytes` of `root` on every rank.
  [[nodiscard]] Result<std::string> BroadcastBytes(const std::string& bytes, int root, const std::string& what);

  // Outside the collectives: one rank posts `value` under `key`; the others Await it for as
  // long as the poster's heartbeat goes on (a paused run waits without a timeout), failing
  // with kUnavailable naming the poster when it stops.
  [[nodiscard]] Status Post(const std::string& key, const std::string& value);
  [[nodiscard]] Result<std::string> Await(const std::string& key, int poster, const std::string& what);

  // This rank is failing with `message`: the others name it with that message. Best effort;
  // call before exiting.
  void ReportFailure(const std::string& message);

  struct Impl;

 private:
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ferry::dist
