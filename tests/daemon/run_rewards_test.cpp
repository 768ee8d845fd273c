#include "daemon/run/rewards.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon/run/reward_command.h"
#include "tests/daemon/run_test_util.h"

namespace ferry::run {
namespace {

using ::ferry::run::testing::ExpectError;
using ::ferry::run::testing::ReadFile;
using ::ferry::run::testing::TempDir;
using ::ferry::run::testing::WriteFile;
using Json = nlohmann::json;

// The rewards of a config whose [[rewards]] tables are `tables` (parsed as ferryd would).
std::vector<RewardSpec> Specs(const std::string& tables) {
  auto c = ParseRunConfig("model_name_or_path = \"m\"\ndataset = \"d\"\n" + tables, "/cfg/run.toml");
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? c->rewards : std::vector<RewardSpec>{};
}

std::shared_ptr<const Dataset> OneExample(const std::string& json) {
  auto ds = Dataset::Parse(json + "\n", "d.jsonl", {});
  EXPECT_TRUE(ds.ok()) << ds.status().ToString();
  return *ds;
}

// The reward of `completion` under a single reward table, the example holding `example_json`.
double Score1(const std::string& table, const std::string& example_json, const std::string& completion,
              int64_t tokens = 0) {
  auto scorer = RewardScorer::Create(Specs(table));
  EXPECT_TRUE(scorer.ok()) << scorer.status().ToString();
  if (!scorer.ok()) return -1;
  const auto ds = OneExample(example_json);
  auto m = (*scorer)->ScoreAll({{"p", completion, tokens, &(*ds)[0], 0}});
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return -1;
  EXPECT_EQ(m->rows, 1u);
  EXPECT_EQ(m->cols(), 1u);
  return m->at(0, 0);
}

// ---------------------------------------------------------------------------------------
// Built-in rewards, worked examples.

TEST(BuiltinRewardTest, AnswerMatchTakesTheLastNumber) {
  const std::string t = "[[rewards]]\ntype = \"answer_match\"\nfield = \"answer\"\n";
  const std::string ex = R"({"prompt": "q", "answer": "42"})";
  EXPECT_EQ(Score1(t, ex, "The answer is 42."), 1.0);
  EXPECT_EQ(Score1(t, ex, "41 + 1 = 42"), 1.0);
  EXPECT_EQ(Score1(t, ex, "42, not 41"), 0.0);
  EXPECT_EQ(Score1(t, ex, "no number here"), 0.0);
  EXPECT_EQ(Score1(t, ex, ""), 0.0);
  EXPECT_EQ(Score1(t, ex, "4 2"), 0.0);
  EXPECT_EQ(Score1(t, ex, "forty-two: 42.0"), 1.0);  // decimals compared by value
  EXPECT_EQ(Score1(t, ex, "042"), 1.0);
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": 1234})", "It costs 1,234 dollars"), 1.0);  // a number field
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": 1234})", "It costs 1,23 dollars"), 0.0);
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": 3.5})", "x = 3.50"), 1.0);
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": "-7"})", "x = -7"), 1.0);
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": "7"})", "x = -7"), 0.0);
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": "1e3"})", "1000"), 1.0);  // the field may use an exponent
  EXPECT_EQ(Score1(t, R"({"prompt": "q", "answer": "0"})", "-0"), 1.0);
}

