// `ferryd train --nproc-per-node N`: ferryd starts N local ranks itself, as torchrun does: N
// children of this executable, each with torchrun's environment (RANK = LOCAL_RANK = i,
// WORLD_SIZE = LOCAL_WORLD_SIZE = N; in place of MASTER_ADDR and MASTER_PORT,
// FERRY_RENDEZVOUS_FILE: c10d's FileStore in a new private directory under $TMPDIR, removed
// when the ranks have ended; and NCCL_SOCKET_IFNAME=lo unless set), so that nothing listens
// beyond loopback (torch's TCPStore would listen on every interface), and waits for them.
// SIGTERM, SIGINT, SIGHUP and SIGQUIT are passed on to every rank (on SIGTERM and SIGINT rank 0
// stops them all at a step boundary). When a rank fails, the others are given `grace` to end
// on their own (they name the failed rank), then killed. The exit code is the first failed
// rank's (128 + signal for one killed by a signal), or 0.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "core/status.h"

namespace ferry::ferryd {

// `argv` is the command each rank runs (argv[0] an executable path), without
// --nproc-per-node. Errors: kIOError when a rank cannot be started (those started are
// stopped).
[[nodiscard]] Result<int> RunLocalRanks(int nproc, const std::vector<std::string>& argv, std::chrono::seconds grace);

}  // namespace ferry::ferryd
