// `ferry daemon ...` end to end, against fake_ferryd (tests/daemon/fake_ferryd.cpp), a
// scripted stand-in for ferryd built from ferry_control: it serves a status, counts pause,
// resume and stop, and exits on stop. Restarting a complete run runs the real ferryd on the
// bundled demo (FERRYD_PATH, defined when LibTorch is built).
#include <signal.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
#include <zmq.hpp>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/control/endpoint.h"
#include "daemon/control/run_lock.h"
#include "tests/cli/cli_runner.h"
#include "tests/temp_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using testing::RunFerry;

constexpr const char* kVersion = "00112233445566778899aabbccddeeff";

std::string Slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class DaemonCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("FERRY_FERRYD", FAKE_FERRYD_PATH, 1);
    run_ = tmp_.path() / "run";
    config_ = tmp_.path() / "fake.json";
    std::ofstream(config_) << Json{
        {"status",
         {{"step", 12},
          {"total_steps", 800},
          {"epoch", 0.25},
          {"generator_version", kVersion},
          {"last_checkpoint", "checkpoint-10"},
          {"reward", 0.75}}},
        {"snapshot_version",
         kVersion}}.dump();
  }
  void TearDown() override {
    // A fake left running by a failed test is killed, so nothing outlives the test.
    if (auto pid = control::RunLock::Holder(run_); pid.ok()) ::kill(*pid, SIGKILL);
    ::unsetenv("FERRY_FERRYD");
  }
  std::vector<std::string> Args(std::vector<std::string> args) {
    args.push_back("--dir");
    args.push_back(run_.string());
    return args;
  }
  testing::ScopedTempDir tmp_{"ferry_daemon_cli_"};
  fs::path run_, config_;
};

TEST_F(DaemonCliTest, DetachedDaemonIsControlledByEveryCommand) {
  auto start = RunFerry(Args({"daemon", "start", "--config", config_.string(), "--detach"}));
  ASSERT_EQ(start.exit_code, 0) << start.err;
  const int pid = std::stoi(start.out);
  auto holder = control::RunLock::Holder(run_);
  ASSERT_TRUE(holder.ok()) << holder.status().ToString();
  EXPECT_EQ(*holder, pid);

  auto status = RunFerry(Args({"daemon", "status", "--json"}));
  ASSERT_EQ(status.exit_code, 0) << status.err;
  Json j = Json::parse(status.out);
  EXPECT_EQ(j["pid"], pid);
  EXPECT_EQ(j["state"], "running");
  EXPECT_EQ(j["step"], 12);
  EXPECT_EQ(j["total_steps"], 800);
  EXPECT_EQ(j["generator_version"], kVersion);
  EXPECT_EQ(j["last_checkpoint"], "checkpoint-10");

  auto again = RunFerry(Args({"daemon", "start", "--config", config_.string(), "--detach"}));
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.err.find("is in use by ferryd pid " + std::to_string(pid)), std::string::npos) << again.err;

  auto pause = RunFerry(Args({"daemon", "pause"}));
  ASSERT_EQ(pause.exit_code, 0) << pause.err;
  EXPECT_EQ(pause.out, "paused\n");
  status = RunFerry(Args({"daemon", "status", "--json"}));
  EXPECT_EQ(Json::parse(status.out)["state"], "paused");
  auto resume = RunFerry(Args({"daemon", "resume", "--json"}));
  ASSERT_EQ(resume.exit_code, 0) << resume.err;
  EXPECT_EQ(Json::parse(resume.out)["state"], "running");
  auto snapshot = RunFerry(Args({"daemon", "snapshot"}));
  ASSERT_EQ(snapshot.exit_code, 0) << snapshot.err;
  EXPECT_EQ(snapshot.out, std::string(kVersion) + "\n");

  auto stop = RunFerry(Args({"daemon", "stop"}));
  ASSERT_EQ(stop.exit_code, 0) << stop.err;
  EXPECT_EQ(stop.out, "stopped (pid " + std::to_string(pid) + ")\n");
  // stop waited for the exit: the lock is free and the fake wrote its counts.
  EXPECT_EQ(control::RunLock::Holder(run_).status().code(), StatusCode::kNotFound);
  const Json counts = Json::parse(Slurp(run_ / "fake_counts.json"));
  EXPECT_EQ(counts["pause"], 1);
  EXPECT_EQ(counts["resume"], 1);
  EXPECT_EQ(counts["snapshot"], 1);
  EXPECT_EQ(counts["stop"], 1);
  EXPECT_EQ(counts["status"], 3);  // two `status` commands and start's readiness probe

  auto logs = RunFerry(Args({"daemon", "logs"}));
  ASSERT_EQ(logs.exit_code, 0) << logs.err;
  EXPECT_NE(logs.out.find("fake_ferryd train --config " + config_.string() + " --dir " + run_.string()),
            std::string::npos)
      << logs.out;
  EXPECT_NE(logs.out.find("fake_ferryd: stopped\n"), std::string::npos) << logs.out;

  auto gone = RunFerry(Args({"daemon", "pause"}));
  EXPECT_EQ(gone.exit_code, 3);
  EXPECT_NE(gone.err.find("no ferryd is running for " + run_.string()), std::string::npos) << gone.err;
}

