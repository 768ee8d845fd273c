// A real vLLM server adopting Ferry versions (sync/engine/): the server is started once for
// this executable with scripts/vllm.sh (the venv it caches; `bash scripts/vllm.sh setup`
// creates it) over a copy of the demo model, and every test talks to it. The references come
// from the built ferryd (`ferryd probe --serve`).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "convert/converter.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/safetensors.h"
#include "daemon/grpo/vllm_generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "store/store.h"
#include "sync/engine/probe.h"
#include "sync/engine/reference.h"
#include "sync/engine/vllm_client.h"
#include "sync/engine/vllm_follower.h"
#include "tests/cli/cli_runner.h"
#include "tests/temp_dir.h"

extern char** environ;

namespace ferry::engine {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::RunFerry;

const fs::path kRoot = fs::path(FERRY_FIXTURES_DIR).parent_path();

// Output of a shell command; the test fails when it exits non-zero.
std::string Shell(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int rc = ::pclose(p);
  EXPECT_EQ(rc, 0) << cmd << " ->\n" << out;
  return out;
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// A background process, stdout and stderr to PREFIX.out / PREFIX.err; SIGTERM and reaped
// when stopped or destroyed.
class Child {
 public:
  Child(const std::string& program, const std::vector<std::string>& args, const fs::path& prefix) {
    std::vector<std::string> all = {program};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    const std::string out = prefix.string() + ".out", err = prefix.string() + ".err";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int rc = ::posix_spawn(&pid_, program.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    EXPECT_EQ(rc, 0) << program;
  }
  ~Child() { Stop(); }
  void Stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
};

// The `n`-th line of `file` holding `needle`, waiting up to `seconds` for it to appear (a test
// failure naming the file's end otherwise).
std::string WaitForLine(const fs::path& file, const std::string& needle, int n, int seconds) {
  std::string text;
  for (int i = 0; i < seconds * 10; ++i) {
    std::ifstream in(file);
    std::string line;
    int seen = 0;
    while (std::getline(in, line)) {
      if (line.find(needle) != std::string::npos && ++seen == n) return line;
    }
    ::usleep(100000);
  }
  std::ifstream in(file);
  text.assign(std::istreambuf_iterator<char>(in), {});
  ADD_FAILURE() << "no line " << n << " with '" << needle << "' in " << file << " after " << seconds << " s:\n"
                << text.substr(text.size() > 3000 ? text.size() - 3000 : 0);
  return "";
}

// One server for the whole executable (starting one takes about a minute on 2 cores).
class Server : public ::testing::Environment {
 public:
  void SetUp() override {
    dir_ = std::make_unique<testing::ScopedTempDir>("ferry_vllm_");
    model_ = dir_->path() / "model";
    fs::copy(fs::path(FERRY_FIXTURES_DIR) / "demo" / "model", model_, fs::copy_options::recursive);
    port_ = FreePort();
    url_ = "http://127.0.0.1:" + std::to_string(port_);
    instance_ = this;
    Start();
  }
  // Stops the server (SIGTERM, as vllm.sh stop) and starts it again on the same port: a
  // restarted server holds none of the adapters it had loaded.
  static void Kill() { instance_->Stop(); }
  static void Restart() { instance_->Start(); }
  void TearDown() override {
    if (::testing::UnitTest::GetInstance()->failed_test_count() > 0) {
      std::printf("the end of the vLLM server's log:\n%s\n",
                  Shell("grep -v \"^(APIServer\" " + (dir_->path() / "server.log").string() + " | tail -40").c_str());
    }
    Stop();
    dir_.reset();
  }
  static const std::string& url() { return url_; }
  static const fs::path& model() { return model_; }

 private:
  void Start() {
    std::string pid = Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " start " + model_.string() + " " +
                            std::to_string(port_) + " " + (dir_->path() / "server.log").string());
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    pid_ = pid;
    ASSERT_FALSE(pid_.empty()) << "the vLLM server did not start (bash scripts/vllm.sh setup creates its venv)";
  }
  void Stop() {
    if (!pid_.empty()) Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " stop " + pid_);
    pid_.clear();
  }

  std::unique_ptr<testing::ScopedTempDir> dir_;
  int port_ = 0;
  static inline Server* instance_ = nullptr;
  static inline std::string url_;
  static inline fs::path model_;
  std::string pid_;
};

// A random LoRA adapter for the demo model (q_proj and v_proj of both layers, rank 8), in
// PEFT's format.
void WriteAdapter(const fs::path& dir, uint32_t seed, double alpha, float scale = 0.05f) {
  fs::create_directories(dir);
  struct Pair {
    std::string module;
    int64_t out;
  };
  const std::vector<Pair> modules = {{"self_attn.q_proj", 128}, {"self_attn.v_proj", 64}};
  const int64_t r = 8, in = 128;
  std::vector<TensorSpec> specs;
  for (int layer = 0; layer < 2; ++layer) {
    for (const auto& m : modules) {
      const std::string p = "base_model.model.model.layers." + std::to_string(layer) + "." + m.module;
      specs.push_back({p + ".lora_A.weight", DType::kF32, {r, in}});
      specs.push_back({p + ".lora_B.weight", DType::kF32, {m.out, r}});
    }
  }
  std::sort(specs.begin(), specs.end(), [](const TensorSpec& a, const TensorSpec& b) { return a.name < b.name; });
  auto w = SafetensorsWriter::CreateFile(dir / "adapter_model.safetensors", specs);
  ASSERT_TRUE(w.ok()) << w.status().message();
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  for (const auto& s : specs) {
    std::vector<float> v(static_cast<size_t>(s.shape[0] * s.shape[1]));
    for (float& x : v) x = normal(rng);
    ASSERT_TRUE((*w)->Append(std::as_bytes(std::span(v))).ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
  std::ofstream(dir / "adapter_config.json") << json{
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"r", r},
      {"lora_alpha", alpha},
      {"lora_dropout", 0.0},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"use_rslora", false},
      {"target_modules", {"q_proj", "v_proj"}},
      {"base_model_name_or_path",
       Server::model().string()}}.dump(2);
}

// The adapter merged onto the demo base (hf layout) and that directory's manifest id.
struct Version {
  fs::path adapter, merged;
  store::Digest id;
};

Version MakeVersion(const fs::path& root, const std::string& name, uint32_t seed, double alpha) {
  Version v;
  v.adapter = root / (name + "-adapter");
  v.merged = root / (name + "-merged");
  WriteAdapter(v.adapter, seed, alpha);
  ConvertOptions c;
  c.base = Server::model();
  c.adapter = v.adapter;
  c.out = v.merged;
  c.threads = 1;
  auto s = Convert(c);
  EXPECT_TRUE(s.ok()) << s.status().message();
  auto id = store::HashPath(v.merged);
  EXPECT_TRUE(id.ok()) << id.status().message();
  if (id.ok()) v.id = id->id;
  return v;
}

EngineVersion AdapterVersion(const Version& v, const fs::path* adapter_override = nullptr) {
  EngineVersion e;
  e.id = v.id;
  e.merged_dir = v.merged;
  e.adapter_dir = adapter_override ? *adapter_override : v.adapter;
  e.base_dir = Server::model();
  return e;
}

std::unique_ptr<ReferenceProber> Reference() {
  ReferenceOptions o;
  o.ferryd = FERRYD_PATH;
  auto r = ReferenceProber::Start(o);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(*r) : nullptr;
}

std::unique_ptr<VllmFollower> Follower(const fs::path& work, EngineMode mode = EngineMode::kAdapter) {
  VllmFollowerOptions o;
  o.client.base_url = Server::url();
  o.client.timeout_ms = 120000;
  o.mode = mode;
  o.work_dir = work;
  auto f = VllmFollower::Create(o, Reference());
  EXPECT_TRUE(f.ok()) << f.status().message();
  return f.ok() ? std::move(*f) : nullptr;
}

bool Lists(VllmClient& c, const std::string& name) {
  auto models = c.Models();
  EXPECT_TRUE(models.ok()) << models.status().message();
  return models.ok() && std::find(models->begin(), models->end(), name) != models->end();
}

TEST(VllmEngineTest, AdoptsEachAdapterVersionUnderItsOwnNameAndProvesIt) {
  testing::ScopedTempDir tmp;
  auto f = Follower(tmp / "engine");
  ASSERT_NE(f, nullptr);
  std::vector<Version> v;
  for (uint32_t i = 0; i < 3; ++i) v.push_back(MakeVersion(tmp.path(), "v" + std::to_string(i), 11 + i, 16.0));
  std::vector<std::string> names;
  for (size_t i = 0; i < v.size(); ++i) {
    auto a = f->Adopt(AdapterVersion(v[i]));
    ASSERT_TRUE(a.ok()) << a.status().message();
    EXPECT_TRUE(a->proof.proven) << a->proof.why;
    EXPECT_LE(a->proof.max_diff, 1e-4);
    EXPECT_EQ(a->proof.tokens, 62);  // one sequence of 63: with the generated token, the 64 positions
    EXPECT_NE(a->served_name.find(v[i].id.Hex().substr(0, 12)), std::string::npos) << a->served_name;
    if (i > 0) {
      // The versions differ measurably, and the server answered as the newer one.
      EXPECT_GT(*a->proof.references_diff, 1e-2);
      EXPECT_GT(*a->proof.previous_diff, 1e-2);
    }
    names.push_back(a->served_name);
    EXPECT_TRUE(Lists(f->client(), a->served_name));
    EXPECT_TRUE(fs::exists(tmp / "engine" / a->served_name / "adapter_model.safetensors"));
  }
  // Two versions old: unloaded and its directory removed.
  EXPECT_FALSE(Lists(f->client(), names[0]));
  EXPECT_FALSE(fs::exists(tmp / "engine" / names[0]));
  EXPECT_TRUE(Lists(f->client(), names[1]));
  EXPECT_EQ(f->proven()->served_name, names[2]);
  // The same version adopted again gets a new name (never reloaded in place).
  auto again = f->Adopt(AdapterVersion(v[2]));
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_TRUE(again->proof.proven);
  EXPECT_NE(again->served_name, names[2]);
  auto still = f->StillServesProven();
  ASSERT_TRUE(still.ok()) << still.status().message();
  EXPECT_TRUE(*still);
  // A later process of the same receiver (a restart, `--once` again) unloads what this one left
  // loaded before its first adoption, and removes their directories.
  const std::string left = f->proven()->served_name;
  f.reset();
  auto next = Follower(tmp / "engine");
  ASSERT_NE(next, nullptr);
  EXPECT_TRUE(Lists(next->client(), left));
  auto adopted = next->Adopt(AdapterVersion(v[1]));
  ASSERT_TRUE(adopted.ok()) << adopted.status().message();
  EXPECT_TRUE(adopted->proof.proven);
  EXPECT_FALSE(Lists(next->client(), left));
  EXPECT_FALSE(fs::exists(tmp / "engine" / left));
  EXPECT_TRUE(Lists(next->client(), adopted->served_name));
}

// An adapter whose scaling is wrong (lora_alpha doubled) or that the server applies as nothing
// (lora_alpha 0: the base answers for the adapter) is refused, unloaded, and the last proven
// version stays served.
TEST(VllmEngineTest, RefusesWrongScalingAndTheBaseAnsweringForAnAdapter) {
  testing::ScopedTempDir tmp;
  auto f = Follower(tmp / "engine");
  ASSERT_NE(f, nullptr);
  const Version good = MakeVersion(tmp.path(), "good", 21, 16.0);
  const Version next = MakeVersion(tmp.path(), "next", 22, 16.0);
  auto first = f->Adopt(AdapterVersion(good));
  ASSERT_TRUE(first.ok()) << first.status().message();
  ASSERT_TRUE(first->proof.proven) << first->proof.why;
  for (double alpha : {32.0, 0.0}) {
    SCOPED_TRACE("lora_alpha " + std::to_string(alpha));
    const fs::path wrong = tmp / ("next-alpha-" + std::to_string(static_cast<int>(alpha)));
    WriteAdapter(wrong, 22, alpha);
    auto a = f->Adopt(AdapterVersion(next, &wrong));
    ASSERT_TRUE(a.ok()) << a.status().message();
    EXPECT_FALSE(a->proof.proven);
    EXPECT_GT(a->proof.max_diff, 1e-2);
    EXPECT_NE(a->proof.why.find("differs from the version's"), std::string::npos) << a->proof.why;
    EXPECT_FALSE(Lists(f->client(), a->served_name)) << "a refused version is unloaded";
    EXPECT_EQ(f->proven()->served_name, first->served_name);
    EXPECT_TRUE(*f->StillServesProven());
  }
  // The base answering: the server's answer under the refused name equals the base's.
  auto base = Reference()->Compute(Server::model(), std::nullopt, *ProbeSequences(14, {1, 63}));
  ASSERT_TRUE(base.ok()) << base.status().message();
  auto answer = f->client().PromptLogProbs("base", *ProbeSequences(14, {1, 63}));
  ASSERT_TRUE(answer.ok()) << answer.status().message();
  EXPECT_LE(*MaxAbsDiff(*answer, *base), 1e-4);
}

// Loading a second adapter under a name already loaded leaves the first one answering (vLLM
// refuses or keeps it: vllm#42125's stale blocks are worse); the probe says so.
TEST(VllmEngineTest, ProbeCatchesAStaleSameNameReload) {
  testing::ScopedTempDir tmp;
  const Version one = MakeVersion(tmp.path(), "one", 31, 16.0);
  const Version two = MakeVersion(tmp.path(), "two", 32, 16.0);
  ConvertOptions c;
  c.base = Server::model();
  c.layout = Layout::kLora;
  c.threads = 1;
  for (const Version* v : {&one, &two}) {
    c.adapter = v->adapter;
    c.out = v->adapter.string() + "-lora";
    ASSERT_TRUE(Convert(c).ok());
  }
  auto client = VllmClient::Create({Server::url(), 120000});
  ASSERT_TRUE(client.ok());
  const std::string name = "stale-" + one.id.Hex().substr(0, 12);
  ASSERT_TRUE((*client)->LoadLoraAdapter(name, one.adapter.string() + "-lora").ok());
  (void)(*client)->LoadLoraAdapter(name, two.adapter.string() + "-lora");  // refused or ignored
  auto reference = Reference();
  const Sequences probe = *ProbeSequences(14, {1, 63});
  auto ref_one = reference->Compute(one.merged, std::nullopt, probe);
  auto ref_two = reference->Compute(two.merged, std::nullopt, probe);
  ASSERT_TRUE(ref_one.ok() && ref_two.ok());
  auto answer = (*client)->PromptLogProbs(name, probe);
  ASSERT_TRUE(answer.ok()) << answer.status().message();
  auto judged = Judge(*answer, *ref_two, &*ref_one, 1e-4);
  ASSERT_TRUE(judged.ok());
  EXPECT_FALSE(judged->proven);
  EXPECT_NE(judged->why.find("it matches the previous version's"), std::string::npos) << judged->why;
  EXPECT_TRUE((*client)->UnloadLoraAdapter(name).ok());
  auto gone = (*client)->PromptLogProbs(name, probe);
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.status().code(), StatusCode::kNotFound) << gone.status().message();
}

