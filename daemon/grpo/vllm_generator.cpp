#include "daemon/grpo/vllm_generator.h"

#include <unistd.h>

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <future>
#include <thread>
#include <utility>

#include "convert/converter.h"
#include "core/text.h"
#include "daemon/runtime/prompt_logprobs.h"
#include "daemon/runtime/torch_util.h"
#include "store/engine_report.h"

namespace ferry::grpo {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Errors a call waits out (within the timeout) rather than failing the step at once: the
// server down, restarting or not answering, or answering something malformed.
bool Retryable(const Status& s) { return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kCorruption; }

// At most this many adapters stay loaded: the proven one and the one before it.
constexpr size_t kKeepLoaded = 2;

}  // namespace

int ReferenceThreadsFor(const std::string& url, int threads) {
  const size_t scheme = url.find("://");
  std::string host = url.substr(scheme == std::string::npos ? 0 : scheme + 3);
  bool loopback = false;
  if (!host.empty() && host.front() == '[') {
    loopback = host.rfind("[::1]", 0) == 0;
  } else {
    host = host.substr(0, host.find_first_of(":/"));
    const bool dotted = !host.empty() && host.find_first_not_of("0123456789.") == std::string::npos;
    loopback = host == "localhost" || (dotted && host.rfind("127.", 0) == 0);
  }
  return loopback ? std::max(1, threads / 2) : 0;
}

Result<double> ProbeToleranceFor(at::ScalarType trainer, const std::string& server_dtype) {
  const char* mine = trainer == at::kFloat ? "float32" : trainer == at::kHalf ? "float16" : "bfloat16";
  FERRY_ASSIGN_OR_RETURN(const double own, engine::ToleranceForDtype(mine));
  if (server_dtype.empty()) return own;
  FERRY_ASSIGN_OR_RETURN(const double server, engine::ToleranceForDtype(server_dtype));
  return std::max(own, server);
}

std::vector<int64_t> VllmWorkerProcesses(const std::filesystem::path& proc) {
  std::vector<int64_t> pids;
  std::error_code ec;
  for (fs::directory_iterator it(proc, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(it->path() / "cmdline", std::ios::binary);
    std::string title;
    std::getline(in, title, '\0');  // argv[0], which setproctitle rewrites
    if (title.find("::Worker") != std::string::npos) pids.push_back(std::strtoll(name.c_str(), nullptr, 10));
  }
  std::sort(pids.begin(), pids.end());
  return pids;
}

VllmGenerator::VllmGenerator(VllmGeneratorOptions options, std::unique_ptr<engine::VllmClient> client,
                             const runtime::CausalLM* model, store::Store* store)
    : options_(std::move(options)), client_(std::move(client)), model_(model), store_(store) {}

VllmGenerator::~VllmGenerator() = default;

Result<std::unique_ptr<VllmGenerator>> VllmGenerator::Create(VllmGeneratorOptions options,
                                                             const runtime::CausalLM* model, store::Store* store) {
  if (model == nullptr || options.work_dir.empty() || options.base_dir.empty()) {
    return Status::InvalidArgument("VllmGenerator needs the trainer's model, a work directory and the base directory");
  }
  const int timeout_ms = static_cast<int>(std::min(options.timeout_seconds * 1000.0, 86'400'000.0));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<engine::VllmClient> client,
                         engine::VllmClient::Create({options.url, timeout_ms}));
  std::error_code ec;
  fs::create_directories(options.work_dir, ec);
  if (ec) return Status::IOError("cannot create " + options.work_dir.string() + ": " + ec.message());
  // The server may still be starting: wait for it within the timeout, as TRL's client does.
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  Result<std::vector<std::string>> models = client->Models();
  while (!models.ok() && Retryable(models.status()) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    models = client->Models();
  }
  if (!models.ok()) return models.status().WithContext("use_vllm: the vLLM server does not answer");
  if (models->empty()) return Status::FailedPrecondition("vLLM " + options.url + "/v1/models lists no model");
  // The adapters this run's earlier processes loaded (a resume, a crash): their directories are
  // in the run's work directory, under the names they were loaded under. Unloaded, so that a
  // server following a run across resumes does not keep each process's last two for good.
  std::vector<std::string> earlier;
  for (fs::directory_iterator it(options.work_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("ferry-", 0) == 0 && it->is_directory()) earlier.push_back(name);
  }
  for (const std::string& name : earlier) {
    if (std::find(models->begin(), models->end(), name) != models->end()) (void)client->UnloadLoraAdapter(name);
    std::error_code rm;
    fs::remove_all(options.work_dir / name, rm);
  }
  const runtime::ModelConfig& mc = model->config();
  options.probe.length = std::min(options.probe.length, engine::ProbeLengthFor(mc.hidden_size, mc.num_hidden_layers));
  const int64_t positions = mc.max_position_embeddings;
  if (positions > 2 && options.probe.length > positions - 1) options.probe.length = static_cast<int>(positions - 1);
  FERRY_ASSIGN_OR_RETURN(engine::Sequences probe, engine::ProbeSequences(model->config().vocab_size, options.probe));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<engine::VllmClient> gen_client,
                         engine::VllmClient::Create({options.url, timeout_ms}));
  std::unique_ptr<VllmGenerator> g(new VllmGenerator(std::move(options), std::move(client), model, store));
  g->gen_client_ = std::move(gen_client);
  g->probe_ = std::move(probe);
  return g;
}

