// Helpers for the runtime tests: tiny random Hugging Face model directories written from
// LibTorch tensors, and the tolerances the tests share.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>

#include "core/status.h"

namespace ferry::testing {

struct TinyModelSpec {
  std::string model_type = "llama";  // llama | mistral | qwen2
  int64_t vocab = 96;
  int64_t hidden = 32;
  int64_t intermediate = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t kv_heads = 2;
  bool tied = false;
  bool qkv_bias = false;  // qwen2 always has them
  at::ScalarType dtype = at::kFloat;
  double rope_theta = 10000.0;
  int64_t max_positions = 4096;
  double std = 0.2;  // weight scale: large enough for peaked distributions
  uint64_t seed = 1;
};

// The tensors of a random model of `spec`, by Hugging Face name.
std::map<std::string, at::Tensor> RandomModelTensors(const TinyModelSpec& spec);

// config.json text for `spec`.
std::string TinyConfigJson(const TinyModelSpec& spec);

// Writes config.json and model.safetensors for `spec` into `dir` (created).
Status WriteTinyModel(const std::filesystem::path& dir, const TinyModelSpec& spec);

// Writes `tensors` as one safetensors file.
Status WriteTensors(const std::filesystem::path& file, const std::map<std::string, at::Tensor>& tensors);

// A file's bytes written / read whole (test set-up; no error handling beyond gtest's checks).
void WriteText(const std::filesystem::path& p, const std::string& text);
std::string ReadText(const std::filesystem::path& p);

// A byte-level BPE tokenizer.json of 12 single characters (0-9 + =, ids 0-11), "<bos>" (12) and
// `token13` (13), as the `tokenizers` package writes one with no merges.
std::string DigitTokenizerJson(const std::string& token13);

}  // namespace ferry::testing