// Merged mode (dev mode endpoints): reload_weights, proven under the base's name; a reload
// from a directory holding only some tensors is caught and the last proven weights restored.
// Runs last: it changes the base the other tests' adapters apply to, and puts it back.
TEST(VllmEngineTest, ZMergedModeReloadsProvesAndCatchesAPartialReload) {
  testing::ScopedTempDir tmp;
  auto f = Follower(tmp / "engine", EngineMode::kMerged);
  ASSERT_NE(f, nullptr);
  const Version one = MakeVersion(tmp.path(), "m1", 41, 16.0);
  const Version two = MakeVersion(tmp.path(), "m2", 42, 16.0);
  EngineVersion e1;
  e1.id = one.id;
  e1.merged_dir = one.merged;
  auto a = f->Adopt(e1);
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_TRUE(a->proof.proven) << a->proof.why;
  EXPECT_EQ(a->served_name, "base");
  // Only the layer-0 tensors of version two: vLLM reloads what it finds and keeps the rest.
  const fs::path partial = tmp / "m2-partial";
  fs::create_directories(partial);
  {
    auto ck = Checkpoint::Open(two.merged);
    ASSERT_TRUE(ck.ok());
    std::vector<TensorSpec> specs;
    for (const auto& name : ck->names()) {
      if (name.find("layers.0.") != std::string::npos) specs.push_back({name, DType::kF32, ck->Info(name)->shape});
    }
    ASSERT_FALSE(specs.empty());
    auto w = SafetensorsWriter::CreateFile(partial / "model.safetensors", specs);
    ASSERT_TRUE(w.ok());
    for (const auto& s : specs) ASSERT_TRUE((*w)->Write(s.name, *ck->Get(s.name)).ok());
    ASSERT_TRUE((*w)->Finish().ok());
    fs::copy_file(two.merged / "config.json", partial / "config.json");
  }
  EngineVersion e2;
  e2.id = two.id;
  e2.merged_dir = two.merged;
  e2.load_dir = partial;
  auto b = f->Adopt(e2);
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_FALSE(b->proof.proven);
  EXPECT_GT(b->proof.max_diff, 1e-3);
  EXPECT_TRUE(*f->StillServesProven()) << "the last proven weights are reloaded";
  // Whole: proven.
  e2.load_dir.reset();
  auto c = f->Adopt(e2);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_TRUE(c->proof.proven) << c->proof.why;
  // The base back for the other tests.
  ASSERT_TRUE(f->client().Pause().ok());
  ASSERT_TRUE(f->client().ReloadWeights(Server::model().string()).ok());
  ASSERT_TRUE(f->client().ResetPrefixCache().ok());
  ASSERT_TRUE(f->client().Resume().ok());
}

