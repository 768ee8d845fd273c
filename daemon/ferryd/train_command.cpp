// ferryd train: a GRPO run (daemon/grpo/trainer.h), operated through its control socket
// (daemon/control: `ferry daemon status|pause|resume|snapshot|stop`) and signals:
//   - everything that can be checked is checked before anything is created (the config, the
//     endpoints and keys here, the rest in Trainer::Create); then the run directory is locked
//     (DIR/ferryd.lock names this pid: a second ferryd on the same directory is refused) and
//     created; a start that fails before its first step removes what it created (the
//     directory, or its store and lock file); then the control socket is bound
//     (ipc://DIR/.ferryd/control, a private directory);
//   - between steps the loop honours pause (hold until resume or stop), snapshot (write a
//     checkpoint now, reply with the generator's version id) and stop (checkpoint, exit 0);
//   - SIGTERM and a first SIGINT mean stop; a second SIGINT exits at once (130): every
//     checkpoint is written under a temporary name and renamed when whole, so the newest
//     complete one is intact and a restart resumes from it;
//   - with [publish] (or --publish EP) each step's version is also served to generators on
//     other hosts by a sync publisher following the run from its own thread (remote.h); their
//     acknowledgements show in status as remote_generators;
//   - with [control] endpoint a second control socket (tcp:// with CURVE) serves the same
//     commands beside DIR/.ferryd/control;
//   - data-parallel: with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) this
//     process is one rank of a c10d group ([distributed] backend and timeout); with
//     --nproc-per-node N it starts N local ranks itself (local_ranks.h). Rank 0 alone takes the
//     lock, serves the control socket (its status lists every rank) and publishes; the others
//     follow its decisions between steps (daemon/grpo/data_parallel.h).
#include <nlohmann/json.hpp>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>

#include "daemon/control/protocol.h"
#include "daemon/control/run_lock.h"
#include "daemon/control/server.h"
#include "daemon/dist/process_group.h"
#include "daemon/ferryd/commands.h"
#include "daemon/ferryd/local_ranks.h"
#include "daemon/ferryd/remote.h"
#include "daemon/grpo/trainer.h"
#include "daemon/run/config.h"

namespace ferry::ferryd {
namespace {

namespace fs = std::filesystem;

struct TrainFlags {
  fs::path config;
  fs::path dir;
  int64_t max_steps = 0;
  bool json = false;
  std::string publish;  // overrides [publish] endpoint
  int nproc_per_node = 0;
};

// "step 40/800  reward 0.612  loss 0.0031  kl -  len 4.0  0.07 s/step  eta 53 s"
std::string ProgressLine(const nlohmann::json& j, int64_t total, double per_step) {
  auto num = [&](const char* k, int precision) -> std::string {
    if (!j.contains(k) || !j[k].is_number()) return "-";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.*f", precision, j[k].get<double>());
    return buf;
  };
  const int64_t step = j.value("step", int64_t{0});
  char line[512];
  std::snprintf(line, sizeof(line),
                "step %lld/%lld  reward %s (std %s)  loss %s  grad_norm %s  lr %s  len %s  %.3f s/step  eta %.0f s",
                static_cast<long long>(step), static_cast<long long>(total), num("reward", 3).c_str(),
                num("reward_std", 3).c_str(), num("loss", 4).c_str(), num("grad_norm", 3).c_str(),
                num("learning_rate", 6).c_str(), num("completions/mean_length", 1).c_str(), per_step,
                per_step * static_cast<double>(total - step));
  return line;
}

// Signals: SIGTERM / the first SIGINT ask for a stop; a second SIGINT exits at once.
std::atomic<int> g_stop_signals{0};

void OnStopSignal(int sig) {
  const int n = g_stop_signals.fetch_add(1) + 1;
  if (sig == SIGINT && n >= 2) {
    static const char kMsg[] = "ferryd: second interrupt: exiting now (the newest checkpoint is intact)\n";
    (void)!::write(STDERR_FILENO, kMsg, sizeof(kMsg) - 1);
    ::_exit(130);
  }
}

void InstallSignalHandlers() {
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
}

// The state the control socket reads and steers. The handler runs on the server's thread,
// the training loop on this one.
class RunControl {
 public:
  enum class State { kRunning, kPaused, kStopping };

