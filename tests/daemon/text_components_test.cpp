// ferry_text on hostile or unsupported tokenizer.json files (one test per refusal, each
// asserting the code and the JSON path named), and the UTF-8 rules it relies on.
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/text/tokenizer.h"
#include "daemon/text/unicode.h"
#include "tests/daemon/text_test_util.h"

namespace ferry::text {
namespace {

using json = nlohmann::json;

constexpr const char* kSrc = "tokenizer.json";

// A small valid byte-level tokenizer: every byte character, "ab" and "abc" merged.
json Base() {
  json vocab = json::object();
  for (const char* t : {"a", "b", "c", "ab", "abc", "Ġ"}) vocab[t] = vocab.size();
  return json{
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array({{{"id", 6}, {"content", "<s>"}, {"special", true}, {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", json::array({"a b", json::array({"ab", "c"})})}}}};
}

Result<Tokenizer> Load(const json& j) { return Tokenizer::FromJson(j.dump(), kSrc); }

// Expects `j` refused with `code` and exactly `message` after "tokenizer.json: ".
void ExpectRefused(const json& j, StatusCode code, const std::string& message) {
  auto t = Load(j);
  ASSERT_FALSE(t.ok()) << j.dump();
  EXPECT_EQ(t.status().code(), code) << t.status().ToString();
  EXPECT_EQ(t.status().message(), std::string(kSrc) + ": " + message);
}

TEST(TokenizerJsonTest, BaseLoadsAndMerges) {
  auto t = Load(Base());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->vocab_size(), 7);
  EXPECT_EQ(*t->Encode("abc"), (std::vector<int32_t>{4}));
  EXPECT_EQ(*t->Encode("ab<s>c"), (std::vector<int32_t>{3, 6, 2}));
  EXPECT_EQ(*t->Encode("ba"), (std::vector<int32_t>{1, 0}));
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{4, 6}), "abc<s>");
  // Characters without a token (and no unk, no byte fallback) are dropped, as upstream.
  EXPECT_EQ(*t->Encode("a?b"), (std::vector<int32_t>{0, 1}));
}

TEST(TokenizerJsonTest, NotJsonOrTooDeep) {
  auto t = Tokenizer::FromJson("{\"model\": ", kSrc);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(t.status().message().rfind("tokenizer.json: not valid JSON (", 0), 0u) << t.status().message();
  auto deep = Tokenizer::FromJson(std::string(100, '[') + std::string(100, ']'), kSrc);
  EXPECT_EQ(deep.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(deep.status().message(), "tokenizer.json: JSON nests deeper than 64");
  auto arr = Tokenizer::FromJson("[]", kSrc);
  EXPECT_EQ(arr.status().message(), "tokenizer.json: must be a JSON object");
  auto bad_utf8 = Tokenizer::FromJson("{\"model\": \"\xff\"}", kSrc);
  EXPECT_EQ(bad_utf8.status().code(), StatusCode::kCorruption);
}

TEST(TokenizerJsonTest, TopLevelFields) {
  json j = Base();
  j.erase("model");
  ExpectRefused(j, StatusCode::kCorruption, "model is missing");
  j = Base();
  j["version"] = "2.0";
  ExpectRefused(j, StatusCode::kUnsupported, "version \"2.0\" is not supported (only \"1.0\")");
  j = Base();
  j["truncation"] = {{"max_length", 8}};
  ExpectRefused(j, StatusCode::kUnsupported,
                "truncation must be null (it changes what encode returns; apply it to the ids instead)");
  j = Base();
  j["padding"] = {{"length", 8}};
  ExpectRefused(j, StatusCode::kUnsupported,
                "padding must be null (it changes what encode returns; apply it to the ids instead)");
}

TEST(TokenizerJsonTest, ModelFields) {
  json j = Base();
  j["model"]["type"] = "WordPiece";
  ExpectRefused(j, StatusCode::kUnsupported, "model.type \"WordPiece\" is not supported (only BPE)");
  j = Base();
  j["model"]["dropout"] = 0.1;
  ExpectRefused(j, StatusCode::kUnsupported,
                "model.dropout 0.1 is not supported (BPE dropout is random; null or 0 only)");
  j = Base();
  j["model"]["dropout"] = 2;
  ExpectRefused(j, StatusCode::kCorruption, "model.dropout 2 is not in [0, 1]");
  j = Base();
  j["model"]["dropout"] = 0.0;
  EXPECT_TRUE(Load(j).ok());
  j = Base();
  j["model"]["continuing_subword_prefix"] = "##";
  ExpectRefused(j, StatusCode::kUnsupported,
                "model.continuing_subword_prefix \"##\" is not supported (null or \"\" only)");
  j = Base();
  j["model"]["end_of_word_suffix"] = "";
  EXPECT_TRUE(Load(j).ok());
  j = Base();
  j["model"]["unk_token"] = "<unk>";
  ExpectRefused(j, StatusCode::kCorruption, "model.unk_token \"<unk>\" is not in model.vocab");
  j = Base();
  j["model"]["byte_fallback"] = "yes";
  ExpectRefused(j, StatusCode::kCorruption, "model.byte_fallback must be true or false, not string");
}

TEST(TokenizerJsonTest, VocabularyMustBeDense) {
  json j = Base();
  j["model"]["vocab"]["abc"] = 9;
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab[\"abc\"] id 9 is outside 0..5 (ids must be dense)");
  j = Base();
  j["model"]["vocab"]["abc"] = 0;
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab[\"abc\"] id 0 is given to two tokens");
  j = Base();
  j["model"]["vocab"]["abc"] = -1;
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab[\"abc\"] must be a non-negative integer, not -1");
  j = Base();
  j["model"]["vocab"]["abc"] = "4";
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab[\"abc\"] must be a non-negative integer, not string");
  j = Base();
  j["model"]["vocab"] = json::array();
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab must be an object, not array");
  j = Base();
  j["model"]["vocab"] = nullptr;
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab must be an object, not null");
  j = Base();
  j["model"].erase("vocab");
  ExpectRefused(j, StatusCode::kCorruption, "model.vocab is missing");
  // model.vocab and model.merges are read from the parser's events, not a DOM: every value
  // type still gets its message.
  for (const auto& [value, shown] : {std::pair{json(1.5), std::string("1.5")},
                                     {json(true), "boolean"},
                                     {json(nullptr), "null"},
                                     {json::array({1}), "array"},
                                     {json::object({{"x", 1}}), "object"}}) {
    j = Base();
    j["model"]["vocab"]["abc"] = value;
    ExpectRefused(j, StatusCode::kCorruption, "model.vocab[\"abc\"] must be a non-negative integer, not " + shown);
  }
}

TEST(TokenizerJsonTest, RepeatedKeysInTheVocabularyAreRefused) {
  // What a JSON object cannot hold: build the text by hand.
  std::string text = Base().dump();
  const std::string from = "\"vocab\":{";
  text.replace(text.find(from), from.size(), from + "\"b\":1,");
  auto t = Tokenizer::FromJson(text, kSrc);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(t.status().message(), "tokenizer.json: model.vocab[\"b\"] id 1 is given to two tokens");
  // A second "model" replaces the first, as in a DOM.
  json second = Base()["model"];
  second["vocab"]["a"] = 1;
  second["vocab"]["b"] = 0;
  text = Base().dump();
  text.insert(text.size() - 1, ",\"model\":" + second.dump());
  auto replaced = Tokenizer::FromJson(text, kSrc);
  ASSERT_TRUE(replaced.ok()) << replaced.status().ToString();
  EXPECT_EQ(replaced->TokenId("a"), 1);
  EXPECT_EQ(*replaced->Encode("abc"), (std::vector<int32_t>{4}));
}

TEST(TokenizerJsonTest, MergesMustNameTokens) {
  json j = Base();
  j["model"]["merges"][0] = "a z";
  ExpectRefused(j, StatusCode::kCorruption, "model.merges[0]: \"z\" is not in the vocabulary");
  j = Base();
  j["model"]["merges"][1] = json::array({"b", "c"});
  ExpectRefused(j, StatusCode::kCorruption, "model.merges[1]: the merged token \"bc\" is not in the vocabulary");
  j = Base();
  j["model"]["merges"][0] = "a  b";
  ExpectRefused(j, StatusCode::kCorruption, "model.merges[0] \"a  b\" is not two tokens separated by one space");
  j = Base();
  j["model"]["merges"][0] = "ab";
  ExpectRefused(j, StatusCode::kCorruption, "model.merges[0] \"ab\" is not two tokens separated by one space");
  j = Base();
  j["model"]["merges"][0] = json::array({"a", "b", "c"});
  ExpectRefused(j, StatusCode::kCorruption, "model.merges[0] must be \"a b\" or [\"a\", \"b\"]");
  j = Base();
  j["model"].erase("merges");
  ExpectRefused(j, StatusCode::kCorruption, "model.merges is missing");
  j = Base();
  j["model"]["merges"] = "a b";
  ExpectRefused(j, StatusCode::kCorruption, "model.merges must be an array, not string");
  for (const json& bad :
       {json(7), json::object(), json::array({"a"}), json::array({"a", 1}), json::array({json::array({"a", "b"})})}) {
    j = Base();
    j["model"]["merges"][1] = bad;
    ExpectRefused(j, StatusCode::kCorruption, "model.merges[1] must be \"a b\" or [\"a\", \"b\"]");
  }
}

TEST(TokenizerJsonTest, UnsupportedComponentsNameTheirPath) {
  json j = Base();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "ByteLevel"}}, {{"type", "Punctuation"}}})}};
  ExpectRefused(j, StatusCode::kUnsupported, "pre_tokenizer.pretokenizers[1].type \"Punctuation\" is not supported");
  j = Base();
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}, {{"type", "Lowercase"}}})}};
  ExpectRefused(j, StatusCode::kUnsupported, "normalizer.normalizers[1].type \"Lowercase\" is not supported");
  j = Base();
  j["decoder"] = {{"type", "WordPiece"}};
  ExpectRefused(j, StatusCode::kUnsupported, "decoder.type \"WordPiece\" is not supported");
  j = Base();
  j["post_processor"] = {{"type", "RobertaProcessing"}};
  ExpectRefused(j, StatusCode::kUnsupported, "post_processor.type \"RobertaProcessing\" is not supported");
  j = Base();
  j["normalizer"] = {{"kind", "NFC"}};
  ExpectRefused(j, StatusCode::kCorruption, "normalizer.type is missing");
}

