// fake_ferryd: a stand-in for ferryd in the `ferry daemon` CLI tests, built from
// ferry_control only (no LibTorch, no training).
//
//   fake_ferryd train --config FILE --dir DIR [--max-steps N]
//
// FILE is a JSON object: "status" (the fields the status reply carries; pid and state are
// filled in), "snapshot_version" (the version id snapshot replies with), "exit_code" (when
// present: print the arguments and exit with it at once, without serving),
// "exit_after_status" (when true: exit 0 once the first status is answered, as ferryd does
// at its run's last step). The fake takes DIR's RunLock, serves the control socket
// (pause/resume change the state), counts every command, and on stop (or SIGTERM) writes the
// counts to DIR/fake_counts.json and exits 0.
#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "daemon/control/protocol.h"
#include "daemon/control/run_lock.h"
#include "daemon/control/server.h"

namespace {

using Json = nlohmann::json;
using ferry::control::ControlCommand;

int Usage() {
  std::fprintf(stderr, "usage: fake_ferryd train --config FILE --dir DIR [--max-steps N]\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) != "train") return Usage();
  std::string config, dir, max_steps;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--config") {
      config = argv[i + 1];
    } else if (flag == "--dir") {
      dir = argv[i + 1];
    } else if (flag == "--max-steps") {
      max_steps = argv[i + 1];
    } else {
      return Usage();
    }
  }
  if (config.empty() || dir.empty() || argc % 2 != 0) return Usage();
  std::ifstream in(config);
  std::stringstream text;
  text << in.rdbuf();
  const Json cfg = Json::parse(text.str(), nullptr, false);
  if (cfg.is_discarded() || !cfg.is_object()) {
    std::fprintf(stderr, "fake_ferryd: %s: not a JSON object\n", config.c_str());
    return 2;
  }
  std::printf("fake_ferryd train --config %s --dir %s%s%s\n", config.c_str(), dir.c_str(),
              max_steps.empty() ? "" : " --max-steps ", max_steps.c_str());
  std::fflush(stdout);
  if (cfg.contains("exit_code")) return cfg["exit_code"].get<int>();

  auto lock = ferry::control::RunLock::Acquire(dir);
  if (!lock.ok()) {
    std::fprintf(stderr, "fake_ferryd: %s\n", lock.status().message().c_str());
    return 1;
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);

  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::string state = "running";
  std::map<std::string, int> counts;
  auto handler = [&](const ferry::control::ControlRequest& r) -> ferry::Result<Json> {
    std::lock_guard guard(mu);
    counts[std::string(ferry::control::ControlCommandName(r.command))]++;
    switch (r.command) {
      case ControlCommand::kStatus: {
        Json j = cfg.value("status", Json::object());
        j["pid"] = ::getpid();
        j["state"] = state;
        if (cfg.value("exit_after_status", false)) {
          stopping = true;  // the reply goes out before the server stops
          cv.notify_all();
        }
        return j;
      }
      case ControlCommand::kPause: state = "paused"; break;
      case ControlCommand::kResume: state = "running"; break;
      case ControlCommand::kSnapshot:
        return Json{{"version", cfg.value("snapshot_version", "")}, {"checkpoint", "checkpoint-7"}, {"step", 7}};
      case ControlCommand::kStop:
        state = "stopping";
        stopping = true;
        cv.notify_all();
        break;
    }
    return Json{{"state", state}};
  };
  ferry::control::ControlServerOptions options;
  options.run_dir = dir;
  auto server = ferry::control::ControlServer::Start(options, handler);
  if (!server.ok()) {
    std::fprintf(stderr, "fake_ferryd: %s\n", server.status().message().c_str());
    return 1;
  }
  std::thread signals([&] {
    int sig = 0;
    sigwait(&set, &sig);
    std::lock_guard guard(mu);
    stopping = true;
    cv.notify_all();
  });
  {
    std::unique_lock guard(mu);
    cv.wait(guard, [&] { return stopping; });
  }
  // Destroyed, not only stopped: closing its context sends the replies still queued (the
  // one to stop, or to the status that ended a run at its last step) before _Exit.
  server->reset();
  {
    std::lock_guard guard(mu);
    std::ofstream(std::string(dir) + "/fake_counts.json") << Json(counts).dump() << "\n";
  }
  std::printf("fake_ferryd: stopped\n");
  std::fflush(stdout);
  // The signal thread may still wait in sigwait: end the process without joining it.
  signals.detach();
  std::_Exit(0);
}
