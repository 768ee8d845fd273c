#include "daemon/grpo/trainer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <mutex>
#include <optional>

#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "daemon/dist/process_group.h"
#include "daemon/grpo/data_parallel.h"
#include "daemon/grpo/optimizer.h"
#include "daemon/grpo/trainer_internal.h"
#include "daemon/runtime/torch_util.h"
#include "daemon/text/chat_format.h"

namespace ferry::grpo {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

Result<at::Device> TorchDevice(const run::DeviceSpec& d, const std::string& source) {
  if (!d.cuda) return at::Device(at::kCPU);
  if (!at::hasCUDA()) {
    return Status::Unsupported(source + ": key 'device': \"" + d.Name() + "\" but this LibTorch has no CUDA device");
  }
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(d.index.value_or(-1)));
}

// logging_steps / save_steps: a whole number of steps, or a ratio of the total below 1.
int64_t Interval(double value, int64_t total) {
  if (value <= 0) return 0;
  if (value < 1) return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(total) * value)));
  return static_cast<int64_t>(value);
}

// The GRPO maths' options from the run config (its settings are parsed already).
void Configure(Trainer::State& s) {
  const run::RunConfig& c = s.config;
  s.schedule = c.lr_scheduler_type;
  s.loss_options.loss_type = c.loss_type;
  s.loss_options.importance_sampling_level = c.importance_sampling_level;
  s.loss_options.epsilon = c.epsilon;
  s.loss_options.epsilon_high = c.epsilon_high;
  s.loss_options.delta = c.delta;
  s.loss_options.beta = c.beta;
  s.loss_options.use_bias_correction_kl = c.use_bias_correction_kl;
  s.loss_options.max_completion_length = c.max_completion_length;
  s.loss_options.gradient_accumulation_steps = c.gradient_accumulation_steps;
  s.loss_options.steps_per_generation = c.steps_per_generation;
  s.loss_options.num_processes = s.world;
  s.advantage_options.num_generations = c.num_generations;
  s.advantage_options.scale_rewards = c.scale_rewards;
  for (const auto& r : c.rewards) {
    s.advantage_options.reward_names.push_back(r.name);
    s.advantage_options.reward_weights.push_back(r.weight);
  }
  s.mismatch_options.mode = c.vllm_importance_sampling_mode;
  s.mismatch_options.clip_min = c.vllm_importance_sampling_clip_min;
  s.mismatch_options.clip_max = c.vllm_importance_sampling_clip_max;
  s.fast_old_logps = c.steps_per_generation == 1 && c.num_iterations == 1 && c.lora.lora_dropout == 0;
}

// The step's record in the store, as a job that may run on another thread: what it needs of
// the trainer is copied now (the adapter's tensors, its config, the step's numbers); the
// snapshot is immutable and the store thread-safe.
Result<std::function<Status()>> PrepareRecord(Trainer::State& s, const sync::Handoff& h, const Metrics& metrics) {
  // The adapter's bytes, then the merged version by its digests (rebuilt from base + adapter).
  FERRY_ASSIGN_OR_RETURN(auto tensors, s.adapter->ExportTensors());  // copies
  auto ckpt = std::make_shared<Checkpoint>(
      Checkpoint::FromTensors("adapter of step " + std::to_string(s.step), std::move(tensors)));
  AuxFiles aux = {{"adapter_config.json", s.adapter->ConfigJson(s.config.model_name_or_path.string())}};
  store::ImportOptions ao;
  ao.run = s.config.store.run;
  ao.kind = store::VersionKind::kAdapter;
  ao.source = store::VersionSource::kDaemon;
  ao.step = s.step;
  ao.base_version = s.base_version;
  ao.metrics = metrics;
  store::ImportOptions mo;
  mo.run = s.config.store.run;
  mo.step = s.step;
  mo.base_version = s.base_version;
  mo.metrics = metrics;
  store::Store* st = s.store.get();
  return std::function<Status()>([st, ckpt, aux, ao, mo, snapshot = h.snapshot]() mutable -> Status {
    FERRY_ASSIGN_OR_RETURN(store::ImportResult adapter, st->ImportCheckpoint(*ckpt, aux, ao));
    mo.adapter_version = adapter.record.id;
    return sync::RecordSnapshotDigests(*st, *snapshot, mo).status();
  });
}

// Appends `line` and a newline to `path` and makes it durable (one metrics.jsonl line per
// logged step: a crash leaves whole lines, the last one possibly missing).
Status AppendLine(const fs::path& path, const std::string& line) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError(path.string() + ": " + std::strerror(errno));
  const std::string data = line + "\n";
  const ssize_t n = ::write(fd, data.data(), data.size());
  const int err = errno;
  const bool synced = n == static_cast<ssize_t>(data.size()) && ::fdatasync(fd) == 0;
  ::close(fd);
  if (!synced) return Status::IOError(path.string() + ": append: " + std::strerror(n < 0 ? err : errno));
  return Status::OK();
}

std::string MetricsLine(int64_t step, const std::map<std::string, double>& m, const std::string& version) {
  ojson j;
  j["step"] = step;
  for (const auto& [k, v] : m) {
    if (std::isfinite(v)) {
      j[k] = v;
    } else {
      j[k] = nullptr;  // JSON has no NaN: a metric TRL logs as NaN is null here
    }
  }
  j["generator_version"] = version;
  return j.dump();
}

}  // namespace

