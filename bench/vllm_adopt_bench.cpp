// A weight version adopted by a real vLLM server (issue 32's speed target): for each model, a
// server is started (scripts/vllm.sh, F32, adapter and dev mode), then per repetition the
// trainer's LoRA adapter is changed (its B factors plus small noise: a new version) and three
// paths make the server serve it, interleaved in this order:
//
//   ferry  grpo::VllmGenerator::Adopt(adapter, version), ferryd's whole path from the step's
//          version to the server's proven acknowledgement: the adapter saved in PEFT's format,
//          the reference prompt log-probs of the probe by the trainer's model, the lora-layout
//          conversion, POST /v1/load_lora_adapter under a fresh name, the probe request, the
//          judgement and the `engine` event in a store.
//   parts  the same steps timed one by one outside Adopt (save, reference, convert), on the
//          same adapter; their sum plus the floor's load and probe is what Adopt should cost.
//   floor  what vLLM itself costs: the server loading the already-converted lora directory
//          under a new name + the same probe request (judged: it must answer as the version).
//   peer   the merged-weights path TRL's (non-async) GRPOTrainer takes in server mode: the
//          adapter saved, base + adapter merged and written (ferry's converter, hf layout, the
//          base's dtype), POST /pause, /collective_rpc reload_weights, /reset_prefix_cache,
//          /resume, then the same probe request under the base name. The server's base is
//          reloaded afterwards (untimed) so that the next version's adapter applies to it.
//
// Models: "demo" (fixtures/demo/model, tiny Llama, r=8 alpha 16 on all 7 projections as
// fixtures/demo/grpo.toml) and "0.5b" (ferry_bench_make_model's Llama shape: hidden 1024,
// intermediate 4864, 24 layers, 16/4 heads, vocab 32000, BF16 on disk, F32 on both sides;
// r=16 alpha 32; GPT-2's tokenizer.json from fixtures/tokenizers copied in, as vLLM needs
// one; the server's context capped at 512 positions). Targets: Adopt's median at most 0.1 s
// (demo) and 1 s (0.5b).
//
// A GEMM calibration (F32 at::mm, 512 x 1024 x 1024 on --threads threads, the median GFLOP/s
// of 7) is printed before and after: other work on the machine shows as a drop.
// Servers the bench started are stopped on exit, on error and on SIGINT/SIGTERM.
//
// Usage: ferry_bench_vllm_adopt [--models demo,0.5b] [--reps 10] [--warmup 2] [--port P]
//                               [--threads 2] [--work DIR] [--keep]
//                               [--staleness-reps 2] [--staleness-steps 30]
//   --staleness-*: (c) max_staleness 1 against 0, ferryd train on the demo with this server
//           generating, the settings alternating (target: >= 1.3x the steps per second).
//   --port: the first model's server port (the next model's is P+1). Default: free ports.
//   --work: where the 0.5B model, adapters, store and server logs go. Default: a new
//           directory under $TMPDIR, removed at the end unless --keep.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "bench/torch_calibration.h"
#include "convert/converter.h"
#include "convert/peft_config.h"
#include "core/status.h"
#include "daemon/grpo/vllm_generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/prompt_logprobs.h"
#include "store/store.h"
#include "sync/engine/probe.h"
#include "sync/engine/vllm_client.h"

