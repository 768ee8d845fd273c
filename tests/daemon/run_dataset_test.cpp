#include "daemon/run/dataset.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/daemon/run_test_util.h"

namespace ferry::run {
namespace {

using ::ferry::run::testing::ExpectError;
using ::ferry::run::testing::Fixture;
using ::ferry::run::testing::TempDir;
using ::ferry::run::testing::WriteFile;
using Json = nlohmann::json;

constexpr const char* kSrc = "data/train.jsonl";

std::shared_ptr<const Dataset> MustParse(const std::string& text, const DatasetOptions& options = {}) {
  auto ds = Dataset::Parse(text, kSrc, options);
  EXPECT_TRUE(ds.ok()) << ds.status().ToString();
  return ds.ok() ? *ds : nullptr;
}

// Expects `text` refused with `code` and a message starting "data/train.jsonl:LINE: field 'FIELD': ".
void ExpectLineError(const std::string& text, int line, const std::string& field, const std::string& needle,
                     const DatasetOptions& options = {}, StatusCode code = StatusCode::kCorruption) {
  auto ds = Dataset::Parse(text, kSrc, options);
  ASSERT_FALSE(ds.ok()) << text;
  const std::string where = std::string(kSrc) + ":" + std::to_string(line) + ": ";
  ExpectError(ds.status(), code, field.empty() ? where : where + "field '" + field + "': ", needle);
}

std::shared_ptr<const Dataset> Numbers(size_t n) {
  std::string text;
  for (size_t i = 0; i < n; ++i)
    text += "{\"prompt\": \"p" + std::to_string(i) + "\", \"i\": " + std::to_string(i) + "}\n";
  return MustParse(text);
}

TEST(DatasetTest, ReadsThePromptForms) {
  const auto ds = MustParse(
      "{\"prompt\": \"2+2=\", \"answer\": \"4\", \"n\": 4, \"x\": 1.5, \"flag\": true, \"list\": [1]}\n"
      "\n"
      "   \t\n"
      "{\"prompt\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
      "\"Hi\"}]}\r\n"
      "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}, "
      "{\"role\": \"user\", \"content\": \"c\", \"name\": \"ignored\"}], \"answer\": -12}");
  ASSERT_EQ(ds->size(), 3u);
  const Example& a = (*ds)[0];
  EXPECT_EQ(a.index, 0u);
  EXPECT_EQ(a.line, 1u);
  EXPECT_EQ(a.prompt, "2+2=");
  EXPECT_FALSE(a.conversational());
  ASSERT_NE(a.Field("answer"), nullptr);
  EXPECT_EQ(*a.Field("answer"), "4");
  EXPECT_EQ(*a.Field("n"), "4");
  EXPECT_EQ(*a.Field("x"), "1.5");
  EXPECT_EQ(*a.Field("prompt"), "2+2=");
  EXPECT_EQ(a.Field("flag"), nullptr);  // not a string or a number
  EXPECT_EQ(a.Field("list"), nullptr);
  EXPECT_EQ(a.Field("missing"), nullptr);
  EXPECT_EQ(a.json.rfind("{\"prompt\": \"2+2=\"", 0), 0u);
  const Example& b = (*ds)[1];
  EXPECT_EQ(b.line, 4u);  // blank lines count
  EXPECT_TRUE(b.conversational());
  EXPECT_TRUE(b.prompt.empty());
  ASSERT_EQ(b.messages.size(), 2u);
  EXPECT_EQ(b.messages[0].role, "system");
  EXPECT_EQ(b.messages[1].content, "Hi");
  EXPECT_EQ(b.json.back(), '}');  // "\r" stripped
  const Example& c = (*ds)[2];
  EXPECT_EQ(c.line, 5u);
  ASSERT_EQ(c.messages.size(), 3u);
  EXPECT_EQ(c.messages[2].content, "c");
  EXPECT_EQ(*c.Field("answer"), "-12");
}

TEST(DatasetTest, SkipsAByteOrderMark) {
  const auto ds = MustParse("\xEF\xBB\xBF{\"prompt\": \"x\"}\n");
  ASSERT_EQ(ds->size(), 1u);
  EXPECT_EQ((*ds)[0].prompt, "x");
}

TEST(DatasetTest, BadLinesNameFileLineAndField) {
  ExpectLineError("{\"prompt\": \"a\"}\n{\"prompt\": \"b\",}\n", 2, "", "not valid JSON");
  ExpectLineError("[1, 2]\n", 1, "", "not a JSON object (got an array)");
  ExpectLineError("{\"question\": \"a\"}\n", 1, "prompt", "missing");
  ExpectLineError("{\"prompt\": \"a\", \"messages\": []}\n", 1, "messages", "not both");
  ExpectLineError("{\"prompt\": 5}\n", 1, "prompt", "must be a string or a list of messages (got a number)");
  ExpectLineError("{\"prompt\": \"\"}\n", 1, "prompt", "must not be empty");
  ExpectLineError("{\"prompt\": []}\n", 1, "prompt", "empty list");
  ExpectLineError("{\"messages\": \"hi\"}\n", 1, "messages", "must be a list of messages");
  ExpectLineError("{\"prompt\": [\"hi\"]}\n", 1, "prompt[0]", "must be a message");
  ExpectLineError("{\"prompt\": [{\"content\": \"x\"}]}\n", 1, "prompt[0].role", "missing");
  ExpectLineError(
      "{\"prompt\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"tool\", \"content\": \"y\"}]}\n", 1,
      "prompt[1].role", "(got \"tool\")");
  ExpectLineError("{\"prompt\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}\n", 1, "prompt[0].content",
                  "multimodal");
  ExpectLineError("{\"prompt\": [{\"role\": \"user\"}]}\n", 1, "prompt[0].content", "missing");
  ExpectLineError("{\"prompt\": [{\"role\": \"system\", \"content\": \"x\"}]}\n", 1, "prompt",
                  "must end with a user message (it ends with a system message)");
  ExpectLineError("{\"prompt\": \"\xff\"}\n", 1, "", "not valid JSON");  // invalid UTF-8
  ExpectLineError("{\"prompt\": \"a\", \"deep\": " + std::string(40, '[') + std::string(40, ']') + "}\n", 1, "",
                  "nested deeper than 32");
}

// A trailing assistant message (TRL would continue it) is refused, in both forms.
TEST(DatasetTest, TrailingAssistantMessageIsAnError) {
  const std::string msgs =
      "[{\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"}]";
  ExpectLineError("{\"messages\": " + msgs + "}\n", 1, "messages", "ends with an assistant message");
  ExpectLineError("{\"prompt\": " + msgs + "}\n", 1, "prompt", "ends with an assistant message");
}