TEST(VllmEngineTest, ClientNamesTheServerAndTheRequestInItsErrors) {
  auto client = VllmClient::Create({Server::url(), 120000});
  ASSERT_TRUE(client.ok());
  auto unknown = (*client)->PromptLogProbs("no-such-adapter", {{1, 2, 3}});
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kNotFound);
  EXPECT_NE(unknown.status().message().find(Server::url() + "/v1/completions"), std::string::npos)
      << unknown.status().message();
  EXPECT_NE(unknown.status().message().find("'no-such-adapter'"), std::string::npos) << unknown.status().message();
  auto closed = VllmClient::Create({"http://127.0.0.1:" + std::to_string(FreePort()), 2000});
  ASSERT_TRUE(closed.ok());
  Status h = (*closed)->Health();
  EXPECT_EQ(h.code(), StatusCode::kUnavailable) << h.message();
  auto bad = VllmClient::Create({"ftp://x", 1000});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------
// ferryd generating its rollouts with the server (use_vllm = true, TRL's server mode).

// The demo's config for a run in `dir`: `extra` lines appended to the top level; `model` in
// place of the server's copy of the demo model.
fs::path DemoConfig(const fs::path& dir, const std::string& extra, const fs::path& model = Server::model()) {
  fs::create_directories(dir);
  const fs::path demo = fs::path(FERRY_FIXTURES_DIR) / "demo";
  std::ifstream in(demo / "grpo.toml");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  auto set = [&](const std::string& key, const std::string& line) {
    const size_t at = text.find("\n" + key + " = ");
    ASSERT_NE(at, std::string::npos) << key;
    text.replace(at + 1, text.find('\n', at + 1) - at - 1, line);
  };
  set("model_name_or_path", "model_name_or_path = \"" + model.string() + "\"");
  set("dataset", "dataset = \"" + (demo / "train.jsonl").string() + "\"");
  set("output_dir", "output_dir = \"" + (dir / "run").string() + "\"");
  set("threads", "threads = 1");
  set("save_steps", "save_steps = 10");
  set("logging_steps", "logging_steps = 1");
  text.insert(text.find("\n[lora]"), "\n" + extra + "\n");
  std::ofstream(dir / "grpo.toml") << text;
  return dir / "grpo.toml";
}