TEST_F(DaemonCliTest, StatusWithoutADaemonReadsTheRunDirectory) {
  fs::create_directories(run_ / "checkpoint-20");
  fs::create_directories(run_ / "checkpoint-40");
  fs::create_directories(run_ / "checkpoint-60.tmp");
  std::ofstream(run_ / "metrics.jsonl")
      << R"({"step":30,"reward":0.5,"learning_rate":0.001,"generator_version":"aa"})"
      << "\n"
      << R"({"step":40,"reward":0.625,"learning_rate":0.0005,"epoch":1.5,"generator_version":")" << kVersion << "\"}\n"
      << R"({"step":41,"rew)";  // being written
  auto r = RunFerry(Args({"daemon", "status", "--json"}));
  EXPECT_EQ(r.exit_code, 3) << r.err;
  const Json j = Json::parse(r.out);
  EXPECT_EQ(j["state"], "stopped");
  EXPECT_TRUE(j["pid"].is_null());
  EXPECT_EQ(j["step"], 40);
  EXPECT_EQ(j["reward"], 0.625);
  EXPECT_EQ(j["learning_rate"], 0.0005);
  EXPECT_EQ(j["epoch"], 1.5);
  EXPECT_EQ(j["generator_version"], kVersion);
  EXPECT_EQ(j["last_checkpoint"], "checkpoint-40");

  auto text = RunFerry(Args({"daemon", "status"}));
  EXPECT_EQ(text.exit_code, 3);
  EXPECT_NE(text.out.find("state:             stopped\n"), std::string::npos) << text.out;
}