TEST(DatasetTest, MessagesNeedAChatTemplate) {
  DatasetOptions o;
  o.allow_messages = false;
  MustParse("{\"prompt\": \"plain\"}\n", o);
  ExpectLineError("{\"prompt\": \"plain\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n", 2,
                  "messages", "chat_template is \"none\"", o);
}

TEST(DatasetTest, FieldsTheRewardsReadAreRequired) {
  DatasetOptions o;
  o.required_fields = {"answer"};
  MustParse("{\"prompt\": \"a\", \"answer\": 3}\n{\"prompt\": \"b\", \"answer\": \"x\"}\n", o);
  ExpectLineError("{\"prompt\": \"a\", \"answer\": 3}\n{\"prompt\": \"b\"}\n", 2, "answer",
                  "missing (a reward reads it)", o);
  ExpectLineError("{\"prompt\": \"a\", \"answer\": null}\n", 1, "answer", "must be a string or a number", o);
  ExpectLineError("{\"prompt\": \"a\", \"answer\": [3]}\n", 1, "answer", "(got an array)", o);
}

TEST(DatasetTest, OptionsForAConfig) {
  RunConfig c;
  c.chat_template = ChatTemplate::kNone;
  RewardSpec a;
  a.type = RewardType::kAnswerMatch;
  a.field = "answer";
  RewardSpec d = a;
  d.type = RewardType::kDigitMatch;
  RewardSpec r;
  r.type = RewardType::kRegex;
  RewardSpec e = a;
  e.field = "other";
  c.rewards = {a, d, r, e};
  const DatasetOptions o = DatasetOptionsFor(c);
  EXPECT_EQ(o.required_fields, (std::vector<std::string>{"answer", "other"}));
  EXPECT_FALSE(o.allow_messages);
}