Status VllmGenerator::Record(const store::Digest& version, const std::string& name, const engine::ProofFigures& proof,
                             double seconds) {
  if (store_ == nullptr) return Status::OK();
  store::EngineReport r;
  r.engine = "vllm";
  r.url = options_.url;
  r.model = name;
  r.proven = proof.proven;
  r.tolerance = proof.tolerance;
  r.max_diff = proof.max_diff;
  r.previous_diff = proof.previous_diff;
  r.tokens = proof.tokens;
  r.seconds = seconds;
  r.why = proof.why;
  store::Event e;
  e.type = proof.proven ? store::Event::Type::kEngine : store::Event::Type::kAnomaly;
  if (!proof.proven) e.anomaly = store::Event::Anomaly::kEngineMismatch;
  e.receiver = options_.receiver_id;
  e.version = version;
  e.detail = store::EngineReportJson(r);
  if (proof.proven) {
    last_proof_ = proof;
    proven_at_ns_ =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
  }
  return store_->AddEvent(e);
}

Status VllmGenerator::Adopt(const runtime::LoraAdapter& adapter, const store::Digest& version,
                            const std::function<void()>& before_probe) {
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.timeout_seconds));
  // vllm_server_timeout bounds the whole adoption, not each of its requests.
  client_->SetDeadline(deadline);
  struct Clear {
    engine::VllmClient& c;
    ~Clear() { c.SetDeadline(std::nullopt); }
  } clear{*client_};
  // The adapter as the trainer holds it now, in PEFT's format, then as the clean lora layout.
  const fs::path peft = options_.work_dir / ("adapter-" + version.Hex().substr(0, 12));
  // A transient copy (removed once the version is proven): no fsync.
  {
    std::error_code ec;
    fs::remove_all(peft, ec);
    fs::create_directories(peft, ec);
    if (ec) return Status::IOError("cannot create " + peft.string() + ": " + ec.message());
  }
  FERRY_RETURN_IF_ERROR(adapter.WriteFiles(peft, options_.base_dir.string(), /*sync=*/false));
  // The reference, the trainer's model with this adapter, computed while the adapter is
  // written and loaded (both only read the adapter's parameters).
  std::future<Result<engine::LogProbs>> reference_future =
      std::async(std::launch::async, [this, &adapter]() -> Result<engine::LogProbs> {
        return runtime::GuardTorch("the probe's reference", [&]() -> Result<engine::LogProbs> {
          at::NoGradGuard no_grad;
          // A new thread starts with OpenMP's default team size (every core), not the process's
          // setting: this one's is set here, and the process's restored after. The trainer's
          // thread waits in this Adopt meanwhile: nothing else computes.
          const int threads = at::get_num_threads();
          const int mine = options_.reference_threads > 0 ? std::min(options_.reference_threads, threads) : threads;
          const bool cpu = model_->device().is_cpu();
          if (cpu) at::set_num_threads(mine);
          struct Restore {
            bool active;
            int threads;
            ~Restore() {
              if (active) at::set_num_threads(threads);
            }
          } restore{cpu, threads};
          std::vector<std::vector<int64_t>> seqs;
          for (const auto& s : probe_) seqs.emplace_back(s.begin(), s.end());
          FERRY_ASSIGN_OR_RETURN(auto lp, runtime::PromptLogProbs(*model_, &adapter.binding(), seqs));
          engine::LogProbs out;
          for (const auto& row : lp) out.emplace_back(row.begin(), row.end());
          return out;
        });
      });
  std::optional<engine::LogProbs> reference_holder;
  auto reference = [&]() -> Result<const engine::LogProbs*> {
    if (!reference_holder) {
      FERRY_ASSIGN_OR_RETURN(engine::LogProbs r, reference_future.get());
      reference_holder = std::move(r);
    }
    return &*reference_holder;
  };
  Status last, refused;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1000 * attempt, 5000)));
    }
    const std::string name = engine::AdapterName(version.Hex(), instance_, ++loads_);
    ConvertOptions c;
    c.base = options_.base_dir;
    c.adapter = peft;
    c.out = options_.work_dir / name;
    c.layout = Layout::kLora;
    c.force = true;
    c.threads = 1;
    c.sync = false;  // the server reads it now; a crash loses nothing the store does not hold
    auto converted = Convert(c);
    if (!converted.ok()) return converted.status().WithContext("use_vllm: writing the adapter for the server");
    last = client_->LoadLoraAdapter(name, fs::absolute(c.out).string());
    if (!last.ok()) {
      std::error_code ec;
      fs::remove_all(c.out, ec);
      if (!Retryable(last)) return last;
      continue;
    }
    // Loaded: unloaded again on every path but its proof (a retry loads it under a new name),
    // so that only proven adapters are kept and the oldest of those is the one unloaded.
    auto drop = [&] {
      (void)client_->UnloadLoraAdapter(name);  // a failure leaves it to the server's LRU
      std::error_code ec;
      fs::remove_all(c.out, ec);
    };
    if (before_probe) before_probe();
    auto answer = client_->PromptLogProbs(name, probe_);
    if (!answer.ok()) {
      last = answer.status();
      drop();
      if (!Retryable(last)) return last;
      continue;
    }
    Result<const engine::LogProbs*> ref = reference();
    Result<engine::ProofFigures> judged =
        ref.ok() ? engine::Judge(*answer, **ref, previous_ ? &*previous_ : nullptr, options_.tolerance)
                 : Result<engine::ProofFigures>(ref.status());
    Status recorded = judged.ok() ? Record(version, name, *judged, SecondsSince(start)) : judged.status();
    if (!recorded.ok()) {
      drop();
      return recorded;
    }
    const engine::ProofFigures& proof = *judged;
    if (proof.proven) {
      proven_ = version;
      served_name_ = name;
      previous_ = **ref;
      loaded_.push_back(name);
      while (loaded_.size() > kKeepLoaded) {
        // A failed unload leaves the adapter to the server's LRU: not an error.
        (void)client_->UnloadLoraAdapter(loaded_.front());
        std::error_code ec;
        fs::remove_all(options_.work_dir / loaded_.front(), ec);
        loaded_.pop_front();
      }
      std::error_code ec;
      fs::remove_all(peft, ec);
      return Status::OK();
    }
    // Not this version: unloaded, tried again under a new name.
    last = refused = Status::Corruption("vLLM " + options_.url + " did not answer as version " + version.Hex() +
                                        " under " + Quote(name) + ": " + proof.why);
    drop();
  }
  // The last error, and the last refusal when something else (the deadline, mid-attempt) came after.
  const bool both = !refused.ok() && refused.message() != last.message();
  return Status::Unavailable("use_vllm: version " + version.Hex() + " was not proven on vLLM " + options_.url +
                             " within vllm_server_timeout (" + FormatNumber(options_.timeout_seconds, 6) +
                             " s): " + last.message() + (both ? "; before that: " + refused.message() : ""));
}