TEST_F(DaemonCliTest, MetricsInThePrometheusFormat) {
  fs::create_directories(run_);
  std::ofstream(run_ / "metrics.jsonl")
      << R"({"step":1,"reward":0.25})"
      << "\n"
      << R"({"step":2,"reward":0.5,"completions/mean_length":3.5,"kl":0.001,"generator_version":")" << kVersion
      << R"(","note":"x"})"
      << "\n";
  auto r = RunFerry(Args({"daemon", "metrics", "--prometheus", "--run", "add"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out,
            "# TYPE ferry_step gauge\n"
            "ferry_step{run=\"add\"} 2\n"
            "# TYPE ferry_reward gauge\n"
            "ferry_reward{run=\"add\"} 0.5\n"
            "# TYPE ferry_completions_mean_length gauge\n"
            "ferry_completions_mean_length{run=\"add\"} 3.5\n"
            "# TYPE ferry_kl gauge\n"
            "ferry_kl{run=\"add\"} 0.001\n"
            "# TYPE ferry_generator_info gauge\n"
            "ferry_generator_info{run=\"add\",version=\"" +
                std::string(kVersion) + "\"} 1\n");

  // The run label defaults to the directory's name; --output replaces a file.
  const fs::path prom = tmp_.path() / "ferry.prom";
  r = RunFerry(Args({"daemon", "metrics", "--prometheus", "--output", prom.string()}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(r.out.empty());
  EXPECT_NE(Slurp(prom).find("ferry_step{run=\"run\"} 2\n"), std::string::npos) << Slurp(prom);

  r = RunFerry(Args({"daemon", "metrics", "--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(Json::parse(r.out.substr(0, r.out.find('\n'))), Json::parse(R"({"step":1,"reward":0.25})"));
}

TEST_F(DaemonCliTest, BadInputIsAClearErrorAndANonZeroExit) {
  auto r = RunFerry(Args({"daemon", "metrics"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find((run_ / "metrics.jsonl").string() + ": no such file"), std::string::npos) << r.err;

  fs::create_directories(run_);
  std::ofstream(run_ / "metrics.jsonl") << "{\"step\":1}\nnot json\n";
  r = RunFerry(Args({"daemon", "metrics", "--prometheus"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("metrics.jsonl line 2"), std::string::npos) << r.err;

  r = RunFerry(Args({"daemon", "start", "--config", (tmp_.path() / "absent.toml").string()}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("absent.toml: no such file"), std::string::npos) << r.err;

  r = RunFerry(Args({"daemon", "status", "--connect", "tcp://127.0.0.1:5999"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("tcp:// needs CURVE keys"), std::string::npos) << r.err;

  r = RunFerry(Args({"daemon", "pause", "--key", "k"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("--key needs --server-key"), std::string::npos) << r.err;

  r = RunFerry({"daemon", "snapshot", "--bogus"});
  EXPECT_EQ(r.exit_code, 1);
}

TEST_F(DaemonCliTest, AHungDaemonIsNamedAfterStatusOwnTimeout) {
  // This process plays a ferryd that holds the lock and whose socket never answers.
  auto lock = control::RunLock::Acquire(run_);
  ASSERT_TRUE(lock.ok()) << lock.status().ToString();
  auto endpoint = control::ControlEndpoint(run_);
  ASSERT_TRUE(endpoint.ok());
  zmq::context_t ctx;
  zmq::socket_t silent(ctx, zmq::socket_type::router);
  silent.set(zmq::sockopt::linger, 0);
  silent.bind(*endpoint);
  // status's default timeout is its own (5 s), not another subcommand's.
  auto r = RunFerry(Args({"daemon", "status"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("ferryd pid " + std::to_string(::getpid()) + " holds " + run_.string() +
                       " but its control socket did not answer"),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("within 5000 ms"), std::string::npos) << r.err;
}

// The bundled demo (fixtures/demo) as a run config of `steps` steps, checkpointed at the end,
// at `path`; `extra` is appended (e.g. a [publish] table).
void WriteDemoConfig(const fs::path& path, int steps, const std::string& extra = "") {
  const fs::path demo = fs::path(FERRY_FIXTURES_DIR) / "demo";
  std::string text = Slurp(demo / "grpo.toml");
  auto set = [&text](const std::string& key, const std::string& value) {
    const size_t at = text.find("\n" + key + " = ");
    ASSERT_NE(at, std::string::npos) << key;
    const size_t end = text.find('\n', at + 1);
    text.replace(at + 1, end - at - 1, key + " = " + value);
  };
  set("model_name_or_path", "\"" + (demo / "model").string() + "\"");
  set("dataset", "\"" + (demo / "train.jsonl").string() + "\"");
  set("max_steps", std::to_string(steps));
  set("save_steps", std::to_string(steps));
  set("logging_steps", "1");
  set("per_device_train_batch_size", "16");
  std::ofstream(path) << text << extra;
}

// `--publish tcp://...` without the config's [publish] key and allow is refused before ferryd
// runs, leaving nothing behind (ferryd would create the run directory and its store first).
TEST_F(DaemonCliTest, StartRefusesTcpPublishWithoutKeysBeforeCreatingAnything) {
  const fs::path toml = tmp_.path() / "grpo.toml";
  WriteDemoConfig(toml, 2);
  ASSERT_FALSE(HasFailure());
  const std::string expected = "ferry: error: --publish tcp://127.0.0.1:5555: tcp:// needs CURVE keys, and " +
                               toml.string() +
                               " has no [publish] key and allow: set key (a keypair prefix, `ferry keys generate "
                               "--out PREFIX`) and allow (a file of the receivers' public keys) there, or publish on "
                               "ipc://DIR\n";
  for (const bool detach : {true, false}) {
    std::vector<std::string> args = {"daemon", "start", "--config", toml.string(), "--publish", "tcp://127.0.0.1:5555"};
    if (detach) args.push_back("--detach");
    auto r = RunFerry(Args(args));
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_EQ(r.err, expected);
    EXPECT_FALSE(fs::exists(run_)) << "detach " << detach;
  }
  // An endpoint of another scheme is refused naming the flag too.
  auto bad = RunFerry(Args({"daemon", "start", "--config", toml.string(), "--publish", "udp://127.0.0.1:5555"}));
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("--publish: endpoint udp://127.0.0.1:5555: only ipc://"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(run_));

  // With [publish] key and allow the CLI lets it through to ferryd (here the fake, which
  // knows no --publish and exits 2 with its usage).
  ASSERT_EQ(RunFerry({"keys", "generate", "--out", (tmp_.path() / "server").string()}).exit_code, 0);
  ASSERT_EQ(RunFerry({"keys", "generate", "--out", (tmp_.path() / "client").string()}).exit_code, 0);
  fs::copy_file(tmp_.path() / "client.pub", tmp_.path() / "allow");
  WriteDemoConfig(toml, 2,
                  "\n[publish]\nkey = \"" + (tmp_.path() / "server").string() + "\"\nallow = \"" +
                      (tmp_.path() / "allow").string() + "\"\n");
  auto keyed = RunFerry(Args({"daemon", "start", "--config", toml.string(), "--publish", "tcp://127.0.0.1:5555"}));
  EXPECT_EQ(keyed.exit_code, 2) << keyed.err;
  EXPECT_NE(keyed.err.find("usage: fake_ferryd"), std::string::npos) << keyed.err;
}

// A detached ferryd that exits 0 before answering is said to have completed the run only
// when DIR's newest checkpoint is at the run's last step; otherwise the exit is reported.
TEST_F(DaemonCliTest, AnEarlyCleanExitIsCalledCompleteOnlyAtTheLastStep) {
  std::ofstream(config_) << R"({"exit_code": 0})";
  auto r = RunFerry(Args({"daemon", "start", "--config", config_.string(), "--detach"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("exited with code 0 before its control socket answered"), std::string::npos) << r.err;
  // A checkpoint, but the steps of the run cannot be told (the fake's config is no run config).
  fs::create_directories(run_ / "checkpoint-2");
  r = RunFerry(Args({"daemon", "start", "--config", config_.string(), "--detach"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("exited with code 0 before its control socket answered"), std::string::npos) << r.err;
}

// Restarting a run that is complete: ferryd resumes at the last step and exits 0 at once, and
// `ferry daemon start --detach` says the run is complete instead of reporting an early exit.
TEST_F(DaemonCliTest, RestartingACompleteRunSaysItIsComplete) {
#ifndef FERRYD_PATH
  GTEST_SKIP() << "ferryd is not built (no LibTorch)";
#else
  ::setenv("FERRY_FERRYD", FERRYD_PATH, 1);
  const fs::path toml = tmp_.path() / "grpo.toml";
  WriteDemoConfig(toml, 2);
  ASSERT_FALSE(HasFailure());
  auto first = RunFerry(Args({"daemon", "start", "--config", toml.string()}));
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_TRUE(fs::is_directory(run_ / "checkpoint-2")) << first.err;

  auto again = RunFerry(Args({"daemon", "start", "--config", toml.string(), "--detach"}));
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(again.out, "the run in " + run_.string() + " is complete at step 2 (checkpoint-2); nothing to do\n")
      << again.err;
  auto json = RunFerry(Args({"daemon", "start", "--config", toml.string(), "--detach", "--json"}));
  EXPECT_EQ(json.exit_code, 0) << json.err;
  const Json j = Json::parse(json.out, nullptr, false);
  EXPECT_EQ(j.value("state", ""), "complete") << json.out;
  EXPECT_EQ(j.value("step", 0), 2) << json.out;
  EXPECT_EQ(j.value("last_checkpoint", ""), "checkpoint-2") << json.out;
  EXPECT_FALSE(fs::exists(run_ / "checkpoint-3"));
#endif
}

TEST_F(DaemonCliTest, ForegroundStartPassesFerrydsExitCodeThrough) {
  std::ofstream(config_) << R"({"exit_code": 7})";
  auto r = RunFerry(Args({"daemon", "start", "--config", config_.string(), "--max-steps", "5"}));
  EXPECT_EQ(r.exit_code, 7) << r.err;
  EXPECT_EQ(r.out, "fake_ferryd train --config " + config_.string() + " --dir " + run_.string() + " --max-steps 5\n");

  // Detached, a ferryd that exits before answering is reported with its log.
  r = RunFerry(Args({"daemon", "start", "--config", config_.string(), "--detach"}));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("exited with code 7 before its control socket answered"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ferryd.log ends with:\n  fake_ferryd train"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace ferry