  explicit RunControl(int64_t total_steps) : total_steps_(total_steps), started_(Clock::now()) {}

  Result<nlohmann::json> Handle(const control::ControlRequest& req) {
    std::unique_lock<std::mutex> lock(mu_);
    switch (req.command) {
      case control::ControlCommand::kStatus: return StatusLocked();
      case control::ControlCommand::kPause:
        if (state_ == State::kRunning) state_ = State::kPaused;
        cv_.notify_all();
        return nlohmann::json{{"state", StateNameLocked()}};
      case control::ControlCommand::kResume:
        if (state_ == State::kPaused) state_ = State::kRunning;
        cv_.notify_all();
        return nlohmann::json{{"state", StateNameLocked()}};
      case control::ControlCommand::kStop:
        state_ = State::kStopping;
        cv_.notify_all();
        return nlohmann::json{{"state", StateNameLocked()}};
      case control::ControlCommand::kSnapshot: {
        if (state_ == State::kStopping) {
          return Status::FailedPrecondition("the run is stopping; its final checkpoint is being written");
        }
        auto promise = std::make_shared<std::promise<Result<nlohmann::json>>>();
        auto future = promise->get_future();
        snapshots_.push_back(promise);
        cv_.notify_all();
        lock.unlock();
        // The loop answers after the current step (a step takes seconds, a checkpoint less).
        if (future.wait_for(std::chrono::minutes(30)) != std::future_status::ready) {
          return Status::Unavailable("no checkpoint within 30 minutes (the current step has not finished)");
        }
        return future.get();
      }
    }
    return Status::InvalidArgument("unknown command");
  }

  // Whether BeforeStep would do anything now: a snapshot, pause or stop asked for, or a signal.
  bool Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return state_ != State::kRunning || !snapshots_.empty() || g_stop_signals.load() > 0;
  }