struct RunResult {
  int exit_code = -1;
  std::string err;
  std::vector<json> metrics;
};

RunResult Ferryd(const fs::path& config, const fs::path& dir, int max_steps) {
  RunResult r;
  const std::string log = (dir.parent_path() / (dir.filename().string() + ".log")).string();
  const std::string cmd = std::string(FERRYD_PATH) + " train --config " + config.string() + " --dir " + dir.string() +
                          " --max-steps " + std::to_string(max_steps) + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  r.exit_code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream err(log);
  r.err.assign(std::istreambuf_iterator<char>(err), {});
  std::ifstream m(dir / "metrics.jsonl");
  for (std::string line; std::getline(m, line);) r.metrics.push_back(json::parse(line, nullptr, false));
  return r;
}

double MeanReward(const std::vector<json>& metrics, size_t from, size_t to) {
  double sum = 0;
  for (size_t i = from; i < to; ++i) sum += metrics[i]["reward"].get<double>();
  return sum / static_cast<double>(to - from);
}

// The demo for 150 steps with every step's completions from the server: the reward rises as
// it does with ferryd's co-located generator; every step's version was proven on the server
// (an engine event for it in the run's store) before it sampled; the sampling log-probs the
// server returned agree with the trainer's (the importance-sampling metrics).
TEST(VllmEngineTest, YFerrydDemoLearnsWithVllmGeneratingEveryVersionProven) {
  testing::ScopedTempDir tmp;
  const fs::path config = DemoConfig(tmp / "vllm", "use_vllm = true\nvllm_server_base_url = \"" + Server::url() + "\"");
  RunResult v = Ferryd(config, tmp / "vllm" / "run", 150);
  ASSERT_EQ(v.exit_code, 0) << v.err;
  ASSERT_EQ(v.metrics.size(), 150u);
  const fs::path colocated_config = DemoConfig(tmp / "colocated", "");
  RunResult c = Ferryd(colocated_config, tmp / "colocated" / "run", 150);
  ASSERT_EQ(c.exit_code, 0) << c.err;
  ASSERT_EQ(c.metrics.size(), 150u);
  const double v_first = MeanReward(v.metrics, 0, 10), v_last = MeanReward(v.metrics, 120, 150);
  const double c_first = MeanReward(c.metrics, 0, 10), c_last = MeanReward(c.metrics, 120, 150);
  std::printf("reward, steps 1-10 -> 121-150: vLLM %.3f -> %.3f, co-located %.3f -> %.3f\n", v_first, v_last, c_first,
              c_last);
  EXPECT_GT(v_last, v_first + 0.03);
  EXPECT_GT(c_last, c_first + 0.03);
  EXPECT_LT(std::fabs(v_last - c_last), 0.05);
  std::set<std::string> proven;
  auto audit = RunFerry({"audit", "--db", (tmp / "vllm" / "run" / "store").string(), "--json"});
  ASSERT_EQ(audit.exit_code, 0) << audit.err;
  const json report = json::parse(audit.out, nullptr, false);
  ASSERT_TRUE(report.is_object());
  for (const auto& e : report["engines"]) {
    EXPECT_LE(e["max_diff"].get<double>(), 1e-4) << e.dump();
    proven.insert(e["version"].get<std::string>());
  }
  EXPECT_EQ(report["engines"].size(), 151u);  // the first version, then one per step
  for (const auto& m : v.metrics) {
    EXPECT_EQ(proven.count(m["generator_version"].get<std::string>()), 1u) << m["step"];
    EXPECT_EQ(m["sampling/staleness"], 0.0) << m["step"];
    // vLLM's sampled-token log-probs (processed: under the temperature) against the trainer's.
    EXPECT_LT(m["sampling/sampling_logp_difference/mean"].get<double>(), 1e-3) << m["step"];
  }
}

