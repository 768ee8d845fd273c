// `ferry daemon ...`: operating ferryd (the GRPO daemon) over its control socket
// (daemon/control/protocol.h) and from its run directory's files (daemon/control/run_dir.h).
//   start    --config FILE [--dir DIR] [--max-steps N] [--publish EP] [--nproc-per-node N] [--detach [--wait-s S]]
//   [--json]
//            runs `ferryd train --config FILE --dir DIR [--max-steps N] [--publish EP]` (ferryd next to this
//            executable, or $FERRY_FERRYD) through daemon/control/launcher.h: in the foreground
//            (its exit code is ferry's), or detached (new session, output appended to
//            DIR/ferryd.log; prints the pid once the control socket answers, fails when ferryd
//            exits first, except that a run already complete is reported as such, exit 0).
//            --publish tcp://... without the config's [publish] key and allow is refused before
//            ferryd starts (nothing is created).
//   status   [--json]                  the daemon's status; without one: state "stopped" from
//                                      DIR/metrics.jsonl and the newest checkpoint, exit 3
//   pause | resume | snapshot | stop   (snapshot prints the version id; stop waits for the
//                                      daemon to exit unless --no-wait)
//   metrics  [--follow] [--prometheus [--output FILE]] [--json] [--run NAME]
//   logs     [--follow]
// Every subcommand takes --dir DIR (default: the current directory). Control commands also
// take --connect tcp://HOST:PORT --key PREFIX --server-key FILE (CURVE) and --timeout-ms.
// Exit codes: 0 done, 1 error, 3 no ferryd is running for DIR.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/output.h"
#include "daemon/control/client.h"
#include "daemon/control/launcher.h"
#include "daemon/control/metrics.h"
#include "daemon/control/run_dir.h"
#include "daemon/control/run_lock.h"
#include "daemon/run/config.h"
#include "daemon/run/dataset.h"
#include "sync/endpoints.h"