TEST(BuiltinRewardTest, AnswerMatchWithAPatternAndNormalisation) {
  const std::string gsm = "[[rewards]]\ntype = \"answer_match\"\nfield = \"answer\"\npattern = \"#### (\\\\S+)\"\n";
  const std::string ex = R"({"prompt": "q", "answer": "11"})";
  EXPECT_EQ(Score1(gsm, ex, "5 + 6 = 11\n#### 11"), 1.0);
  EXPECT_EQ(Score1(gsm, ex, "#### 10\n#### 11.00"), 1.0);  // the last match
  EXPECT_EQ(Score1(gsm, ex, "11"), 0.0);                   // no match: 0
  const std::string exact = gsm + "normalize = \"none\"\n";
  EXPECT_EQ(Score1(exact, ex, "#### 11.00"), 0.0);
  EXPECT_EQ(Score1(exact, ex, "#### 11"), 1.0);
  const std::string word = "[[rewards]]\ntype = \"answer_match\"\nfield = \"city\"\npattern = \"answer: *(\\\\w+)\"\n";
  EXPECT_EQ(Score1(word, R"({"prompt": "q", "city": " Paris "})", "answer: Paris"), 1.0);  // trimmed text
  EXPECT_EQ(Score1(word, R"({"prompt": "q", "city": "paris"})", "answer: Paris"), 0.0);    // case matters
  // A group that did not take part in the last match gives no answer.
  const std::string alt = "[[rewards]]\ntype = \"answer_match\"\nfield = \"answer\"\npattern = \"a(1)|b\"\n";
  EXPECT_EQ(Score1(alt, R"({"prompt": "q", "answer": "1"})", "a1 b"), 0.0);
  EXPECT_EQ(Score1(alt, R"({"prompt": "q", "answer": "1"})", "b a1"), 1.0);
}

TEST(BuiltinRewardTest, DigitMatchGivesPartialCredit) {
  const std::string left = "[[rewards]]\ntype = \"digit_match\"\nfield = \"answer\"\n";
  const std::string right = left + "align = \"right\"\n";
  const std::string ex = R"({"prompt": "q", "answer": "123"})";
  EXPECT_EQ(Score1(left, ex, "= 123"), 1.0);
  EXPECT_DOUBLE_EQ(Score1(left, ex, "= 124"), 2.0 / 3);
  EXPECT_DOUBLE_EQ(Score1(left, ex, "= 12"), 2.0 / 3);
  EXPECT_DOUBLE_EQ(Score1(left, ex, "= 1234"), 3.0 / 4);
  EXPECT_DOUBLE_EQ(Score1(left, ex, "= 023"), 2.0 / 3);
  EXPECT_EQ(Score1(left, ex, "none"), 0.0);
  EXPECT_EQ(Score1(right, ex, "= 12"), 0.0);
  EXPECT_DOUBLE_EQ(Score1(right, ex, "= 23"), 2.0 / 3);
  EXPECT_EQ(Score1(right, ex, "= 1234"), 0.0);
  // Characters are code points; the answer comes from the pattern's group.
  const std::string words = "[[rewards]]\ntype = \"digit_match\"\nfield = \"w\"\npattern = \"= (\\\\S+)\"\n";
  EXPECT_DOUBLE_EQ(Score1(words, R"({"prompt": "q", "w": "日本語"})", "= 日本人"), 2.0 / 3);
  // The prototype's task: three zero-padded digits.
  EXPECT_DOUBLE_EQ(Score1(left, R"({"prompt": "17+28=", "answer": "045"})", "055"), 2.0 / 3);
}

TEST(BuiltinRewardTest, RegexFullOrSearch) {
  // TRL's documented format reward, with (?s) for Python's re.DOTALL.
  const std::string fmt = "[[rewards]]\ntype = \"regex\"\npattern = \"(?s)^<think>.*?</think><answer>.*?</answer>$\"\n";
  const std::string ex = R"({"prompt": "q"})";
  EXPECT_EQ(Score1(fmt, ex, "<think>a\nb</think><answer>1</answer>"), 1.0);
  EXPECT_EQ(Score1(fmt, ex, "<think>a</think><answer>1</answer> extra"), 0.0);
  const std::string no_dotall = "[[rewards]]\ntype = \"regex\"\npattern = \"<think>.*</think>\"\n";
  EXPECT_EQ(Score1(no_dotall, ex, "<think>a\nb</think>"), 0.0);
  EXPECT_EQ(Score1(no_dotall, ex, "<think>ab</think>"), 1.0);
  const std::string digit_full = "[[rewards]]\ntype = \"regex\"\npattern = \"\\\\d\"\n";
  const std::string digit_search = digit_full + "match = \"search\"\n";
  EXPECT_EQ(Score1(digit_full, ex, "abc1"), 0.0);
  EXPECT_EQ(Score1(digit_search, ex, "abc1"), 1.0);
  EXPECT_EQ(Score1(digit_search, ex, "abc"), 0.0);
}

