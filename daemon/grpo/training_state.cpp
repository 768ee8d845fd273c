// checkpoint-N/: the adapter in PEFT's format plus everything needed to continue the run
// exactly where it stopped.
//
//   adapter_model.safetensors, adapter_config.json   the adapter (PEFT loads it as is)
//   optimizer.safetensors   AdamW state: "exp_avg.<key>", "exp_avg_sq.<key>" per adapter tensor
//                           key, and "__metadata__" {"step.<key>": "<n>"}
//   rollout.safetensors     the buffered generation batch, when the next step still uses it
//                           (num_iterations or steps_per_generation > 1)
//   trainer_state.json      global_step, micro_step, num_tokens, dataset position and digest,
//                           the config's fingerprint, the default CPU generator's state (hex),
//                           metrics since the last log line, the rollout's metadata
// The directory is written under a temporary name and renamed when whole; a directory named
// checkpoint-N is therefore complete. Only the newest save_total_limit are kept.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <mutex>
#include <regex>
#include <sstream>
#include <type_traits>
#include <utility>

#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "daemon/grpo/optimizer.h"
#include "daemon/grpo/trainer_internal.h"
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
  const fs::path final_path = s.dir / ("checkpoint-" + std::to_string(s.step));
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(final_path, /*replace_existing=*/true));
  const fs::path& d = staging.path();
  FERRY_RETURN_IF_ERROR(s.adapter->WriteFiles(d, s.config.model_name_or_path.string()));

  json state;
  FERRY_RETURN_IF_ERROR(runtime::GuardTorch("saving the optimizer", [&]() -> Status {
    std::map<std::string, at::Tensor> tensors;
    std::map<std::string, std::string> meta;
    for (const auto& [key, p] : s.adapter->named_parameters()) {
      auto it = s.optimizer->state().find(StateKey(p));
      if (it == s.optimizer->state().end()) continue;  // no step taken yet
      auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
      tensors["exp_avg." + key] = st.exp_avg().to(at::kCPU);
      tensors["exp_avg_sq." + key] = st.exp_avg_sq().to(at::kCPU);
      meta["step." + key] = std::to_string(st.step());
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
      state["rollout"] = {{"num_items", r.num_items}, {"metrics", r.metrics}, {"rows", r.rows_of_micro_batch}};
    }
    state["torch_rng_state"] = Hex(at::detail::getDefaultCPUGenerator().get_state());
    return Status::OK();
  }));
  const run::DatasetPosition pos = s.sampler->position();
  state["global_step"] = s.step;
  state["micro_step"] = s.micro_step;
  state["num_tokens"] = s.num_tokens;
  state["dataset"] = {{"epoch", pos.epoch}, {"index", pos.index}, {"digest", s.dataset->digest()}};
  state["config_fingerprint"] = s.config.Fingerprint();
  state["pending_metrics"] = s.pending;
  state["last_logged"] = s.last_logged;
  state["generator_version"] = s.generator_version;
  FERRY_RETURN_IF_ERROR(WriteFileAtomic(d / "trainer_state.json", state.dump(2) + "\n"));
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

Result<int64_t> RestoreNewestCheckpoint(Trainer::State& s) {
  auto all = ListCheckpoints(s.dir);
  if (all.empty()) {
    // A run killed before its first checkpoint starts again from step 0.
    FERRY_RETURN_IF_ERROR(TruncateMetrics(s.dir, 0));
    return int64_t{0};
  }
  const auto& [step, d] = all.back();
  const std::string where = (d / "trainer_state.json").string();
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(d / "trainer_state.json", 64u << 20));
  json st = json::parse(text, nullptr, false);
  if (st.is_discarded() || !st.is_object()) return Status::Corruption(where + ": not a JSON object");
  try {
    if (st.at("global_step").get<int64_t>() != step) {
      return Status::Corruption(where + ": global_step " + st.at("global_step").dump() + " in " +
                                d.filename().string());
    }
    if (st.at("config_fingerprint").get<std::string>() != s.config.Fingerprint()) {
      return Status::FailedPrecondition(
          s.config.source.string() + " differs from the configuration " + d.filename().string() +
          " was trained with (fingerprint " + st.at("config_fingerprint").get<std::string>() + ", now " +
          s.config.Fingerprint() + "); resume with the same configuration or use another output_dir");
    }
    const json& ds = st.at("dataset");
    if (ds.at("digest").get<std::string>() != s.dataset->digest()) {
      return Status::FailedPrecondition(s.config.dataset.string() + " changed since " + d.filename().string() +
                                        " was written (dataset digest differs)");
    }
    FERRY_RETURN_IF_ERROR(s.sampler->Seek({ds.at("epoch").get<uint64_t>(), ds.at("index").get<uint64_t>()}));
    s.step = step;
    s.micro_step = st.at("micro_step").get<int64_t>();
    s.num_tokens = st.at("num_tokens").get<double>();
    s.last_logged = st.at("last_logged").get<int64_t>();
    s.last_saved = step;
    s.pending = st.at("pending_metrics").get<std::map<std::string, std::vector<double>>>();
    FERRY_RETURN_IF_ERROR(s.adapter->LoadInto(*s.model, d));
    FERRY_ASSIGN_OR_RETURN(Checkpoint opt, Checkpoint::Open(d / "optimizer.safetensors"));
    const auto meta = opt.metadata();
    FERRY_ASSIGN_OR_RETURN(at::Tensor rng, Unhex(st.at("torch_rng_state").get<std::string>(), where));
    FERRY_RETURN_IF_ERROR(runtime::GuardTorch("restoring " + d.string(), [&]() -> Status {
      for (const auto& [key, p] : s.adapter->named_parameters()) {
        auto it = meta.find("step." + key);
        if (it == meta.end()) continue;
        FERRY_ASSIGN_OR_RETURN(Tensor m, opt.Get("exp_avg." + key));
        FERRY_ASSIGN_OR_RETURN(Tensor v, opt.Get("exp_avg_sq." + key));
        FERRY_ASSIGN_OR_RETURN(at::Tensor mt, runtime::ToTorch(m, p.device()));
        FERRY_ASSIGN_OR_RETURN(at::Tensor vt, runtime::ToTorch(v, p.device()));
        auto ps = std::make_unique<torch::optim::AdamWParamState>();
        ps->step(std::stoll(it->second));
        ps->exp_avg(mt.clone());
        ps->exp_avg_sq(vt.clone());
        s.optimizer->state()[StateKey(p)] = std::move(ps);
      }
      {
        at::Generator gen = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(rng);
      }
      if (st.contains("rollout")) {
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
        r.num_items = st["rollout"].at("num_items").get<int64_t>();
        r.metrics = st["rollout"].at("metrics").get<Metrics>();
        r.rows_of_micro_batch = st["rollout"].at("rows").get<std::vector<std::vector<int64_t>>>();
        s.buffer = std::move(r);
      }
      return Status::OK();
    }));
  } catch (const json::exception& e) {
    return Status::Corruption(where + ": " + e.what());
  }
  FERRY_RETURN_IF_ERROR(TruncateMetrics(s.dir, step));
  return step;
}

}  // namespace ferry::grpo