// A server that lost the proven adapter (restarted, or unloaded behind ferryd's back): the
// next generation loads it again under a new name, proves it against its kept reference, and
// the request goes through.
TEST(VllmEngineTest, YGeneratorLoadsTheProvenVersionAgainWhenTheServerLostIt) {
  testing::ScopedTempDir tmp;
  auto model = runtime::CausalLM::Load(Server::model(), {});
  ASSERT_TRUE(model.ok()) << model.status().message();
  auto peft = LoadPeftConfig(MakeVersion(tmp.path(), "cfg", 61, 16.0).adapter);
  ASSERT_TRUE(peft.ok());
  auto adapter = runtime::LoraAdapter::Create(**model, *peft, 7);
  ASSERT_TRUE(adapter.ok()) << adapter.status().message();
  auto store = store::Store::Open(tmp / "store", {.create_if_missing = true});
  ASSERT_TRUE(store.ok());
  grpo::VllmGeneratorOptions o;
  o.url = Server::url();
  o.timeout_seconds = 60;
  o.work_dir = tmp / "vllm";
  o.base_dir = Server::model();
  auto g = grpo::VllmGenerator::Create(o, model->get(), store->get());
  ASSERT_TRUE(g.ok()) << g.status().message();
  const store::Digest version = *store::Digest::FromHex(std::string(32, 'a'));
  EXPECT_EQ((*g)->proven_at_ns(), 0);
  ASSERT_TRUE((*g)->Adopt(**adapter, version).ok());
  const std::string first = (*g)->served_name();
  // The newest proof, as ferry daemon status shows it: when, and within its tolerance.
  const int64_t proven_at = (*g)->proven_at_ns();
  EXPECT_GT(proven_at, 0);
  EXPECT_TRUE((*g)->last_proof().proven);
  EXPECT_LE((*g)->last_proof().max_diff, (*g)->last_proof().tolerance);
  auto client = VllmClient::Create({Server::url(), 60000});
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->UnloadLoraAdapter(first).ok());
  runtime::SamplingParams sp;
  sp.max_new_tokens = 3;
  sp.seed = 1;
  auto got = (*g)->Generate({{12, 5, 6}}, 2, sp);
  ASSERT_TRUE(got.ok()) << got.status().message();
  EXPECT_EQ(got->size(), 2u);
  EXPECT_NE((*g)->served_name(), first);
  EXPECT_TRUE(Lists(**client, (*g)->served_name()));
  EXPECT_GT((*g)->proven_at_ns(), proven_at);  // proven again
  auto events = (*store)->ListEvents(version);
  ASSERT_TRUE(events.ok());
  int proofs = 0;
  for (const auto& e : *events) proofs += e.type == store::Event::Type::kEngine;
  EXPECT_EQ(proofs, 2);  // adopted, then loaded again and proven again
  // A later process of the same run (a resume) unloads what this one left loaded.
  const std::string left = (*g)->served_name();
  g->reset();
  auto again = grpo::VllmGenerator::Create(o, model->get(), store->get());
  ASSERT_TRUE(again.ok()) << again.status().message();
  EXPECT_FALSE(Lists(**client, left));
  EXPECT_FALSE(fs::exists(o.work_dir / left));
}