TEST(TokenizerJsonTest, PatternsAndSplitFields) {
  const auto split = [](json pattern, json behavior) {
    json j = Base();
    j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", false}};
    return j;
  };
  auto bad = Load(split({{"Regex", "(unclosed"}}, "Isolated"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(bad.status().message().rfind("tokenizer.json: pre_tokenizer.pattern.Regex: regex does not compile (", 0),
            0u)
      << bad.status().message();
  ExpectRefused(split({{"Regex", "a"}}, "Bogus"), StatusCode::kCorruption,
                "pre_tokenizer.behavior \"Bogus\" is not a split behavior");
  ExpectRefused(split({{"String", ""}}, "Isolated"), StatusCode::kUnsupported,
                "pre_tokenizer.pattern.String \"\" (an empty pattern) is not supported");
  ExpectRefused(split({{"Glob", "*"}}, "Isolated"), StatusCode::kCorruption,
                "pre_tokenizer.pattern must be {\"String\": ...} or {\"Regex\": ...}");
  ExpectRefused(split({{"Regex", std::string(5000, 'a')}}, "Isolated"), StatusCode::kUnsupported,
                "pre_tokenizer.pattern.Regex is longer than 4096 bytes");
  EXPECT_TRUE(Load(split({{"String", "b"}}, "Removed")).ok());
}

TEST(TokenizerJsonTest, MetaspaceFields) {
  const auto metaspace = [](json fields) {
    json j = Base();
    fields["type"] = "Metaspace";
    j["pre_tokenizer"] = fields;
    return j;
  };
  ExpectRefused(metaspace({{"replacement", "ab"}}), StatusCode::kCorruption,
                "pre_tokenizer.replacement \"ab\" must be exactly one character");
  ExpectRefused(metaspace({{"replacement", "_"}, {"prepend_scheme", "sometimes"}}), StatusCode::kCorruption,
                "pre_tokenizer.prepend_scheme \"sometimes\" is not always, first or never");
  ExpectRefused(metaspace({{"replacement", "_"}, {"add_prefix_space", false}}), StatusCode::kCorruption,
                "pre_tokenizer.add_prefix_space false does not match prepend_scheme \"always\"");
  EXPECT_TRUE(Load(metaspace({{"replacement", "_"}, {"add_prefix_space", false}, {"prepend_scheme", "never"}})).ok());
  json j = metaspace({{"replacement", "▁"}, {"prepend_scheme", "first"}});
  EXPECT_TRUE(Load(j).ok());
  j["normalizer"] = {{"type", "NFC"}};
  ExpectRefused(j, StatusCode::kUnsupported,
                "pre_tokenizer.prepend_scheme \"first\" together with a normalizer is not supported");
}

TEST(TokenizerJsonTest, AddedTokensGetTheIdsTokenizersAssigns) {
  json j = Base();
  j["added_tokens"][0]["id"] = 9;
  ExpectRefused(j, StatusCode::kCorruption, "added_tokens[0].id 9 for \"<s>\" is not the id 6 that tokenizers assigns");
  j = Base();
  j["added_tokens"].push_back({{"id", 7}, {"content", "<s>"}, {"special", true}});
  ExpectRefused(j, StatusCode::kCorruption, "added_tokens[1] \"<s>\" is listed twice (also added_tokens[0])");
  j = Base();
  j["added_tokens"][0]["content"] = "";
  ExpectRefused(j, StatusCode::kCorruption, "added_tokens[0].content is empty");
  j = Base();
  // A token that is in the model keeps the model's id; the next new one gets the next id.
  j["added_tokens"] = json::array({{{"id", 3}, {"content", "ab"}, {"special", true}, {"normalized", false}},
                                   {{"id", 6}, {"content", "<s>"}, {"special", true}, {"normalized", false}}});
  auto t = Load(j);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->vocab_size(), 7);
  EXPECT_TRUE(t->IsSpecial(3));
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{0, 3, 1}, {.skip_special_tokens = true}), "ab");
}

