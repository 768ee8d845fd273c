// libFuzzer entry point for the adapter_config.json parser (convert/peft_config.h): any
// bytes must give a config or an error, never a crash, hang or unbounded allocation.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "convert/peft_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = ferry::ParsePeftConfig(text, "fuzz/adapter_config.json");
  (void)ferry::ParseAdapterKey(text, config.ok() ? &*config : nullptr);
  if (!config.ok()) return 0;
  for (const char* module : {"model.layers.0.self_attn.q_proj", "model.layers.12.mlp.down_proj", "lm_head",
                             "transformer.h.3.attn.c_attn", "model.embed_tokens"}) {
    (void)config->ScalingFor(module);
    (void)config->IsTargeted(module, 2);
    (void)config->IsModuleToSave(module);
    (void)ferry::ParseAdapterKey(std::string("base_model.model.") + module + ".lora_A.weight", &*config);
  }
  (void)config->CheckMergeable();
  return 0;
}