// max_staleness = 1: the next batch is sampled while a step trains; no step trains on
// completions of a version more than one step old, and the run still learns what it should.
TEST(VllmEngineTest, YFerrydWithMaxStalenessOneNeverTrainsOnOlderCompletions) {
  testing::ScopedTempDir tmp;
  const fs::path config =
      DemoConfig(tmp.path(), "use_vllm = true\nmax_staleness = 1\nvllm_server_base_url = \"" + Server::url() + "\"");
  RunResult r = Ferryd(config, tmp / "run", 20);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_EQ(r.metrics.size(), 20u);
  for (const auto& m : r.metrics) {
    const int64_t step = m["step"].get<int64_t>();
    EXPECT_EQ(m["sampling/staleness"].get<double>(), step == 1 ? 0.0 : 1.0) << step;
    EXPECT_EQ(m["timing/generation_wait"].is_number(), true);
  }
}

// A server that does not answer: the start fails within vllm_server_timeout naming it, and a
// server that dies mid-run fails the step naming the server and the request; the same command
// resumes once it is back.
TEST(VllmEngineTest, YFerrydNamesAServerThatDoesNotAnswerAndResumesOnceItIsBack) {
  testing::ScopedTempDir tmp;
  const std::string nowhere = "http://127.0.0.1:" + std::to_string(FreePort());
  const fs::path dead =
      DemoConfig(tmp / "dead", "use_vllm = true\nvllm_server_timeout = 2\nvllm_server_base_url = \"" + nowhere + "\"");
  RunResult d = Ferryd(dead, tmp / "dead" / "run", 5);
  EXPECT_EQ(d.exit_code, 1);
  EXPECT_NE(d.err.find("use_vllm: the vLLM server does not answer"), std::string::npos) << d.err;
  EXPECT_NE(d.err.find(nowhere), std::string::npos) << d.err;

  // A fresh or restarted server's first prompt_logprobs and LoRA requests pay a one-off 3-22 s
  // (docs/vllm.md): the runs against a live server wait for it; the timeout is operational,
  // outside the run's fingerprint, so each start may set its own.
  auto config = [&](int timeout) {
    return DemoConfig(tmp / "live", "use_vllm = true\nvllm_server_timeout = " + std::to_string(timeout) +
                                        "\nvllm_server_base_url = \"" + Server::url() + "\"");
  };
  RunResult first = Ferryd(config(120), tmp / "live" / "run", 10);
  ASSERT_EQ(first.exit_code, 0) << first.err;
  Server::Kill();
  RunResult failed = Ferryd(config(3), tmp / "live" / "run", 20);
  EXPECT_EQ(failed.exit_code, 1);
  EXPECT_NE(failed.err.find(Server::url()), std::string::npos) << failed.err;
  EXPECT_EQ(failed.metrics.size(), 10u) << "nothing of a failed step is applied";
  Server::Restart();
  RunResult resumed = Ferryd(config(120), tmp / "live" / "run", 20);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_NE(resumed.err.find("resumed from"), std::string::npos) << resumed.err;
  ASSERT_EQ(resumed.metrics.size(), 20u);
  EXPECT_EQ(resumed.metrics.back()["step"], 20);
}