namespace ferry::cli {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using control::ControlCommand;

constexpr int kExitNotRunning = 3;

struct Flags {
  std::string dir = ".";
  bool json = false;
  // Control socket.
  std::string connect, key, server_key;
  int timeout_ms = 10000;
  // start
  std::string config;
  bool detach = false;
  int64_t max_steps = 0;
  std::string publish;
  int nproc_per_node = 0;
  int wait_s = 120;
  // stop
  bool no_wait = false;
  // metrics, logs
  bool follow = false, prometheus = false;
  std::string output, run;
  int poll_ms = 500;
};

void AddDir(CLI::App* c, Flags& f) {
  c->add_option("--dir", f.dir, "The run directory (default: the current directory)");
}

void AddControl(CLI::App* c, Flags& f, int default_timeout_ms) {
  AddDir(c, f);
  f.timeout_ms = default_timeout_ms;
  c->add_option("--connect", f.connect,
                "ferryd's control endpoint, tcp://HOST:PORT (needs --key and --server-key); default: the ipc socket "
                "in DIR/.ferryd/");
  c->add_option("--key", f.key, "CURVE keypair prefix (PREFIX.key / PREFIX.pub) of this client, for tcp://");
  c->add_option("--server-key", f.server_key, "ferryd's CURVE public key file, for tcp://");
  c->add_option("--timeout-ms", f.timeout_ms, "How long to wait for ferryd's reply")
      ->default_str(std::to_string(default_timeout_ms));
}

std::string DirText(const Flags& f) { return f.dir; }

control::ControlClientOptions ClientOptionsOrFail(const Flags& f) {
  if (f.timeout_ms <= 0) Fail("--timeout-ms must be positive");
  control::ControlClientOptions o;
  o.run_dir = f.dir;
  o.endpoint = f.connect;
  if (f.key.empty()) {
    if (!f.server_key.empty()) Fail("--server-key needs --key");
    return o;
  }
  if (f.server_key.empty()) Fail("--key needs --server-key FILE (ferryd's public key)");
  auto curve = sync::LoadClientCurve(f.key, f.server_key);
  if (!curve.ok()) Fail(curve.status());
  o.curve = std::move(*curve);
  return o;
}

// The pid holding DIR's lock, or nullopt when no ferryd runs there.
std::optional<pid_t> HolderOrFail(const Flags& f) {
  auto pid = control::RunLock::Holder(f.dir);
  if (pid.ok()) return *pid;
  if (pid.status().code() == StatusCode::kNotFound) return std::nullopt;
  Fail(pid.status());
}

// Calls `command` on the daemon of `f`. Exits 3 when no ferryd runs for DIR; exits 1 naming
// the pid when one holds DIR but does not answer.
Json CallOrFail(const Flags& f, ControlCommand command) {
  const auto options = ClientOptionsOrFail(f);
  std::optional<pid_t> holder;
  if (f.connect.empty()) {
    holder = HolderOrFail(f);
    if (!holder) Fail("no ferryd is running for " + DirText(f), kExitNotRunning);
  }
  auto client = control::ControlClient::Connect(options);
  Result<Json> reply =
      client.ok() ? (*client)->Call(command, std::chrono::milliseconds(f.timeout_ms)) : Result<Json>(client.status());
  if (reply.ok()) return std::move(*reply);
  if (reply.status().code() == StatusCode::kUnavailable) {
    if (holder) {
      Fail("ferryd pid " + std::to_string(*holder) + " holds " + DirText(f) +
           " but its control socket did not answer within " + std::to_string(f.timeout_ms) +
           " ms (hung, or still starting)");
    }
    Fail(reply.status(), kExitNotRunning);
  }
  Fail(reply.status());
}

void PrintJson(const Json& j) {
  std::printf("%s\n", JsonText(j).c_str());
  std::fflush(stdout);
}

std::string ValueText(const Json& v) { return v.is_string() ? v.get<std::string>() : JsonText(v); }

// Known status fields first, in the protocol's order, then any others.
void PrintStatusText(const Json& j) {
  static const char* kOrder[] = {"state",         "pid",
                                 "step",          "total_steps",
                                 "epoch",         "generator_version",
                                 "generator",     "last_checkpoint",
                                 "reward",        "reward_trend",
                                 "learning_rate", "steps_per_second",
                                 "uptime_seconds"};
  std::vector<std::string> shown;
  for (const char* k : kOrder) {
    if (auto it = j.find(k); it != j.end()) {
      std::printf("%-18s %s\n", (std::string(k) + ":").c_str(), ValueText(*it).c_str());
      shown.emplace_back(k);
    }
  }
  for (const auto& [k, v] : j.items()) {
    if (k == "ranks" && v.is_array()) {
      // A data-parallel run: one line per rank.
      std::printf("ranks:\n");
      for (const Json& r : v) {
        if (!r.is_object()) {  // a reply is as hostile as any message: shown, not trusted
          std::printf("  %s\n", JsonText(r).c_str());
          continue;
        }
        std::printf("  rank %s  host %s  pid %s  step %s  generator_version %s\n",
                    ValueText(r.value("rank", Json())).c_str(), ValueText(r.value("host", Json())).c_str(),
                    ValueText(r.value("pid", Json())).c_str(), ValueText(r.value("step", Json())).c_str(),
                    ValueText(r.value("generator_version", Json())).c_str());
      }
      continue;
    }
    if (std::find(shown.begin(), shown.end(), k) == shown.end()) {
      std::printf("%-18s %s\n", (k + ":").c_str(), ValueText(v).c_str());
    }
  }
  std::fflush(stdout);
}

// What the run directory says when no daemon answers.
Json StoppedStatus(const Flags& f) {
  Json j;
  j["state"] = "stopped";
  j["pid"] = nullptr;
  auto checkpoint = control::NewestCheckpoint(f.dir);
  if (!checkpoint.ok()) Fail(checkpoint.status());
  j["last_checkpoint"] = checkpoint->has_value() ? Json((*checkpoint)->name) : Json(nullptr);
  auto metrics = control::LastMetrics(f.dir);
  if (!metrics.ok()) Fail(metrics.status());
  for (const char* k : {"step", "epoch", "generator_version", "reward", "learning_rate"}) {
    const Json* v = nullptr;
    if (metrics->has_value()) {
      if (auto it = (*metrics)->value.find(k); it != (*metrics)->value.end()) v = &*it;
    }
    j[k] = v != nullptr ? *v : Json(nullptr);
  }
  return j;
}

void RunStatusCommand(const Flags& f) {
  if (f.connect.empty() && !HolderOrFail(f)) {
    const Json j = StoppedStatus(f);
    f.json ? PrintJson(j) : PrintStatusText(j);
    throw CLI::RuntimeError(kExitNotRunning);
  }
  const Json j = CallOrFail(f, ControlCommand::kStatus);
  f.json ? PrintJson(j) : PrintStatusText(j);
}

// The reply's "state" when it is a string ("" otherwise: a reply is not trusted to be well formed).
std::string StateOf(const Json& j) {
  const auto it = j.find("state");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

void RunSimple(const Flags& f, ControlCommand command) {
  Json j = CallOrFail(f, command);
  if (command == ControlCommand::kPause) {
    // "pausing" while the step in flight finishes: wait (within --timeout-ms) for "paused",
    // after which no step runs and the status is final.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(f.timeout_ms);
    while (StateOf(j) == "pausing" && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const Json status = CallOrFail(f, ControlCommand::kStatus);
      j["state"] = StateOf(status);
    }
  }
  if (f.json) return PrintJson(j);
  const auto state = j.find("state");
  std::printf("%s\n", state != j.end() ? ValueText(*state).c_str() : "ok");
  std::fflush(stdout);
}

void RunSnapshot(const Flags& f) {
  const Json j = CallOrFail(f, ControlCommand::kSnapshot);
  const auto version = j.find("version");
  if (version == j.end() || !version->is_string()) Fail("ferryd's snapshot reply carries no version id");
  if (f.json) return PrintJson(j);
  std::printf("%s\n", version->get_ref<const std::string&>().c_str());
  std::fflush(stdout);
}

void RunStop(const Flags& f) {
  const std::optional<pid_t> holder = f.connect.empty() ? HolderOrFail(f) : std::nullopt;
  const int64_t pid = holder.value_or(0);
  const Json j = CallOrFail(f, ControlCommand::kStop);
  if (!f.no_wait && f.connect.empty()) {
    // The lock goes when the process does, however it ends.
    while (HolderOrFail(f)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const bool stopped = !f.no_wait && f.connect.empty();
  if (f.json) {
    Json out = j;
    if (stopped) out["state"] = "stopped";
    if (pid != 0 && !out.contains("pid")) out["pid"] = pid;
    return PrintJson(out);
  }
  if (stopped) {
    std::printf("stopped%s\n", pid != 0 ? (" (pid " + std::to_string(pid) + ")").c_str() : "");
  } else {
    const auto state = j.find("state");
    std::printf("%s\n", state != j.end() ? ValueText(*state).c_str() : "stopping");
  }
  std::fflush(stdout);
}

// ---- start ----

// --publish EP against the endpoint policy ferryd applies (sync::CheckEndpoint): tcp:// needs
// the config's [publish] key and allow. Checked before ferryd starts, since ferryd creates the
// run directory and its store (holding the base) before it starts publishing.
void CheckPublishOrFail(const Flags& f) {
  if (f.publish.empty()) return;
  bool curve = false;
  if (f.publish.starts_with("tcp://")) {
    auto config = run::LoadRunConfig(f.config);
    if (!config.ok()) Fail(config.status());
    curve = !config->publish.key.empty();  // the config refuses a key without allow, and allow without key
  }
  const Status s = sync::CheckEndpoint(f.publish, curve);
  if (s.ok()) return;
  if (s.code() == StatusCode::kFailedPrecondition) {
    Fail("--publish " + f.publish + ": tcp:// needs CURVE keys, and " + f.config +
         " has no [publish] key and allow: set key (a keypair prefix, `ferry keys generate --out PREFIX`) and allow "
         "(a file of the receivers' public keys) there, or publish on ipc://DIR");
  }
  Fail(s.WithContext("--publish"));
}

// The steps ferryd runs for `f` (the config's max_steps, else TRL's count over the dataset;
// capped by --max-steps); nullopt when the config or dataset cannot be read here.
std::optional<int64_t> TotalSteps(const Flags& f) {
  auto config = run::LoadRunConfig(f.config);
  if (!config.ok()) return std::nullopt;
  uint64_t dataset_size = 0;
  if (config->max_steps <= 0) {
    auto dataset = run::Dataset::Load(config->dataset, run::DatasetOptionsFor(*config));
    if (!dataset.ok()) return std::nullopt;
    dataset_size = (*dataset)->size();
  }
  auto total = run::TotalSteps(*config, dataset_size);
  if (!total.ok()) return std::nullopt;
  return f.max_steps > 0 ? std::min(*total, f.max_steps) : *total;
}

// Prints that the run in `dir` is complete at `checkpoint`: what a detached start reports
// when ferryd had nothing to do.
void PrintComplete(const Flags& f, const fs::path& dir, const fs::path& log, const control::CheckpointDir& checkpoint) {
  if (f.json) {
    return PrintJson(Json{{"pid", nullptr},
                          {"dir", dir.string()},
                          {"log", log.string()},
                          {"state", "complete"},
                          {"step", checkpoint.step},
                          {"last_checkpoint", checkpoint.name}});
  }
  std::printf("the run in %s is complete at step %llu (%s); nothing to do\n", dir.c_str(),
              static_cast<unsigned long long>(checkpoint.step), checkpoint.name.c_str());
  std::fflush(stdout);
}

// ferryd exited 0 before its control socket answered: when DIR's newest checkpoint is at the
// run's last step (`total`, or worked out from the config), the run was complete and ferryd
// had nothing to do. Prints so and returns true; false otherwise.
bool ReportedComplete(const Flags& f, const fs::path& dir, const fs::path& log, std::optional<int64_t> total) {
  auto checkpoint = control::NewestCheckpoint(dir);
  if (!checkpoint.ok() || !checkpoint->has_value()) return false;
  if (!total) total = TotalSteps(f);
  if (!total || static_cast<int64_t>((*checkpoint)->step) < *total) return false;
  PrintComplete(f, dir, log, **checkpoint);
  return true;
}

void RunStart(const Flags& f) {
  std::error_code ec;
  if (!fs::is_regular_file(f.config, ec)) Fail("--config " + f.config + ": no such file");
  if (f.max_steps < 0) Fail("--max-steps must be positive");
  if (f.wait_s <= 0) Fail("--wait-s must be positive");
  CheckPublishOrFail(f);
  if (auto holder = HolderOrFail(f)) {
    Fail(DirText(f) + " is in use by ferryd pid " + std::to_string(*holder));
  }
  control::FerrydTrainOptions train;
  train.ferryd = FerrydPathOrFail();
  train.config = fs::absolute(f.config).lexically_normal();
  train.run_dir = fs::absolute(f.dir).lexically_normal();
  train.max_steps = f.max_steps;
  train.publish = f.publish;
  train.nproc_per_node = f.nproc_per_node;
  if (!f.detach) Fail(control::ExecFerrydTrain(train));

  control::DetachOptions detach;
  detach.wait = std::chrono::seconds(f.wait_s);
  auto started = control::StartDetached(train, detach);
  if (!started.ok()) Fail(started.status());
  const fs::path& dir = train.run_dir;
  if (started->state == control::DetachedState::kExited && started->exit_code == 0 &&
      ReportedComplete(f, dir, started->log, started->last_step)) {
    return;
  }
  if (started->state != control::DetachedState::kAnswering) Fail(started->error);
  const int pid = static_cast<int>(started->pid);
  if (f.json) {
    PrintJson(Json{{"pid", pid}, {"dir", dir.string()}, {"log", started->log.string()}});
  } else {
    std::printf("%d\n", pid);
    std::fprintf(stderr, "ferry: ferryd pid %d is running in %s (log: %s)\n", pid, dir.c_str(), started->log.c_str());
  }
  std::fflush(stdout);
}

// ---- metrics, logs ----

std::string RunLabel(const Flags& f) {
  if (!f.run.empty()) return f.run;
  fs::path p = fs::absolute(f.dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().string();
}

// Writes `text` to `path` through a temporary file renamed over it.
void WriteAtomicOrFail(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(tmp, ec);
      Fail(tmp.string() + ": cannot write");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    Fail(path.string() + ": cannot replace: " + ec.message());
  }
}

// Prints one metrics line as --json / --prometheus / text ask; a line that is not a JSON
// object is reported on stderr (naming file and line) and skipped.
void PrintMetricsLine(const Flags& f, const fs::path& file, uint64_t number, const std::string& line,
                      const std::string& run) {
  if (line.find_first_not_of(" \t\r") == std::string::npos) return;
  const auto warn = [&](const std::string& what) {
    std::fprintf(stderr, "ferry: warning: %s line %llu: %s; skipped\n", file.c_str(),
                 static_cast<unsigned long long>(number), what.c_str());
  };
  if (f.prometheus) {
    auto text = control::MetricsToPrometheus(line, run);
    if (!text.ok()) return warn(text.status().message());
    if (!f.output.empty()) {
      WriteAtomicOrFail(f.output, *text);
    } else {
      std::printf("%s", text->c_str());
      if (f.follow) std::printf("\n");
    }
    std::fflush(stdout);
    return;
  }
  auto j = control::ParseMetricsLine(line);
  if (!j.ok()) return warn(j.status().message());
  if (f.json) {
    std::printf("%s\n", line.c_str());
  } else {
    std::string out;
    for (const auto& [k, v] : j->items()) {
      if (!out.empty()) out += "  ";
      out += k + " " + (v.is_string() ? v.get<std::string>() : JsonText(v));
    }
    std::printf("%s\n", out.c_str());
  }
  std::fflush(stdout);
}

void RunMetrics(const Flags& f) {
  if (!f.output.empty() && !f.prometheus) Fail("--output is only used with --prometheus");
  if (f.json && f.prometheus) Fail("--json and --prometheus exclude each other");
  if (f.poll_ms <= 0) Fail("--poll-ms must be positive");
  const fs::path file = fs::path(f.dir) / control::kMetricsFileName;
  const std::string run = RunLabel(f);
  std::error_code ec;
  if (!f.follow) {
    if (!fs::exists(file, ec)) Fail(file.string() + ": no such file (ferryd has not logged a step yet)");
    if (f.prometheus) {
      auto last = control::LastMetrics(f.dir);
      if (!last.ok()) Fail(last.status());
      if (!last->has_value()) Fail(file.string() + ": no complete line yet");
      auto text = control::MetricsToPrometheus((*last)->text, run);
      if (!text.ok()) Fail(text.status().WithContext(file.string() + " line " + std::to_string((*last)->number)));
      if (!f.output.empty()) {
        WriteAtomicOrFail(f.output, *text);
      } else {
        std::printf("%s", text->c_str());
      }
      std::fflush(stdout);
      return;
    }
  }
  control::FileTail tail(file);
  uint64_t number = 0;
  for (;;) {
    // Whether a daemon runs is read before the file, so nothing it wrote before exiting is missed.
    const bool running = f.follow && HolderOrFail(f).has_value();
    for (;;) {
      auto update = tail.Poll();
      if (!update.ok()) Fail(update.status());
      if (update->rewritten) {
        std::fprintf(stderr,
                     "ferry: %s was truncated or replaced (a resumed run?); continuing from its first changed line\n",
                     file.c_str());
        number = 0;  // line numbers restart; replayed lines are counted below
      }
      for (const std::string& line : update->lines) PrintMetricsLine(f, file, ++number, line, run);
      if (update->lines.empty()) break;
    }
    if (!running) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(f.poll_ms));
  }
}

void RunLogs(const Flags& f) {
  if (f.poll_ms <= 0) Fail("--poll-ms must be positive");
  const fs::path file = fs::path(f.dir) / control::kLogFileName;
  std::error_code ec;
  if (!f.follow && !fs::exists(file, ec)) {
    Fail(file.string() + ": no such file (a ferryd started with `ferry daemon start --detach` writes it)");
  }
  control::FileTail tail(file, /*remember_lines=*/false);
  for (;;) {
    const bool running = f.follow && HolderOrFail(f).has_value();
    for (;;) {
      auto update = tail.Poll();
      if (!update.ok()) Fail(update.status());
      if (update->rewritten)
        std::fprintf(stderr, "ferry: %s was truncated or replaced; reading it again\n", file.c_str());
      for (const std::string& line : update->lines) std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      if (update->lines.empty()) break;
    }
    if (!running) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(f.poll_ms));
  }
  if (!f.follow) {
    // A last line without its newline yet.
    std::ifstream in(file, std::ios::binary);
    std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t nl = all.rfind('\n');
    const std::string rest = nl == std::string::npos ? all : all.substr(nl + 1);
    if (!rest.empty() && rest.size() <= control::FileTail::kMaxPendingBytes) std::printf("%s\n", rest.c_str());
  }
}

}  // namespace

void SetDaemonCommand(CLI::App& app) {
  auto* daemon = app.add_subcommand("daemon",
                                    "Operate ferryd, the GRPO daemon: start, status, pause, resume, "
                                    "snapshot, stop, metrics, logs");
  daemon->require_subcommand(1);
  // One Flags per subcommand: each has its own defaults (--timeout-ms differs).
  auto flags = std::make_shared<Flags>();
  auto* start = daemon->add_subcommand("start", "Run `ferryd train` on a run directory (foreground, or --detach)");
  start->add_option("--config", flags->config, "The run's TOML config")->required();
  AddDir(start, *flags);
  start->add_option("--max-steps", flags->max_steps, "Passed to ferryd: stop after N steps");
  start->add_option("--publish", flags->publish,
                    "Passed to ferryd: also serve each step's version to remote generators (ipc://DIR or "
                    "tcp://HOST:PORT; overrides [publish] endpoint)");
  start
      ->add_option("--nproc-per-node", flags->nproc_per_node,
                   "Passed to ferryd: start this many local data-parallel ranks (rank 0 serves the control socket; "
                   "status lists every rank)")
      ->check(CLI::Range(1, 1024));
  start->add_flag("--detach", flags->detach,
                  "Run as a daemon (new session, output appended to DIR/ferryd.log); print its pid once its control "
                  "socket answers");
  start->add_option("--wait-s", flags->wait_s, "With --detach: how long to wait for the control socket")
      ->default_str("120");
  start->add_flag("--json", flags->json, "With --detach: print {pid, dir, log} as JSON");
  start->callback([flags] { RunStart(*flags); });

  flags = std::make_shared<Flags>();
  auto* status = daemon->add_subcommand(
      "status", "The daemon's status; without a daemon: \"stopped\" with the last logged step (exit 3)");
  AddControl(status, *flags, 5000);
  status->add_flag("--json", flags->json, "Print the status as one JSON object");
  status->callback([flags] { RunStatusCommand(*flags); });

  struct Simple {
    const char* name;
    const char* help;
    ControlCommand command;
  };
  for (const Simple& s :
       {Simple{"pause", "Finish the current step and hold; waits (up to --timeout-ms) until no step runs",
               ControlCommand::kPause},
        Simple{"resume", "Continue a paused run", ControlCommand::kResume}}) {
    auto* c = daemon->add_subcommand(s.name, s.help);
    auto own = std::make_shared<Flags>();
    AddControl(c, *own, 10000);
    c->add_flag("--json", own->json, "Print ferryd's reply as JSON");
    const ControlCommand command = s.command;
    c->callback([own, command] { RunSimple(*own, command); });
  }

  flags = std::make_shared<Flags>();
  auto* snapshot = daemon->add_subcommand("snapshot", "Checkpoint now; prints the checkpoint's version id");
  AddControl(snapshot, *flags, 600000);
  snapshot->add_flag("--json", flags->json, "Print ferryd's reply (version, checkpoint, step) as JSON");
  snapshot->callback([flags] { RunSnapshot(*flags); });

  flags = std::make_shared<Flags>();
  auto* stop = daemon->add_subcommand("stop", "Finish the step, checkpoint and exit; waits for the exit");
  AddControl(stop, *flags, 10000);
  stop->add_flag("--no-wait", flags->no_wait, "Return once ferryd has accepted the stop");
  stop->add_flag("--json", flags->json, "Print ferryd's reply as JSON");
  stop->callback([flags] { RunStop(*flags); });

  flags = std::make_shared<Flags>();
  auto* metrics = daemon->add_subcommand("metrics", "The run's logged metrics (DIR/metrics.jsonl)");
  AddDir(metrics, *flags);
  metrics->add_flag("--follow", flags->follow, "Keep printing new steps while a ferryd runs for DIR");
  metrics->add_flag("--prometheus", flags->prometheus,
                    "The Prometheus text format (the last step; with --follow, a block per step)");
  metrics->add_option("--output", flags->output,
                      "With --prometheus: write FILE (replaced atomically per step) instead of stdout, e.g. for "
                      "node_exporter's textfile collector");
  metrics->add_option("--run", flags->run, "The run label for --prometheus (default: DIR's name)");
  metrics->add_flag("--json", flags->json, "Print the JSON lines as they are");
  metrics->add_option("--poll-ms", flags->poll_ms, "With --follow: how often to look for new lines")
      ->default_str("500");
  metrics->callback([flags] { RunMetrics(*flags); });

  flags = std::make_shared<Flags>();
  auto* logs = daemon->add_subcommand("logs", "A detached ferryd's output (DIR/ferryd.log)");
  AddDir(logs, *flags);
  logs->add_flag("--follow", flags->follow, "Keep printing new lines while a ferryd runs for DIR");
  logs->add_option("--poll-ms", flags->poll_ms, "With --follow: how often to look for new lines")->default_str("500");
  logs->callback([flags] { RunLogs(*flags); });
}

}  // namespace ferry::cli