TEST(TokenizerJsonTest, TemplateProcessingFields) {
  const auto with = [](json single, json special_ids) {
    json j = Base();
    j["post_processor"] = {{"type", "TemplateProcessing"},
                           {"single", single},
                           {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", special_ids}, {"tokens", {"<s>"}}}}}}};
    return j;
  };
  const json bos_a =
      json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}});
  auto ok = Load(with(bos_a, {6}));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(*ok->Encode("ab", {.add_special_tokens = true}), (std::vector<int32_t>{6, 3}));
  EXPECT_EQ(*ok->Encode("ab"), (std::vector<int32_t>{3}));
  ExpectRefused(with(bos_a, {7}), StatusCode::kCorruption,
                "post_processor.special_tokens.<s>.ids[0] 7 is not a token id (vocabulary size 7)");
  ExpectRefused(with(json::array({{{"Sequence", {{"id", "B"}, {"type_id", 0}}}}}), {6}), StatusCode::kUnsupported,
                "post_processor.single[0].Sequence.id \"B\" in the single template is not supported");
  ExpectRefused(with(json::array({{{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}), {6}), StatusCode::kCorruption,
                "post_processor.single[0].SpecialToken.id \"</s>\" is not in special_tokens");
}

TEST(TokenizerJsonTest, StripDecoderThatUpstreamPanicsOnIsAnError) {
  json j = Base();
  j["decoder"] = {{"type", "Strip"}, {"content", "a"}, {"start", 0}, {"stop", 2}};
  auto t = Load(j);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{4}), "abc");  // one token per string: "abc", nothing to strip
  auto bad = t->Decode(std::vector<int32_t>{0});          // "a": stripping 2 runs past its start
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

