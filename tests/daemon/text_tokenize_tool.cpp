// ferry_tokenize: a test-only CLI over ferry_text, used by fixtures/tokenizers/generate.py
// to compare the C++ tokenizers with the `tokenizers` package on many strings at once.
//
//   ferry_tokenize encode TOKENIZER   stdin: one JSON string per line; stdout: one JSON
//       object per line: {"ids": encode(text), "ids_special": encode(text,
//       add_special_tokens), "decoded": decode(ids_special), "decoded_skip":
//       decode(ids_special, skip_special_tokens)} or {"error": "<code>: <message>"}
//   ferry_tokenize decode TOKENIZER   stdin: one JSON array of ids per line; stdout:
//       {"decoded": ..., "decoded_skip": ...} or {"error": ...}
//   ferry_tokenize nfc                stdin: JSON strings; stdout: their NFC as JSON strings
//
// TOKENIZER is a tokenizer.json file or a directory (tokenizer.json + tokenizer_config.json).
// Exit status 2 for bad usage or a tokenizer that does not load.
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/text/tokenizer.h"
#include "daemon/text/unicode.h"

namespace {

using json = nlohmann::json;
using ferry::text::Tokenizer;

json Error(const ferry::Status& s) { return json{{"error", s.ToString()}}; }

int Usage() {
  std::cerr << "usage: ferry_tokenize encode|decode TOKENIZER  |  ferry_tokenize nfc\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::ios::sync_with_stdio(false);
  if (argc < 2) return Usage();
  const std::string mode = argv[1];
  std::string line;
  if (mode == "nfc") {
    while (std::getline(std::cin, line)) {
      const auto text = json::parse(line).get<std::string>();
      auto out = ferry::text::NormalizeNfc(text);
      std::cout << (out.ok() ? json(*out) : Error(out.status())).dump() << "\n";
    }
    return 0;
  }
  if (argc != 3 || (mode != "encode" && mode != "decode")) return Usage();
  const std::filesystem::path path = argv[2];
  auto tok = std::filesystem::is_directory(path) ? Tokenizer::FromDirectory(path) : Tokenizer::FromFile(path);
  if (!tok.ok()) {
    std::cerr << "ferry_tokenize: " << tok.status().ToString() << "\n";
    return 2;
  }
  while (std::getline(std::cin, line)) {
    json out;
    if (mode == "encode") {
      const auto text = json::parse(line).get<std::string>();
      auto ids = tok->Encode(text);
      auto ids_special = tok->Encode(text, {.add_special_tokens = true});
      if (!ids.ok() || !ids_special.ok()) {
        out = Error(ids.ok() ? ids_special.status() : ids.status());
      } else {
        auto decoded = tok->Decode(*ids_special);
        auto decoded_skip = tok->Decode(*ids_special, {.skip_special_tokens = true});
        if (!decoded.ok() || !decoded_skip.ok()) {
          out = Error(decoded.ok() ? decoded_skip.status() : decoded.status());
        } else {
          out = json{
              {"ids", *ids}, {"ids_special", *ids_special}, {"decoded", *decoded}, {"decoded_skip", *decoded_skip}};
        }
      }
    } else {
      const auto ids = json::parse(line).get<std::vector<int32_t>>();
      auto decoded = tok->Decode(ids);
      auto decoded_skip = tok->Decode(ids, {.skip_special_tokens = true});
      if (!decoded.ok() || !decoded_skip.ok()) {
        out = Error(decoded.ok() ? decoded_skip.status() : decoded.status());
      } else {
        out = json{{"decoded", *decoded}, {"decoded_skip", *decoded_skip}};
      }
    }
    std::cout << out.dump() << "\n";
  }
  return 0;
}