TEST(DatasetTest, Limits) {
  DatasetOptions o;
  o.max_line_bytes = 32;
  ExpectLineError("{\"prompt\": \"short\"}\n{\"prompt\": \"" + std::string(40, 'x') + "\"}\n", 2, "",
                  "a line of 54 bytes; at most 32", o, StatusCode::kUnsupported);
  o = {};
  o.max_examples = 2;
  ExpectLineError("{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n{\"prompt\": \"c\"}\n", 3, "", "more than 2 examples", o,
                  StatusCode::kUnsupported);
  o = {};
  o.max_file_bytes = 10;
  ExpectError(Dataset::Parse("{\"prompt\": \"abc\"}\n", kSrc, o).status(), StatusCode::kUnsupported,
              std::string(kSrc) + ": 18 bytes; a dataset has at most 10");
}

TEST(DatasetTest, EmptyDatasetIsRefused) {
  ExpectError(Dataset::Parse("", kSrc, {}).status(), StatusCode::kInvalidArgument, std::string(kSrc) + ": no examples");
  ExpectError(Dataset::Parse("\n  \n\r\n", kSrc, {}).status(), StatusCode::kInvalidArgument,
              std::string(kSrc) + ": no examples");
}

TEST(DatasetTest, LoadReadsTheFileAndDigestsIt) {
  TempDir dir;
  ExpectError(Dataset::Load(dir / "none.jsonl", {}).status(), StatusCode::kNotFound, (dir / "none.jsonl").string());
  ExpectError(Dataset::Load(dir.path(), {}).status(), StatusCode::kInvalidArgument, dir.path().string(),
              "not a regular file");
  WriteFile(dir / "a.jsonl", "{\"prompt\": \"x\"}\n{\"prompt\": \"y\"}\n");
  auto a = Dataset::Load(dir / "a.jsonl", {});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ((*a)->size(), 2u);
  EXPECT_EQ((*a)->source(), (dir / "a.jsonl").string());
  EXPECT_EQ((*a)->digest().size(), 32u);
  // The digest is the file's: equal bytes, equal digest; one byte changed, another.
  EXPECT_EQ((*a)->digest(), (*MustParse("{\"prompt\": \"x\"}\n{\"prompt\": \"y\"}\n")).digest());
  EXPECT_NE((*a)->digest(), (*MustParse("{\"prompt\": \"x\"}\n{\"prompt\": \"z\"}\n")).digest());
  WriteFile(dir / "bad.jsonl", "{\"prompt\": \"x\"}\n{\"prompt\": 1}\n");
  ExpectError(Dataset::Load(dir / "bad.jsonl", {}).status(), StatusCode::kCorruption,
              (dir / "bad.jsonl").string() + ":2: field 'prompt': ");
}

// ---------------------------------------------------------------------------------------
// Order.

// The orders of an independent Python implementation of the documented algorithm
// (fixtures/run/epoch_order.json, from fixtures/run/generate.py).
TEST(DatasetOrderTest, EqualsTheDocumentedAlgorithm) {
  const Json fx = Fixture("epoch_order.json");
  ASSERT_GE(fx["cases"].size(), 10u);
  for (const Json& k : fx["cases"]) {
    SCOPED_TRACE("n=" + k["n"].dump() + " seed=" + k["seed"].dump() + " epoch=" + k["epoch"].dump());
    const auto order = EpochOrder(k["n"].get<uint64_t>(), k["seed"].get<uint64_t>(), k["epoch"].get<uint64_t>());
    EXPECT_EQ(order, k["order"].get<std::vector<uint32_t>>());
  }
}