// A second vLLM server, for one test, over `model` (scripts/vllm.sh start; stopped when it
// goes out of scope).
class OwnServer {
 public:
  OwnServer(const fs::path& model, const fs::path& log) {
    const int port = FreePort();
    pid_ = Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " start " + model.string() + " " +
                 std::to_string(port) + " " + log.string());
    while (!pid_.empty() && (pid_.back() == '\n' || pid_.back() == ' ')) pid_.pop_back();
    if (!pid_.empty()) url_ = "http://127.0.0.1:" + std::to_string(port);
  }
  ~OwnServer() {
    if (!pid_.empty()) Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " stop " + pid_);
  }
  const std::string& url() const { return url_; }

 private:
  std::string pid_, url_;
};

// A QLoRA run: the demo model quantized to NF4 by transformers + bitsandbytes
// (fixtures/demo/model_nf4). vLLM does not load bitsandbytes' serialisation on a CPU, so the
// server is started on `ferry convert`'s dequantized base (bit for bit bitsandbytes'
// dequantize_4bit: convert_test), and the run's adapters are loaded onto it. Every version is
// proven within the F32 tolerance. A server started on the unquantized model instead answers
// for a different model, and the probe refuses it: the run stops naming the server and the
// difference, with nothing trained.
TEST(VllmEngineTest, YQloraRunIsServedOnTheDequantizedBaseAndAWrongBaseIsRefused) {
  testing::ScopedTempDir tmp;
  const fs::path nf4 = fs::path(FERRY_FIXTURES_DIR) / "demo" / "model_nf4";
  auto dq = RunFerry({"convert", "--base", nf4.string(), "--out", (tmp / "dequantized").string(), "--json"});
  ASSERT_EQ(dq.exit_code, 0) << dq.err;
  EXPECT_EQ(json::parse(dq.out)["dequantized_4bit"], 14) << dq.out;
  {
    OwnServer server(tmp / "dequantized", tmp / "dequantized-server.log");
    ASSERT_FALSE(server.url().empty());
    const fs::path config =
        DemoConfig(tmp / "qlora", "use_vllm = true\nvllm_server_base_url = \"" + server.url() + "\"", nf4);
    RunResult r = Ferryd(config, tmp / "qlora" / "run", 10);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ASSERT_EQ(r.metrics.size(), 10u);
    auto audit = RunFerry({"audit", "--db", (tmp / "qlora" / "run" / "store").string(), "--json"});
    ASSERT_EQ(audit.exit_code, 0) << audit.err;
    const json report = json::parse(audit.out, nullptr, false);
    ASSERT_TRUE(report.is_object());
    std::set<std::string> proven;
    for (const auto& e : report["engines"]) {
      EXPECT_EQ(e["url"], server.url()) << e.dump();
      EXPECT_LE(e["max_diff"].get<double>(), 1e-4) << e.dump();
      proven.insert(e["version"].get<std::string>());
    }
    EXPECT_EQ(report["engines"].size(), 11u);  // the first version, then one per step
    for (const auto& m : r.metrics) {
      EXPECT_EQ(proven.count(m["generator_version"].get<std::string>()), 1u) << m["step"];
      EXPECT_LT(m["sampling/sampling_logp_difference/mean"].get<double>(), 1e-3) << m["step"];
    }
  }
  const fs::path wrong = DemoConfig(
      tmp / "wrong", "use_vllm = true\nvllm_server_timeout = 20\nvllm_server_base_url = \"" + Server::url() + "\"",
      nf4);  // room for a fresh server's one-off first probe; the refusals are retried until then
  RunResult w = Ferryd(wrong, tmp / "wrong" / "run", 5);
  EXPECT_EQ(w.exit_code, 1);
  EXPECT_NE(w.err.find("was not proven on vLLM " + Server::url()), std::string::npos) << w.err;
  EXPECT_NE(w.err.find("the engine's answer differs from the version's by"), std::string::npos) << w.err;
  EXPECT_TRUE(w.metrics.empty());
}

