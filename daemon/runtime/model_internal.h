// What the files of CausalLM share and nothing outside them uses: a decoder layer's weights as
// weight_loader.cpp fills them and model.cpp runs them. Include model.h for the public API.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstddef>
#include <string>

#include "daemon/runtime/model.h"

namespace ferry::runtime {

// One decoder layer's weights (vLLM's LlamaDecoderLayer: input_layernorm, self_attn,
// post_attention_layernorm, mlp), each Linear named as in the checkpoint.
struct CausalLM::Layer {
  at::Tensor input_norm;  // input_layernorm.weight [hidden]
  at::Tensor post_norm;   // post_attention_layernorm.weight [hidden]
  // q, k, v, o, gate, up, down by Proj; use linear(). In the fused layout q, k, v are left
  // empty (name "") and qkv holds them stacked, and likewise gate, up and gate_up.
  std::array<Linear, kNumProj> proj;
  Linear qkv;      // self_attn.qkv_proj: [q_size + 2 kv_size, hidden], rows q | k | v
  Linear gate_up;  // mlp.gate_up_proj: [2 intermediate, hidden], rows gate | up
  bool fused_qkv = false;
  bool fused_gate_up = false;
  bool sliding = false;  // sliding-window attention (ModelConfig::sliding_layers)

  Linear& linear(Proj p) { return proj[static_cast<size_t>(p)]; }
  const Linear& linear(Proj p) const { return proj[static_cast<size_t>(p)]; }
};

// "[2, 3]": a shape in error messages.
inline std::string ShapeText(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace ferry::runtime