namespace {

namespace fs = std::filesystem;
using ferry::Result;
using ferry::Status;
using ferry::bench::CalibrationGflops;
using ferry::bench::Median;
using ferry::bench::Seconds;

const fs::path kRoot = FERRY_SOURCE_DIR;

// ---------------------------------------------------------------- servers

// Process groups of the servers this process started (vllm.sh starts each with setsid).
constexpr int kMaxServers = 8;
volatile sig_atomic_t g_servers[kMaxServers] = {};

void KillServersNow() {
  for (int i = 0; i < kMaxServers; ++i) {
    const pid_t pid = static_cast<pid_t>(g_servers[i]);
    if (pid > 0) {
      ::kill(-pid, SIGTERM);
      ::kill(pid, SIGTERM);
    }
  }
}

// While vllm.sh start runs, the server's pid is not known yet: a signal then only marks the
// bench interrupted, and Server::Start finds the server by its port and stops it.
volatile sig_atomic_t g_starting = 0;
volatile sig_atomic_t g_interrupted = 0;

void OnSignal(int sig) {
  KillServersNow();
  g_interrupted = 1;
  if (g_starting) return;
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// The pid of the vLLM server listening on `port` that vllm.sh started (its own session leader,
// "--port PORT" on its command line), or 0.
pid_t FindServerPid(int port) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "cmdline", std::ios::binary);
    std::string cmd((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const pid_t pid = static_cast<pid_t>(std::atol(name.c_str()));
    if (cmd.find("vllm.entrypoints.openai.api_server") != std::string::npos &&
        cmd.find(std::string("--port") + '\0' + std::to_string(port) + '\0') != std::string::npos &&
        ::getsid(pid) == pid) {
      return pid;
    }
  }
  return 0;
}

// Output of a shell command, and its exit status.
std::string Shell(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *rc = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *rc = ::pclose(p);
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

// A vLLM server started by `bash scripts/vllm.sh start`, stopped (vllm.sh stop) when destroyed.
class Server {
 public:
  static Result<std::unique_ptr<Server>> Start(const fs::path& model, int port, const fs::path& log,
                                               const std::string& max_model_len) {
    const std::string url = "http://127.0.0.1:" + std::to_string(port);
    // vllm.sh waits for /health on the port: another process answering there would pass for ours.
    FERRY_ASSIGN_OR_RETURN(auto probe_client, ferry::engine::VllmClient::Create({url, 2000}));
    if (probe_client->Health().ok()) {
      return Status::FailedPrecondition("port " + std::to_string(port) +
                                        " already answers /health: pick another --port");
    }
    std::string cmd;
    if (!max_model_len.empty()) cmd += "FERRY_VLLM_MAX_MODEL_LEN=" + max_model_len + " ";
    cmd += "bash " + (kRoot / "scripts" / "vllm.sh").string() + " start " + model.string() + " " +
           std::to_string(port) + " " + log.string();
    int rc = 0;
    const double t = ferry::bench::Now();
    g_starting = 1;
    std::string out = Shell(cmd, &rc);
    g_starting = 0;
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    const size_t nl = out.rfind('\n');
    const std::string last = nl == std::string::npos ? out : out.substr(nl + 1);
    const long pid = std::atol(last.c_str());
    if (rc != 0 || pid <= 0 || g_interrupted) {
      const pid_t found = pid > 0 ? static_cast<pid_t>(pid) : FindServerPid(port);
      if (found > 0) Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " stop " + std::to_string(found), &rc);
      if (g_interrupted) return Status::Unavailable("interrupted while the server started");
      return Status::Unavailable("vllm.sh start " + model.string() + " failed (" + out + "); see " + log.string());
    }
    auto s = std::unique_ptr<Server>(new Server(static_cast<pid_t>(pid), url));
    std::printf("  vLLM server pid %ld on %s started in %.1f s (log %s)\n", pid, url.c_str(), ferry::bench::Now() - t,
                log.c_str());
    std::fflush(stdout);
    return s;
  }
  ~Server() {
    int rc = 0;
    Shell("bash " + (kRoot / "scripts" / "vllm.sh").string() + " stop " + std::to_string(pid_), &rc);
    for (int i = 0; i < kMaxServers; ++i) {
      if (g_servers[i] == pid_) g_servers[i] = 0;
    }
  }
  const std::string& url() const { return url_; }

 private:
  Server(pid_t pid, std::string url) : pid_(pid), url_(std::move(url)) {
    for (int i = 0; i < kMaxServers; ++i) {
      if (g_servers[i] == 0) {
        g_servers[i] = pid;
        break;
      }
    }
  }
  pid_t pid_;
  std::string url_;
};

// ---------------------------------------------------------------- figures

struct Series {
  std::vector<double> v;
  void Add(double s) { v.push_back(s); }
  double median() const { return Median(v); }
};

void PrintRow(const char* name, const Series& s) {
  std::printf("  %-42s %9.4f %9.4f %9.4f\n", name, ferry::bench::Min(s.v), s.median(),
              *std::max_element(s.v.begin(), s.v.end()));
}

// ---------------------------------------------------------------- one model

struct ModelSpec {
  std::string key;      // "demo" / "0.5b"
  fs::path dir;         // base model directory
  int rank = 8;         // LoRA r
  double alpha = 16;    // lora_alpha
  std::string max_len;  // FERRY_VLLM_MAX_MODEL_LEN ("" = the model's positions)
  double target = 0.1;  // seconds, Adopt's median
};

struct Flags {
  int staleness_reps = 2;  // (c): alternating ferryd runs per setting (0: skip)
  int staleness_steps = 30;
  std::vector<std::string> models = {"demo", "0.5b"};
  int reps = 10, warmup = 2, port = 0, threads = 2;
  fs::path work;
  bool keep = false;
};

Status Check(const Status& s, const std::string& what) { return s.ok() ? s : s.WithContext(what); }

// Writes the 0.5B shape (BF16) with GPT-2's tokenizer.json beside it, unless already there.
Status MakeHalfB(const fs::path& dir) {
  if (fs::exists(dir / "config.json")) return Status::OK();
  const fs::path maker = fs::read_symlink("/proc/self/exe").parent_path() / "ferry_bench_make_model";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::remove_all(dir.string() + "-adapter", ec);
  int rc = 0;
  const std::string out = Shell(maker.string() + " --base " + dir.string() + " --adapter " + dir.string() +
                                    "-adapter --hidden 1024 --intermediate 4864 --layers 24 --vocab 32000"
                                    " --heads 16 --kv-heads 4 2>&1",
                                &rc);
  if (rc != 0) return Status::IOError(maker.string() + " failed: " + out);
  fs::copy_file(kRoot / "fixtures" / "tokenizers" / "gpt2" / "tokenizer.json", dir / "tokenizer.json", ec);
  if (ec) return Status::IOError("copying GPT-2's tokenizer.json: " + ec.message());
  return Status::OK();
}

ferry::store::Digest VersionDigest(std::mt19937_64& rng) { return {rng(), rng()}; }

// (c) max_staleness 1 against 0: ferryd train on the demo (threads = 1, use_vllm against this
// server, logging every step) for --staleness-steps steps, the two settings alternating
// --staleness-reps times; the figure is each run's median step_time after its first 3 steps.
Status RunStaleness(const Flags& flags, const std::string& url, const fs::path& work) {
  std::printf("\n== max_staleness 1 vs 0: ferryd train on the demo with vLLM generating, %d steps, %d reps ==\n",
              flags.staleness_steps, flags.staleness_reps);
  const fs::path demo = kRoot / "fixtures" / "demo";
  std::ifstream in(demo / "grpo.toml");
  std::string base((std::istreambuf_iterator<char>(in)), {});
  auto set = [&](std::string& text, const std::string& key, const std::string& line) {
    const size_t at = text.find("\n" + key + " = ");
    if (at != std::string::npos) text.replace(at + 1, text.find('\n', at + 1) - at - 1, line);
  };
  set(base, "model_name_or_path", "model_name_or_path = \"" + (demo / "model").string() + "\"");
  set(base, "dataset", "dataset = \"" + (demo / "train.jsonl").string() + "\"");
  set(base, "threads", "threads = 1");
  set(base, "logging_steps", "logging_steps = 1");
  set(base, "save_steps", "save_steps = 100000");
  std::vector<double> s0, s1, gen0;  // gen0: max_staleness 0's median timing/generation per run
  for (int rep = 0; rep < flags.staleness_reps; ++rep) {
    for (int staleness : {0, 1}) {
      const fs::path dir = work / ("staleness-" + std::to_string(staleness) + "-" + std::to_string(rep));
      std::error_code ec;
      fs::remove_all(dir, ec);
      fs::create_directories(dir);
      std::string text = base;
      set(text, "output_dir", "output_dir = \"" + (dir / "run").string() + "\"");
      text.insert(text.find("\n[lora]"), "\nuse_vllm = true\nvllm_server_base_url = \"" + url +
                                             "\"\nmax_staleness = " + std::to_string(staleness) + "\n");
      std::ofstream(dir / "grpo.toml") << text;
      int rc = 0;
      Shell(std::string(FERRYD_PATH) + " train --config " + (dir / "grpo.toml").string() + " --dir " +
                (dir / "run").string() + " --max-steps " + std::to_string(flags.staleness_steps) + " > " +
                (dir / "ferryd.log").string() + " 2>&1",
            &rc);
      if (rc != 0) return Status::Internal("ferryd train failed: see " + (dir / "ferryd.log").string());
      std::ifstream m(dir / "run" / "metrics.jsonl");
      std::vector<double> times, generation;
      for (std::string line; std::getline(m, line);) {
        auto j = nlohmann::json::parse(line, nullptr, false);
        if (j.is_object() && j.value("step", 0) > 3 && j.contains("step_time")) times.push_back(j["step_time"]);
        if (j.is_object() && j.value("step", 0) > 3 && j.contains("timing/generation")) {
          generation.push_back(j["timing/generation"]);
        }
      }
      if (times.empty()) return Status::Internal("no step_time in " + (dir / "run" / "metrics.jsonl").string());
      (staleness == 0 ? s0 : s1).push_back(Median(times));
      if (staleness == 0 && !generation.empty()) gen0.push_back(Median(generation));
      std::printf("  rep %d, max_staleness %d: median step %.3f s\n", rep + 1, staleness, Median(times));
      std::fflush(stdout);
    }
  }
  const double m0 = Median(s0), m1 = Median(s1);
  std::printf("  steps per second: max_staleness 0 %.2f, 1 %.2f; ratio %.2fx (target >= 1.3x: %s)\n", 1 / m0, 1 / m1,
              m0 / m1, m0 / m1 >= 1.3 ? "met" : "NOT MET");
  if (!gen0.empty()) {
    // Amdahl: overlapping generation G with the rest R of a step (training, adoption) at
    // best turns G + R into max(G, R), and only with the CPU to run both at once.
    const double g = Median(gen0), r = m0 - g;
    std::printf(
        "  max_staleness 0's step: generation %.3f s + the rest %.3f s; perfect overlap bounds the ratio at "
        "%.2fx\n",
        g, r, m0 / std::max(g, r));
  }
  return Status::OK();
}

Status RunModel(const ModelSpec& spec, const Flags& flags, int port, const fs::path& work) {
  namespace engine = ferry::engine;
  using ferry::runtime::CausalLM;
  using ferry::runtime::LoraAdapter;
  std::printf("\n== %s: %s, LoRA r=%d alpha=%g on all 7 projections, %d reps after %d warm-up ==\n", spec.key.c_str(),
              spec.dir.c_str(), spec.rank, spec.alpha, flags.reps, flags.warmup);
  std::fflush(stdout);
  const fs::path mwork = work / spec.key;
  fs::create_directories(mwork);

  // The trainer's side: the model in F32 and a fresh adapter.
  ferry::runtime::ModelOptions mo;
  mo.dtype = at::kFloat;
  double t_load = 0;
  std::unique_ptr<CausalLM> model;
  {
    Result<std::unique_ptr<CausalLM>> m = Status::OK();
    t_load = Seconds([&] { m = CausalLM::Load(spec.dir, mo); });
    if (!m.ok()) return m.status().WithContext("loading " + spec.dir.string());
    model = std::move(*m);
  }
  const std::string peft_json =
      "{\"peft_type\": \"LORA\", \"task_type\": \"CAUSAL_LM\", \"r\": " + std::to_string(spec.rank) +
      ", \"lora_alpha\": " + std::to_string(spec.alpha) +
      ", \"target_modules\": [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\","
      " \"gate_proj\", \"up_proj\", \"down_proj\"], \"init_lora_weights\": true}";
  FERRY_ASSIGN_OR_RETURN(ferry::PeftConfig peft, ferry::ParsePeftConfig(peft_json, "bench lora"));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<LoraAdapter> adapter, LoraAdapter::Create(*model, peft, 42));
  std::printf("  trainer model loaded (F32) in %.2f s; adapter %lld parameters\n", t_load,
              static_cast<long long>(adapter->num_parameters()));