// The maximal-subpart rule of Rust's from_utf8_lossy (Unicode 15, section 3.9, table 3-8).
TEST(Utf8Test, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(Utf8Lossy("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
            "b\xEF\xBF\xBD"
            "c\xEF\xBF\xBD\xEF\xBF\xBD"
            "d");
  EXPECT_EQ(Utf8Lossy("Hello \xF0\x90\x80World"), "Hello \xEF\xBF\xBDWorld");
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: 3 subparts
  EXPECT_EQ(Utf8Lossy("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(Utf8Lossy("ok \xE2\x82\xAC"), "ok \xE2\x82\xAC");
}

TEST(Utf8Test, Nfc) {
  EXPECT_EQ(*NormalizeNfc("Cafe\xCC\x81"), "Caf\xC3\xA9");
  EXPECT_EQ(*NormalizeNfc("plain ascii"), "plain ascii");
  // U+0898 (Unicode 14) is left alone like every character after Unicode 9.0: "e" U+0898
  // U+0323 does not become U+1EB9 U+0898 as Unicode 14 NFC would make it.
  EXPECT_EQ(*NormalizeNfc("e\xE0\xA2\x98\xCC\xA3"), "e\xE0\xA2\x98\xCC\xA3");
}

// IsWordChar on every code point against the `tokenizers` package's \w (the Rust regex crate's,
// which decides single_word), as fixtures/tokenizers/generate.py wrote it.
TEST(UnicodeTest, WordCharactersAreThePackagesOnEveryCodePoint) {
  std::ifstream in(testing::TokenizerFixtures() / "expected" / "word_chars.json");
  const json expected = json::parse(in);
  std::vector<bool> word(0x110000, false);
  for (const auto& r : expected.at("ranges")) {
    for (uint32_t cp = r[0].get<uint32_t>(); cp <= r[1].get<uint32_t>(); ++cp) word[cp] = true;
  }
  int wrong = 0;
  for (uint32_t cp = 0; cp < 0x110000; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;  // surrogates are no characters
    if (IsWordChar(cp) != word[cp] && ++wrong <= 10) {
      ADD_FAILURE() << "U+" << std::hex << cp << ": IsWordChar " << IsWordChar(cp) << ", the package " << word[cp];
    }
  }
  EXPECT_EQ(wrong, 0);
}

// The Rust regex crate's \w, which decides a single_word added token (fixtures/tokenizers'
// random strings compare it with the package's); its Unicode 16.0 is newer than Debian's ICU.
TEST(UnicodeTest, WordCharactersFollowTheTokenizersPackagesUnicode) {
  for (char32_t cp : {U'a', U'Z', U'_', U'7', U'\u00E9', U'\u0301', U'\u0663', U'\u200D', U'\u24B6'}) {
    EXPECT_TRUE(IsWordChar(cp)) << std::hex << static_cast<uint32_t>(cp);
  }
  // Unicode 15.1 and 16.0: CJK extension I, Garay, Todhri, Sunuwar, Garay digits.
  for (char32_t cp : {U'\U0002EBF0', U'\U00010D4A', U'\U000105C0', U'\U00011BC0', U'\U00010D40'}) {
    EXPECT_TRUE(IsWordChar(cp)) << std::hex << static_cast<uint32_t>(cp);
  }
  // Not word characters: punctuation, symbols, spaces, an unassigned code point, Kaktovik
  // numerals (No, not Nd).
  for (char32_t cp : {U' ', U'-', U'<', U'\u00A0', U'\u2028', U'\U0001F600', U'\U0002EE5E', U'\U0001D2C0'}) {
    EXPECT_FALSE(IsWordChar(cp)) << std::hex << static_cast<uint32_t>(cp);
  }
}

}  // namespace
}  // namespace ferry::text
