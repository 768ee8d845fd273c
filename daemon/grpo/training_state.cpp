// checkpoint-N/: the adapter in PEFT's format plus everything needed to continue the run
// exactly where it stopped, and a record that proves those bytes before a resume uses them.
//
//   adapter_model.safetensors, adapter_config.json   the adapter (PEFT loads it as is)
//   optimizer.safetensors   AdamW state: "exp_avg.<key>", "exp_avg_sq.<key>" per adapter tensor
//                           key, and "__metadata__" {"step.<key>": "<n>"}
//   rollout.safetensors     the buffered generation batch, when the next step still uses it
//                           (num_iterations or steps_per_generation > 1)
//   trainer_state.json      global_step, micro_step, num_tokens, dataset position and digest,
//                           the config's fingerprint, the default CPU generator's state (hex),
//                           metrics since the last log line, the rollout's metadata, and the
//                           size and digests of every other file (daemon/run/checkpoint_state.h)
// The directory is written under a temporary name; the digest of its trainer_state.json is
// recorded in the run's store (a checkpoint event) and only then is the directory renamed into
// place, so a directory named checkpoint-N is complete and recorded. Only the newest
// save_total_limit are kept.
//
// Resume (RestoreNewestCheckpoint) takes the newest checkpoint that verifies:
//   trainer_state.json against the store's record of the checkpoint, every other file against
//   trainer_state.json's record (a mismatch names the file and the tensor), the adapter's
//   tensors against the adapter version the store recorded for the step (the one merged into
//   its generator_version), and the merge of that adapter onto the base against
//   generator_version itself. A checkpoint that fails is skipped, saying why, and moved aside
//   (checkpoint-N.refused) once an older one verifies; with none verifying the run refuses to
//   start. A checkpoint written before checkpoints were recorded (no "files") is resumed
//   when its adapter and generator_version verify, with a warning that its optimizer and
//   rollout state could not be.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <type_traits>
#include <utility>

#include "core/checkpoint.h"
#include "core/file_util.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "daemon/grpo/optimizer.h"
#include "daemon/grpo/trainer_internal.h"
#include "daemon/run/checkpoint_state.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::grpo {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string Hex(const at::Tensor& bytes) {
  static const char* d = "0123456789abcdef";
  at::Tensor b = bytes.contiguous();
  std::string out;
  const auto* p = b.data_ptr<uint8_t>();
  for (int64_t i = 0; i < b.numel(); ++i) {
    out.push_back(d[p[i] >> 4]);
    out.push_back(d[p[i] & 15]);
  }
  return out;
}

Result<at::Tensor> Unhex(const std::string& s, const std::string& where) {
  if (s.size() % 2 != 0) return Status::Corruption(where + ": odd hex length");
  at::Tensor out = at::empty({static_cast<int64_t>(s.size() / 2)}, at::kByte);
  auto* p = out.data_ptr<uint8_t>();
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < s.size(); i += 2) {
    const int hi = nib(s[i]), lo = nib(s[i + 1]);
    if (hi < 0 || lo < 0) return Status::Corruption(where + ": not lowercase hex");
    p[i / 2] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

Status WriteTensorFile(const fs::path& file, const std::map<std::string, at::Tensor>& tensors,
                       std::map<std::string, std::string> metadata) {
  std::vector<TensorSpec> specs;
  std::vector<Tensor> views;
  for (const auto& [name, t] : tensors) {
    FERRY_ASSIGN_OR_RETURN(Tensor v, runtime::ToCore(t));
    specs.push_back({name, v.dtype(), v.shape()});
    views.push_back(std::move(v));
  }
  WriterOptions opts;
  metadata["format"] = "pt";
  opts.metadata = std::move(metadata);
  FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateFile(file, specs, opts));
  size_t i = 0;
  for (const auto& [name, t] : tensors) FERRY_RETURN_IF_ERROR(writer->Write(name, views[i++]));
  return writer->Finish();
}

