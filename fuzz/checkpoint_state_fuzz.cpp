// libFuzzer target for what a resume reads from a checkpoint directory (daemon/run/
// checkpoint_state.h): the first byte chooses the file (even: trainer_state.json, parsed in
// memory; odd: optimizer.safetensors, written to a private temporary file and opened as a
// resume opens it), the rest is its bytes. Any bytes must give a value or an error, never a
// crash, hang or unbounded allocation; what is accepted must keep the header's promises
// (checked below, trapping otherwise).
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/checkpoint.h"
#include "daemon/run/checkpoint_state.h"

namespace {

namespace fs = std::filesystem;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

bool SameMetric(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

void FuzzTrainerState(std::string_view text) {
  auto st = ferry::run::ParseTrainerState(text, "/fuzz/checkpoint-1/trainer_state.json");
  if (!st.ok()) {
    Check(st.status().code() == ferry::StatusCode::kCorruption);
    Check(st.status().message().find("/fuzz/checkpoint-1/trainer_state.json") == 0);
    return;
  }
  Check(st->global_step >= 0 && st->micro_step >= 0 && st->last_logged <= st->global_step);
  Check(std::isfinite(st->num_tokens) && st->num_tokens >= 0);
  Check(st->generator_version.size() == 32 && st->torch_rng_state.size() % 2 == 0);
  Check(st->files.size() <= ferry::run::kMaxCheckpointFiles && st->files.count("trainer_state.json") == 0);
  for (const auto& [name, values] : st->pending_metrics) {
    Check(values.size() <= static_cast<size_t>(st->global_step - st->last_logged));
  }
  if (st->rollout) {
    for (const auto& mb : st->rollout->rows) {
      for (int64_t r : mb) Check(r >= 0);
    }
  }
  // What the writer makes of it reads back the same.
  auto again = ferry::run::ParseTrainerState(ferry::run::TrainerStateJson(*st), "again");
  Check(again.ok());
  Check(again->global_step == st->global_step && again->micro_step == st->micro_step);
  Check(again->num_tokens == st->num_tokens && again->last_logged == st->last_logged);
  Check(again->dataset_epoch == st->dataset_epoch && again->dataset_index == st->dataset_index);
  Check(again->dataset_digest == st->dataset_digest && again->config_fingerprint == st->config_fingerprint);
  Check(again->generator_version == st->generator_version && again->torch_rng_state == st->torch_rng_state);
  Check(again->pending_metrics.size() == st->pending_metrics.size());
  for (const auto& [name, values] : st->pending_metrics) {
    const auto& other = again->pending_metrics.at(name);
    Check(other.size() == values.size());
    for (size_t i = 0; i < values.size(); ++i) Check(SameMetric(values[i], other[i]));
  }
  Check(again->rollout.has_value() == st->rollout.has_value());
  if (st->rollout)
    Check(again->rollout->rows == st->rollout->rows && again->rollout->num_items == st->rollout->num_items);
  Check(again->files.size() == st->files.size());
  for (const auto& [name, f] : st->files) {
    const auto& g = again->files.at(name);
    Check(g.size == f.size && g.digest == f.digest && g.tensors == f.tensors);
  }
}

void FuzzOptimizerState(std::string_view bytes) {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("ferry-fuzz-checkpoint-" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  const fs::path path = dir / "optimizer.safetensors";
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  auto file = ferry::Checkpoint::Open(path);
  if (!file.ok()) return;
  auto state = ferry::run::ReadOptimizerState(*file);
  if (!state.ok()) {
    Check(state.status().code() == ferry::StatusCode::kCorruption);
    Check(state.status().message().find(path.string()) == 0);
    return;
  }
  size_t tensors = 0;
  for (const auto& [key, e] : *state) {
    Check(e.step >= 1);
    Check(e.exp_avg.dtype() == ferry::DType::kF32 && e.exp_avg.shape() == e.exp_avg_sq.shape());
    Check(e.exp_avg.nbytes() == e.exp_avg_sq.nbytes());
    tensors += 2;
  }
  Check(tensors == file->names().size());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    FuzzTrainerState(rest);
  } else {
    FuzzOptimizerState(rest);
  }
  return 0;
}