Trainer::Trainer(std::unique_ptr<State> state) : s_(std::move(state)) {}
Trainer::~Trainer() {
  if (s_ && s_->channel) s_->channel->Close();
}

int64_t Trainer::step() const { return s_->step; }
const std::string& Trainer::generator_version() const { return s_->generator_version; }
Trainer::GeneratorInfo Trainer::generator_info() const {
  if (!s_->vllm) return {"colocated", "", "", 0, 0, 0, std::nullopt};
  const engine::ProofFigures& p = s_->vllm->last_proof();
  return {"vllm",     s_->vllm->url(), s_->vllm->served_name(), s_->vllm->proven_at_ns(),
          p.max_diff, p.tolerance,     p.previous_diff};
}
std::shared_ptr<const sync::Snapshot> Trainer::generator_snapshot() const { return s_->generator_snapshot; }
int64_t Trainer::total_steps() const { return s_->total_steps; }
const run::RunConfig& Trainer::config() const { return s_->config; }
const fs::path& Trainer::dir() const { return s_->dir; }
const fs::path& Trainer::store_dir() const { return s_->store_dir; }
store::Store* Trainer::store() const { return s_->store.get(); }
const store::Digest& Trainer::base_version() const { return s_->base_version; }
const std::vector<fs::path>& Trainer::created_by_start() const { return s_->created_by_start; }

namespace {

// MemAvailable of /proc/meminfo in bytes; nullopt when it cannot be read.
std::optional<uint64_t> AvailableMemory() {
  std::ifstream in("/proc/meminfo");
  for (std::string line; std::getline(in, line);) {
    unsigned long long kib = 0;
    if (std::sscanf(line.c_str(), "MemAvailable: %llu kB", &kib) == 1) return uint64_t{kib} << 10;
  }
  return std::nullopt;
}

std::string GiB(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f GiB", bytes / double(uint64_t{1} << 30));
  return buf;
}

// What a step needs of the model's limits and of the machine, checked before a run creates
// anything: a completion must fit the context, and the generation's KV cache and logits
// (a lower bound of a step's memory: every prompt at least one token, every completion at
// max_completion_length) must fit the memory available.
Status CheckSizes(const run::RunConfig& c, const runtime::ModelConfig& m, at::Device device) {
  const std::string src = c.source.string();
  if (c.max_completion_length + 1 > m.max_position_embeddings) {
    return Status::InvalidArgument(src + ": key 'max_completion_length': " + std::to_string(c.max_completion_length) +
                                   " tokens after a prompt of at least 1 exceed max_position_embeddings " +
                                   std::to_string(m.max_position_embeddings) + " of " + m.source);
  }
  if (!device.is_cpu()) return Status::OK();  // the device's memory is its own; not estimated here
  const double elem = (c.generation_dtype == run::GenerationDtype::kBFloat16 ||
                       (c.generation_dtype == run::GenerationDtype::kAuto && c.bf16))
                          ? 2.0
                          : 4.0;
  const double rows = static_cast<double>(std::max(c.generation_batch_size, c.num_generations));
  const double kv = rows * static_cast<double>(m.num_hidden_layers) * 2.0 * static_cast<double>(m.num_key_value_heads) *
                    static_cast<double>(m.head_dim) * static_cast<double>(c.max_completion_length + 1) * elem;
  const double logits = rows * static_cast<double>(m.vocab_size) * 4.0;
  const std::optional<uint64_t> available = AvailableMemory();
  if (available && kv + logits > static_cast<double>(*available)) {
    return Status::InvalidArgument(
        src + ": key 'num_generations': generating " + std::to_string(c.generation_batch_size) +
        " completions at once (generation_batch_size, " + std::to_string(c.num_generations) + " per prompt) of up to " +
        std::to_string(c.max_completion_length) + " tokens needs at least " + GiB(kv + logits) +
        " for their KV cache and logits; this machine has " + GiB(static_cast<double>(*available)) +
        " available: lower num_generations, generation_batch_size or max_completion_length");
  }
  return Status::OK();
}

// The paths a start creates, removed again when it fails (Trainer::created_by_start).
struct StartPaths {
  std::vector<fs::path> created;
  void Remove() const {
    for (auto it = created.rbegin(); it != created.rend(); ++it) {
      std::error_code ec;
      fs::remove_all(*it, ec);
    }
  }
};

// The store's objects of the run's base re-hashed: a corrupt one stops the start, naming the
// tensor and its object.
Status CheckBaseObjects(store::Store& st, const store::VersionRecord& base, const fs::path& store_dir) {
  FERRY_ASSIGN_OR_RETURN(std::vector<store::VerifyReport> reports, st.Verify(base.id));
  for (const store::VerifyReport& r : reports) {
    if (r.ok()) continue;
    const bool missing = r.corrupted.empty();
    const std::string& name = missing ? r.missing.front() : r.corrupted.front();
    std::string object;
    for (const store::TensorRow& row : base.tensors) {
      if (row.name == name) object = " (object " + row.digest.Hex() + ")";
    }
    return Status::Corruption("store " + store_dir.string() + ": base version " + base.id.Hex() + ": tensor '" + name +
                              "'" + object + (missing ? " is missing" : " no longer hashes to its digest") +
                              (r.corrupted.size() + r.missing.size() > 1
                                   ? " (and " + std::to_string(r.corrupted.size() + r.missing.size() - 1) + " more)"
                                   : "") +
                              "; the run's derived versions depend on it (`ferry versions verify --db " +
                              store_dir.string() + "` lists every damaged object)");
  }
  return Status::OK();
}

// What a data-parallel run does not do yet: the vLLM server mode (TRL's main rank gathers every
// rank's prompts for one request) and a generation buffered across steps (its rollout is each
// rank's own, and a checkpoint holds rank 0's).
Status CheckDataParallel(const run::RunConfig& c, int world) {
  const std::string src = c.source.string();
  const std::string ranks = " with " + std::to_string(world) + " ranks";
  if (c.use_vllm) {
    return Status::Unsupported(src +
                               ": key 'use_vllm': a vLLM server generating for several ranks is not supported"
                               " yet" +
                               ranks + "; each rank's co-located generator is used without it");
  }
  if (c.num_iterations > 1 || c.steps_per_generation != c.gradient_accumulation_steps) {
    return Status::Unsupported(
        src + ": key '" + std::string(c.num_iterations > 1 ? "num_iterations" : "steps_per_generation") +
        "': a generation used across several steps (num_iterations " + std::to_string(c.num_iterations) +
        ", steps_per_generation " + std::to_string(c.steps_per_generation) + ", gradient_accumulation_steps " +
        std::to_string(c.gradient_accumulation_steps) + ") is not supported" + ranks + " yet: one generation per step");
  }
  return Status::OK();
}

Result<std::unique_ptr<Trainer::State>> CreateState(const TrainOptions& options, StartPaths& paths);

}  // namespace

