// libFuzzer target for a model directory's tokenizer_config.json and special_tokens_map.json
// (Tokenizer::FromDirectory), beside the qwen2-style fixture's tokenizer.json: the input is the
// first file, or the first, a NUL byte and the second (JSON text has no NUL of its own). Any bytes must load
// or be refused with a Status, never crash, hang or allocate without bound; the tokens the
// config adds (added_tokens_decoder, named, model-specific and extra special tokens) must
// leave a tokenizer whose ids decode (the first 4,096 are checked one by one) and whose bos,
// eos and pad ids are tokens.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/text/tokenizer.h"

namespace {

namespace fs = std::filesystem;

// A directory of this process with the fixture's tokenizer.json, removed at exit.
const fs::path& Directory() {
  static const fs::path* dir = [] {
    std::string tmpl = (fs::temp_directory_path() / "ferry-fuzz-tokconfig-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
    auto* d = new fs::path(tmpl);
    fs::copy_file(fs::path(FERRY_FIXTURES_DIR) / "tokenizers" / "qwen2-style" / "tokenizer.json",
                  *d / "tokenizer.json");
    std::atexit([] {
      std::error_code ec;
      fs::remove_all(Directory(), ec);
    });
    return d;
  }();
  return *dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path& dir = Directory();
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const auto write = [&](const char* name, std::string_view bytes) {
    std::ofstream out(dir / name, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) std::abort();
  };
  write("tokenizer_config.json", input.substr(0, nul));
  std::error_code ec;
  fs::remove(dir / "special_tokens_map.json", ec);
  if (nul != std::string_view::npos) write("special_tokens_map.json", input.substr(nul + 1));
  auto t = ferry::text::Tokenizer::FromDirectory(dir);
  if (!t.ok()) {
    if (t.status().code() == ferry::StatusCode::kOk) std::abort();
    return 0;
  }
  for (const auto& id : {t->bos_id(), t->eos_id(), t->pad_id()}) {
    if (id && (*id < 0 || *id >= t->vocab_size() || !t->TokenText(*id).ok())) std::abort();
  }
  for (const bool special : {false, true}) {
    auto ids =
        t->Encode("Hello <s> wörld <|im_start|>user\n[INST] café <tool_call> The 😀", {.add_special_tokens = special});
    if (!ids.ok()) std::abort();  // valid UTF-8 always encodes
    if (!t->Decode(*ids).ok() || !t->Decode(*ids, {.skip_special_tokens = true}).ok()) std::abort();
  }
  std::vector<int32_t> all;
  for (int32_t id = 0; id < t->vocab_size() && id < 4096; ++id) {
    all.push_back(id);
    if (!t->TokenBytes(id).ok() || !t->TokenText(id).ok()) std::abort();
  }
  (void)t->Decode(all);
  return 0;
}