  FERRY_ASSIGN_OR_RETURN(auto server, Server::Start(spec.dir, port, mwork / "server.log", spec.max_len));
  ferry::store::StoreOptions so;
  so.create_if_missing = true;
  FERRY_ASSIGN_OR_RETURN(auto store, ferry::store::Store::Open(mwork / "store", so));

  ferry::grpo::VllmGeneratorOptions vo;
  vo.url = server->url();
  vo.timeout_seconds = 120;
  vo.work_dir = mwork / "vllm";
  vo.base_dir = spec.dir;
  vo.tolerance = 1e-4;
  vo.reference_threads = ferry::grpo::ReferenceThreadsFor(vo.url, flags.threads);  // as ferryd's trainer
  FERRY_ASSIGN_OR_RETURN(auto gen, ferry::grpo::VllmGenerator::Create(vo, model.get(), store.get()));
  FERRY_ASSIGN_OR_RETURN(auto client, engine::VllmClient::Create({server->url(), 120000}));

  // The probe VllmGenerator uses (Create caps its length below the model's positions).
  engine::ProbeOptions po;
  po.length =
      std::min(po.length, engine::ProbeLengthFor(model->config().hidden_size, model->config().num_hidden_layers));
  const int64_t positions = model->config().max_position_embeddings;
  if (positions > 2 && po.length > positions - 1) po.length = static_cast<int>(positions - 1);
  FERRY_ASSIGN_OR_RETURN(engine::Sequences probe, engine::ProbeSequences(model->config().vocab_size, po));
  std::printf("  probe: %zu sequence of %zu tokens\n", probe.size(), probe[0].size());