// Checkpoint directories of `dir` by step, oldest first.
std::vector<std::pair<int64_t, fs::path>> ListCheckpoints(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  static const std::regex kName("checkpoint-([0-9]{1,12})");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, kName)) out.emplace_back(std::stoll(m[1]), e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

Result<fs::path> WriteCheckpoint(Trainer::State& s) {
  const std::string name = "checkpoint-" + std::to_string(s.step);
  const fs::path final_path = s.dir / name;
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(final_path, /*replace_existing=*/true));
  const fs::path& d = staging.path();
  FERRY_RETURN_IF_ERROR(s.adapter->WriteFiles(d, s.config.model_name_or_path.string()));

  run::TrainerState st;
  FERRY_RETURN_IF_ERROR(runtime::GuardTorch("saving the optimizer", [&]() -> Status {
    std::map<std::string, at::Tensor> tensors;
    std::map<std::string, std::string> meta;
    for (const auto& [key, p] : s.adapter->named_parameters()) {
      auto it = s.optimizer->state().find(StateKey(p));
      if (it == s.optimizer->state().end()) continue;  // no step taken yet
      auto& os = static_cast<torch::optim::AdamWParamState&>(*it->second);
      tensors["exp_avg." + key] = os.exp_avg().to(at::kCPU);
      tensors["exp_avg_sq." + key] = os.exp_avg_sq().to(at::kCPU);
      meta["step." + key] = std::to_string(os.step());
    }
    FERRY_RETURN_IF_ERROR(WriteTensorFile(d / "optimizer.safetensors", tensors, meta));
    if (s.buffer) {
      const Rollout& r = *s.buffer;
      std::map<std::string, at::Tensor> t = {
          {"prompt_ids", r.prompt_ids},         {"prompt_mask", r.prompt_mask},
          {"completion_ids", r.completion_ids}, {"completion_mask", r.completion_mask},
          {"sampling_logps", r.sampling_logps}, {"advantages", r.advantages}};
      if (r.old_logps.defined()) t["old_logps"] = r.old_logps;
      if (r.ref_logps.defined()) t["ref_logps"] = r.ref_logps;
      if (r.is_ratio.defined()) t["is_ratio"] = r.is_ratio;
      FERRY_RETURN_IF_ERROR(WriteTensorFile(d / "rollout.safetensors", t, {}));
      st.rollout = run::RolloutState{r.num_items, r.metrics, r.rows_of_micro_batch};
    }
    st.torch_rng_state = Hex(at::detail::getDefaultCPUGenerator().get_state());
    return Status::OK();
  }));
  // Prompts drawn for a generation still in flight (max_staleness 1) are drawn again on resume.
  const run::DatasetPosition pos = s.inflight ? s.inflight->from : s.sampler->position();
  st.global_step = s.step;
  st.micro_step = s.micro_step;
  st.num_tokens = s.num_tokens;
  st.dataset_epoch = pos.epoch;
  st.dataset_index = pos.index;
  st.dataset_digest = s.dataset->digest();
  st.config_fingerprint = s.options.config.Fingerprint();  // the run's (one process), whatever the world size
  st.pending_metrics = s.pending;
  st.last_logged = s.last_logged;
  st.generator_version = s.generator_version;
  // Each file as it now is on disk (read back from the page cache), so a resume can name the
  // file and tensor that changed.
  for (const char* file : {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors"}) {
    FERRY_ASSIGN_OR_RETURN(st.files[file], run::RecordCheckpointFile(d, file));
  }
  if (s.buffer) {
    FERRY_ASSIGN_OR_RETURN(st.files["rollout.safetensors"], run::RecordCheckpointFile(d, "rollout.safetensors"));
  }
  const std::string text = run::TrainerStateJson(st);
  FERRY_RETURN_IF_ERROR(WriteFileAtomic(d / "trainer_state.json", text));
  // The store's record comes before the directory appears under its name: a checkpoint-N
  // that exists is recorded.
  store::Event e;
  e.type = store::Event::Type::kCheckpoint;
  FERRY_ASSIGN_OR_RETURN(e.version, store::Digest::FromHex(s.generator_version));
  e.detail = json{{"run", s.config.store.run},
                  {"step", s.step},
                  {"checkpoint", name},
                  {"trainer_state", store::AuxDigest(text).Hex()}}
                 .dump();
  FERRY_RETURN_IF_ERROR(s.store->AddEvent(e));
  FERRY_RETURN_IF_ERROR(staging.Commit());

  if (s.config.save_total_limit && *s.config.save_total_limit > 0) {
    auto all = ListCheckpoints(s.dir);
    const size_t keep = static_cast<size_t>(*s.config.save_total_limit);
    for (size_t i = 0; i + keep < all.size(); ++i) {
      std::error_code ec;
      fs::remove_all(all[i].second, ec);
    }
  }
  return final_path;
}

// metrics.jsonl keeps only the lines of steps <= `step` (those a restored checkpoint covers:
// the steps after it are run again and logged again).
Status TruncateMetrics(const fs::path& dir, int64_t step) {
  const fs::path metrics = dir / "metrics.jsonl";
  std::ifstream in(metrics);
  if (!in) return Status::OK();
  std::string line, kept;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() <= step) {
      kept += line + "\n";
    }
  }
  in.close();
  return WriteFileAtomic(metrics, kept);
}