// The whole path with the CLI: a trainer drops checkpoints (TRL's layout) into a directory
// `ferry sync publish --watch --mode adapter` follows; `ferry sync receive --engine vllm`
// makes the server adopt each one. The server is killed and restarted mid-run; the receiver
// ends with the newest version proven on it, the publisher's store records every proof, and
// the real transformers + PEFT, given that checkpoint converted by `ferry convert`, answer as
// the server does under the version's name. Runs last: it restarts the shared server.
TEST(VllmEngineTest, ZzReceiverFollowsAWatchedTrainerThroughAServerRestart) {
  testing::ScopedTempDir tmp;
  const fs::path trainer = tmp / "trainer", db = tmp / "db", recv = tmp / "gen";
  fs::create_directories(trainer);
  const std::string ep = "ipc://" + (tmp / "sock").string();
  Child publisher(FERRY_CLI_PATH,
                  {"sync", "publish", "--db", db.string(), "--bind", ep, "--run", "rl", "--mode", "adapter", "--watch",
                   trainer.string(), "--base", Server::model().string(), "--poll-ms", "100"},
                  tmp / "pub");
  Child receiver(FERRY_CLI_PATH,
                 {"sync", "receive", "--connect", ep, "--out", recv.string(), "--id", "gen-v", "--json", "--engine",
                  "vllm", "--engine-url", Server::url(), "--timeout-ms", "20000"},
                 tmp / "recv");
  // A checkpoint appears whole (renamed into the watched directory), as a trainer saves it.
  auto checkpoint = [&](int step, uint32_t seed) {
    const fs::path staging = tmp / ("staging-" + std::to_string(step));
    WriteAdapter(staging, seed, 16.0);
    fs::rename(staging, trainer / ("checkpoint-" + std::to_string(step)));
  };
  // The receiver's JSON line proving the n-th engine adoption.
  auto proven = [&](int n) -> json {
    const std::string line = WaitForLine(tmp / "recv.out", "\"event\":\"engine\"", n, 180);
    auto j = json::parse(line, nullptr, false);
    EXPECT_TRUE(j.is_object()) << line;
    return j.is_object() ? j : json::object();
  };
  json first = proven(1);  // the base, served before the first checkpoint
  EXPECT_EQ(first["model"], "base");
  EXPECT_EQ(first["proven"], true) << first.dump();
  checkpoint(1, 51);
  json one = proven(2);
  EXPECT_EQ(one["proven"], true) << one.dump();
  EXPECT_NE(one["model"].get<std::string>().find(one["version"].get<std::string>().substr(0, 12)), std::string::npos);

  Server::Kill();
  // Three versions while the server is down, each activated by the receiver (its third to
  // fifth: the base and checkpoint 1 before) and tried on the server: the adoption waits and
  // retries. The proven version's reference stays with it (a cache of three references, and
  // the receiver keeping two version directories, once lost it for good: every later adoption
  // failed).
  for (int step = 2; step <= 4; ++step) {
    checkpoint(step, static_cast<uint32_t>(50 + step));
    WaitForLine(tmp / "recv.out", "\"already_active\"", step + 1, 120);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // an adoption attempt fails
  }
  Server::Restart();
  json two = proven(3);
  EXPECT_EQ(two["proven"], true) << two.dump();
  EXPECT_NE(two["version"], one["version"]);
  checkpoint(5, 55);
  json three = proven(4);
  EXPECT_EQ(three["proven"], true) << three.dump();
  EXPECT_LE(three["max_diff"].get<double>(), 1e-4);
  EXPECT_GT(three["previous_diff"].get<double>(), 1e-2);
  receiver.Stop();
  publisher.Stop();

  // The store: the receiver is on the run's newest version, and the engine serves that one.
  auto st = RunFerry({"sync", "status", "--db", db.string(), "--run", "rl", "--json"});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  const json rows = json::parse(st.out, nullptr, false);
  ASSERT_TRUE(rows.is_array() && rows.size() == 1u) << st.out;
  EXPECT_EQ(rows[0]["lag"], 0);
  EXPECT_EQ(rows[0]["engine"]["version"], three["version"]) << st.out;
  EXPECT_EQ(rows[0]["version"], three["version"]) << st.out;
  EXPECT_EQ(rows[0]["engine"]["model"], three["model"]);
  auto audit = RunFerry({"audit", "--db", db.string(), "--json"});
  ASSERT_EQ(audit.exit_code, 0) << audit.err;
  const json report = json::parse(audit.out, nullptr, false);
  ASSERT_TRUE(report.is_object()) << audit.out;
  EXPECT_EQ(report["engines"].size(), 4u) << audit.out;

  // Independent check: transformers + PEFT on the newest checkpoint (converted by ferry to the
  // lora layout the server loaded, and to a merged model) answer as the server does.
  auto lora = RunFerry({"convert", "--base", Server::model().string(), "--adapter", (trainer / "checkpoint-5").string(),
                        "--out", (tmp / "ck5-lora").string(), "--layout", "lora"});
  ASSERT_EQ(lora.exit_code, 0) << lora.err;
  auto merged = RunFerry({"convert", "--base", Server::model().string(), "--adapter",
                          (trainer / "checkpoint-5").string(), "--out", (tmp / "ck5-merged").string()});
  ASSERT_EQ(merged.exit_code, 0) << merged.err;
  const std::vector<int32_t> ids = (*ProbeSequences(14, {1, 63}))[0];
  std::string csv;
  for (int32_t id : ids) csv += (csv.empty() ? "" : ",") + std::to_string(id);
  const std::string python = Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " python");
  const std::string script = (kRoot / "tests" / "sync" / "peft_prompt_logprobs.py").string();
  auto client = VllmClient::Create({Server::url(), 120000});
  ASSERT_TRUE(client.ok());
  auto served = (*client)->PromptLogProbs(three["model"].get<std::string>(), {ids});
  ASSERT_TRUE(served.ok()) << served.status().message();
  for (const std::string& args :
       {Server::model().string() + " --adapter " + (tmp / "ck5-lora").string(), (tmp / "ck5-merged").string()}) {
    SCOPED_TRACE(args);
    const json peft = json::parse(
        Shell(python.substr(0, python.find('\n')) + " " + script + " " + args + " --ids " + csv), nullptr, false);
    ASSERT_TRUE(peft.is_array() && peft.size() == ids.size() - 1);
    LogProbs reference = {peft.get<std::vector<double>>()};
    EXPECT_LE(*MaxAbsDiff(*served, reference), 1e-4);
  }
}

}  // namespace
}  // namespace ferry::engine

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new ferry::engine::Server);
  return RUN_ALL_TESTS();
}
