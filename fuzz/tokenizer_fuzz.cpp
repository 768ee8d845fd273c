// libFuzzer target for ferry_text's Encode / Decode / TokenBytes on fixture tokenizers
// (fixtures/tokenizers/): any bytes must encode to ids or to kInvalidArgument (exactly when
// they are not valid UTF-8), and any ids must decode or be refused by id.
//
// Input layout: byte 0 selects the tokenizer (low 3 bits) and add_special_tokens (bit 7);
// the rest is the text. The text's bytes, read two at a time, are also a list of ids (some
// outside the vocabulary) for Decode.
//
// Beyond "no sanitizer report": decoded text is valid UTF-8, and on llama3-style (byte-level,
// no normalizer, every byte a token) decode(encode(x)) == x for valid UTF-8 x and the
// TokenBytes of the ids concatenate to it.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/text/tokenizer.h"
#include "daemon/text/unicode.h"

namespace {

using ferry::text::Tokenizer;

struct Loaded {
  Tokenizer tokenizer;
  bool round_trips;  // byte-level, no normalizer, no dropped characters
};

const std::vector<Loaded>& Tokenizers() {
  static const std::vector<Loaded>* all = [] {
    auto* v = new std::vector<Loaded>();
    const struct {
      const char* name;
      bool round_trips;
    } names[] = {{"llama3-style", true},   {"qwen2-style", false},     {"llama2-legacy", false},
                 {"mistral-style", false}, {"edge-bytelevel", false},  {"edge-metaspace", false},
                 {"edge-regex", false},    {"llama2-metaspace", false}};
    for (const auto& n : names) {
      auto t = Tokenizer::FromFile(std::string(FERRY_FIXTURES_DIR) + "/tokenizers/" + n.name + "/tokenizer.json");
      if (!t.ok()) {
        std::fprintf(stderr, "fuzz_tokenizer: %s\n", t.status().ToString().c_str());
        std::abort();
      }
      v->push_back({std::move(t).value(), n.round_trips});
    }
    return v;
  }();
  return *all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& all = Tokenizers();
  const Loaded& l = all[(data[0] & 7) % all.size()];
  const Tokenizer& t = l.tokenizer;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool valid = !ferry::text::FirstInvalidUtf8(text);

  auto ids = t.Encode(text, {.add_special_tokens = (data[0] & 0x80) != 0});
  if (!valid) {
    if (ids.ok() || ids.status().code() != ferry::StatusCode::kInvalidArgument) std::abort();
  } else {
    if (!ids.ok()) std::abort();
    auto decoded = t.Decode(*ids);
    if (!decoded.ok()) std::abort();
    if (l.round_trips && (data[0] & 0x80) == 0) {
      if (*decoded != text) std::abort();
      std::string concat;
      for (const int32_t id : *ids) concat += *t.TokenBytes(id);
      if (ferry::text::Utf8Lossy(concat) != *decoded) std::abort();
    }
    if (!t.Decode(*ids, {.skip_special_tokens = true}).ok()) std::abort();
  }

  std::vector<int32_t> raw;
  bool in_range = true;
  for (size_t i = 1; i + 1 < size; i += 2) {
    const int32_t id = static_cast<int32_t>((data[i] | (data[i + 1] << 8)) % (t.vocab_size() + 2)) - 1;
    in_range = in_range && id >= 0 && id < t.vocab_size();
    raw.push_back(id);
    if (t.TokenBytes(id).ok() != (id >= 0 && id < t.vocab_size())) std::abort();
  }
  auto decoded = t.Decode(raw);
  if (decoded.ok() != in_range) std::abort();
  if (decoded.ok() && ferry::text::FirstInvalidUtf8(*decoded)) std::abort();
  return 0;
}