  // The base's answer (no adapter): how far each version moves the probe.
  engine::LogProbs base_lp;
  {
    at::NoGradGuard no_grad;
    std::vector<std::vector<int64_t>> seqs;
    for (const auto& s : probe) seqs.emplace_back(s.begin(), s.end());
    FERRY_ASSIGN_OR_RETURN(auto lp, ferry::runtime::PromptLogProbs(*model, nullptr, seqs));
    for (const auto& row : lp) base_lp.emplace_back(row.begin(), row.end());
  }
  std::optional<engine::LogProbs> previous_ref;
  std::vector<double> base_dist, step_dist;
  uint64_t merged_bytes = 0;

  std::mt19937_64 rng(7);
  at::manual_seed(7);
  const auto perturb = [&] {
    at::NoGradGuard no_grad;
    for (const auto& [key, t] : adapter->named_parameters()) {
      if (key.ends_with(".lora_B.weight")) {
        t.add_(at::randn_like(t) * 0.01);
      }
    }
  };
  const auto reference = [&]() -> Result<engine::LogProbs> {
    at::NoGradGuard no_grad;
    std::vector<std::vector<int64_t>> seqs;
    for (const auto& s : probe) seqs.emplace_back(s.begin(), s.end());
    FERRY_ASSIGN_OR_RETURN(auto lp, ferry::runtime::PromptLogProbs(*model, &adapter->binding(), seqs));
    engine::LogProbs out;
    for (const auto& row : lp) out.emplace_back(row.begin(), row.end());
    return out;
  };