namespace {

// The trainer_state.json digests the store recorded for the run's checkpoints, by step (a
// step checkpointed again after a resume has several).
Result<std::map<int64_t, std::vector<store::Digest>>> RecordedCheckpoints(store::Store& st, const std::string& run) {
  FERRY_ASSIGN_OR_RETURN(std::vector<store::Event> events, st.ListEvents(std::nullopt));
  std::map<int64_t, std::vector<store::Digest>> out;
  for (const store::Event& e : events) {
    if (e.type != store::Event::Type::kCheckpoint) continue;
    const json d = json::parse(e.detail, nullptr, false);
    if (!d.is_object() || d.value("run", std::string()) != run || !d.contains("step") ||
        !d["step"].is_number_integer() || !d.contains("trainer_state") || !d["trainer_state"].is_string()) {
      continue;
    }
    auto digest = store::Digest::FromHex(d["trainer_state"].get<std::string>());
    if (digest.ok()) out[d["step"].get<int64_t>()].push_back(*digest);
  }
  return out;
}

// Checks checkpoint `d` of `step` before anything of it is used (see the top of this file).
// Returns its parsed trainer_state.json; `legacy` tells that it carries no record of its files.
// kFailedPrecondition when the checkpoint is intact but belongs to another configuration or
// dataset (the operator's to resolve: no older checkpoint would do better); any other error
// names what does not verify.
Result<run::TrainerState> VerifyCheckpoint(const Trainer::State& s, int64_t step, const fs::path& d,
                                           const std::map<int64_t, std::vector<store::Digest>>& recorded,
                                           bool& legacy) {
  const fs::path state_path = d / "trainer_state.json";
  const std::string where = state_path.string();
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(state_path, run::kMaxTrainerStateBytes));
  const store::Digest digest = store::AuxDigest(text);
  auto rec = recorded.find(step);
  if (rec != recorded.end() && std::find(rec->second.begin(), rec->second.end(), digest) == rec->second.end()) {
    return Status::Corruption(where + ": differs from what the store recorded for " + d.filename().string() +
                              " (digest " + digest.Hex() + ", recorded " + rec->second.back().Hex() + ")");
  }
  FERRY_ASSIGN_OR_RETURN(run::TrainerState st, run::ParseTrainerState(text, where));
  if (st.global_step != step) {
    return Status::Corruption(where + ": global_step " + std::to_string(st.global_step) + " in " +
                              d.filename().string());
  }
  legacy = st.files.empty() && rec == recorded.end();
  if (!legacy && rec == recorded.end()) {
    return Status::Corruption(where + ": the store " + s.store_dir.string() + " has no record of " +
                              d.filename().string() + " (ferryd records each checkpoint before it appears)");
  }
  if (st.config_fingerprint != s.options.config.Fingerprint()) {
    return Status::FailedPrecondition(s.config.source.string() + " differs from the configuration " +
                                      d.filename().string() + " was trained with (fingerprint " +
                                      st.config_fingerprint + ", now " + s.options.config.Fingerprint() +
                                      "); resume with the same configuration or use another output_dir");
  }
  if (st.dataset_digest != s.dataset->digest()) {
    return Status::FailedPrecondition(s.config.dataset.string() + " changed since " + d.filename().string() +
                                      " was written (dataset digest differs)");
  }
  if (!legacy) {
    std::vector<std::string> required = {"adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors"};
    if (st.rollout) required.push_back("rollout.safetensors");
    for (const std::string& name : required) {
      if (st.files.count(name) == 0) return Status::Corruption(where + ": records no " + name);
    }
    for (const auto& [name, file] : st.files) FERRY_RETURN_IF_ERROR(run::CheckCheckpointFile(d, name, file));
  }