  // Called by the loop before each step: writes requested snapshots, holds while paused;
  // false when the run must stop.
  bool BeforeStep(grpo::Trainer& trainer) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (g_stop_signals.load() > 0 && state_ != State::kStopping) {
        state_ = State::kStopping;
        std::fprintf(stderr, "ferryd: stop requested by a signal: finishing with a checkpoint\n");
      }
      while (!snapshots_.empty()) {
        auto promise = snapshots_.front();
        snapshots_.pop_front();
        lock.unlock();
        auto path = trainer.SaveCheckpoint();
        lock.lock();
        if (path.ok()) {
          last_checkpoint_ = path->filename().string();
          promise->set_value(nlohmann::json{
              {"version", trainer.generator_version()}, {"checkpoint", last_checkpoint_}, {"step", trainer.step()}});
        } else {
          promise->set_value(path.status());
        }
      }
      holding_ = state_ == State::kPaused;
      if (state_ == State::kStopping) return false;
      if (state_ == State::kRunning) return true;
      cv_.wait_for(lock, std::chrono::milliseconds(200));
    }
  }

  void AfterStep(const grpo::Trainer& trainer, const grpo::StepResult& r) {
    std::lock_guard<std::mutex> lock(mu_);
    step_ = r.step;
    rank_versions_ = r.rank_versions;
    generator_version_ = r.generator_version;
    generator_ = trainer.generator_info();
    if (auto it = r.metrics.find("epoch"); it != r.metrics.end()) epoch_ = it->second;
    if (auto it = r.metrics.find("learning_rate"); it != r.metrics.end()) learning_rate_ = it->second;
    if (auto it = r.metrics.find("reward"); it != r.metrics.end() && std::isfinite(it->second)) {
      rewards_.push_back(it->second);
      if (rewards_.size() > 20) rewards_.pop_front();
    }
    step_times_.push_back(Clock::now());
    if (step_times_.size() > 20) step_times_.pop_front();
  }

  void Started(const grpo::Trainer& trainer, const std::string& last_checkpoint) {
    std::lock_guard<std::mutex> lock(mu_);
    step_ = trainer.step();
    generator_version_ = trainer.generator_version();
    generator_ = trainer.generator_info();
    last_checkpoint_ = last_checkpoint;
  }

  // The data-parallel ranks the status lists (host and pid; each one's acknowledged version
  // after every step).
  void SetRanks(std::vector<dist::RankInfo> ranks, std::vector<std::string> versions) {
    std::lock_guard<std::mutex> lock(mu_);
    ranks_ = std::move(ranks);
    rank_versions_ = std::move(versions);
  }

  // Adds remote_generators to every status (called with the current step, under the lock).
  void SetRemote(std::function<nlohmann::json(int64_t)> remote) {
    std::lock_guard<std::mutex> lock(mu_);
    remote_ = std::move(remote);
  }

  void Checkpointed(const std::filesystem::path& p) {
    std::lock_guard<std::mutex> lock(mu_);
    last_checkpoint_ = p.filename().string();
  }

  // Fails every snapshot still waiting (the run ended).
  void Finish(const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = State::kStopping;
    for (auto& p : snapshots_) p->set_value(why.ok() ? Status::Unavailable("the run has ended") : why);
    snapshots_.clear();
  }

 private:
  using Clock = std::chrono::steady_clock;

  // "pausing" while the step in flight at a pause request finishes: only "paused" means no
  // step runs and the step, version and metrics of the status are final.
  const char* StateNameLocked() const {
    switch (state_) {
      case State::kRunning: return "running";
      case State::kPaused: return holding_ ? "paused" : "pausing";
      case State::kStopping: return "stopping";
    }
    return "?";
  }

  nlohmann::json StatusLocked() const {
    nlohmann::json j;
    j["pid"] = static_cast<int64_t>(::getpid());
    j["state"] = StateNameLocked();
    j["step"] = step_;
    j["total_steps"] = total_steps_;
    j["epoch"] = epoch_;
    j["generator_version"] = generator_version_;
    // The generator serving generator_version: ferryd's own, or a vLLM server and the name it
    // serves the version under (proven there: an engine event in the run's store).
    // With the newest proof: when (ns since the epoch) and its figures, as its engine event has them.
    j["generator"] =
        generator_.engine == "vllm"
            ? nlohmann::json{{"engine", "vllm"},
                             {"url", generator_.url},
                             {"served_as", generator_.served_as},
                             {"proven_at_ns", generator_.proven_at_ns},
                             {"max_diff", generator_.max_diff},
                             {"tolerance", generator_.tolerance},
                             {"previous_diff",
                              generator_.previous_diff ? nlohmann::json(*generator_.previous_diff) : nlohmann::json()}}
            : nlohmann::json{{"engine", generator_.engine}};
    j["last_checkpoint"] = last_checkpoint_.empty() ? nlohmann::json(nullptr) : nlohmann::json(last_checkpoint_);
    j["reward"] = rewards_.empty() ? nlohmann::json(nullptr) : nlohmann::json(rewards_.back());
    if (rewards_.size() >= 20) {
      double recent = 0, before = 0;
      for (size_t i = 0; i < 10; ++i) before += rewards_[i];
      for (size_t i = 10; i < 20; ++i) recent += rewards_[i];
      j["reward_trend"] = (recent - before) / 10.0;
    } else {
      j["reward_trend"] = nullptr;
    }
    j["learning_rate"] = learning_rate_;
    j["steps_per_second"] = step_times_.size() >= 2
                                ? static_cast<double>(step_times_.size() - 1) /
                                      std::chrono::duration<double>(step_times_.back() - step_times_.front()).count()
                                : 0.0;
    j["uptime_seconds"] = std::chrono::duration<double>(Clock::now() - started_).count();
    if (remote_) j["remote_generators"] = remote_(step_);
    if (!ranks_.empty()) {
      // Every rank of a data-parallel run: the steps are synchronous, so each is at step_.
      nlohmann::json ranks = nlohmann::json::array();
      for (const dist::RankInfo& r : ranks_) {
        const size_t i = static_cast<size_t>(r.rank);
        ranks.push_back({{"rank", r.rank},
                         {"host", r.host},
                         {"pid", r.pid},
                         {"step", step_},
                         {"generator_version",
                          i < rank_versions_.size() ? nlohmann::json(rank_versions_[i]) : nlohmann::json(nullptr)}});
      }
      j["ranks"] = ranks;
    }
    return j;
  }

  const int64_t total_steps_;
  const Clock::time_point started_;
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kRunning;
  bool holding_ = false;  // the loop is between steps, held by a pause
  std::deque<std::shared_ptr<std::promise<Result<nlohmann::json>>>> snapshots_;
  int64_t step_ = 0;
  double epoch_ = 0;
  double learning_rate_ = 0;
  std::string generator_version_;
  grpo::Trainer::GeneratorInfo generator_;
  std::string last_checkpoint_;
  std::deque<double> rewards_;  // reward per step, newest last (20 kept)
  std::deque<Clock::time_point> step_times_;
  std::function<nlohmann::json(int64_t)> remote_;
  std::vector<dist::RankInfo> ranks_;
  std::vector<std::string> rank_versions_;
};

