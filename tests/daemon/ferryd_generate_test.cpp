// `ferryd generate` end to end against transformers: the prompt text through the model
// directory's tokenizer, 16 greedy tokens, and the decoded text, as fixtures/runtime/cases.json's
// cli_prompt case recorded them (AutoTokenizer + model.generate + tokenizer.decode).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <cstdio>
#include <fstream>
#include <string>

namespace {

using nlohmann::json;

struct Ran {
  int exit_code = -1;
  std::string out;
};

Ran RunCommand(const std::string& cmd) {
  Ran r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

TEST(FerrydGenerateTest, GreedyCompletionEqualsTransformers) {
  const std::string runtime = std::string(FERRY_FIXTURES_DIR) + "/runtime";
  std::ifstream in(runtime + "/cases.json");
  ASSERT_TRUE(in) << runtime << "/cases.json";
  const json cases = json::parse(in);
  const json& c = cases.at("cli_prompt");
  const std::string cmd = std::string(FERRYD_PATH) + " generate --model " +
                          Quote(runtime + "/" + c.at("model_dir").get<std::string>()) + " --prompt " +
                          Quote(c.at("text").get<std::string>()) + " --max-new-tokens " +
                          std::to_string(c.at("max_new_tokens").get<int>()) + " --temperature 0 --threads 1 --json";
  const Ran r = RunCommand(cmd);
  ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.out;
  const json got = json::parse(r.out.substr(0, r.out.find('\n')));
  EXPECT_EQ(got.at("prompt_token_ids"), c.at("prompt_ids"));
  EXPECT_EQ(got.at("token_ids"), c.at("new_ids"));
  EXPECT_EQ(got.at("text").get<std::string>(), c.at("decoded").get<std::string>());
  EXPECT_EQ(got.at("finish_reason").get<std::string>(), c.at("stopped_at_eos").get<bool>() ? "stop" : "length");
  ASSERT_EQ(got.at("logprobs").size(), c.at("new_ids").size());
  for (const json& lp : got.at("logprobs")) EXPECT_LE(lp.get<double>(), 0.0);
}

TEST(FerrydGenerateTest, MissingModelIsAnErrorNamingIt) {
  const Ran r = RunCommand(std::string(FERRYD_PATH) + " generate --model /nonexistent/ferry-model --prompt hi 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("/nonexistent/ferry-model"), std::string::npos) << r.out;
}

}  // namespace
