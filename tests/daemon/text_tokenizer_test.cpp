// ferry_text against the `tokenizers` and `transformers` packages, through the fixtures
// fixtures/tokenizers/generate.py made with them; plus the API's errors and properties.
#include "daemon/text/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/text/unicode.h"
#include "tests/daemon/text_test_util.h"
#include "tests/temp_dir.h"

namespace ferry::text {
namespace {

using testing::Corpus;
using testing::LoadFixture;
using testing::Printable;
using testing::ReadJsonLines;
using testing::TokenizerFixtures;

const char* const kFixtureTokenizers[] = {
    "gpt2",          "qwen2",          "llama3-style",   "qwen2-style", "llama2-legacy", "llama2-metaspace",
    "mistral-style", "edge-bytelevel", "edge-metaspace", "edge-regex"};

std::vector<int32_t> Ids(const nlohmann::json& j) { return j.get<std::vector<int32_t>>(); }

void WriteFile(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class FixtureTest : public ::testing::TestWithParam<const char*> {};

// Encode (with and without special tokens) and Decode (with and without skipping special
// tokens) of every corpus string, as the package gave them.
TEST_P(FixtureTest, CorpusMatchesTokenizersPackage) {
  const Tokenizer tok = LoadFixture(GetParam());
  const auto corpus = Corpus();
  const auto expected = ReadJsonLines(TokenizerFixtures() / "expected" / (std::string(GetParam()) + ".jsonl"));
  ASSERT_EQ(expected.size(), corpus.size());
  ASSERT_GT(corpus.size(), 300u);
  int mismatches = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const auto& want = expected[i];
    auto ids = tok.Encode(corpus[i]);
    auto ids_special = tok.Encode(corpus[i], {.add_special_tokens = true});
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    ASSERT_TRUE(ids_special.ok()) << ids_special.status().ToString();
    auto decoded = tok.Decode(*ids_special);
    auto decoded_skip = tok.Decode(*ids_special, {.skip_special_tokens = true});
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    ASSERT_TRUE(decoded_skip.ok()) << decoded_skip.status().ToString();
    const bool same = *ids == Ids(want["ids"]) && *ids_special == Ids(want["ids_special"]) &&
                      *decoded == want["decoded"].get<std::string>() &&
                      *decoded_skip == want["decoded_skip"].get<std::string>();
    if (!same && ++mismatches <= 5) {
      ADD_FAILURE() << GetParam() << " corpus[" << i << "] " << Printable(corpus[i]) << "\n want " << want.dump()
                    << "\n got ids " << nlohmann::json(*ids).dump() << " special "
                    << nlohmann::json(*ids_special).dump() << " decoded " << Printable(*decoded);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// Decode of random id sequences (partial UTF-8 in byte tokens, specials, byte-fallback runs).
TEST_P(FixtureTest, RandomIdSequencesDecodeAsTokenizersPackage) {
  const Tokenizer tok = LoadFixture(GetParam());
  const auto rows = ReadJsonLines(TokenizerFixtures() / "expected" / (std::string(GetParam()) + ".decode.jsonl"));
  ASSERT_GT(rows.size(), 100u);
  for (const auto& row : rows) {
    const auto ids = Ids(row["ids"]);
    auto decoded = tok.Decode(ids);
    auto decoded_skip = tok.Decode(ids, {.skip_special_tokens = true});
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    ASSERT_TRUE(decoded_skip.ok()) << decoded_skip.status().ToString();
    EXPECT_EQ(*decoded, row["decoded"].get<std::string>()) << row["ids"].dump();
    EXPECT_EQ(*decoded_skip, row["decoded_skip"].get<std::string>()) << row["ids"].dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, FixtureTest, ::testing::ValuesIn(kFixtureTokenizers), [](const auto& param_info) {
  std::string n = param_info.param;
  for (char& c : n) c = c == '-' ? '_' : c;
  return n;
});

// transformers' own encodings of llama.cpp's test strings for GPT-2 and Qwen1.5 (the .inp/.out
// pairs of the GGUF vocabularies, produced by AutoTokenizer.encode(text, add_special_tokens=False)).
TEST(TokenizerTest, RealVocabulariesMatchTransformersReferenceEncodings) {
  for (const char* name : {"gpt2", "qwen2"}) {
    const Tokenizer tok = LoadFixture(name);
    const auto rows = ReadJsonLines(TokenizerFixtures() / "expected" / (std::string(name) + ".gguf.jsonl"));
    ASSERT_EQ(rows.size(), 46u) << name;
    for (const auto& row : rows) {
      auto ids = tok.Encode(row["text"].get<std::string>());
      ASSERT_TRUE(ids.ok()) << ids.status().ToString();
      EXPECT_EQ(*ids, Ids(row["ids"])) << name << " " << row["text"].dump();
    }
  }
}

TEST(TokenizerTest, Gpt2KnownIds) {
  const Tokenizer tok = LoadFixture("gpt2");
  EXPECT_EQ(tok.vocab_size(), 50257);
  auto ids = tok.Encode("Hello world");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(*tok.Decode(*ids), "Hello world");
  EXPECT_EQ(tok.TokenId("<|endoftext|>"), 50256);
  EXPECT_EQ(tok.TokenId("Ġworld"), 995);
  EXPECT_EQ(tok.TokenId("no such token"), std::nullopt);
  EXPECT_EQ(*tok.TokenText(995), "Ġworld");
  EXPECT_TRUE(tok.IsSpecial(50256));
  EXPECT_FALSE(tok.IsSpecial(995));
  EXPECT_FALSE(tok.IsSpecial(-1));
  EXPECT_FALSE(tok.IsSpecial(50257));
  // An added token inside text is one token; skip_special_tokens drops it.
  auto with_eot = tok.Encode("a<|endoftext|>b");
  ASSERT_TRUE(with_eot.ok());
  EXPECT_EQ(with_eot->size(), 3u);
  EXPECT_EQ((*with_eot)[1], 50256);
  EXPECT_EQ(*tok.Decode(*with_eot, {.skip_special_tokens = true}), "ab");
  EXPECT_EQ(*tok.Decode(*with_eot), "a<|endoftext|>b");
}

TEST(TokenizerTest, Qwen2SpecialTokensAndVocabulary) {
  const Tokenizer tok = LoadFixture("qwen2");
  EXPECT_EQ(tok.vocab_size(), 151646);
  EXPECT_EQ(tok.TokenId("<|endoftext|>"), 151643);
  EXPECT_EQ(tok.TokenId("<|im_start|>"), 151644);
  EXPECT_EQ(tok.TokenId("<|im_end|>"), 151645);
  auto ids = tok.Encode("<|im_start|>user\nHi<|im_end|>");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->front(), 151644);
  EXPECT_EQ(ids->back(), 151645);
  // Byte-level tokenizers without a normalizer-changing input round-trip exactly.
  for (const auto& text : Corpus()) {
    auto e = tok.Encode(text);
    ASSERT_TRUE(e.ok());
    if (*NormalizeNfc(text) == text) {
      EXPECT_EQ(*tok.Decode(*e), text) << Printable(text);
    }
  }
}

TEST(TokenizerTest, Llama3StyleAddsBeginOfTextOnlyWithSpecialTokens) {
  const Tokenizer tok = LoadFixture("llama3-style");
  const auto bos = tok.TokenId("<|begin_of_text|>");
  ASSERT_TRUE(bos.has_value());
  auto plain = tok.Encode("hello");
  auto special = tok.Encode("hello", {.add_special_tokens = true});
  ASSERT_TRUE(plain.ok() && special.ok());
  ASSERT_EQ(special->size(), plain->size() + 1);
  EXPECT_EQ(special->front(), *bos);
  auto empty = tok.Encode("", {.add_special_tokens = true});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, std::vector<int32_t>{*bos});
}

TEST(TokenizerTest, InvalidUtf8IsRefusedNamingTheByteOffset) {
  const Tokenizer tok = LoadFixture("qwen2-style");
  const struct {
    std::string text;
    size_t offset;
  } cases[] = {
      {"abc\xff", 3},    // never a UTF-8 byte
      {"ab\x80", 2},     // a lone continuation byte
      {"x\xe4\xbd", 1},  // cut short by the end
      {"\xe4\xbd"
       "a",
       0},                              // cut short by an ASCII byte
      {"ok \xc0\xaf", 3},               // overlong '/'
      {"\xed\xa0\x80", 0},              // a UTF-16 surrogate
      {"12\xf4\x90\x80\x80", 2},        // above U+10FFFF
      {"\xe2\x82\xac\xf0\x9f\x98", 3},  // valid euro sign, then a cut emoji
  };
  for (const auto& c : cases) {
    auto ids = tok.Encode(c.text);
    ASSERT_FALSE(ids.ok()) << Printable(c.text);
    EXPECT_EQ(ids.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(ids.status().message(), "text is not valid UTF-8 at byte " + std::to_string(c.offset));
  }
  // U+10FFFF and the last code points before and after the surrogates are valid.
  EXPECT_TRUE(tok.Encode("\xf4\x8f\xbf\xbf \xed\x9f\xbf \xee\x80\x80").ok());
}

TEST(TokenizerTest, DecodeRefusesIdsOutsideTheVocabulary) {
  const Tokenizer tok = LoadFixture("llama2-legacy");
  const int32_t n = tok.vocab_size();
  for (const int32_t bad : {-1, n, n + 1000}) {
    const std::vector<int32_t> ids = {5, bad, 6};
    auto text = tok.Decode(ids);
    ASSERT_FALSE(text.ok());
    EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(text.status().message().find("token id " + std::to_string(bad) + " is not in the vocabulary"),
              std::string::npos)
        << text.status().message();
    EXPECT_EQ(tok.TokenBytes(bad).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(tok.TokenText(bad).status().code(), StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(*tok.Decode(std::vector<int32_t>{}), "");
}

// TokenBytes as documented: for byte-level tokenizers Decode is the lossy UTF-8 of the
// concatenation; for Llama-2-style ones it is the concatenation less one leading space
// whenever the concatenation is valid UTF-8.
TEST(TokenizerTest, TokenBytesConcatenateToDecode) {
  for (const char* name : {"gpt2", "qwen2", "llama3-style", "edge-bytelevel"}) {
    const Tokenizer tok = LoadFixture(name);
    for (const auto& row : ReadJsonLines(TokenizerFixtures() / "expected" / (std::string(name) + ".decode.jsonl"))) {
      std::string concat;
      for (const int32_t id : Ids(row["ids"])) concat += *tok.TokenBytes(id);
      EXPECT_EQ(Utf8Lossy(concat), row["decoded"].get<std::string>()) << name << " " << row["ids"].dump();
    }
  }
  for (const char* name : {"llama2-legacy", "llama2-metaspace"}) {
    const Tokenizer tok = LoadFixture(name);
    int checked = 0;
    for (const auto& row : ReadJsonLines(TokenizerFixtures() / "expected" / (std::string(name) + ".jsonl"))) {
      std::string concat;
      for (const int32_t id : Ids(row["ids_special"])) concat += *tok.TokenBytes(id);
      if (FirstInvalidUtf8(concat)) continue;
      if (!concat.empty() && concat[0] == ' ') concat.erase(0, 1);
      EXPECT_EQ(concat, row["decoded"].get<std::string>()) << name << " " << row["ids_special"].dump();
      ++checked;
    }
    EXPECT_GT(checked, 300) << name;
  }
  const Tokenizer spm = LoadFixture("llama2-legacy");
  EXPECT_EQ(*spm.TokenBytes(*spm.TokenId("<0x41>")), "A");
  EXPECT_EQ(*spm.TokenBytes(*spm.TokenId("<0xE4>")), "\xE4");
  EXPECT_EQ(*spm.TokenBytes(*spm.TokenId("▁")), " ");
  EXPECT_EQ(*spm.TokenBytes(*spm.TokenId("</s>")), "</s>");
  const Tokenizer gpt2 = LoadFixture("gpt2");
  EXPECT_EQ(*gpt2.TokenBytes(995), " world");
  EXPECT_EQ(*gpt2.TokenBytes(*gpt2.TokenId("Ċ")), "\n");
}

// A fixture directory as transformers' AutoTokenizer.from_pretrained loaded it: <name>/ itself,
// or <name>/tokenizer.json beside the files of <name>/variants/<variant>/ (generate.py's
// DIR_VARIANTS).
struct DirectoryFixture {
  const char* name;
  const char* variant;  // nullptr: <name>/ itself
};

const DirectoryFixture kDirectoryFixtures[] = {
    {"llama3-style", nullptr},                // TokenizersBackend
    {"qwen2-style", nullptr},                 // TokenizersBackend
    {"llama2-legacy", nullptr},               // LlamaTokenizer, legacy false: Metaspace "first"
    {"llama2-legacy", "legacy"},              // LlamaTokenizerFast, legacy true: Metaspace "always"
    {"llama2-legacy", "no-prefix-space"},     // add_prefix_space false: "never", no Strip decoder
    {"llama2-legacy", "model-config-class"},  // LlamaTokenizer named by config.json only
    {"llama2-legacy", "mistral"},             // model_type mistral: TokenizersBackend, the file's normalizer
    {"llama2-legacy", "tokenizers-backend"},  // TokenizersBackend named: the file's normalizer
    {"llama2-legacy", "class-defaults"},      // no named tokens: LlamaTokenizer's own
    {"llama3-style", "llama-class"},          // LlamaTokenizerFast on a byte-level file: TokenizersBackend
    {"qwen2-style", "added-tokens"},          // tokenizer_config.json's added and special tokens
    {"qwen2-style", "named-extras"},          // extra_special_tokens as transformers 5's object
    {"qwen2-style", "legacy-map"},            // special_tokens_map.json over a config of before 4.34
};

std::string DirectoryFixtureName(const DirectoryFixture& f) {
  return f.variant == nullptr ? f.name : std::string(f.name) + "." + f.variant;
}

void PrintTo(const DirectoryFixture& f, std::ostream* os) { *os << DirectoryFixtureName(f); }

// The directory of `f`, assembled under `tmp` for a variant.
std::filesystem::path DirectoryFixturePath(const DirectoryFixture& f, const std::filesystem::path& tmp) {
  if (f.variant == nullptr) return TokenizerFixtures() / f.name;
  std::filesystem::copy(TokenizerFixtures() / f.name / "variants" / f.variant, tmp);
  std::filesystem::copy_file(TokenizerFixtures() / f.name / "tokenizer.json", tmp / "tokenizer.json");
  return tmp;
}

class DirectoryTest : public ::testing::TestWithParam<DirectoryFixture> {};

// FromDirectory against AutoTokenizer.from_pretrained(dir) of transformers 5.23.0 on every corpus
// string: encode with and without special tokens, decode with and without skipping them. On
// the Llama-2 directories transformers builds LlamaTokenizer, which replaces the file's legacy
// normalizer by Metaspace: leading spaces, space runs and text after <s> / </s> tokenize
// differently from the tokenizers package, and ferry follows transformers.
// A LlamaTokenizer directory that names no special tokens has the class's own (transformers'
// LlamaTokenizer.__init__: unk_token "<unk>", bos_token "<s>", eos_token "</s>").
TEST(DirectoryClassDefaultsTest, LlamaTokenizersOwnSpecialTokensStandInForMissingOnes) {
  ferry::testing::ScopedTempDir tmp("ferry_text_");
  auto tok = Tokenizer::FromDirectory(DirectoryFixturePath({"llama2-legacy", "class-defaults"}, tmp.path()));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  ASSERT_TRUE(tok->TokenId("</s>").has_value());
  EXPECT_EQ(tok->bos_id(), tok->TokenId("<s>"));
  EXPECT_EQ(tok->eos_id(), tok->TokenId("</s>"));
  EXPECT_FALSE(tok->pad_id().has_value());
}

TEST_P(DirectoryTest, CorpusMatchesTransformersAutoTokenizer) {
  const DirectoryFixture& f = GetParam();
  const std::string name = DirectoryFixtureName(f);
  ferry::testing::ScopedTempDir tmp("ferry_text_");
  auto tok = Tokenizer::FromDirectory(DirectoryFixturePath(f, tmp.path()));
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  const auto corpus = Corpus();
  const auto rows = ReadJsonLines(TokenizerFixtures() / "expected" / (name + ".dir.jsonl"));
  ASSERT_EQ(rows.size(), corpus.size());
  int mismatches = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const auto& want = rows[i];
    auto ids = tok->Encode(corpus[i]);
    auto ids_special = tok->Encode(corpus[i], {.add_special_tokens = true});
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    ASSERT_TRUE(ids_special.ok()) << ids_special.status().ToString();
    auto decoded = tok->Decode(*ids_special);
    auto decoded_skip = tok->Decode(*ids_special, {.skip_special_tokens = true});
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    ASSERT_TRUE(decoded_skip.ok()) << decoded_skip.status().ToString();
    const bool same = *ids == Ids(want["ids"]) && *ids_special == Ids(want["ids_special"]) &&
                      *decoded == want["decoded"].get<std::string>() &&
                      *decoded_skip == want["decoded_skip"].get<std::string>();
    if (!same && ++mismatches <= 5) {
      ADD_FAILURE() << name << " corpus[" << i << "] " << Printable(corpus[i]) << "\n want " << want.dump()
                    << "\n got ids " << nlohmann::json(*ids).dump() << " special "
                    << nlohmann::json(*ids_special).dump() << " decoded " << Printable(*decoded);
    }
  }
  EXPECT_EQ(mismatches, 0) << name;
}

INSTANTIATE_TEST_SUITE_P(Directories, DirectoryTest, ::testing::ValuesIn(kDirectoryFixtures),
                         [](const auto& param_info) {
                           std::string n = DirectoryFixtureName(param_info.param);
                           for (char& c : n) c = (c == '-' || c == '.') ? '_' : c;
                           return n;
                         });

// The Llama-2 fixture directory exercises what LlamaTokenizer changes: corpus strings where
// transformers' ids differ from the tokenizers package's on the same tokenizer.json, among them
// a leading space, a run of spaces and text right after <s> or </s>. FromFile keeps the package's.
TEST(TokenizerTest, LlamaTokenizerDirectoryDiffersFromTheFileWhereTransformersDoes) {
  const auto corpus = Corpus();
  const auto package = ReadJsonLines(TokenizerFixtures() / "expected" / "llama2-legacy.jsonl");
  const auto transformers = ReadJsonLines(TokenizerFixtures() / "expected" / "llama2-legacy.dir.jsonl");
  const Tokenizer file = LoadFixture("llama2-legacy");
  auto dir = Tokenizer::FromDirectory(TokenizerFixtures() / "llama2-legacy");
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  ASSERT_EQ(package.size(), corpus.size());
  ASSERT_EQ(transformers.size(), corpus.size());
  int differ = 0, leading_space = 0, space_run = 0, after_special = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string& text = corpus[i];
    const auto want_package = Ids(package[i]["ids_special"]);
    const auto want_transformers = Ids(transformers[i]["ids_special"]);
    EXPECT_EQ(*file.Encode(text, {.add_special_tokens = true}), want_package) << Printable(text);
    EXPECT_EQ(*dir->Encode(text, {.add_special_tokens = true}), want_transformers) << Printable(text);
    if (want_package == want_transformers) continue;
    ++differ;
    if (text.front() == ' ') ++leading_space;
    if (text.find("  ") != std::string::npos) ++space_run;
    for (const char* special : {"<s>", "</s>"}) {
      const size_t at = text.find(special);
      if (at != std::string::npos && at + std::strlen(special) < text.size()) ++after_special;
    }
  }
  EXPECT_GT(differ, 40);
  EXPECT_GT(leading_space, 5);
  EXPECT_GT(space_run, 5);
  EXPECT_GT(after_special, 3);
}

// AutoTokenizer's choice of class, beyond the fixture directories (each expectation checked
// against transformers 5.23.0): tokenizer_config.json values are Python truth values, an
// auto_map for AutoTokenizer skips the model-type and byte-level overrides, and a model type
// registered to LlamaTokenizer gets it with no class named. Each case encodes as the fixture
// directory whose class and settings it shares.
TEST(TokenizerTest, AutoTokenizerClassRules) {
  const auto corpus = Corpus();
  const struct {
    const char* tokenizer_config;
    const char* model_config;  // nullptr: no config.json
    const char* same_as;       // the .dir.jsonl it must reproduce
  } cases[] = {
      {R"({"tokenizer_class": "LlamaTokenizer", "legacy": "false"})", nullptr, "llama2-legacy.legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "legacy": [0]})", nullptr, "llama2-legacy.legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "legacy": 0})", nullptr, "llama2-legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "legacy": null})", nullptr, "llama2-legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "add_prefix_space": ""})", nullptr, "llama2-legacy.no-prefix-space"},
      {R"({"tokenizer_class": "LlamaTokenizer", "add_prefix_space": null})", nullptr, "llama2-legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "legacy": true, "add_prefix_space": false})", nullptr,
       "llama2-legacy.no-prefix-space"},
      {R"({"tokenizer_class": "LlamaTokenizer", "auto_map": {"AutoTokenizer": [null, "x.Y"]}})",
       R"({"model_type": "mistral"})", "llama2-legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "auto_map": ["x.Y", null]})", R"({"model_type": "mistral"})",
       "llama2-legacy"},
      {R"({"tokenizer_class": "LlamaTokenizer", "auto_map": {"AutoTokenizer": null}})", R"({"model_type": "mistral"})",
       "llama2-legacy.mistral"},
      {R"({"tokenizer_class": "LlamaTokenizer"})", R"({"model_type": "phi3"})", "llama2-legacy.mistral"},
      {R"({"tokenizer_class": "LlamaTokenizer"})", R"({"model_type": "no_such_model"})", "llama2-legacy"},
      {R"({"tokenizer_class": null})", R"({"model_type": "llama", "tokenizer_class": "LlamaTokenizerFast"})",
       "llama2-legacy"},
      {R"({})", R"({"model_type": "idefics"})", "llama2-legacy"},
      {R"({})", R"({"model_type": "llama"})", "llama2-legacy.mistral"},
  };
  for (const auto& c : cases) {
    ferry::testing::ScopedTempDir tmp("ferry_text_");
    std::filesystem::copy_file(TokenizerFixtures() / "llama2-legacy" / "tokenizer.json", tmp.path() / "tokenizer.json");
    WriteFile(tmp.path() / "tokenizer_config.json", c.tokenizer_config);
    if (c.model_config != nullptr) WriteFile(tmp.path() / "config.json", c.model_config);
    auto tok = Tokenizer::FromDirectory(tmp.path());
    ASSERT_TRUE(tok.ok()) << c.tokenizer_config << ": " << tok.status().ToString();
    const auto rows = ReadJsonLines(TokenizerFixtures() / "expected" / (std::string(c.same_as) + ".dir.jsonl"));
    ASSERT_EQ(rows.size(), corpus.size());
    int mismatches = 0;
    for (size_t i = 0; i < corpus.size(); ++i) {
      auto ids = tok->Encode(corpus[i], {.add_special_tokens = true});
      ASSERT_TRUE(ids.ok()) << ids.status().ToString();
      auto decoded = tok->Decode(*ids);
      ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
      if (*ids != Ids(rows[i]["ids_special"]) || *decoded != rows[i]["decoded"].get<std::string>()) ++mismatches;
    }
    EXPECT_EQ(mismatches, 0) << c.tokenizer_config << " " << (c.model_config ? c.model_config : "") << " should be "
                             << c.same_as;
  }
}

// A tokenizer.json alone keeps following the tokenizers package, whatever lies beside it.
TEST(TokenizerTest, FromFileIgnoresTheDirectory) {
  const auto corpus = Corpus();
  const auto package = ReadJsonLines(TokenizerFixtures() / "expected" / "llama2-legacy.jsonl");
  auto tok = Tokenizer::FromFile(TokenizerFixtures() / "llama2-legacy" / "tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  for (size_t i = 0; i < corpus.size(); ++i) {
    EXPECT_EQ(*tok->Encode(corpus[i]), Ids(package[i]["ids"])) << Printable(corpus[i]);
  }
}

TEST(TokenizerTest, DirectoryAppliesTokenizerConfigSpecialTokens) {
  auto llama3 = Tokenizer::FromDirectory(TokenizerFixtures() / "llama3-style");
  ASSERT_TRUE(llama3.ok());
  EXPECT_EQ(llama3->bos_id(), llama3->TokenId("<|begin_of_text|>"));
  EXPECT_EQ(llama3->eos_id(), llama3->TokenId("<|eot_id|>"));
  EXPECT_EQ(llama3->pad_id(), std::nullopt);
  EXPECT_NE(llama3->chat_template().find("<|start_header_id|>"), std::string::npos);
  auto qwen = Tokenizer::FromDirectory(TokenizerFixtures() / "qwen2-style");
  ASSERT_TRUE(qwen.ok());
  EXPECT_EQ(qwen->bos_id(), std::nullopt);
  EXPECT_EQ(qwen->eos_id(), qwen->TokenId("<|im_end|>"));
  EXPECT_EQ(qwen->pad_id(), qwen->TokenId("<|endoftext|>"));
  // A tokenizer.json alone has no bos/eos/pad.
  const Tokenizer file_only = LoadFixture("qwen2-style");
  EXPECT_EQ(file_only.eos_id(), std::nullopt);
  EXPECT_EQ(file_only.chat_template(), "");
}

TEST(TokenizerTest, MissingFilesAreNotFoundNamingThePath) {
  ferry::testing::ScopedTempDir dir("ferry_text_");
  auto file = Tokenizer::FromFile(dir.path() / "tokenizer.json");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(file.status().message(), (dir.path() / "tokenizer.json").string() + ": no such file");
  auto d = Tokenizer::FromDirectory(dir.path());
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
}

TEST(TokenizerTest, BadTokenizerConfigNamesFileAndField) {
  ferry::testing::ScopedTempDir dir("ferry_text_");
  WriteFile(dir.path() / "tokenizer.json", ReadFile(TokenizerFixtures() / "qwen2-style" / "tokenizer.json"));
  const auto config = dir.path() / "tokenizer_config.json";
  const struct {
    std::string json;
    StatusCode code;
    std::string needle;
  } cases[] = {
      {R"({"pad_token": 7})", StatusCode::kCorruption, ": pad_token must be a string, {\"content\": ...} or null"},
      {R"({"eos_token": {"content": ""}})", StatusCode::kCorruption, ": eos_token.content is empty"},
      {R"({"added_tokens_decoder": []})", StatusCode::kCorruption,
       ": added_tokens_decoder must be an object, not array"},
      {R"({"added_tokens_decoder": {"x1": {"content": "a"}}})", StatusCode::kCorruption,
       ": added_tokens_decoder.\"x1\" is not a token id"},
      {R"({"added_tokens_decoder": {"-1": {"content": "a"}}})", StatusCode::kCorruption,
       ": added_tokens_decoder.\"-1\" is not a token id"},
      {R"({"added_tokens_decoder": {"5": {"content": "a", "lstrip": 1}}})", StatusCode::kCorruption,
       ": added_tokens_decoder.\"5\".lstrip must be true or false"},
      {R"({"added_tokens_decoder": {"5": "<a>"}})", StatusCode::kCorruption,
       ": added_tokens_decoder.\"5\" must be an object, not string"},
      {R"({"extra_special_tokens": 3})", StatusCode::kCorruption, ": extra_special_tokens must be a list, not number"},
      {R"({"extra_special_tokens": {"image_token": 3}})", StatusCode::kCorruption,
       ": extra_special_tokens.image_token must be a string, {\"content\": ...} or null, not number"},
      {R"({"additional_special_tokens": [{"content": 1}]})", StatusCode::kCorruption,
       ": additional_special_tokens[0].content must be a string, not number"},
      {R"({"add_bos_token": "yes"})", StatusCode::kCorruption, ": add_bos_token must be true or false"},
      {R"({"chat_template": 3})", StatusCode::kCorruption, ": chat_template must be a string or a list"},
      {R"({"tokenizer_class": 3})", StatusCode::kCorruption, ": tokenizer_class must be a string, not number"},
      {R"({"auto_map": "x.Y"})", StatusCode::kCorruption, ": auto_map must be an object or a list, not string"},
      {R"([1, 2])", StatusCode::kCorruption, ": must be a JSON object"},
      {R"({"bos_token": )", StatusCode::kCorruption, ": not valid JSON"},
  };
  for (const auto& c : cases) {
    WriteFile(config, c.json);
    auto tok = Tokenizer::FromDirectory(dir.path());
    ASSERT_FALSE(tok.ok()) << c.json;
    EXPECT_EQ(tok.status().code(), c.code) << tok.status().ToString();
    EXPECT_EQ(tok.status().message().rfind(config.string() + ":", 0), 0u) << tok.status().message();
    EXPECT_NE(tok.status().message().find(c.needle), std::string::npos) << tok.status().message();
  }
  // A special token tokenizer.json lacks is added, as transformers adds it (the corpus
  // comparison of the qwen2-style.added-tokens directory checks the rest against transformers).
  WriteFile(config, R"({"bos_token": "<nope>", "eos_token": {"content": "<|im_end|>"}})");
  {
    auto added = Tokenizer::FromDirectory(dir.path());
    ASSERT_TRUE(added.ok()) << added.status().ToString();
    const std::optional<int32_t> id = added->TokenId("<nope>");
    ASSERT_TRUE(id.has_value());
    EXPECT_EQ(*id, 914);  // after the file's 909 model tokens and 5 added ones
    EXPECT_EQ(added->bos_id(), id);
    auto ids = added->Encode("a<nope>b");
    ASSERT_TRUE(ids.ok()) << ids.status().ToString();
    EXPECT_EQ(std::count(ids->begin(), ids->end(), *id), 1) << ::testing::PrintToString(*ids);
    auto text = added->Decode(*ids, {.skip_special_tokens = true});
    ASSERT_TRUE(text.ok());
    EXPECT_EQ(*text, "ab");
  }
  WriteFile(config, R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
                        "bos_token": null, "eos_token": {"content": "<|im_end|>", "lstrip": false}})");
  auto tok = Tokenizer::FromDirectory(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ(tok->chat_template(), "D");
  EXPECT_EQ(tok->eos_id(), tok->TokenId("<|im_end|>"));
  // config.json is read for model_type and tokenizer_class.
  const auto model_config = dir.path() / "config.json";
  for (const char* bad : {R"({"model_type": 5})", R"({"tokenizer_class": ["LlamaTokenizer"]})", "{", "[]"}) {
    WriteFile(model_config, bad);
    auto t = Tokenizer::FromDirectory(dir.path());
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_EQ(t.status().code(), StatusCode::kCorruption) << t.status().ToString();
    EXPECT_EQ(t.status().message().rfind(model_config.string() + ": ", 0), 0u) << t.status().message();
  }
}

TEST(TokenizerTest, OversizedFileIsRefusedBeforeReading) {
  ferry::testing::ScopedTempDir dir("ferry_text_");
  const auto path = dir.path() / "tokenizer.json";
  WriteFile(path, "{}");
  std::filesystem::resize_file(path, kMaxTokenizerJsonBytes + 1);  // sparse: no disk used
  auto tok = Tokenizer::FromFile(path);
  ASSERT_FALSE(tok.ok());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnsupported);
  EXPECT_EQ(tok.status().message(), path.string() + ": " + std::to_string(kMaxTokenizerJsonBytes + 1) +
                                        " bytes is more than the " + std::to_string(kMaxTokenizerJsonBytes) +
                                        " bytes allowed");
}

// One tokenizer shared by threads gives every thread the package's ids.
TEST(TokenizerTest, ConcurrentEncodesAgree) {
  const Tokenizer tok = LoadFixture("qwen2");
  const auto corpus = Corpus();
  const auto expected = ReadJsonLines(TokenizerFixtures() / "expected" / "qwen2.jsonl");
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 2; ++round) {
        for (size_t i = t; i < corpus.size() + t; ++i) {
          const size_t k = i % corpus.size();
          auto ids = tok.Encode(corpus[k]);
          if (!ids.ok() || *ids != Ids(expected[k]["ids"])) ++mismatches[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

// Pieces of hundreds of kilobytes: the heap merge keeps them near-linear (the quadratic loop
// would take minutes), and the results still round-trip.
TEST(TokenizerTest, LongPiecesEncode) {
  const Tokenizer spm = LoadFixture("llama2-legacy");  // the whole text is one BPE word
  std::string text;
  for (int i = 0; i < 20000; ++i) text += "word" + std::to_string(i % 97) + " ";
  auto ids = spm.Encode(text);
  ASSERT_TRUE(ids.ok());
  EXPECT_GT(ids->size(), 20000u);
  EXPECT_EQ(*spm.Decode(*ids), text);
  const Tokenizer gpt2 = LoadFixture("gpt2");
  const std::string letters(300000, 'x');
  auto x = gpt2.Encode(letters);
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(*gpt2.Decode(*x), letters);
  const std::string spaces(200000, ' ');
  auto s = gpt2.Encode(spaces + "end");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*gpt2.Decode(*s), spaces + "end");
  std::string specials;
  for (int i = 0; i < 20000; ++i) specials += "  <|endoftext|> ";
  auto sp = gpt2.Encode(specials);
  ASSERT_TRUE(sp.ok());
  EXPECT_EQ(*gpt2.Decode(*sp), specials);
}

}  // namespace
}  // namespace ferry::text