// Everything of [publish] / --publish and [control] ferryd can check before the trainer
// creates anything: the endpoints against the policy, the CURVE keys, the mode.
struct Serving {
  std::string publish;
  std::optional<sync::CurveOptions> publish_curve;
  std::optional<sync::CurveOptions> control_curve;
};

Result<Serving> CheckServing(const TrainFlags& f, const run::RunConfig& rc) {
  Serving e;
  e.publish = f.publish.empty() ? rc.publish.endpoint : f.publish;
  const std::string where = f.publish.empty() ? rc.source.string() + ": [publish] endpoint" : "--publish";
  if (!e.publish.empty()) {
    FERRY_ASSIGN_OR_RETURN(e.publish_curve, ServerCurve("publish", rc.publish.key, rc.publish.allow));
    FERRY_ASSIGN_OR_RETURN(sync::Endpoints parsed, sync::ParseSyncEndpoint(e.publish));
    FERRY_RETURN_IF_ERROR(sync::CheckEndpoints(parsed, e.publish_curve.has_value()).WithContext(where));
  }
  if (!rc.control.endpoint.empty()) {
    FERRY_ASSIGN_OR_RETURN(e.control_curve, ServerCurve("control", rc.control.key, rc.control.allow));
  }
  return e;
}

// The command line of one local rank: this command without --nproc-per-node.
std::vector<std::string> RankArgv(const TrainFlags& f) {
  std::vector<std::string> a = {"/proc/self/exe", "train", "--config", fs::absolute(f.config).string()};
  if (!f.dir.empty()) {
    a.push_back("--dir");
    a.push_back(fs::absolute(f.dir).string());
  }
  if (f.max_steps > 0) {
    a.push_back("--max-steps");
    a.push_back(std::to_string(f.max_steps));
  }
  if (f.json) a.push_back("--json");
  if (!f.publish.empty()) {
    a.push_back("--publish");
    a.push_back(f.publish);
  }
  return a;
}