Result<std::unique_ptr<Trainer>> Trainer::Create(const TrainOptions& options) {
  StartPaths paths;
  Result<std::unique_ptr<State>> s = CreateState(options, paths);
  if (!s.ok()) {
    paths.Remove();  // the state (its store, its files) is gone by now
    return s.status();
  }
  (*s)->created_by_start = std::move(paths.created);
  return std::unique_ptr<Trainer>(new Trainer(std::move(*s)));
}

namespace {

Result<std::unique_ptr<Trainer::State>> CreateState(const TrainOptions& options, StartPaths& paths) {
  auto s = std::make_unique<Trainer::State>();
  s->options = options;
  auto say = [&](const std::string& m) {
    if (options.on_message) options.on_message(m);
  };
  // 1. Everything that can be checked without writing anything.
  s->config = options.config;
  if (options.group) {
    s->group = options.group;
    s->rank = options.group->rank();
    s->world = options.group->size();
    FERRY_ASSIGN_OR_RETURN(s->config, run::ForWorldSize(options.config, s->world));
    FERRY_RETURN_IF_ERROR(CheckDataParallel(s->config, s->world));
  }
  const run::RunConfig& c = s->config;
  const bool writer = s->rank == 0;  // rank 0 alone writes the run directory
  for (const auto& w : c.warnings) say("warning: " + w);
  std::error_code ec;
  s->dir = fs::absolute(options.dir.empty() ? c.output_dir : options.dir, ec);
  if (ec) return Status::IOError(s->dir.string() + ": " + ec.message());
  Configure(*s);

  runtime::SetTorchThreads(static_cast<int>(run::ResolvedThreads(c)));
  runtime::KeepFreedTensorMemory();
  if (const runtime::BlasInfo blas = runtime::LoadedBlas(); blas.reference) {
    say("warning: LibTorch runs on the reference BLAS (" + blas.library +
        "), ~15x slower; install libopenblas0-openmp");
  }
  run::DeviceSpec device_spec = c.device;
  if (device_spec.cuda && !device_spec.index && options.group) {
    device_spec.index = options.group->local_rank();  // one device per rank
  }
  FERRY_ASSIGN_OR_RETURN(at::Device device, TorchDevice(device_spec, c.source.string()));

  // Tokenizer, chat format, special ids.
  FERRY_ASSIGN_OR_RETURN(s->tokenizer, text::Tokenizer::FromDirectory(c.model_name_or_path));
  FERRY_ASSIGN_OR_RETURN(s->dataset, run::Dataset::Load(c.dataset, run::DatasetOptionsFor(c)));
  bool conversational = false;
  for (const auto& ex : s->dataset->examples()) conversational = conversational || ex.conversational();
  switch (c.chat_template) {
    case run::ChatTemplate::kNone: break;
    case run::ChatTemplate::kChatML: s->chat_format = text::ChatFormat::kChatML; break;
    case run::ChatTemplate::kLlama3: s->chat_format = text::ChatFormat::kLlama3; break;
    case run::ChatTemplate::kAuto:
      if (conversational) {
        auto f = text::DetectChatFormat(*s->tokenizer);
        if (!f.ok()) {
          return f.status().WithContext(c.dataset.string() + " holds conversational prompts (chat_template \"auto\")");
        }
        s->chat_format = *f;
      }
      break;
  }
  s->sampler = std::make_unique<run::DatasetSampler>(s->dataset, c);
  FERRY_ASSIGN_OR_RETURN(s->rewards, run::RewardScorer::Create(c));
  FERRY_RETURN_IF_ERROR(s->rewards->Probe(s->dataset->examples().front()));

  // The model's config and weight files (headers checked; the bytes are mapped, not read).
  FERRY_ASSIGN_OR_RETURN(fs::path weights, FindWeights(c.model_name_or_path));
  FERRY_ASSIGN_OR_RETURN(Checkpoint base_ckpt, Checkpoint::Open(weights));
  FERRY_ASSIGN_OR_RETURN(runtime::ModelConfig model_config, runtime::LoadModelConfig(c.model_name_or_path));
  FERRY_RETURN_IF_ERROR(CheckSizes(c, model_config, device));
  FERRY_ASSIGN_OR_RETURN(PeftConfig peft, run::LoraPeftConfig(c));
  FERRY_ASSIGN_OR_RETURN(s->total_steps, run::TotalSteps(c, s->dataset->size()));
  if (options.max_steps) s->total_steps = std::min(s->total_steps, *options.max_steps);
  s->warmup_steps = run::WarmupSteps(c, s->total_steps);
  // The run's store unless [store] path names another (the config's default,
  // <output_dir>/store, follows --dir).
  const bool default_store = c.store.path.empty() || c.store.path == (c.output_dir / "store").lexically_normal();
  s->store_dir = default_store ? s->dir / "store" : c.store.path;

  // 2. The run directory and its store (rank 0's); from here a failure removes what this
  // start created.
  const bool dir_existed = fs::exists(s->dir, ec);
  const bool store_existed = fs::exists(s->store_dir, ec);
  if (writer) {
    if (options.claim_dir) FERRY_RETURN_IF_ERROR(options.claim_dir(s->dir));
    if (!dir_existed) paths.created.push_back(s->dir);
    fs::create_directories(s->dir, ec);
    if (ec) return Status::IOError(s->dir.string() + ": " + ec.message());
    if (!store_existed && (dir_existed || !default_store)) paths.created.push_back(s->store_dir);
  }
  const bool had_run_config = fs::exists(s->dir / "run_config.json", ec);

  // The store (the base recorded, its objects re-hashed) on another thread while this one
  // loads the model from the same files.
  struct Opened {
    std::unique_ptr<store::Store> store;
    store::Digest base_version;
  };
  std::future<Result<Opened>> opened = std::async(std::launch::async, [&]() -> Result<Opened> {
    if (!writer) return Opened{};
    store::StoreOptions so;
    so.create_if_missing = true;
    Opened o;
    FERRY_ASSIGN_OR_RETURN(o.store, store::Store::Open(s->store_dir, so));
    store::ImportOptions bo;
    bo.run = c.store.run;
    bo.kind = store::VersionKind::kBase;
    FERRY_ASSIGN_OR_RETURN(store::ImportResult base, o.store->Import(c.model_name_or_path, bo));
    // A base this import wrote was hashed back as it was written; one already stored is
    // checked once per start.
    if (base.already_present) FERRY_RETURN_IF_ERROR(CheckBaseObjects(*o.store, base.record, s->store_dir));
    o.base_version = base.record.id;
    return o;
  });

  // The trainer's model: the frozen base (mapped) with the LoRA adapter. The publisher's
  // snapshots share the same read-only mapping: one copy of the base in the process.
  runtime::ModelOptions mopts;
  mopts.device = device;
  if (c.bf16) mopts.dtype = at::kBFloat16;
  Result<std::unique_ptr<runtime::CausalLM>> model = runtime::CausalLM::FromCheckpoint(model_config, base_ckpt, mopts);
  Result<Opened> store = opened.get();  // joined before any return below
  FERRY_RETURN_IF_ERROR(model.status());
  FERRY_RETURN_IF_ERROR(store.status());
  s->model = std::move(*model);
  s->store = std::move(store->store);
  s->base_version = store->base_version;

  s->eos_ids = s->model->config().eos_token_ids;
  if (auto e = s->tokenizer->eos_id(); e && std::find(s->eos_ids.begin(), s->eos_ids.end(), *e) == s->eos_ids.end()) {
    s->eos_ids.push_back(*e);
  }
  s->pad_id = s->tokenizer->pad_id().value_or(s->eos_ids.empty() ? 0 : static_cast<int32_t>(s->eos_ids.front()));
  FERRY_ASSIGN_OR_RETURN(s->adapter, runtime::LoraAdapter::Create(*s->model, peft, static_cast<uint64_t>(c.seed)));
  auto adamw = torch::optim::AdamWOptions(c.learning_rate)
                   .betas({c.adam_beta1, c.adam_beta2})
                   .eps(c.adam_epsilon)
                   .weight_decay(c.weight_decay);
  s->optimizer = std::make_unique<torch::optim::AdamW>(s->adapter->parameters(), adamw);
  at::manual_seed(static_cast<uint64_t>(c.seed));  // LoRA dropout draws from the default generator

  // The hand-off: trainer -> channel -> co-located generator.
  // Its published / acknowledged events need not wait for the disk: the step's record that
  // follows each hand-off is a synced write, which makes them durable (RocksDB's log is in order).
  s->channel = std::make_unique<sync::SnapshotChannel>(s->store.get(), c.store.run, /*sync_events=*/false);
  FERRY_ASSIGN_OR_RETURN(AuxFiles aux, CollectAuxFiles(c.model_name_or_path));
  s->publisher =
      std::make_unique<WeightPublisher>(std::move(base_ckpt), std::move(aux), s->model->config().tie_word_embeddings,
                                        s->channel.get(), static_cast<int>(run::ResolvedThreads(c)));
  ColocatedGeneratorOptions go;
  go.model.device = device;
  switch (c.generation_dtype) {
    case run::GenerationDtype::kAuto:  // the trainer's, as mopts above
      if (c.bf16) go.model.dtype = at::kBFloat16;
      break;
    case run::GenerationDtype::kFloat32: go.model.dtype = at::kFloat; break;
    case run::GenerationDtype::kBFloat16: go.model.dtype = at::kBFloat16; break;
  }
  go.generator.max_batch = std::max<int64_t>(c.generation_batch_size / s->world, 1);  // this rank's share
  if (c.use_vllm) {
    VllmGeneratorOptions vo;
    vo.url = c.VllmServerUrl();
    vo.timeout_seconds = c.vllm_server_timeout;
    vo.work_dir = s->dir / "vllm";
    vo.base_dir = c.model_name_or_path;
    FERRY_ASSIGN_OR_RETURN(vo.tolerance, ProbeToleranceFor(s->model->dtype(), c.vllm_server_dtype));
    vo.reference_threads = ReferenceThreadsFor(vo.url, at::get_num_threads());
    if (device.is_cpu() && vo.reference_threads > 0) {
      if (const std::vector<int64_t> workers = VllmWorkerProcesses(); !workers.empty()) {
        say("warning: a vLLM on this machine runs its model in a worker process (pid " + std::to_string(workers[0]) +
            "): on a CPU server it spins on a core for a second after every request, which this trainer loses "
            "(steps 2-3x slower on 2 cores); start it with --distributed-executor-backend uni and "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0, as scripts/vllm.sh does (docs/vllm.md)");
      }
    }
    FERRY_ASSIGN_OR_RETURN(s->vllm, VllmGenerator::Create(vo, s->model.get(), s->store.get()));
  } else {
    s->generator = std::make_unique<ColocatedGenerator>(s->channel.get(), go);
  }

  Restored restored;
  if (writer) {
    FERRY_ASSIGN_OR_RETURN(restored, RestoreNewestCheckpoint(*s));
    if (restored.snapshot) {
      // A run with earlier steps: nothing of it is removed if the start fails from here.
      paths.created.clear();
      say("resumed from " + (s->dir / ("checkpoint-" + std::to_string(restored.step))).string());
    }
  }
  if (s->group) {
    // Every rank starts from rank 0's state: its restored checkpoint, or its fresh adapter.
    FERRY_RETURN_IF_ERROR(ShareStartState(*s));
    if (!writer && s->step > 0) {
      FERRY_ASSIGN_OR_RETURN(restored.snapshot, s->publisher->Build(s->adapter.get()));
      restored.step = s->step;
    }
  }
  FERRY_ASSIGN_OR_RETURN(sync::Handoff first,
                         restored.snapshot ? s->publisher->Publish(restored.snapshot) : s->publisher->PublishBase());
  if (s->vllm) {
    // The server serves the restored adapter (or the fresh one, whose merge is the base) proven.
    FERRY_RETURN_IF_ERROR(s->vllm->Adopt(*s->adapter, first.snapshot->manifest_id()));
    s->generator_version = first.snapshot->manifest_id().Hex();
    s->generator_step = restored.step;
  } else {
    FERRY_ASSIGN_OR_RETURN(store::Digest acked, s->generator->Sync());
    if (acked != first.snapshot->manifest_id()) {
      return Status::Corruption("the generator acknowledged " + acked.Hex() + " for snapshot " +
                                first.snapshot->manifest_id().Hex());
    }
    s->generator_version = acked.Hex();
    s->generator_step = restored.step;
    Metrics none;
    FERRY_RETURN_IF_ERROR(ShareStepEnd(*s, acked, none, /*check_adapter=*/s->group != nullptr, /*at_start=*/true));
    s->await_word = true;  // before the first step, the ranks wait for rank 0's word
  }
  s->generator_snapshot = first.snapshot;
  if (writer) {
    if (!had_run_config && dir_existed && !restored.snapshot) paths.created.push_back(s->dir / "run_config.json");
    // The run's config as written (one process): a resume under another world size matches it.
    FERRY_RETURN_IF_ERROR(WriteFileAtomic(s->dir / "run_config.json", options.config.ToJson()));
  }
  return s;
}

}  // namespace

namespace {

// Step's work; see Trainer::Step for what a failure leaves behind.
Result<StepResult> TakeStep(Trainer::State& s) {
  const run::RunConfig& c = s.config;
  const auto t0 = std::chrono::steady_clock::now();
  s.timing.clear();
  const int64_t S = c.steps_per_generation, mu = c.num_iterations, A = c.gradient_accumulation_steps;
  Metrics step_metrics;
  std::map<std::string, std::vector<double>> micro;  // per micro-batch / per generation values
  double loss_total = 0;
  for (int64_t a = 0; a < A; ++a) {
    if (!s.buffer || s.micro_step % (S * mu) == 0) {
      FERRY_ASSIGN_OR_RETURN(Rollout r, MakeRollout(s));
      for (const auto& [k, v] : r.metrics) micro[k].push_back(v);
      s.buffer = std::move(r);
    }
    const Rollout& r = *s.buffer;
    const std::vector<int64_t>& rows = r.rows_of_micro_batch[static_cast<size_t>(s.micro_step % S)];
    PhaseTimer timer(s, "forward_backward");
    FERRY_ASSIGN_OR_RETURN(MicroBatchLogps mb, MicroBatchLogProbs(s, r, rows, /*lora=*/true, /*training=*/true));
    FERRY_RETURN_IF_ERROR(runtime::GuardTorch("loss", [&]() -> Status {
      LossInputs in;
      in.per_token_logps = mb.logps;
      in.completion_mask = mb.mask;
      in.advantages = r.advantages.index_select(0, mb.rows);
      in.entropies = mb.entropy;
      in.num_items_in_batch = r.num_items;
      if (s.group && c.loss_type == run::LossType::kBnpo) {
        FERRY_ASSIGN_OR_RETURN(in.micro_batch_items,
                               SumOverRanks(s, mb.mask.sum().item<int64_t>(), "counting the micro-batch's tokens"));
      }
      if (r.old_logps.defined()) in.old_per_token_logps = r.old_logps.index_select(0, mb.rows);
      if (r.ref_logps.defined()) in.ref_per_token_logps = r.ref_logps.index_select(0, mb.rows);
      if (r.is_ratio.defined()) {
        in.importance_sampling_ratio = r.is_ratio.index_select(0, mb.rows);
      } else if (c.vllm_importance_sampling_correction) {
        // Old log-probs are this forward's, detached (nothing has changed the weights yet).
        FERRY_ASSIGN_OR_RETURN(MismatchCorrection mc,
                               ComputeMismatchCorrection(mb.logps.detach(), r.sampling_logps.index_select(0, mb.rows),
                                                         mb.mask, s.mismatch_options));
        in.importance_sampling_ratio = mc.ratio;
        for (const auto& [k, v] : mc.metrics) micro[k].push_back(v);
      }
      FERRY_ASSIGN_OR_RETURN(Loss loss, ComputeLoss(in, s.loss_options));
      loss.loss.backward();
      loss_total += loss.loss.item<double>();
      for (const auto& [k, v] : loss.metrics) micro[k].push_back(v);
      return Status::OK();
    }));
    ++s.micro_step;
  }
  // The optimizer step.
  double grad_norm = 0;
  FERRY_RETURN_IF_ERROR(AverageGradients(s));
  FERRY_RETURN_IF_ERROR(runtime::GuardTorch("optimizer step", [&]() -> Status {
    PhaseTimer timer(s, "optimizer");
    std::vector<at::Tensor> params = s.adapter->parameters();
    grad_norm = ClipGradNorm(params, c.max_grad_norm);
    const double lr = c.learning_rate * LrMultiplier(s.schedule, s.step, s.warmup_steps, s.total_steps);
    for (auto& group : s.optimizer->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    AdamWStep(*s.optimizer);
    return Status::OK();
  }));
  ++s.step;
  if (s.buffer && s.micro_step % (S * mu) == 0) s.buffer.reset();

  // Hand the new weights to the generator; the step ends when it has proven it holds them.
  Result<sync::Handoff> published = Status::Internal("unset");
  {
    PhaseTimer timer(s, "snapshot");  // the merged snapshot built into new buffers and hashed
    published = s.publisher->Publish(*s.adapter);
  }
  FERRY_ASSIGN_OR_RETURN(sync::Handoff h, std::move(published));
  if (s.vllm) {
    // The next step samples from the server only once it has proven it serves this version.
    // The probe runs alone on the server: vLLM 0.32's CPU LoRA path crashes its engine when a
    // prompt_logprobs request shares a batch with another request (docs/vllm.md), so a
    // generation still in flight (max_staleness 1) ends first; the adapter is written, loaded
    // and its reference computed meanwhile.
    const auto adopt_start = std::chrono::steady_clock::now();
    auto generation_done = [&s] {
      if (s.inflight) s.inflight->completions.wait();
    };
    FERRY_RETURN_IF_ERROR(s.vllm->Adopt(*s.adapter, h.snapshot->manifest_id(), generation_done));
    s.generator_version = h.snapshot->manifest_id().Hex();
    s.generator_step = s.step;
    step_metrics["timing/adopt"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - adopt_start).count();
  } else {
    Result<store::Digest> synced = Status::Internal("unset");
    {
      PhaseTimer timer(s, "proof");  // the generator takes the snapshot and re-hashes its bytes
      synced = s.generator->Sync();
    }
    FERRY_ASSIGN_OR_RETURN(store::Digest acked, std::move(synced));
    if (acked != h.snapshot->manifest_id()) {
      return Status::Corruption("the generator acknowledged " + acked.Hex() + " but the snapshot after the update is " +
                                h.snapshot->manifest_id().Hex());
    }
    s.generator_version = acked.Hex();
    s.generator_step = s.step;
  }
  s.generator_snapshot = h.snapshot;

  for (const auto& [k, v] : micro) {
    double sum = 0;
    for (double x : v) sum += x;
    step_metrics[k] = sum / static_cast<double>(v.size());
  }
  step_metrics["loss"] = loss_total;
  step_metrics["grad_norm"] = grad_norm;
  step_metrics["learning_rate"] = c.learning_rate * LrMultiplier(s.schedule, s.step, s.warmup_steps, s.total_steps);
  const run::DatasetPosition pos = s.sampler->position();
  step_metrics["epoch"] =
      static_cast<double>(pos.epoch) + static_cast<double>(pos.index) / static_cast<double>(s.dataset->size());
  step_metrics["step_time"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Where the step's time went (seconds per phase; communication: the collectives of a
  // data-parallel run, waiting for the slowest rank included).
  for (const auto& [phase, seconds] : s.timing) step_metrics["timing/" + phase] = seconds;
  FERRY_ASSIGN_OR_RETURN(store::Digest acked, store::Digest::FromHex(s.generator_version));
  const double communicated = s.timing["communication"];
  FERRY_RETURN_IF_ERROR(ShareStepEnd(s, acked, step_metrics, AdapterCheckDue(s, s.step)));
  if (s.group) step_metrics["timing/communication"] += s.timing["communication"] - communicated;  // this rank's
  StepResult out;
  out.step = s.step;
  out.metrics = step_metrics;
  out.generator_version = s.generator_version;
  out.rank_versions = s.rank_versions;
  if (s.rank != 0) return out;  // rank 0 alone records and logs

  if (s.options.on_snapshot) s.options.on_snapshot(h.snapshot->manifest_id(), h.snapshot);
  FERRY_ASSIGN_OR_RETURN(std::function<Status()> record, PrepareRecord(s, h, step_metrics));
  // Written in the background under Run, a failure is seen by a later step: it names this one.
  const std::string what = (s.recorder ? "recording step " + std::to_string(s.step) : std::string("recording it")) +
                           " in the store " + s.store_dir.string();
  if (s.recorder) {
    // Under Run: the record is written while the next step computes; timing/record is then
    // the previous step's (written in the background, outside step_time).
    step_metrics["timing/record"] = s.recorder->last_seconds();
  } else {
    // The store's record of the step (written after step_time, so not in it).
    const auto record_start = std::chrono::steady_clock::now();
    FERRY_RETURN_IF_ERROR(record().WithContext(what));
    step_metrics["timing/record"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - record_start).count();
    record = nullptr;
  }
  out.metrics["timing/record"] = step_metrics["timing/record"];
  for (const auto& [k, v] : step_metrics) s.pending[k].push_back(v);
  std::optional<std::string> line;
  const int64_t every = Interval(c.logging_steps, s.total_steps);
  if ((every > 0 && s.step % every == 0) || s.step == s.total_steps) {
    std::map<std::string, double> avg;
    for (const auto& [k, v] : s.pending) {
      double sum = 0;
      for (double x : v) sum += x;
      avg[k] = sum / static_cast<double>(v.size());
    }
    // Cumulative and point-in-time values are not averaged (as TRL logs them).
    for (const char* k : {"num_tokens", "learning_rate", "epoch"}) avg[k] = step_metrics[k];
    line = MetricsLine(s.step, avg, s.generator_version);
    s.pending.clear();
    s.last_logged = s.step;
    out.logged = true;
  }
  // The store's record first, then the metrics line (a line in metrics.jsonl is of a step the
  // store holds).
  auto job = [record = std::move(record), line = std::move(line), what, path = s.dir / "metrics.jsonl",
              on_log = s.options.on_log]() -> Status {
    if (record) FERRY_RETURN_IF_ERROR(record().WithContext(what));
    if (line) {
      FERRY_RETURN_IF_ERROR(AppendLine(path, *line));
      if (on_log) on_log(*line);
    }
    return Status::OK();
  };
  if (s.recorder) {
    s.recorder->Add(std::move(job));
  } else {
    FERRY_RETURN_IF_ERROR(job());
  }
  return out;
}

}  // namespace

Result<StepResult> Trainer::Step() {
  State& s = *s_;
  if (s.recorder) FERRY_RETURN_IF_ERROR(s.recorder->error());  // an earlier step's record failed
  if (s.broken) {
    return Status::FailedPrecondition("step " + std::to_string(s.step + 1) +
                                      ": an earlier step failed on this rank, so the ranks are out of step");
  }
  // What a step changes before its optimizer update: a failure there (a reward command that
  // crashed or wrote a malformed line, a forward that failed) puts it back, so nothing of the
  // failed step is applied (parameters, optimizer state and the step counter are untouched
  // until the update; metrics.jsonl, the store and checkpoints only follow it).
  const int64_t step = s.step, micro_step = s.micro_step;
  const double num_tokens = s.num_tokens;
  // With a generation in flight (max_staleness 1) its prompts are drawn already: a failed step
  // drops it and draws them again.
  const run::DatasetPosition position = s.inflight ? s.inflight->from : s.sampler->position();
  std::optional<Rollout> buffer = s.buffer;
  at::Generator rng = at::detail::getDefaultCPUGenerator();
  at::Tensor rng_state;
  {
    std::lock_guard<std::mutex> lock(rng.mutex());
    rng_state = rng.get_state();
  }
  Result<StepResult> r = TakeStep(s);
  if (r.ok()) return r;
  if (s.group) {
    // The others are waiting in a collective: they name this rank and its error (a failure
    // that is itself a peer's, kUnavailable, names that peer already).
    s.broken = true;
    if (r.status().code() != StatusCode::kUnavailable) {
      s.group->ReportFailure("step " + std::to_string(step + 1) + ": " + r.status().message());
    }
    return r.status().WithContext("step " + std::to_string(step + 1));
  }
  if (s.step == step) {
    s.micro_step = micro_step;
    s.num_tokens = num_tokens;
    s.buffer = std::move(buffer);
    s.inflight.reset();  // waits for its request to end
    // Gradients back to none, as after a step (AdamWStep): not zero-filled tensors.
    for (at::Tensor& p : s.adapter->parameters()) p.mutable_grad().reset();
    {
      std::lock_guard<std::mutex> lock(rng.mutex());
      rng.set_state(rng_state);
    }
    if (Status seek = s.sampler->Seek(position); !seek.ok())
      return seek.WithContext("step " + std::to_string(step + 1));
  }
  return r.status().WithContext("step " + std::to_string(step + 1));
}

Status Trainer::Run(const RunHooks& hooks) {
  State& s = *s_;
  // Each step's record (store, metrics.jsonl) is written while the next step computes; a
  // checkpoint, and the end of Run, wait for it.
  StepRecorder recorder;
  s.recorder = &recorder;
  struct Detach {
    State& s;
    ~Detach() { s.recorder = nullptr; }
  } detach{s};
  const Status run = RunSteps(hooks);
  const Status recorded = recorder.Drain();
  FERRY_RETURN_IF_ERROR(run);
  return recorded;
}

Status Trainer::RunSteps(const RunHooks& hooks) {
  State& s = *s_;
  const int64_t save_every = Interval(s.config.save_steps, s.total_steps);
  auto save = [&]() -> Status {
    FERRY_ASSIGN_OR_RETURN(fs::path p, SaveCheckpoint());
    if (hooks.on_checkpoint) hooks.on_checkpoint(p);
    return Status::OK();
  };
  if (s.group && s.rank == 0) {
    s.ask_before_step = [&hooks] { return hooks.before_step && (!hooks.pending || hooks.pending()); };
  } else if (s.group) {
    s.ask_before_step = [&hooks] { return hooks.pending && hooks.pending(); };  // a stop asked here
  }
  struct Forget {
    State& s;
    ~Forget() { s.ask_before_step = nullptr; }
  } forget{s};
  while (s.step < s.total_steps) {
    if (s.group && s.await_word) {
      // Rank 0 decides for every rank (it may block there: a paused run); the others wait for
      // its word without a collective's timeout, for as long as rank 0 is alive. Without
      // anything pending at the last step's end, rank 0 said so then and every rank goes on.
      const std::string key = "go/" + std::to_string(s.step);
      if (s.rank == 0) {
        // A rank asked to stop (torchrun's agent, or the user, signalled it alone): every rank stops.
        if (s.stop_asked_by >= 0 && s.options.on_message) {
          s.options.on_message(s.group->Describe(s.stop_asked_by) + " was asked to stop: every rank stops after step " +
                               std::to_string(s.step));
        }
        const bool go = s.stop_asked_by < 0 && (!hooks.before_step || hooks.before_step());
        FERRY_RETURN_IF_ERROR(s.group->Post(key, go ? "1" : "0"));
        if (!go) break;
      } else {
        FERRY_ASSIGN_OR_RETURN(std::string go, s.group->Await(key, 0, "before step " + std::to_string(s.step + 1)));
        if (go != "1") break;
      }
    } else if (!s.group && hooks.before_step && !hooks.before_step()) {
      break;
    }
    FERRY_ASSIGN_OR_RETURN(StepResult r, Step());
    if (hooks.after_step) hooks.after_step(r);
    if (s.rank == 0 && save_every > 0 && s.step % save_every == 0) {
      FERRY_RETURN_IF_ERROR(save());
    }
  }
  if (s.rank == 0 && s.last_saved != s.step) {
    FERRY_RETURN_IF_ERROR(save());
  }
  if (s.recorder) FERRY_RETURN_IF_ERROR(s.recorder->Drain());
  return Status::OK();
}

Result<fs::path> Trainer::SaveCheckpoint() {
  if (s_->rank != 0) {
    return Status::FailedPrecondition("rank " + std::to_string(s_->rank) + " writes no checkpoints (rank 0 does)");
  }
  // The checkpoint's store event follows the records of the steps it covers.
  if (s_->recorder) FERRY_RETURN_IF_ERROR(s_->recorder->Drain());
  const fs::path existing = s_->dir / ("checkpoint-" + std::to_string(s_->step));
  if (s_->last_saved == s_->step && s_->step > 0 && fs::exists(existing)) return existing;
  FERRY_ASSIGN_OR_RETURN(fs::path p, WriteCheckpoint(*s_));
  s_->last_saved = s_->step;
  if (s_->options.on_message) s_->options.on_message("saved " + p.string());
  return p;
}

StepRecorder::StepRecorder() : thread_([this] { Loop(); }) {}

StepRecorder::~StepRecorder() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StepRecorder::Add(std::function<Status()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

Status StepRecorder::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return jobs_.empty() && !busy_; });
  return error_;
}

Status StepRecorder::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

double StepRecorder::last_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_seconds_;
}

void StepRecorder::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, every job run
    std::function<Status()> job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    const bool failed = !error_.ok();
    lock.unlock();
    const auto start = std::chrono::steady_clock::now();
    Status st = failed ? Status::OK() : job();  // after an error, later jobs are dropped
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    lock.lock();
    if (!st.ok() && error_.ok()) error_ = std::move(st);
    last_seconds_ = seconds;
    busy_ = false;
    cv_.notify_all();
  }
}

}  // namespace ferry::grpo
