// Every case of the bad-input corpus must be rejected by Checkpoint::Open with the exact
// StatusCode expected and a message naming the file (and tensor) at fault, without a
// crash, an abort, a sanitizer report, or any file written.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/checkpoint.h"
#include "core/safetensors.h"
#include "tests/core/bad_input_corpus.h"
#include "tests/temp_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using corpus::BadInputCase;

class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry_bad_input_") {}
};

// Relative path -> contents of every regular file under `root` (directories as "<dir>/").
std::map<std::string, std::string> Snapshot(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    const std::string rel = fs::relative(e.path(), root).string();
    if (e.is_directory()) {
      out[rel + "/"] = "";
    } else {
      std::ifstream in(e.path(), std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      out[rel] = ss.str();
    }
  }
  return out;
}

class BadInput : public ::testing::TestWithParam<BadInputCase> {};

TEST_P(BadInput, CheckpointOpenRejectsWithNamedError) {
  const BadInputCase& c = GetParam();
  TempDir dir;
  ASSERT_TRUE(corpus::WriteCase(c, dir.path()).ok());
  const auto before = Snapshot(dir.path());

  auto ck = Checkpoint::Open(corpus::OpenPath(c, dir.path()));
  ASSERT_FALSE(ck.ok()) << c.name << " opened";
  const Status& st = ck.status();
  EXPECT_EQ(st.code(), c.code) << st.ToString();
  for (const auto& want : c.message_contains) {
    const std::string expanded = corpus::ExpandRoot(want, dir.path());
    EXPECT_NE(st.message().find(expanded), std::string::npos)
        << "message lacks '" << expanded << "': " << st.ToString();
  }
  EXPECT_EQ(Snapshot(dir.path()), before) << "opening wrote into the directory";
}

INSTANTIATE_TEST_SUITE_P(Corpus, BadInput, ::testing::ValuesIn(corpus::BadInputCases()),
                         [](const ::testing::TestParamInfo<BadInputCase>& p) { return p.param.name; });

// The cases that are one safetensors file opened by its path.
std::vector<BadInputCase> SingleFileCases() {
  std::vector<BadInputCase> out;
  for (auto& c : corpus::BadInputCases()) {
    if (c.open == "model.safetensors" && c.files.size() == 1 && c.files.count("model.safetensors")) {
      out.push_back(std::move(c));
    }
  }
  return out;
}

class BadSingleFile : public ::testing::TestWithParam<BadInputCase> {};

// The header parser on its own (in memory, no file): same code, and the tensor named.
TEST_P(BadSingleFile, ParseHeaderInMemoryAgrees) {
  const BadInputCase& c = GetParam();
  const std::string& bytes = c.files.at("model.safetensors");
  auto h = ParseSafetensorsHeader({reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()}, bytes.size());
  ASSERT_FALSE(h.ok()) << c.name;
  EXPECT_EQ(h.status().code(), c.code) << h.status().ToString();
  for (const auto& want : c.message_contains) {
    if (want.find("{root}") != std::string::npos) continue;  // the caller adds the path
    EXPECT_NE(h.status().message().find(want), std::string::npos) << want << " / " << h.status().ToString();
  }
}

// SafetensorsFile::Open on the same bytes: the same code, the message starting with the path.
TEST_P(BadSingleFile, SafetensorsFileOpenNamesThePath) {
  const BadInputCase& c = GetParam();
  TempDir dir;
  ASSERT_TRUE(corpus::WriteCase(c, dir.path()).ok());
  auto f = SafetensorsFile::Open(dir.path() / "model.safetensors");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), c.code);
  EXPECT_EQ(f.status().message().rfind((dir.path() / "model.safetensors").string() + ": ", 0), 0u)
      << "message does not start with the path: " << f.status().message();
}

INSTANTIATE_TEST_SUITE_P(Corpus, BadSingleFile, ::testing::ValuesIn(SingleFileCases()),
                         [](const ::testing::TestParamInfo<BadInputCase>& p) { return p.param.name; });

TEST(BadInputCorpus, NamesAreUniqueAndCoverTheBrief) {
  std::set<std::string> names;
  for (const auto& c : corpus::BadInputCases()) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate case " << c.name;
    EXPECT_FALSE(c.message_contains.empty()) << c.name;
    for (char ch : c.name)
      EXPECT_TRUE(std::islower(static_cast<unsigned char>(ch)) || std::isdigit(ch) || ch == '_') << c.name;
  }
  for (const char* must : {"empty_file",
                           "seven_bytes",
                           "header_past_end",
                           "header_over_limit",
                           "header_length_max_u64",
                           "header_not_json",
                           "header_not_brace",
                           "header_json_array",
                           "header_invalid_utf8_name",
                           "overlapping_offsets",
                           "gap_between_tensors",
                           "trailing_bytes",
                           "truncated_data",
                           "shape_overflow_int64max_x2",
                           "shape_overflow_2p32_cubed",
                           "negative_dim",
                           "float_dim",
                           "dtype_size_mismatch",
                           "unknown_dtype_f7",
                           "duplicate_tensor_name",
                           "offsets_end_before_begin",
                           "offsets_near_u64_max",
                           "missing_dtype",
                           "extra_unknown_field",
                           "metadata_non_string",
                           "index_missing_shard",
                           "index_tensor_not_in_shard",
                           "shard_tensor_not_indexed",
                           "index_not_json",
                           "index_path_traversal",
                           "same_tensor_in_two_shards",
                           "missing_path",
                           "directory_without_weights",
                           "directory_two_files_no_index"}) {
    EXPECT_TRUE(names.count(must)) << "corpus lacks " << must;
  }
}

TEST(BadInputCorpus, WriteCorpusLaysOutEveryCase) {
  TempDir dir;
  ASSERT_TRUE(corpus::WriteCorpus(dir.path() / "corpus").ok());
  for (const auto& c : corpus::BadInputCases()) {
    const fs::path root = dir.path() / "corpus" / c.name;
    ASSERT_TRUE(fs::is_directory(root)) << root;
    for (const auto& [rel, bytes] : c.files) {
      std::ifstream in(root / rel, std::ios::binary);
      std::stringstream ss;
      ss << in.rdbuf();
      EXPECT_EQ(ss.str(), bytes) << root / rel;
    }
  }
}

// The header-length prefix is checked for every value around the limits without
// building a 100 MB file: only the first 8 + N bytes matter.
TEST(BadInputCorpus, HeaderLengthBoundaries) {
  const std::string body = "{}";
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{3}, kMaxSafetensorsHeaderBytes, kMaxSafetensorsHeaderBytes + 1,
                     std::numeric_limits<uint64_t>::max() - 8, std::numeric_limits<uint64_t>::max() - 7,
                     std::numeric_limits<uint64_t>::max()}) {
    const std::string file = corpus::Le64(n) + body;
    auto h = ParseSafetensorsHeader({reinterpret_cast<const std::byte*>(file.data()), file.size()}, file.size());
    ASSERT_FALSE(h.ok()) << n;
    EXPECT_EQ(h.status().code(), StatusCode::kCorruption) << n;
  }
  // N = 2 exactly fits and describes an empty checkpoint.
  const std::string ok = corpus::Le64(2) + body;
  auto h = ParseSafetensorsHeader({reinterpret_cast<const std::byte*>(ok.data()), ok.size()}, ok.size());
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(h->tensors.empty());
  EXPECT_EQ(h->data_offset, 10u);
}

}  // namespace
}  // namespace ferry