  Series ferry_s, save_s, ref_s, conv_s, load_s, fprobe_s, floor_s, psave_s, pmerge_s, preload_s, pprobe_s, peer_s;
  Series restore_s;
  std::vector<double> floor_diff, peer_diff;
  for (int rep = 0; rep < flags.warmup + flags.reps; ++rep) {
    const bool timed = rep >= flags.warmup;
    perturb();
    const ferry::store::Digest version = VersionDigest(rng);

    // ferry
    Status adopted;
    const double t_ferry = Seconds([&] { adopted = gen->Adopt(*adapter, version); });
    FERRY_RETURN_IF_ERROR(Check(adopted, "VllmGenerator::Adopt"));
    if (!gen->proven() || *gen->proven() != version) return Status::Internal("Adopt returned without a proof");

    // parts, as Adopt does them
    const fs::path peft_dir = mwork / "parts-peft";
    const fs::path lora_dir = mwork / ("parts-lora-" + std::to_string(rep));
    Status saved;
    const double t_save = Seconds([&] { saved = adapter->Save(peft_dir, spec.dir.string(), /*force=*/true); });
    FERRY_RETURN_IF_ERROR(Check(saved, "saving the adapter"));
    Result<engine::LogProbs> ref = Status::OK();
    const double t_ref = Seconds([&] { ref = reference(); });
    FERRY_RETURN_IF_ERROR(Check(ref.status(), "the reference"));
    ferry::ConvertOptions c;
    c.base = spec.dir;
    c.adapter = peft_dir;
    c.out = lora_dir;
    c.layout = ferry::Layout::kLora;
    c.force = true;
    c.threads = 1;
    c.sync = false;
    Result<ferry::ConvertSummary> conv = Status::OK();
    const double t_conv = Seconds([&] { conv = ferry::Convert(c); });
    FERRY_RETURN_IF_ERROR(Check(conv.status(), "converting to the lora layout"));

    // floor
    const std::string floor_name = "floor-" + std::to_string(rep);
    Status loaded;
    const double t_lload =
        Seconds([&] { loaded = client->LoadLoraAdapter(floor_name, fs::absolute(lora_dir).string()); });
    FERRY_RETURN_IF_ERROR(Check(loaded, "floor: loading the converted adapter"));
    Result<std::vector<std::vector<double>>> answer = Status::OK();
    const double t_fprobe = Seconds([&] { answer = client->PromptLogProbs(floor_name, probe); });
    FERRY_RETURN_IF_ERROR(Check(answer.status(), "floor: the probe request"));
    FERRY_ASSIGN_OR_RETURN(double fdiff, engine::MaxAbsDiff(*answer, *ref));
    (void)client->UnloadLoraAdapter(floor_name);
    std::error_code ec;
    fs::remove_all(lora_dir, ec);

    // peer: merged weights through the dev-mode reload
    const fs::path peer_peft = mwork / "peer-peft";
    const fs::path merged = mwork / "peer-merged";
    const double t_psave = Seconds([&] { saved = adapter->Save(peer_peft, spec.dir.string(), /*force=*/true); });
    FERRY_RETURN_IF_ERROR(Check(saved, "peer: saving the adapter"));
    ferry::ConvertOptions m;
    m.base = spec.dir;
    m.adapter = peer_peft;
    m.out = merged;
    m.layout = ferry::Layout::kHf;
    m.force = true;
    m.threads = 0;
    m.sync = false;
    const double t_pmerge = Seconds([&] { conv = ferry::Convert(m); });
    FERRY_RETURN_IF_ERROR(Check(conv.status(), "peer: writing the merged model"));
    merged_bytes = conv->bytes_written;
    Status reloaded;
    const double t_preload = Seconds([&] {
      reloaded = client->Pause();
      if (reloaded.ok()) reloaded = client->ReloadWeights(fs::absolute(merged).string());
      if (reloaded.ok()) reloaded = client->ResetPrefixCache();
      if (reloaded.ok()) reloaded = client->Resume();
    });
    FERRY_RETURN_IF_ERROR(Check(reloaded, "peer: pause, reload_weights, reset_prefix_cache, resume"));
    const double t_pprobe = Seconds([&] { answer = client->PromptLogProbs("base", probe); });
    FERRY_RETURN_IF_ERROR(Check(answer.status(), "peer: the probe request"));
    FERRY_ASSIGN_OR_RETURN(double pdiff, engine::MaxAbsDiff(*answer, *ref));
    // The base back (untimed), so that the next version's adapter applies to it.
    const double t_restore = Seconds([&] {
      reloaded = client->Pause();
      if (reloaded.ok()) reloaded = client->ReloadWeights(fs::absolute(spec.dir).string());
      if (reloaded.ok()) reloaded = client->ResetPrefixCache();
      if (reloaded.ok()) reloaded = client->Resume();
    });
    FERRY_RETURN_IF_ERROR(Check(reloaded, "restoring the server's base"));
    fs::remove_all(merged, ec);

    FERRY_ASSIGN_OR_RETURN(double bdist, engine::MaxAbsDiff(*ref, base_lp));
    double sdist = 0;
    if (previous_ref) {
      FERRY_ASSIGN_OR_RETURN(sdist, engine::MaxAbsDiff(*ref, *previous_ref));
    }
    previous_ref = *ref;
    std::printf(
        "  %s %2d: ferry %.4f  parts %.4f+%.4f+%.4f  floor %.4f+%.4f  peer %.4f+%.4f+%.4f+%.4f  "
        "(diff floor %.1e peer %.1e; version vs base %.1e, vs previous %.1e)\n",
        timed ? "rep" : "warm-up", timed ? rep - flags.warmup + 1 : rep + 1, t_ferry, t_save, t_ref, t_conv, t_lload,
        t_fprobe, t_psave, t_pmerge, t_preload, t_pprobe, fdiff, pdiff, bdist, sdist);
    std::fflush(stdout);
    if (fdiff > vo.tolerance) {
      return Status::Internal("floor: the server answered " + std::to_string(fdiff) + " from the reference");
    }
    if (!timed) continue;
    ferry_s.Add(t_ferry);
    save_s.Add(t_save);
    ref_s.Add(t_ref);
    conv_s.Add(t_conv);
    load_s.Add(t_lload);
    fprobe_s.Add(t_fprobe);
    floor_s.Add(t_lload + t_fprobe);
    psave_s.Add(t_psave);
    pmerge_s.Add(t_pmerge);
    preload_s.Add(t_preload);
    pprobe_s.Add(t_pprobe);
    peer_s.Add(t_psave + t_pmerge + t_preload + t_pprobe);
    restore_s.Add(t_restore);
    base_dist.push_back(bdist);
    step_dist.push_back(sdist);
    floor_diff.push_back(fdiff);
    peer_diff.push_back(pdiff);
  }

