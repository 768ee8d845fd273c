// KvCache (kv_cache.h): allocation, appending slots, selecting rows.
#include "daemon/runtime/kv_cache.h"

#include <c10/util/Exception.h>

namespace ferry::runtime {

KvCache::KvCache(const ModelConfig& config, int64_t batch, int64_t capacity, at::ScalarType dtype,
                 const at::Device& device)
    : batch_(batch), capacity_(capacity) {
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    keys_.push_back(at::zeros({batch, config.num_key_value_heads, capacity, config.head_dim}, opts));
    values_.push_back(at::zeros({batch, config.num_key_value_heads, capacity, config.head_dim}, opts));
  }
  valid_ = at::zeros({batch, capacity}, at::TensorOptions().dtype(at::kBool).device(device));
}

void KvCache::Append(const at::Tensor& valid) {
  const int64_t t = valid.size(1);
  TORCH_CHECK(length_ + t <= capacity_, "KV cache full: ", length_, " + ", t, " > ", capacity_);
  valid_.narrow(1, length_, t).copy_(valid);
  length_ += t;
}

void KvCache::AppendAt(const at::Tensor& slots, const at::Tensor& valid) {
  const int64_t t = valid.size(1);
  TORCH_CHECK(length_ + t <= capacity_, "KV cache full: ", length_, " + ", t, " > ", capacity_);
  valid_.index_copy_(1, slots, valid);
  length_ += t;
}

void KvCache::set_length(int64_t filled) {
  TORCH_CHECK(filled >= 0 && filled <= capacity_, "KV cache length ", filled, " outside [0, ", capacity_, "]");
  length_ = filled;
}

void KvCache::Clear() {
  length_ = 0;
  valid_.zero_();
}

KvCache KvCache::Select(const at::Tensor& rows) const {
  KvCache out;
  out.batch_ = rows.size(0);
  out.capacity_ = capacity_;
  out.length_ = length_;
  for (size_t i = 0; i < keys_.size(); ++i) {
    out.keys_.push_back(at::zeros({out.batch_, keys_[i].size(1), capacity_, keys_[i].size(3)}, keys_[i].options()));
    out.values_.push_back(at::zeros_like(out.keys_.back()));
    out.keys_[i].narrow(2, 0, length_).copy_(keys_[i].index_select(0, rows).narrow(2, 0, length_));
    out.values_[i].narrow(2, 0, length_).copy_(values_[i].index_select(0, rows).narrow(2, 0, length_));
  }
  out.valid_ = valid_.index_select(0, rows).clone();
  return out;
}

int64_t KvCache::bytes() const {
  int64_t b = valid_.defined() ? valid_.nbytes() : 0;
  for (size_t i = 0; i < keys_.size(); ++i) b += keys_[i].nbytes() + values_[i].nbytes();
  return b;
}

}  // namespace ferry::runtime