TEST(DatasetOrderTest, IsAPermutationThatChangesWithEpochAndSeed) {
  const auto e0 = EpochOrder(1000, 42, 0);
  std::vector<uint32_t> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  std::vector<uint32_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0u);
  EXPECT_EQ(sorted, identity);
  EXPECT_NE(e0, identity);
  EXPECT_NE(e0, EpochOrder(1000, 42, 1));
  EXPECT_NE(e0, EpochOrder(1000, 43, 0));
  EXPECT_EQ(e0, EpochOrder(1000, 42, 0));
  EXPECT_EQ(EpochOrder(1000, 42, 3, /*shuffle=*/false), identity);
}

TEST(DatasetSamplerTest, NextContinuesAcrossEpochs) {
  const auto ds = Numbers(5);
  DatasetSampler s(ds, 7, true);
  const auto e0 = EpochOrder(5, 7, 0), e1 = EpochOrder(5, 7, 1);
  EXPECT_EQ(s.position(), (DatasetPosition{0, 0}));
  const std::vector<size_t> first = s.NextIndices(7);
  EXPECT_EQ(first, (std::vector<size_t>{e0[0], e0[1], e0[2], e0[3], e0[4], e1[0], e1[1]}));
  EXPECT_EQ(s.position(), (DatasetPosition{1, 2}));
  const std::vector<const Example*> next = s.Next(3);
  ASSERT_EQ(next.size(), 3u);
  EXPECT_EQ(next[0], &(*ds)[e1[2]]);
  EXPECT_EQ(next[2]->index, e1[4]);
  EXPECT_EQ(s.position(), (DatasetPosition{2, 0}));  // the end of an epoch is the start of the next
  EXPECT_EQ(s.NextIndices(12).size(), 12u);          // more than a whole epoch at once
  EXPECT_EQ(s.position(), (DatasetPosition{4, 2}));
  // Every example once per epoch.
  DatasetSampler t(ds, 7, true);
  for (int epoch = 0; epoch < 3; ++epoch) {
    auto idx = t.NextIndices(5);
    EXPECT_EQ(std::set<size_t>(idx.begin(), idx.end()).size(), 5u);
  }
}

TEST(DatasetSamplerTest, ShuffleOffReadsFileOrder) {
  DatasetSampler s(Numbers(3), 7, false);
  EXPECT_EQ(s.NextIndices(7), (std::vector<size_t>{0, 1, 2, 0, 1, 2, 0}));
}

TEST(DatasetSamplerTest, SeedAndShuffleComeFromTheConfig) {
  RunConfig c;
  c.seed = 1234;
  c.shuffle_dataset = true;
  const auto ds = Numbers(20);
  DatasetSampler a(ds, c), b(ds, 1234, true);
  EXPECT_EQ(a.NextIndices(50), b.NextIndices(50));
}

// A position saved mid-epoch and restored into a fresh sampler continues exactly.
TEST(DatasetSamplerTest, ResumesFromASavedPosition) {
  const auto ds = Numbers(11);
  for (size_t consumed : {0, 1, 10, 11, 12, 30, 33}) {
    SCOPED_TRACE(consumed);
    DatasetSampler a(ds, 99, true);
    a.NextIndices(consumed);
    const DatasetPosition saved = a.position();
    EXPECT_EQ(saved.epoch * 11 + saved.index, consumed);
    DatasetSampler b(ds, 99, true);
    b.NextIndices(5);  // somewhere else first
    ASSERT_TRUE(b.Seek(saved).ok());
    EXPECT_EQ(b.position(), saved);
    for (int step = 0; step < 6; ++step) EXPECT_EQ(a.NextIndices(4), b.NextIndices(4));
    EXPECT_EQ(a.position(), b.position());
  }
}

TEST(DatasetSamplerTest, SeekRefusesAPositionOutsideTheDataset) {
  DatasetSampler s(Numbers(4), 1, true);
  s.NextIndices(2);
  ExpectError(s.Seek({0, 4}), StatusCode::kInvalidArgument, std::string(kSrc) + ": dataset position index 4",
              "its 4 examples");
  EXPECT_EQ(s.position(), (DatasetPosition{0, 2}));  // unchanged
}

}  // namespace
}  // namespace ferry::run