TEST(BuiltinRewardTest, LengthPeaksAtTheTarget) {
  const std::string t = "[[rewards]]\ntype = \"length\"\ntarget = 10\n";
  const std::string ex = R"({"prompt": "q"})";
  EXPECT_EQ(Score1(t, ex, "", 10), 1.0);
  EXPECT_EQ(Score1(t, ex, "", 5), 0.5);
  EXPECT_EQ(Score1(t, ex, "", 15), 0.5);
  EXPECT_DOUBLE_EQ(Score1(t, ex, "", 12), 0.8);
  EXPECT_EQ(Score1(t, ex, "", 0), 0.0);
  EXPECT_EQ(Score1(t, ex, "", 20), 0.0);
  EXPECT_EQ(Score1(t, ex, "", 25), 0.0);
}

TEST(RewardScorerTest, MatrixHasOneColumnPerRewardInConfigOrder) {
  auto scorer = RewardScorer::Create(
      Specs("[[rewards]]\nname = \"len\"\ntype = \"length\"\ntarget = 4\nweight = 0.5\n"
            "[[rewards]]\nname = \"ans\"\ntype = \"answer_match\"\nfield = \"answer\"\nweight = 2\n"));
  ASSERT_TRUE(scorer.ok()) << scorer.status().ToString();
  EXPECT_EQ((*scorer)->names(), (std::vector<std::string>{"len", "ans"}));
  const auto ds = Dataset::Parse("{\"prompt\": \"a\", \"answer\": 1}\n{\"prompt\": \"b\", \"answer\": 2}\n", "d", {});
  ASSERT_TRUE(ds.ok());
  const Example* a = &(**ds)[0];
  const Example* b = &(**ds)[1];
  auto m = (*scorer)->ScoreAll({{"a", "1", 4, a, 0}, {"a", "2", 2, a, 0}, {"b", "2", 8, b, 1}});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->rows, 3u);
  EXPECT_EQ(m->names, (std::vector<std::string>{"len", "ans"}));
  EXPECT_EQ(m->weights, (std::vector<double>{0.5, 2.0}));
  EXPECT_EQ(m->values, (std::vector<double>{1.0, 1.0, 0.5, 0.0, 0.0, 1.0}));
  auto empty = (*scorer)->ScoreAll({});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->rows, 0u);
}

TEST(RewardScorerTest, InputsWithoutTheirFieldsAreRefused) {
  auto scorer = RewardScorer::Create(Specs("[[rewards]]\ntype = \"answer_match\"\nfield = \"answer\"\n"));
  ASSERT_TRUE(scorer.ok());
  const auto ds = OneExample(R"({"prompt": "q", "solution": "1"})");
  ExpectError((*scorer)->ScoreAll({{"q", "1", 1, &(*ds)[0], 0}}).status(), StatusCode::kInvalidArgument,
              "reward 'answer_match': the example of line 1 has no string or number field 'answer'");
  ExpectError((*scorer)->ScoreAll({{"q", "1", 1, nullptr, 0}}).status(), StatusCode::kInvalidArgument,
              "reward input 0 has no dataset example");
}

// ---------------------------------------------------------------------------------------
// The external command.

class RewardCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ds_ = *Dataset::Parse(
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n"
        "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi \\\"you\\\"\"}], \"answer\": 7, \"meta\": {\"k\": "
        "[1]}}\n",
        "d.jsonl", {});
  }

  // A command reward running `script` (a /bin/sh script written to the temp directory).
  RewardSpec Spec(const std::string& script, double timeout = 20, int64_t batch = 0) {
    WriteFile(dir_ / "score.sh", script, /*executable=*/true);
    RewardSpec s;
    s.name = "judge";
    s.type = RewardType::kCommand;
    s.command = {"/bin/sh", "score.sh"};
    s.working_dir = dir_.path();
    s.timeout_seconds = timeout;
    s.batch_size = batch;
    return s;
  }

  std::unique_ptr<RewardScorer> Scorer(const RewardSpec& spec, RewardScorerOptions options = {}) {
    options.stop_grace_seconds = 0.5;
    auto s = RewardScorer::Create(std::vector<RewardSpec>{spec}, options);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  std::vector<RewardInput> Inputs(size_t n) {
    std::vector<RewardInput> in;
    for (size_t i = 0; i < n; ++i) {
      in.push_back({"prompt " + std::to_string(i / 2), "completion " + std::to_string(i), static_cast<int64_t>(i),
                    &(*ds_)[i / 2 % 2], static_cast<int64_t>(i / 2)});
    }
    return in;
  }

  static constexpr const char* kLabel = "reward 'judge' (/bin/sh score.sh): ";
  TempDir dir_;
  std::shared_ptr<const Dataset> ds_;
};

TEST_F(RewardCommandTest, SendsOneJsonLinePerCompletion) {
  auto scorer =
      Scorer(Spec("while IFS= read -r line; do printf '%s\\n' \"$line\" >> requests.log; "
                  "echo '{\"reward\": 0.25, \"why\": \"ok\"}'; done\n"));
  ASSERT_NE(scorer, nullptr);
  std::vector<RewardInput> in = Inputs(2);
  in[0].completion = "two lines\n\"quoted\" é \\ tab\t";
  in[1].completion = "bad utf-8 \xff";
  in[1].prompt = "<|im_start|>user\nhi<|im_end|>\n";
  auto m = scorer->ScoreAll(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->values, (std::vector<double>{0.25, 0.25}));
  std::istringstream log(ReadFile(dir_ / "requests.log"));
  std::string line;
  std::vector<Json> req;
  while (std::getline(log, line)) req.push_back(Json::parse(line));
  ASSERT_EQ(req.size(), 2u);
  EXPECT_EQ(req[0]["index"], 0);
  EXPECT_EQ(req[0]["prompt_index"], 0);
  EXPECT_EQ(req[0]["completion_tokens"], 0);
  EXPECT_EQ(req[0]["last_in_batch"], false);
  EXPECT_EQ(req[0]["prompt"], "prompt 0");
  EXPECT_EQ(req[0]["completion"], "two lines\n\"quoted\" é \\ tab\t");
  EXPECT_EQ(req[0]["example"], Json::parse((*ds_)[0].json));
  EXPECT_EQ(req[1]["index"], 1);
  EXPECT_EQ(req[1]["completion_tokens"], 1);
  EXPECT_EQ(req[1]["last_in_batch"], true);
  EXPECT_EQ(req[1]["prompt"], "<|im_start|>user\nhi<|im_end|>\n");
  EXPECT_EQ(req[1]["completion"], "bad utf-8 \xEF\xBF\xBD");  // U+FFFD
}

TEST_F(RewardCommandTest, NullAndNanMeanNoReward) {
  auto scorer =
      Scorer(Spec("while IFS= read -r line; do case \"$line\" in\n"
                  "  *'\"completion\":\"good\"'*) echo '{\"reward\": 1.5}';;\n"
                  "  *'\"completion\":\"none\"'*) echo '{\"reward\": null}';;\n"
                  "  *'\"completion\":\"nan\"'*) echo '{\"note\": \"NaN in a string\", \"reward\": NaN}';;\n"
                  "  *) echo '{\"reward\": -2e-1}';;\n"
                  "esac; done\n"));
  ASSERT_NE(scorer, nullptr);
  std::vector<RewardInput> in = Inputs(4);
  in[0].completion = "good";
  in[1].completion = "none";
  in[2].completion = "nan";
  in[3].completion = "other";
  auto m = scorer->ScoreAll(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->at(0, 0), 1.5);
  EXPECT_TRUE(std::isnan(m->at(1, 0)));
  EXPECT_TRUE(std::isnan(m->at(2, 0)));
  EXPECT_EQ(m->at(3, 0), -0.2);
}