// This process's rank of a data-parallel run (torchrun's environment), or null for one
// process.
Result<std::unique_ptr<dist::ProcessGroup>> JoinGroup(const run::RunConfig& config) {
  FERRY_ASSIGN_OR_RETURN(dist::Launch launch, dist::LaunchFromEnv());
  if (!launch.distributed()) return std::unique_ptr<dist::ProcessGroup>();
  dist::GroupOptions go;
  go.backend = !config.distributed.backend.empty() ? config.distributed.backend : config.device.cuda ? "nccl" : "gloo";
  go.timeout = std::chrono::milliseconds(static_cast<int64_t>(config.distributed.timeout * 1000));
  go.prefix = "ferry/" + config.store.run;
  Result<std::unique_ptr<dist::ProcessGroup>> g = dist::ProcessGroup::Join(launch, go);
  if (!g.ok()) return g.status().WithContext(config.source.string() + ": [distributed]");
  std::fprintf(stderr, "ferryd: rank %d of %d (local rank %d), %s, met at %s\n", launch.rank, launch.world_size,
               launch.local_rank, go.backend.c_str(), launch.Rendezvous().c_str());
  return g;
}

Status RunTrain(const TrainFlags& f) {
  // Checked before anything is created: the config and the endpoints here, the rest by
  // Trainer::Create, which takes the run lock (claim_dir) only once its own checks passed.
  FERRY_ASSIGN_OR_RETURN(run::RunConfig config, run::LoadRunConfig(f.config));
  FERRY_ASSIGN_OR_RETURN(Serving serving, CheckServing(f, config));
  const fs::path dir = fs::absolute(f.dir.empty() ? config.output_dir : f.dir);
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<dist::ProcessGroup> group, JoinGroup(config));
  // From here SIGTERM and SIGINT stop the run at a step boundary; until now (nothing written
  // yet, the rendezvous perhaps waiting for other ranks) they end the process at once.
  InstallSignalHandlers();
  const int rank = group ? group->rank() : 0;
  std::optional<control::RunLock> lock;
  bool lock_file_created = false;

  grpo::TrainOptions o;
  o.config = config;
  o.dir = dir;
  o.group = group.get();
  if (f.max_steps > 0) o.max_steps = f.max_steps;
  o.claim_dir = [&](const fs::path& d) -> Status {
    std::error_code ec;
    lock_file_created = !fs::exists(control::RunLock::LockPath(d), ec);
    FERRY_ASSIGN_OR_RETURN(control::RunLock l, control::RunLock::Acquire(d));
    lock.emplace(std::move(l));
    return Status::OK();
  };
  const auto start = std::chrono::steady_clock::now();
  int64_t total = 0;
  int64_t first_step = 0;
  o.on_message = [rank, &group](const std::string& m) {
    if (group) {
      std::fprintf(stderr, "ferryd[rank %d]: %s\n", rank, m.c_str());
    } else {
      std::fprintf(stderr, "ferryd: %s\n", m.c_str());
    }
  };
  o.on_log = [&](const std::string& line) {
    if (f.json) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      return;
    }
    const auto j = nlohmann::json::parse(line, nullptr, false);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t done = std::max<int64_t>(1, j.value("step", int64_t{0}) - first_step);
    std::fprintf(stderr, "%s\n", ProgressLine(j, total, elapsed / static_cast<double>(done)).c_str());
  };
  // Started after the trainer (it follows the trainer's store); merged/delta mode serves each
  // step's merged snapshot handed over here (remote.h).
  std::unique_ptr<RemotePublisher> remote;
  o.on_snapshot = [&remote](const store::Digest& v, std::shared_ptr<const sync::Snapshot> snapshot) {
    if (remote) remote->Offer(v, std::move(snapshot));
  };
  Result<std::unique_ptr<grpo::Trainer>> created = grpo::Trainer::Create(o);
  if (!created.ok()) {
    // Create removed what it made; the lock file too, when this start made it.
    if (lock && lock_file_created) lock->Remove();
    if (group && created.status().code() != StatusCode::kUnavailable) {
      group->ReportFailure("starting: " + created.status().message());
    }
    return created.status();
  }
  std::unique_ptr<grpo::Trainer> trainer = std::move(*created);
  // Until the first step: a failure of this start removes what it created (a new run's
  // directory, store and lock file), as Create does for its own.
  bool started = false;
  struct Undo {
    std::function<void()> fn;
    ~Undo() { fn(); }
  } undo{[&] {
    if (started || !trainer) return;
    const std::vector<fs::path> made = trainer->created_by_start();
    if (made.empty()) return;
    remote.reset();
    trainer.reset();
    for (auto it = made.rbegin(); it != made.rend(); ++it) {
      std::error_code ec;
      fs::remove_all(*it, ec);
    }
    if (lock && lock_file_created) lock->Remove();
  }};
  total = trainer->total_steps();
  first_step = trainer->step();
  if (rank != 0) {
    // A rank other than 0 trains and follows rank 0's decisions; it serves nothing. A stop
    // signal it gets alone (torchrun's agent on its host) is passed to rank 0 at the step's end,
    // which stops every rank there, after its checkpoint.
    started = true;
    grpo::RunHooks hooks;
    hooks.pending = [] { return g_stop_signals.load() > 0; };
    const Status run = trainer->Run(hooks);
    if (!run.ok() && run.code() != StatusCode::kUnavailable) group->ReportFailure(run.message());
    FERRY_RETURN_IF_ERROR(run);
    std::fprintf(stderr, "ferryd[rank %d]: done at step %lld\n", rank, static_cast<long long>(trainer->step()));
    return Status::OK();
  }
  RunControl control(total);
  control.Started(*trainer, first_step > 0 ? "checkpoint-" + std::to_string(first_step) : "");
  if (group) {
    control.SetRanks(group->ranks(),
                     std::vector<std::string>(static_cast<size_t>(group->size()), trainer->generator_version()));
  }
  const run::RunConfig& rc = config;
  auto handler = [&control](const control::ControlRequest& r) { return control.Handle(r); };
  std::unique_ptr<control::ControlServer> server, extra;
  // What rank 0 serves; a failure here is posted for the other ranks, which then name it rather
  // than a rank 0 that "stopped answering".
  const Status serving_started = [&]() -> Status {
    if (!serving.publish.empty()) {
      RemotePublisherOptions ro;
      ro.endpoint = serving.publish;
      ro.curve = serving.publish_curve;
      ro.run = rc.store.run;
      ro.base_version = trainer->base_version();
      if (first_step > 0) ro.resumed = trainer->generator_snapshot();
      ro.mode = rc.publish.mode;
      ro.on_rejected_key = [](const std::string& key) {
        std::fprintf(stderr, "ferryd: warning: refused a receiver with CURVE public key %s: not in [publish] allow\n",
                     key.c_str());
      };
      FERRY_ASSIGN_OR_RETURN(remote, RemotePublisher::Start(trainer->store(), std::move(ro)));
      control.SetRemote([&remote](int64_t step) { return remote->Generators(step); });
      std::fprintf(stderr, "ferryd: publishing (mode %s) on %s and %s\n",
                   std::string(sync::PublishModeName(rc.publish.mode)).c_str(), remote->endpoints().requests.c_str(),
                   remote->endpoints().updates.c_str());
    }
    control::ControlServerOptions so;
    so.run_dir = dir;
    FERRY_ASSIGN_OR_RETURN(server, control::ControlServer::Start(so, handler));
    std::fprintf(stderr, "ferryd: pid %d, control socket %s\n", static_cast<int>(::getpid()),
                 server->endpoint().c_str());
    if (!rc.control.endpoint.empty()) {
      control::ControlServerOptions xo;
      xo.run_dir = dir;
      xo.endpoint = rc.control.endpoint;
      xo.curve = serving.control_curve;
      xo.on_rejected_key = [](const std::string& key) {
        std::fprintf(stderr,
                     "ferryd: warning: refused a control client with CURVE public key %s: not in [control] allow\n",
                     key.c_str());
      };
      auto started = control::ControlServer::Start(xo, handler);
      if (!started.ok()) return started.status().WithContext("control.endpoint");
      extra = std::move(*started);
      std::fprintf(stderr, "ferryd: control socket %s\n", extra->endpoint().c_str());
    }
    return Status::OK();
  }();
  if (!serving_started.ok()) {
    if (group) group->ReportFailure("starting: " + serving_started.message());
    return serving_started;
  }
  std::fprintf(stderr, "ferryd: training %s for %lld steps (from step %lld) in %s\n",
               config.model_name_or_path.string().c_str(), static_cast<long long>(total),
               static_cast<long long>(first_step), trainer->dir().string().c_str());
  started = true;
  grpo::RunHooks hooks;
  hooks.before_step = [&] { return control.BeforeStep(*trainer); };
  hooks.pending = [&] { return control.Pending(); };
  hooks.after_step = [&](const grpo::StepResult& r) { control.AfterStep(*trainer, r); };
  hooks.on_checkpoint = [&](const fs::path& p) { control.Checkpointed(p); };
  const Status run = trainer->Run(hooks);
  if (group && !run.ok() && run.code() != StatusCode::kUnavailable) group->ReportFailure(run.message());
  control.Finish(run);
  if (extra) extra->Stop();
  server->Stop();
  control.SetRemote(nullptr);
  remote.reset();
  FERRY_RETURN_IF_ERROR(run);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "ferryd: done: %lld steps in %.1f s; metrics in %s, checkpoints in %s, store in %s\n",
               static_cast<long long>(trainer->step() - first_step), elapsed,
               (trainer->dir() / "metrics.jsonl").string().c_str(), trainer->dir().string().c_str(),
               trainer->store_dir().string().c_str());
  return Status::OK();
}

}  // namespace

