// KvCache: the keys and values CausalLM's attention keeps between forwards, as llama.cpp's
// llama-kv-cache keeps them (allocated once, written in place). The attention block
// (model.cpp) writes a forward's keys and values after length() and reads every filled slot.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "daemon/runtime/model_config.h"

namespace ferry::runtime {

// Keys and values of every layer for `batch` sequences and up to `capacity` positions,
// preallocated once and written in place: a decode step never grows or copies the cache.
// Slot s of row b holds that row's s-th token (rows are left-padded to a common start).
class KvCache {
 public:
  KvCache() = default;
  // REQUIRES: batch >= 1, capacity >= 1.
  KvCache(const ModelConfig& config, int64_t batch, int64_t capacity, at::ScalarType dtype, const at::Device& device);

  int64_t batch() const { return batch_; }
  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }  // slots filled
  // [batch, capacity] bool: slot holds a real token (not padding).
  const at::Tensor& valid() const { return valid_; }
  at::Tensor& key(int layer) { return keys_[static_cast<size_t>(layer)]; }      // [B, nKV, capacity, D]
  at::Tensor& value(int layer) { return values_[static_cast<size_t>(layer)]; }  // [B, nKV, capacity, D]

  // Marks `t` new slots filled; `valid` [B, t] says which are real tokens. REQUIRES: room.
  void Append(const at::Tensor& valid);
  // Append for slots given on the device (long [t]): valid is written there by index.
  // REQUIRES: `slots` are length() .. length() + t - 1, room.
  void AppendAt(const at::Tensor& slots, const at::Tensor& valid);
  // Sets the count of filled slots the host keeps, for work it did not see: a captured decoding
  // step (cuda_graph.h) fills its slot on the device at every replay, while the capture ran the
  // host code (AppendAt's count) once without filling anything. REQUIRES: 0 <= filled <= capacity.
  void set_length(int64_t filled);
  // Forgets everything (keeps the memory).
  void Clear();
  // Keeps only `rows` (a long tensor of row indices, repeats allowed) in that order: copies the
  // filled slots into a cache of rows.size(0) rows and the same capacity.
  KvCache Select(const at::Tensor& rows) const;
  int64_t bytes() const;

 private:
  int64_t batch_ = 0, capacity_ = 0, length_ = 0;
  std::vector<at::Tensor> keys_, values_;
  at::Tensor valid_;
};

}  // namespace ferry::runtime