  std::printf("\n  %s, seconds (%d reps)                         %9s %9s %9s\n", spec.key.c_str(), flags.reps, "min",
              "median", "max");
  PrintRow("ferry: VllmGenerator::Adopt", ferry_s);
  PrintRow("  part: adapter save (PEFT, fsynced)", save_s);
  PrintRow("  part: reference prompt log-probs", ref_s);
  PrintRow("  part: convert to the lora layout", conv_s);
  PrintRow("  part: load_lora_adapter (= floor's)", load_s);
  PrintRow("  part: probe request (= floor's)", fprobe_s);
  PrintRow("floor: load_lora_adapter + probe", floor_s);
  PrintRow("peer: merged-weights reload + probe", peer_s);
  PrintRow("  peer: adapter save (PEFT)", psave_s);
  PrintRow("  peer: merge + write (hf layout)", pmerge_s);
  PrintRow("  peer: pause+reload_weights+reset+resume", preload_s);
  PrintRow("  peer: probe request", pprobe_s);
  PrintRow("(untimed: the base reloaded after the peer)", restore_s);
  const double parts = save_s.median() + ref_s.median() + conv_s.median() + load_s.median() + fprobe_s.median();
  std::printf("  sum of the parts' medians %.4f s; Adopt beyond it %.4f s\n", parts, ferry_s.median() - parts);
  std::printf(
      "  server vs reference, max |diff| median: floor %.2e, peer %.2e (the peer's merge is in the base's dtype)\n",
      Median(floor_diff), Median(peer_diff));
  std::printf("  the probe moved by each version, max |diff| median: from the base %.2e, from the previous %.2e\n",
              Median(base_dist), Median(step_dist));
  std::printf("  peer's merged model: %.1f MB written\n", static_cast<double>(merged_bytes) / 1e6);
  std::printf("  ratios of medians: ferry/floor %.2fx, ferry/peer %.2fx\n", ferry_s.median() / floor_s.median(),
              ferry_s.median() / peer_s.median());
  std::printf("  target: Adopt median <= %.2f s: %s (%.4f s)\n", spec.target,
              ferry_s.median() <= spec.target ? "MET" : "NOT MET", ferry_s.median());
  std::fflush(stdout);