  // The adapter is the one the store recorded for the step: the adapter version merged into
  // the version its generator acknowledged.
  FERRY_ASSIGN_OR_RETURN(store::Digest generator, store::Digest::FromHex(st.generator_version));
  if (generator == s.base_version) {
    if (step != 0) {
      return Status::Corruption(where + ": generator_version is the base, but the checkpoint is of step " +
                                std::to_string(step));
    }
    return st;  // checkpoint-0: the initial adapter, recorded by the checkpoint alone
  }
  auto merged = s.store->GetVersion(generator.Hex());
  if (!merged.ok()) {
    return Status::Corruption(where + ": generator_version " + generator.Hex() + ": " + merged.status().message());
  }
  if (merged->kind != store::VersionKind::kMerged || !merged->adapter_version ||
      merged->base_version != s.base_version) {
    return Status::Corruption(where + ": generator_version " + generator.Hex() +
                              " is not a merge of an adapter onto this run's base " + s.base_version.Hex());
  }
  auto adapter = s.store->GetVersion(merged->adapter_version->Hex());
  if (!adapter.ok()) {
    return Status::Corruption(where + ": the adapter version of generator_version " + generator.Hex() + ": " +
                              adapter.status().message());
  }
  FERRY_ASSIGN_OR_RETURN(Checkpoint file, Checkpoint::Open(d / "adapter_model.safetensors"));
  FERRY_RETURN_IF_ERROR(run::CheckAgainstVersion(file, *adapter));
  FERRY_ASSIGN_OR_RETURN(std::string config_text, ReadSmallFile(d / "adapter_config.json", 1u << 20));
  for (const store::AuxFile& aux : adapter->aux) {
    if (aux.name == "adapter_config.json" && aux.digest != store::AuxDigest(config_text)) {
      return Status::Corruption((d / "adapter_config.json").string() + ": differs from the store's record of version " +
                                adapter->id.Hex());
    }
  }
  return st;
}

// Puts the trainer into the state checkpoint `d` (verified, `st` its trainer_state.json)
// holds: every field is set, so a later call for an older checkpoint replaces all of it.
Status ApplyCheckpoint(Trainer::State& s, const fs::path& d, const run::TrainerState& st) {
  FERRY_RETURN_IF_ERROR(s.sampler->Seek({st.dataset_epoch, st.dataset_index}));
  s.step = st.global_step;
  s.micro_step = st.micro_step;
  s.num_tokens = st.num_tokens;
  s.last_logged = st.last_logged;
  s.last_saved = st.global_step;
  s.pending = st.pending_metrics;
  s.buffer.reset();
  FERRY_RETURN_IF_ERROR(s.adapter->LoadInto(*s.model, d));
  const fs::path opt_path = d / "optimizer.safetensors";
  FERRY_ASSIGN_OR_RETURN(Checkpoint opt, Checkpoint::Open(opt_path));
  FERRY_ASSIGN_OR_RETURN(auto entries, run::ReadOptimizerState(opt));
  const auto& params = s.adapter->named_parameters();
  for (const auto& [key, e] : entries) {
    auto p = params.find(key);
    if (p == params.end()) {
      return Status::Corruption(opt_path.string() + ": state of '" + key + "', which this run's adapter does not have");
    }
    if (!p->second.sizes().equals(e.exp_avg.shape())) {
      return Status::Corruption(opt_path.string() + ": state of '" + key + "' has another shape than the tensor");
    }
  }
  FERRY_ASSIGN_OR_RETURN(at::Tensor rng, Unhex(st.torch_rng_state, (d / "trainer_state.json").string()));
  return runtime::GuardTorch("restoring " + d.string(), [&]() -> Status {
    s.optimizer->state().clear();
    for (const auto& [key, e] : entries) {
      const at::Tensor& p = params.at(key);
      FERRY_ASSIGN_OR_RETURN(at::Tensor mt, runtime::ToTorch(e.exp_avg, p.device()));
      FERRY_ASSIGN_OR_RETURN(at::Tensor vt, runtime::ToTorch(e.exp_avg_sq, p.device()));
      auto ps = std::make_unique<torch::optim::AdamWParamState>();
      ps->step(e.step);
      ps->exp_avg(mt.clone());
      ps->exp_avg_sq(vt.clone());
      s.optimizer->state()[StateKey(p)] = std::move(ps);
    }
    {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
    if (st.rollout) {
      FERRY_ASSIGN_OR_RETURN(Checkpoint rc, Checkpoint::Open(d / "rollout.safetensors"));
      Rollout r;
      auto get = [&](const char* name, at::Tensor& out) -> Status {
        if (!rc.Contains(name)) return Status::OK();
        FERRY_ASSIGN_OR_RETURN(Tensor t, rc.Get(name));
        FERRY_ASSIGN_OR_RETURN(at::Tensor v, runtime::ToTorch(t, at::kCPU));
        out = v.clone();
        return Status::OK();
      };
      for (auto [name, field] :
           std::initializer_list<std::pair<const char*, at::Tensor*>>{{"prompt_ids", &r.prompt_ids},
                                                                      {"prompt_mask", &r.prompt_mask},
                                                                      {"completion_ids", &r.completion_ids},
                                                                      {"completion_mask", &r.completion_mask},
                                                                      {"sampling_logps", &r.sampling_logps},
                                                                      {"advantages", &r.advantages},
                                                                      {"old_logps", &r.old_logps},
                                                                      {"ref_logps", &r.ref_logps},
                                                                      {"is_ratio", &r.is_ratio}}) {
        FERRY_RETURN_IF_ERROR(get(name, *field));
      }
      if (!r.completion_ids.defined() || r.completion_ids.dim() != 2) {
        return Status::Corruption((d / "rollout.safetensors").string() + ": no 2-D completion_ids");
      }
      const int64_t rows = r.completion_ids.size(0);
      for (const auto& mb : st.rollout->rows) {
        for (int64_t row : mb) {
          if (row >= rows) {
            return Status::Corruption((d / "trainer_state.json").string() + ": rollout row " + std::to_string(row) +
                                      " of " + std::to_string(rows));
          }
        }
      }
      r.num_items = st.rollout->num_items;
      r.metrics = st.rollout->metrics;
      r.rows_of_micro_batch = st.rollout->rows;
      s.buffer = std::move(r);
    }
    return Status::OK();
  });
}

// A name beside `d` for a refused checkpoint: checkpoint-N.refused, or .refused-2, -3, ...
fs::path RefusedName(const fs::path& d) {
  fs::path p = d;
  p += ".refused";
  for (int i = 2; fs::exists(p); ++i) {
    p = d;
    p += ".refused-" + std::to_string(i);
  }
  return p;
}

}  // namespace

