// ferry_bench_tokenizer: single-threaded Encode throughput of ferry_text on a corpus.
//
//   ferry_bench_tokenizer TOKENIZER CORPUS.jsonl [--seconds S] [--add-special-tokens]
//
// CORPUS.jsonl holds one JSON string per line (fixtures/tokenizers/corpus.jsonl). After one
// untimed pass (warming the pre-token cache, as the package's own cache is warm in its
// runs), the whole corpus is encoded again and again for at least S seconds (default 3).
// Prints one JSON line: {"bytes": corpus bytes, "passes": n, "seconds": t, "mb_per_s": x,
// "tokens": ids per pass, "load_seconds": time to load the tokenizer}.
// bench/tokenizer_bench.py runs it side by side with the `tokenizers` package.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/text/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: ferry_bench_tokenizer TOKENIZER CORPUS.jsonl [--seconds S] [--add-special-tokens]\n";
    return 2;
  }
  double seconds = 3;
  bool special = false;
  for (int i = 3; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
      seconds = std::stod(argv[++i]);
    } else if (std::strcmp(argv[i], "--add-special-tokens") == 0) {
      special = true;
    } else {
      std::cerr << "ferry_bench_tokenizer: unknown argument " << argv[i] << "\n";
      return 2;
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const std::filesystem::path path = argv[1];
  auto tok = std::filesystem::is_directory(path) ? ferry::text::Tokenizer::FromDirectory(path)
                                                 : ferry::text::Tokenizer::FromFile(path);
  if (!tok.ok()) {
    std::cerr << "ferry_bench_tokenizer: " << tok.status().ToString() << "\n";
    return 1;
  }
  const double load = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<std::string> corpus;
  size_t bytes = 0;
  std::ifstream in(argv[2]);
  std::string line;
  while (std::getline(in, line)) {
    corpus.push_back(nlohmann::json::parse(line).get<std::string>());
    bytes += corpus.back().size();
  }
  size_t tokens = 0;
  const auto pass = [&] {
    size_t n = 0;
    for (const auto& text : corpus) {
      auto ids = tok->Encode(text, {.add_special_tokens = special});
      if (!ids.ok()) {
        std::cerr << "ferry_bench_tokenizer: " << ids.status().ToString() << "\n";
        std::exit(1);
      }
      n += ids->size();
    }
    return n;
  };
  tokens = pass();
  int passes = 0;
  const auto start = Clock::now();
  double elapsed = 0;
  do {
    pass();
    ++passes;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  std::printf(
      "{\"bytes\": %zu, \"passes\": %d, \"seconds\": %.4f, \"mb_per_s\": %.3f, \"tokens\": %zu, "
      "\"load_seconds\": %.3f}\n",
      bytes, passes, elapsed, static_cast<double>(bytes) * passes / elapsed / 1e6, tokens, load);
  return 0;
}