Result<std::vector<runtime::Completion>> VllmGenerator::Generate(const std::vector<std::vector<int32_t>>& prompts,
                                                                 int n, const runtime::SamplingParams& params) {
  if (!proven_) return Status::FailedPrecondition("use_vllm: no version is proven on the vLLM server yet");
  auto got = GenerateUnder(served_name_, prompts, n, params);
  if (got.ok() || got.status().code() != StatusCode::kNotFound) return got;
  // A restarted server knows no adapter: the proven one again, proven again, then the request.
  FERRY_RETURN_IF_ERROR(Readopt().WithContext(got.status().message()));
  return GenerateUnder(served_name_, prompts, n, params);
}

Status VllmGenerator::Readopt() {
  const auto start = Clock::now();
  const fs::path dir = options_.work_dir / served_name_;
  const std::string name = engine::AdapterName(proven_->Hex(), instance_, ++loads_);
  std::error_code ec;
  fs::rename(dir, options_.work_dir / name, ec);
  if (ec) return Status::IOError("use_vllm: cannot rename " + dir.string() + ": " + ec.message());
  FERRY_RETURN_IF_ERROR(client_->LoadLoraAdapter(name, fs::absolute(options_.work_dir / name).string()));
  loaded_.clear();
  loaded_.push_back(name);
  FERRY_ASSIGN_OR_RETURN(engine::LogProbs answer, client_->PromptLogProbs(name, probe_));
  FERRY_ASSIGN_OR_RETURN(engine::ProofFigures proof, engine::Judge(answer, *previous_, nullptr, options_.tolerance));
  FERRY_RETURN_IF_ERROR(Record(*proven_, name, proof, SecondsSince(start)));
  if (!proof.proven) {
    return Status::Corruption("vLLM " + options_.url + " did not answer as version " + proven_->Hex() +
                              " loaded again under " + Quote(name) + ": " + proof.why);
  }
  served_name_ = name;
  return Status::OK();
}