Result<Restored> RestoreNewestCheckpoint(Trainer::State& s) {
  auto say = [&](const std::string& m) {
    if (s.options.on_message) s.options.on_message(m);
  };
  auto all = ListCheckpoints(s.dir);
  if (all.empty()) {
    // A run killed before its first checkpoint starts again from step 0.
    FERRY_RETURN_IF_ERROR(TruncateMetrics(s.dir, 0));
    return Restored{};
  }
  FERRY_ASSIGN_OR_RETURN(auto recorded, RecordedCheckpoints(*s.store, s.config.store.run));
  std::vector<std::pair<fs::path, std::string>> refused;  // newest first
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    const auto& [step, d] = *it;
    bool legacy = false;
    Result<run::TrainerState> st = VerifyCheckpoint(s, step, d, recorded, legacy);
    Status why = st.status();
    if (st.ok()) {
      if (legacy) {
        say("warning: " + d.filename().string() +
            " was written before Ferry recorded checkpoints: its adapter is verified against the store, its "
            "optimizer and rollout state cannot be");
      }
      why = ApplyCheckpoint(s, d, *st);
    } else if (why.code() == StatusCode::kFailedPrecondition) {
      return why;
    }
    std::shared_ptr<const sync::Snapshot> snapshot;
    if (why.ok()) {
      auto built = step > 0 ? s.publisher->Build(s.adapter.get()) : s.publisher->Build(nullptr);
      why = built.status();
      if (built.ok()) {
        snapshot = *built;
        if (snapshot->manifest_id().Hex() != st->generator_version) {
          why = Status::Corruption(d.string() + ": its adapter merged onto the base is version " +
                                   snapshot->manifest_id().Hex() + ", but the step's generator ran " +
                                   st->generator_version + " (trainer_state.json generator_version)");
        }
      }
    }
    if (!why.ok()) {
      say("skipped " + d.filename().string() + ": " + why.message());
      refused.emplace_back(d, why.message());
      continue;
    }
    for (const auto& [bad, reason] : refused) {
      const fs::path aside = RefusedName(bad);
      std::error_code ec;
      fs::rename(bad, aside, ec);
      if (ec) return Status::IOError(bad.string() + ": moving the refused checkpoint aside: " + ec.message());
      say("moved " + bad.filename().string() + " aside to " + aside.filename().string() +
          " (kept for inspection; the run goes on from " + d.filename().string() + ")");
    }
    FERRY_RETURN_IF_ERROR(TruncateMetrics(s.dir, step));
    return Restored{step, std::move(snapshot)};
  }
  std::string reasons;
  for (const auto& [bad, reason] : refused) reasons += "\n  " + bad.filename().string() + ": " + reason;
  return Status::Corruption("no checkpoint of " + s.dir.string() +
                            " verifies, so the run does not resume from any (nothing was changed; move the "
                            "checkpoints aside to start it again from step 0):" +
                            reasons);
}

}  // namespace ferry::grpo