TEST_F(RewardCommandTest, TheProcessIsKeptForTheRun) {
  auto scorer = Scorer(Spec("n=0; while IFS= read -r line; do n=$((n+1)); echo \"{\\\"reward\\\": $n}\"; done\n"));
  ASSERT_NE(scorer, nullptr);
  auto a = scorer->ScoreAll(Inputs(2));
  auto b = scorer->ScoreAll(Inputs(3));
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
  EXPECT_EQ(a->values, (std::vector<double>{1, 2}));
  EXPECT_EQ(b->values, (std::vector<double>{3, 4, 5}));
}

TEST_F(RewardCommandTest, BatchesEndWithLastInBatch) {
  // Replies only once a batch is complete: ferryd must write the whole batch first.
  auto scorer =
      Scorer(Spec("n=0; while IFS= read -r line; do n=$((n+1)); printf '%s\\n' \"$line\" >> requests.log\n"
                  "  case \"$line\" in *'\"last_in_batch\":true'*)\n"
                  "    while [ $n -gt 0 ]; do echo \"{\\\"reward\\\": $n}\"; n=$((n-1)); done;; esac\n"
                  "done\n",
                  20, /*batch=*/2));
  ASSERT_NE(scorer, nullptr);
  auto m = scorer->ScoreAll(Inputs(5));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->values, (std::vector<double>{2, 1, 2, 1, 1}));
  std::istringstream log(ReadFile(dir_ / "requests.log"));
  std::string line;
  std::vector<bool> last;
  while (std::getline(log, line)) last.push_back(Json::parse(line)["last_in_batch"].get<bool>());
  EXPECT_EQ(last, (std::vector<bool>{false, true, false, true, true}));
}

// More input than the socket holds, and more output than the pipe holds, answered line by
// line: writing everything before reading would deadlock; ferryd reads while it writes.
TEST_F(RewardCommandTest, LargeRequestsDoNotDeadlock) {
  const std::string pad(1000, 'p');
  auto scorer = Scorer(Spec("exec stdbuf -oL sed 's/.*/{\"reward\": 0.5, \"pad\": \"" + pad + "\"}/'\n"));
  ASSERT_NE(scorer, nullptr);
  std::vector<RewardInput> in = Inputs(300);  // 1.2 MB in, 300 KB out
  for (auto& x : in) x.completion = std::string(4096, 'x');
  auto m = scorer->ScoreAll(in);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->values, std::vector<double>(300, 0.5));
}

TEST_F(RewardCommandTest, StderrGoesToTheConfiguredFile) {
  RewardSpec spec = Spec("echo 'warming up' >&2; while IFS= read -r line; do echo '{\"reward\": 1}'; done\n");
  spec.stderr_file = dir_ / "logs.txt";
  auto scorer = Scorer(spec);
  ASSERT_NE(scorer, nullptr);
  ASSERT_TRUE(scorer->ScoreAll(Inputs(1)).ok());
  EXPECT_EQ(ReadFile(dir_ / "logs.txt"), "warming up\n");
}

TEST_F(RewardCommandTest, MissingProgramFailsAtStart) {
  RewardSpec spec = Spec("");
  spec.command = {"/nonexistent/ferry-reward", "x"};
  auto s = RewardScorer::Create(std::vector<RewardSpec>{spec});
  ExpectError(s.status(), StatusCode::kNotFound, "reward 'judge' (/nonexistent/ferry-reward x): cannot start it");
}

TEST_F(RewardCommandTest, ACrashNamesTheSignal) {
  auto scorer = Scorer(Spec("IFS= read -r line; kill -SEGV $$\n"));
  ASSERT_NE(scorer, nullptr);
  ExpectError(scorer->ScoreAll(Inputs(2)).status(), StatusCode::kUnavailable,
              std::string(kLabel) + "was killed by signal 11", "reply line 1 missing");
}

TEST_F(RewardCommandTest, ANonZeroExitNamesTheStatus) {
  auto scorer = Scorer(Spec("IFS= read -r line; echo '{\"reward\": 1}'; exit 3\n"));
  ASSERT_NE(scorer, nullptr);
  ExpectError(
      scorer->ScoreAll(Inputs(2)).status(), StatusCode::kUnavailable,
      std::string(kLabel) + "exited with status 3 (1 of 2 replies of this batch received; reply line 2 missing)");
}

