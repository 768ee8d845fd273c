// libFuzzer target for Tokenizer::FromJson: tokenizer.json files are hostile, so any bytes
// must load or be refused with a Status, never crash, hang or allocate without bound. A
// tokenizer that loads must encode and decode a fixed text and decode every id it has
// (up to 2048 of them) without a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "daemon/text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  auto t = ferry::text::Tokenizer::FromJson(json, "tokenizer.json");
  if (!t.ok()) {
    if (t.status().code() == ferry::StatusCode::kOk) std::abort();
    return 0;
  }
  for (const bool special : {false, true}) {
    auto ids = t->Encode("Hello wörld, it's <s> 123 \n\n  x\t😀 <|im_start|>", {.add_special_tokens = special});
    if (ids.ok()) {
      (void)t->Decode(*ids);
      (void)t->Decode(*ids, {.skip_special_tokens = true});
    }
  }
  std::vector<int32_t> all;
  for (int32_t id = 0; id < t->vocab_size() && id < 2048; ++id) {
    all.push_back(id);
    if (!t->TokenBytes(id).ok() || !t->TokenText(id).ok()) std::abort();
  }
  (void)t->Decode(all);
  return 0;
}
