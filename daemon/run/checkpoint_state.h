// What a training checkpoint (checkpoint-N/) holds besides the adapter, and the record that
// lets a resume prove its bytes before using them. LibTorch-free: the trainer (daemon/grpo)
// turns the parsed values into tensors; the fuzz target fuzz/checkpoint_state_fuzz.cpp feeds
// these parsers hostile bytes.
//
// checkpoint-N/trainer_state.json, one JSON object (written by TrainerStateJson):
//   global_step, micro_step, last_logged   integers >= 0 (micro_step, last_logged <= 2^53)
//   num_tokens                             a finite number >= 0
//   dataset {epoch, index, digest}         the dataset position and the dataset's digest
//   config_fingerprint                     run::RunConfig::Fingerprint() of the run
//   pending_metrics {name: [x, ...]}       metrics since the last log line (null = NaN)
//   generator_version                      the 32-hex id the generator acknowledged after step N
//   torch_rng_state                        the default CPU generator's state, lowercase hex
//   rollout {num_items, metrics, rows}     the buffered generation batch's metadata, when
//                                          rollout.safetensors holds one
//   files {name: {size, digest[, tensors {name: digest}]}}
//                                          every other file of the directory as written:
//                                          its size, store::AuxDigest of its bytes and, for
//                                          a safetensors file, each tensor's store::TensorDigest
//                                          (so a mismatch names the tensor). Absent in
//                                          checkpoints written before Ferry recorded it.
// The daemon records the digest of trainer_state.json in the run's store (an event of type
// checkpoint on the step's version) before the directory is renamed into place; a resume
// proves trainer_state.json against that record, every other file against `files`, and the
// adapter's tensors against the adapter version the store recorded for the step.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/checkpoint.h"
#include "core/status.h"
#include "store/store.h"

namespace ferry::run {

// Bounds of what a trainer_state.json may hold (a hostile file gets an error, not an
// allocation of its choosing).
inline constexpr size_t kMaxTrainerStateBytes = size_t{64} << 20;
inline constexpr size_t kMaxCheckpointFiles = 64;
inline constexpr size_t kMaxRecordedTensors = size_t{1} << 20;

// A file of a checkpoint as it was written.
struct CheckpointFile {
  uint64_t size = 0;
  store::Digest digest;                          // store::AuxDigest of the file's bytes
  std::map<std::string, store::Digest> tensors;  // safetensors files only: name -> TensorDigest
};

// The buffered generation batch's metadata (its tensors are in rollout.safetensors).
struct RolloutState {
  int64_t num_items = 0;
  std::map<std::string, double> metrics;
  std::vector<std::vector<int64_t>> rows;  // row indices of each micro-batch, each >= 0
};

struct TrainerState {
  int64_t global_step = 0;
  int64_t micro_step = 0;
  double num_tokens = 0;
  uint64_t dataset_epoch = 0;
  uint64_t dataset_index = 0;
  std::string dataset_digest;
  std::string config_fingerprint;
  std::map<std::string, std::vector<double>> pending_metrics;  // NaN where the file has null
  int64_t last_logged = 0;
  std::string generator_version;  // 32 lowercase hex
  std::string torch_rng_state;    // lowercase hex, even length
  std::optional<RolloutState> rollout;
  std::map<std::string, CheckpointFile> files;  // empty: written before files were recorded
};

// Parses trainer_state.json. kCorruption naming `where` and the field for anything that is
// not as described at the top of this file (a missing or mistyped field, a negative step,
// hex that is not hex, a bound exceeded).
Result<TrainerState> ParseTrainerState(std::string_view text, const std::string& where);
// The file's text (pretty-printed, one trailing newline). ParseTrainerState reads it back equal.
std::string TrainerStateJson(const TrainerState& state);

// Records `dir/name` as it is on disk now (safetensors files by their ".safetensors" name
// also tensor by tensor).
Result<CheckpointFile> RecordCheckpointFile(const std::filesystem::path& dir, const std::string& name);
// Checks `dir/name` against what was recorded: kCorruption "DIR/NAME: ..." naming the first
// tensor whose bytes differ (or the header, when every tensor matches), a size that differs,
// a missing file; kIOError when it cannot be read.
Status CheckCheckpointFile(const std::filesystem::path& dir, const std::string& name, const CheckpointFile& recorded);

// Checks the tensors of `file` (a checkpoint's adapter_model.safetensors, opened) against the
// adapter version the store recorded: the same names, and each tensor's digest equal to its
// row's. kCorruption naming the file, the tensor and both digests.
Status CheckAgainstVersion(const Checkpoint& file, const store::VersionRecord& version);

// One adapter tensor's AdamW state from optimizer.safetensors.
struct OptimizerEntry {
  int64_t step = 0;   // AdamW's step count, >= 1
  Tensor exp_avg;     // F32
  Tensor exp_avg_sq;  // F32, exp_avg's shape
};
// Reads optimizer.safetensors: for each "step.<key>" of the metadata (a decimal integer in
// [1, 2^53]) the F32 tensors "exp_avg.<key>" and "exp_avg_sq.<key>" of one shape, and no other
// tensor. kCorruption naming `file`'s path and the key otherwise.
Result<std::map<std::string, OptimizerEntry>> ReadOptimizerState(const Checkpoint& file);

}  // namespace ferry::run