  // Where the probe's time goes: the reference and the server's request against the probe's
  // length (the proven adapter, median of 3), and the reference with the BLAS only
  // (ModelOptions::skinny_linear_rows = 0) and on 1 thread.
  std::printf("\n  probe length    reference s   server request s   (medians of 3, the proven adapter)\n");
  for (int len : {8, 16, 32, po.length}) {
    if (len > po.length) continue;
    engine::ProbeOptions lo = po;
    lo.length = len;
    FERRY_ASSIGN_OR_RETURN(probe, engine::ProbeSequences(model->config().vocab_size, lo));
    std::vector<double> r, q;
    for (int i = 0; i < 3; ++i) {
      Result<engine::LogProbs> x = Status::OK();
      r.push_back(Seconds([&] { x = reference(); }));
      FERRY_RETURN_IF_ERROR(x.status());
      Result<std::vector<std::vector<double>>> y = Status::OK();
      q.push_back(Seconds([&] { y = client->PromptLogProbs(gen->served_name(), probe); }));
      FERRY_RETURN_IF_ERROR(y.status());
    }
    std::printf("  %12d    %11.4f   %16.4f\n", len, Median(r), Median(q));
  }
  FERRY_ASSIGN_OR_RETURN(probe, engine::ProbeSequences(model->config().vocab_size, po));
  {
    std::vector<double> one;
    at::set_num_threads(1);
    for (int i = 0; i < 3; ++i) one.push_back(Seconds([&] { (void)reference(); }));
    at::set_num_threads(flags.threads);
    model.reset();
    ferry::runtime::ModelOptions blas = mo;
    blas.skinny_linear_rows = 0;
    FERRY_ASSIGN_OR_RETURN(model, CausalLM::Load(spec.dir, blas));
    const fs::path peft_dir = mwork / "parts-peft";
    FERRY_RETURN_IF_ERROR(adapter->Save(peft_dir, spec.dir.string(), /*force=*/true));
    FERRY_ASSIGN_OR_RETURN(adapter, LoraAdapter::Load(*model, peft_dir));
    std::vector<double> b;
    for (int i = 0; i < 3; ++i) b.push_back(Seconds([&] { (void)reference(); }));
    std::printf(
        "  reference at length %d: %d threads (as above) %.4f s, 1 thread %.4f s, BLAS only "
        "(skinny_linear_rows 0, %d threads) %.4f s\n",
        po.length, flags.threads, ref_s.median(), Median(one), flags.threads, Median(b));
  }
  std::fflush(stdout);
  if (spec.key == "demo" && flags.staleness_reps > 0) {
    FERRY_RETURN_IF_ERROR(RunStaleness(flags, server->url(), mwork));
  }
  return Status::OK();
}