Result<std::vector<runtime::Completion>> VllmGenerator::GenerateUnder(const std::string& name,
                                                                      const std::vector<std::vector<int32_t>>& prompts,
                                                                      int n, const runtime::SamplingParams& params) {
  engine::CompletionRequest req;
  req.model = name;
  req.prompts = prompts;
  req.n = n;
  req.max_tokens = static_cast<int>(params.max_new_tokens);
  req.temperature = params.temperature;
  req.top_p = params.top_p;
  req.top_k = params.top_k > 0 ? static_cast<int>(params.top_k) : -1;
  req.seed = params.seed & 0x7fffffffffffffffULL;  // vLLM takes a signed 64-bit seed
  for (int64_t id : params.eos_token_ids) req.stop_token_ids.push_back(static_cast<int32_t>(id));
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options_.timeout_seconds));
  // vllm_server_timeout bounds the step's generation, retries included, not each request.
  gen_client_->SetDeadline(deadline);
  struct Clear {
    engine::VllmClient& c;
    ~Clear() { c.SetDeadline(std::nullopt); }
  } clear{*gen_client_};
  Result<std::vector<engine::Completion>> got = gen_client_->Complete(req);
  for (int attempt = 1; !got.ok() && Retryable(got.status()) && Clock::now() < deadline; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(1000 * attempt, 5000)));
    got = gen_client_->Complete(req);
  }
  if (!got.ok()) {
    return got.status().WithContext("use_vllm: completions of " + std::to_string(prompts.size()) + " prompts x " +
                                    std::to_string(n) + " under " + Quote(name));
  }
  std::vector<runtime::Completion> out;
  out.reserve(got->size());
  for (auto& c : *got) {
    runtime::Completion r;
    r.prompt_index = static_cast<size_t>(c.prompt_index);
    r.token_ids = std::move(c.token_ids);
    r.logprobs.assign(c.logprobs.begin(), c.logprobs.end());
    const bool eos = !r.token_ids.empty() && std::find(params.eos_token_ids.begin(), params.eos_token_ids.end(),
                                                       r.token_ids.back()) != params.eos_token_ids.end();
    r.finish =
        c.finish_reason == "stop" && eos ? runtime::Completion::Finish::kEos : runtime::Completion::Finish::kLength;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace ferry::grpo