void SetTrainCommand(CLI::App& app) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd =
      app.add_subcommand("train", "Run GRPO training in the foreground (resumes from the newest checkpoint)");
  cmd->add_option("--config", f->config, "the run's TOML file (TRL GRPOConfig / PEFT LoraConfig names)")->required();
  cmd->add_option("--dir", f->dir, "run directory (default: the config's output_dir)");
  cmd->add_option("--max-steps", f->max_steps, "stop after this many optimizer steps in total")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", f->json, "print each metrics line (as metrics.jsonl gets it) to stdout");
  cmd->add_option("--publish", f->publish,
                  "also serve each step's version to remote generators (`ferry sync receive`): ipc://DIR or "
                  "tcp://HOST:PORT (needs [publish] key and allow); overrides [publish] endpoint");
  cmd->add_option("--nproc-per-node", f->nproc_per_node,
                  "start this many local data-parallel ranks (as torchrun --nproc-per-node; each a ferryd process "
                  "with torchrun's RANK and WORLD_SIZE, meeting through a private rendezvous file: nothing listens "
                  "beyond loopback). Without it, torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                  "MASTER_PORT, LOCAL_RANK) is honoured")
      ->check(CLI::Range(1, 1024));
  cmd->callback([f] {
    if (f->nproc_per_node > 1) {
      if (const char* w = std::getenv("WORLD_SIZE"); w != nullptr && *w != '\0') {
        Fail(Status::InvalidArgument("--nproc-per-node with torchrun's environment (WORLD_SIZE=" + std::string(w) +
                                     "): use one or the other"));
      }
      // How long the others may take to end (naming the failed rank) before they are killed.
      auto config = run::LoadRunConfig(f->config);
      if (!config.ok()) Fail(config.status());
      const auto grace = std::chrono::seconds(static_cast<int64_t>(config->distributed.timeout) + 30);
      Result<int> code = RunLocalRanks(f->nproc_per_node, RankArgv(*f), grace);
      if (!code.ok()) Fail(code.status());
      if (*code != 0) throw CLI::RuntimeError(*code);
      return;
    }
    Status s = RunTrain(*f);
    if (!s.ok()) Fail(s);
  });
}

}  // namespace ferry::ferryd