int Usage(int rc) {
  std::fprintf(rc == 0 ? stdout : stderr,
               "usage: ferry_bench_vllm_adopt [--models demo,0.5b] [--reps 10] [--warmup 2] [--port P]\n"
               "                              [--threads 2] [--work DIR] [--keep]\n"
               "A weight version adopted by a real vLLM server (scripts/vllm.sh; `bash scripts/vllm.sh setup` first):\n"
               "VllmGenerator::Adopt against vLLM's own load + probe (floor) and the merged-weights reload (peer).\n"
               "  --models   demo (fixtures/demo/model) and/or 0.5b (a synthetic 0.5B Llama shape)\n"
               "  --reps     measured versions per model, after --warmup ones\n"
               "  --port     the first server's port (the next model's is P+1); default: free ports\n"
               "  --threads  LibTorch threads of the trainer's side (the server runs vllm.sh's default)\n"
               "  --work     working directory (default: a new one under $TMPDIR, removed unless --keep)\n"
               "  --staleness-reps N, --staleness-steps S   max_staleness 1 vs 0 (ferryd train on the demo with\n"
               "             the server generating, S steps, the settings alternating N times; 0 reps: skip)\n");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return Usage(0);
    if (a == "--keep") {
      flags.keep = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "ferry_bench_vllm_adopt: %s needs a value\n", a.c_str());
      return Usage(2);
    }
    const std::string v = argv[++i];
    if (a == "--models") {
      flags.models.clear();
      std::stringstream ss(v);
      std::string m;
      while (std::getline(ss, m, ',')) {
        if (m != "demo" && m != "0.5b") {
          std::fprintf(stderr, "ferry_bench_vllm_adopt: unknown model '%s' (demo, 0.5b)\n", m.c_str());
          return 2;
        }
        flags.models.push_back(m);
      }
    } else if (a == "--reps") flags.reps = std::atoi(v.c_str());
    else if (a == "--warmup") flags.warmup = std::atoi(v.c_str());
    else if (a == "--port") flags.port = std::atoi(v.c_str());
    else if (a == "--staleness-reps") flags.staleness_reps = std::atoi(v.c_str());
    else if (a == "--staleness-steps") flags.staleness_steps = std::atoi(v.c_str());
    else if (a == "--threads") flags.threads = std::atoi(v.c_str());
    else if (a == "--work") flags.work = v;
    else {
      std::fprintf(stderr, "ferry_bench_vllm_adopt: unknown flag %s\n", a.c_str());
      return Usage(2);
    }
  }
  if (flags.reps < 1 || flags.warmup < 0 || flags.threads < 1 || flags.port < 0 || flags.models.empty()) {
    std::fprintf(stderr, "ferry_bench_vllm_adopt: --reps and --threads must be >= 1, --warmup and --port >= 0\n");
    return 2;
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGHUP, OnSignal);
  at::set_num_threads(flags.threads);

  bool own_work = false;
  if (flags.work.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "ferry_vllm_adopt_XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      std::perror("mkdtemp");
      return 1;
    }
    flags.work = tmpl;
    own_work = !flags.keep;
  }
  fs::create_directories(flags.work);

  std::printf("ferry_bench_vllm_adopt: %d LibTorch threads, %u hardware threads, work %s\n", flags.threads,
              std::thread::hardware_concurrency(), flags.work.c_str());
  std::printf("calibration before: F32 GEMM 512x1024x1024 %.1f GFLOP/s\n", CalibrationGflops());
  std::fflush(stdout);
  int rc = 0;
  for (size_t i = 0; i < flags.models.size() && rc == 0; ++i) {
    ModelSpec spec;
    spec.key = flags.models[i];
    if (spec.key == "demo") {
      spec.dir = kRoot / "fixtures" / "demo" / "model";
    } else {
      spec.dir = flags.work / "model-0.5b";
      spec.rank = 16;
      spec.alpha = 32;
      spec.max_len = "512";
      spec.target = 1.0;
      Status made = MakeHalfB(spec.dir);
      if (!made.ok()) {
        std::fprintf(stderr, "ferry_bench_vllm_adopt: %s\n", made.ToString().c_str());
        rc = 1;
        break;
      }
    }
    const int port = flags.port > 0 ? flags.port + static_cast<int>(i) : FreePort();
    if (g_interrupted) break;
    Status s;
    try {
      s = RunModel(spec, flags, port, flags.work);
    } catch (const std::exception& e) {
      s = Status::Internal(e.what());
    }
    if (!s.ok()) {
      std::fprintf(stderr, "ferry_bench_vllm_adopt: %s: %s\n", spec.key.c_str(), s.ToString().c_str());
      rc = 1;
    }
  }
  if (g_interrupted) {
    KillServersNow();
    return 130;
  }
  std::printf("\ncalibration after: F32 GEMM 512x1024x1024 %.1f GFLOP/s\n", CalibrationGflops());
  if (own_work) {
    std::error_code ec;
    fs::remove_all(flags.work, ec);
  }
  return rc;
}
