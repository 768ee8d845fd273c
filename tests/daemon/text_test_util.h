// Shared helpers of the ferry_text tests: fixture paths and JSON-lines readers.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/text/tokenizer.h"

namespace ferry::text::testing {

inline std::filesystem::path TokenizerFixtures() { return std::filesystem::path(FERRY_FIXTURES_DIR) / "tokenizers"; }

inline std::vector<nlohmann::json> ReadJsonLines(const std::filesystem::path& path) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::string line;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

inline std::vector<std::string> Corpus() {
  std::vector<std::string> out;
  for (const auto& j : ReadJsonLines(TokenizerFixtures() / "corpus.jsonl")) out.push_back(j.get<std::string>());
  return out;
}

// The fixture tokenizer `name` (fixtures/tokenizers/<name>/tokenizer.json); fails the test
// when it does not load.
inline Tokenizer LoadFixture(const std::string& name) {
  auto t = Tokenizer::FromFile(TokenizerFixtures() / name / "tokenizer.json");
  if (!t.ok()) {
    ADD_FAILURE() << t.status().ToString();
    std::abort();
  }
  return std::move(t).value();
}

inline std::string Printable(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ferry::text::testing