TEST_F(RewardCommandTest, TooFewLinesIsAWrongCount) {
  auto scorer = Scorer(Spec("IFS= read -r a; IFS= read -r b; echo '{\"reward\": 1}'\n"));
  ASSERT_NE(scorer, nullptr);
  ExpectError(scorer->ScoreAll(Inputs(2)).status(), StatusCode::kUnavailable,
              std::string(kLabel) + "exited with status 0 (1 of 2 replies", "reply line 2 missing");
}

TEST_F(RewardCommandTest, TooManyLinesIsAWrongCount) {
  auto scorer = Scorer(Spec("while IFS= read -r l; do printf '{\"reward\": 1}\\n{\"reward\": 2}\\n'; done\n"));
  ASSERT_NE(scorer, nullptr);
  ExpectError(scorer->ScoreAll(Inputs(1)).status(), StatusCode::kCorruption,
              std::string(kLabel) + "reply line 2 is one more than the completions sent (1): \"{\\\"reward\\\": 2}\"");
}

// An extra line that arrives after the call ended is caught by the next call.
TEST_F(RewardCommandTest, LateExtraLinesAreCaughtNextCall) {
  auto scorer =
      Scorer(Spec("IFS= read -r l; echo '{\"reward\": 1}'; sleep 0.2; echo '{\"reward\": 9}'; "
                  ": > extra.done; exec sleep 30\n"));
  ASSERT_NE(scorer, nullptr);
  ASSERT_TRUE(scorer->ScoreAll(Inputs(1)).ok());
  for (int i = 0; i < 1000 && !std::filesystem::exists(dir_ / "extra.done"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(std::filesystem::exists(dir_ / "extra.done"));
  ExpectError(scorer->ScoreAll(Inputs(1)).status(), StatusCode::kCorruption,
              std::string(kLabel) + "wrote more lines than completions: \"{\\\"reward\\\": 9}");
}

TEST_F(RewardCommandTest, MalformedLinesNameTheLine) {
  struct Case {
    std::string reply;
    std::string what;
  };
  for (const Case& c : std::vector<Case>{
           {"not json at all", "reply line 2: not JSON: \"not json at all\""},
           {"[1]", "reply line 2: not a JSON object {\"reward\": ...}: \"[1]\""},
           {"{\"score\": 1}", "reply line 2: no \"reward\" key"},
           {"{\"reward\": \"1\"}", "reply line 2: \"reward\" is not a number, null or NaN"},
           {"{\"reward\": Infinity}", "reply line 2: the reward is Infinity"},
           {"{\"reward\": 1e999}", "reply line 2: not JSON"},
           {"", "reply line 2: an empty line"},
       }) {
    SCOPED_TRACE(c.reply);
    auto scorer = Scorer(Spec("IFS= read -r a; echo '{\"reward\": 1}'; IFS= read -r b; printf '%s\\n' '" + c.reply +
                              "'; exec sleep 30\n"));
    ASSERT_NE(scorer, nullptr);
    const Status s = scorer->ScoreAll(Inputs(2)).status();
    EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.ToString();
    EXPECT_EQ(s.message().rfind(kLabel, 0), 0u) << s.message();
    EXPECT_NE(s.message().find(c.what), std::string::npos) << s.message();
  }
}

TEST_F(RewardCommandTest, OverlongLinesAreRefused) {
  RewardScorerOptions o;
  o.max_reply_bytes = 1000;
  auto scorer = Scorer(Spec("IFS= read -r a; head -c 5000 /dev/zero | tr '\\0' x; exec sleep 30\n"), o);
  ASSERT_NE(scorer, nullptr);
  ExpectError(scorer->ScoreAll(Inputs(1)).status(), StatusCode::kCorruption,
              std::string(kLabel) + "reply line 1 is longer than 1000 bytes: \"xxxx");
}

TEST_F(RewardCommandTest, ATimeoutKillsTheCommand) {
  auto scorer = Scorer(Spec("IFS= read -r line; exec sleep 30\n", /*timeout=*/0.3));
  ASSERT_NE(scorer, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  ExpectError(scorer->ScoreAll(Inputs(1)).status(), StatusCode::kUnavailable,
              std::string(kLabel) + "no reply within timeout_seconds = 0.3 s (0 of 1 replies");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(15));
}

TEST_F(RewardCommandTest, AfterAFailureRestartIsTheCallersChoice) {
  // Fails the first time it runs, works after.
  auto scorer =
      Scorer(Spec("if [ ! -f failed.once ]; then : > failed.once; IFS= read -r l; exit 4; fi\n"
                  "while IFS= read -r line; do echo '{\"reward\": 3}'; done\n"));
  ASSERT_NE(scorer, nullptr);
  EXPECT_EQ(scorer->ScoreAll(Inputs(1)).status().code(), StatusCode::kUnavailable);
  ExpectError(scorer->ScoreAll(Inputs(1)).status(), StatusCode::kFailedPrecondition,
              std::string(kLabel) + "stopped after an earlier failure; Restart() starts it again");
  ASSERT_TRUE(scorer->Restart().ok());
  auto m = scorer->ScoreAll(Inputs(2));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->values, (std::vector<double>{3, 3}));
}

// True when `pid` exists and is not a zombie.
bool Alive(pid_t pid) {
  const std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  if (stat.empty()) return false;
  const size_t paren = stat.rfind(')');
  return paren == std::string::npos || paren + 2 >= stat.size() || stat[paren + 2] != 'Z';
}

// Stop closes stdin, waits the grace period, then kills the whole process group.
TEST_F(RewardCommandTest, StopKillsTheProcessGroup) {
  RewardSpec spec = Spec("trap '' TERM HUP; sleep 1000 & echo $! > child.pid; wait; wait\n");
  auto cmd = RewardCommand::Start(spec, 1024, 0.2);
  ASSERT_TRUE(cmd.ok()) << cmd.status().ToString();
  const pid_t pid = (*cmd)->pid();
  ASSERT_GT(pid, 0);
  for (int i = 0; i < 1000 && ReadFile(dir_ / "child.pid").empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const pid_t child = static_cast<pid_t>(std::atoi(ReadFile(dir_ / "child.pid").c_str()));
  ASSERT_GT(child, 0);
  EXPECT_TRUE(Alive(pid));
  EXPECT_TRUE(Alive(child));
  (*cmd)->Stop();
  EXPECT_FALSE((*cmd)->running());
  EXPECT_FALSE(Alive(pid));
  // The grandchild got the group's SIGKILL too (it may stay a zombie until init reaps it).
  for (int i = 0; i < 500 && Alive(child); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_FALSE(Alive(child));
  // A command that exits on EOF is reaped without waiting for the grace period.
  auto quick = RewardCommand::Start(Spec("while IFS= read -r l; do :; done\n"), 1024, 30);
  ASSERT_TRUE(quick.ok());
  const auto t0 = std::chrono::steady_clock::now();
  (*quick)->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

// Through the config: argv[0] relative to the config file, run in its directory.
TEST_F(RewardCommandTest, ConfigPathsAndWorkingDirectory) {
  WriteFile(dir_ / "bin" / "score.sh",
            "#!/bin/sh\nr=$(cat value.txt); while IFS= read -r l; do echo \"{\\\"reward\\\": $r}\"; done\n", true);
  WriteFile(dir_ / "value.txt", "0.75\n");
  auto c = ParseRunConfig(
      "model_name_or_path = \"m\"\ndataset = \"d\"\n[[rewards]]\ntype = \"command\"\n"
      "command = [\"./bin/score.sh\"]\n",
      dir_ / "run.toml");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  auto scorer = RewardScorer::Create(*c);
  ASSERT_TRUE(scorer.ok()) << scorer.status().ToString();
  auto m = (*scorer)->ScoreAll(Inputs(1));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->names, (std::vector<std::string>{"command"}));
  EXPECT_EQ(m->values, (std::vector<double>{0.75}));
}

}  // namespace
}  // namespace ferry::run
