// `ferryd probe` as a process: the built ferryd, one-shot with --json and as a --serve prober fed
// request lines on a pipe. Its answers must equal PromptLogProbs called here on the same model
// (both single-threaded, the same batch: the same F32 operations, so the same floats; "%.9g"
// round-trips them), malformed requests must get an error line naming the field, and the
// process must go on answering after them and exit 0 at EOF.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/prompt_logprobs.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::runtime {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A reply line must come within this long (a model load of the fixtures takes milliseconds).
constexpr int kReplyTimeoutMs = 120'000;

const fs::path kFixtures = fs::path(FERRY_FIXTURES_DIR) / "runtime";
const std::string kModel = (kFixtures / "models" / "llama_f32").string();
const std::string kAdapter = (kFixtures / "adapters" / "llama_f32_all_linear").string();

// `ferryd probe --serve` with its stdin and stdout on pipes (stderr inherited).
class Prober {
 public:
  bool Start() {
    std::signal(SIGPIPE, SIG_IGN);
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return false;
    pid_ = ::fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      ::execl(FERRYD_PATH, FERRYD_PATH, "probe", "--serve", "--threads", "1", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    return true;
  }

  bool Send(const std::string& line) {
    const std::string s = line + "\n";
    size_t done = 0;
    while (done < s.size()) {
      const ssize_t n = ::write(to_, s.data() + done, s.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // The next line of stdout, or "" on EOF or timeout.
  std::string ReadLine() {
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return line;
      }
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, kReplyTimeoutMs) <= 0) return "";
      char chunk[65536];
      const ssize_t n = ::read(from_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buf_.append(chunk, static_cast<size_t>(n));
    }
  }

  // Closes stdin; returns the exit code (-1 when killed), and what stdout held after the last line.
  int Finish(std::string* rest) {
    ::close(to_);
    to_ = -1;
    char chunk[4096];
    for (ssize_t n; (n = ::read(from_, chunk, sizeof(chunk))) > 0;) buf_.append(chunk, static_cast<size_t>(n));
    *rest = buf_;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  ~Prober() {
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buf_;
};

// PromptLogProbs here, on the model as ferryd probe loads it (F32).
std::vector<std::vector<float>> Reference(const std::string& model_dir, const std::string& adapter_dir,
                                          const std::vector<std::vector<int64_t>>& seqs) {
  SetTorchThreads(1);
  ModelOptions options;
  options.dtype = at::kFloat;
  auto m = CausalLM::Load(model_dir, options);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  if (!m.ok()) return {};
  std::unique_ptr<LoraAdapter> adapter;
  if (!adapter_dir.empty()) {
    auto a = LoraAdapter::Load(**m, adapter_dir);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (!a.ok()) return {};
    adapter = std::move(*a);
  }
  auto r = PromptLogProbs(**m, adapter ? &adapter->binding() : nullptr, seqs);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : std::vector<std::vector<float>>{};
}

void ExpectValues(const json& got, const std::vector<std::vector<float>>& want, const std::string& what) {
  ASSERT_TRUE(got.is_array()) << what;
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << what << " sequence " << i;
    for (size_t t = 0; t < want[i].size(); ++t) {
      EXPECT_EQ(got[i][t].get<float>(), want[i][t]) << what << " sequence " << i << " token " << t + 1;
    }
  }
}

// The error line's message, after checking the line is {"ok": false, "error": ...}.
std::string ErrorOf(const std::string& line) {
  const json j = json::parse(line, nullptr, false);
  EXPECT_TRUE(j.is_object()) << line;
  if (!j.is_object()) return "";
  EXPECT_EQ(j.value("ok", true), false) << line;
  EXPECT_TRUE(j.contains("error") && j["error"].is_string()) << line;
  return j.value("error", "");
}

TEST(FerrydProbeTest, ServeAnswersEachLineAndSurvivesMalformedOnes) {
  const std::vector<std::vector<int64_t>> seqs_a = {{5, 17, 200, 300, 4, 9, 511}, {42, 43}, {100, 7, 7, 7}};
  const std::vector<std::vector<int64_t>> seqs_b = {{1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11}};
  const auto want_a = Reference(kModel, kAdapter, seqs_a);
  const auto want_b = Reference(kModel, "", seqs_b);
  ASSERT_FALSE(want_a.empty());
  ASSERT_FALSE(want_b.empty());

  Prober p;
  ASSERT_TRUE(p.Start());
  // 1. valid, with the adapter.
  ASSERT_TRUE(p.Send(json{{"model", kModel}, {"adapter", kAdapter}, {"sequences", seqs_a}}.dump()));
  const std::string a = p.ReadLine();
  const json ja = json::parse(a, nullptr, false);
  ASSERT_TRUE(ja.is_object()) << a;
  EXPECT_EQ(ja.value("ok", false), true) << a;
  EXPECT_TRUE(ja.contains("seconds") && ja["seconds"].is_number()) << a;
  ExpectValues(ja["logprobs"], want_a, "request 1");

  // 2. malformed requests, each answered with the field at fault.
  ASSERT_TRUE(p.Send(R"({"model": ")" + kModel + R"(", "sequences": [[1, 2], [3, "x"]]})"));
  EXPECT_NE(ErrorOf(p.ReadLine()).find("field 'sequences'[1][1] is not a token id: \"x\""), std::string::npos);
  ASSERT_TRUE(p.Send("{not json"));
  EXPECT_NE(ErrorOf(p.ReadLine()).find("not a JSON object"), std::string::npos);
  ASSERT_TRUE(p.Send(R"({"model": ")" + kModel + R"(", "adaptor": "x", "sequences": [[1, 2]]})"));
  EXPECT_NE(ErrorOf(p.ReadLine()).find("unknown field \"adaptor\""), std::string::npos);
  ASSERT_TRUE(p.Send(R"({"sequences": [[1, 2]]})"));
  EXPECT_NE(ErrorOf(p.ReadLine()).find("field 'model'"), std::string::npos);
  ASSERT_TRUE(p.Send(R"({"model": ")" + kModel + R"(", "sequences": [[1, 2], [3, 4, 512]]})"));
  EXPECT_NE(ErrorOf(p.ReadLine()).find("field 'sequences': sequence 1, token 2: id 512"), std::string::npos);
  ASSERT_TRUE(p.Send(R"({"model": "/nonexistent/ferry-model", "sequences": [[1, 2]]})"));
  const std::string missing = ErrorOf(p.ReadLine());
  EXPECT_NE(missing.find("field 'model'"), std::string::npos) << missing;
  EXPECT_NE(missing.find("/nonexistent/ferry-model"), std::string::npos) << missing;
  ASSERT_TRUE(p.Send(std::string(2u << 20, ' ')));
  EXPECT_NE(ErrorOf(p.ReadLine()).find("longer than"), std::string::npos);

  // 3. valid again: the base model (another cache entry), then the adapter's (cached) once more.
  ASSERT_TRUE(p.Send(json{{"model", kModel}, {"adapter", nullptr}, {"sequences", seqs_b}}.dump()));
  const std::string b = p.ReadLine();
  const json jb = json::parse(b, nullptr, false);
  ASSERT_TRUE(jb.is_object()) << b;
  EXPECT_EQ(jb.value("ok", false), true) << b;
  ExpectValues(jb["logprobs"], want_b, "request 3");
  ASSERT_TRUE(p.Send(json{{"model", kModel}, {"adapter", kAdapter}, {"sequences", seqs_a}}.dump()));
  const json ja2 = json::parse(p.ReadLine(), nullptr, false);
  ASSERT_TRUE(ja2.is_object());
  ExpectValues(ja2["logprobs"], want_a, "request 1 again");

  std::string rest;
  EXPECT_EQ(p.Finish(&rest), 0);
  EXPECT_EQ(rest, "") << "stdout after the last answer";
}

std::string Quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

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

TEST(FerrydProbeTest, OneShotJsonEqualsTheFunction) {
  const std::vector<std::vector<int64_t>> seqs = {{1, 2, 3}, {4, 5, 6, 7}};
  const auto want = Reference(kModel, kAdapter, seqs);
  const Ran r = RunCommand(std::string(FERRYD_PATH) + " probe --model " + Quote(kModel) + " --adapter " +
                           Quote(kAdapter) + " --ids '1,2,3; 4,5,6,7' --json --threads 1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_EQ(j.at("model"), kModel);
  EXPECT_EQ(j.at("adapter"), kAdapter);
  ExpectValues(j.at("logprobs"), want, "one-shot");

  // Without an adapter: "adapter": null; without --json: one line of values per sequence.
  const Ran base =
      RunCommand(std::string(FERRYD_PATH) + " probe --model " + Quote(kModel) + " --ids '1,2,3' --json --threads 1");
  ASSERT_EQ(base.exit_code, 0) << base.out;
  EXPECT_TRUE(json::parse(base.out).at("adapter").is_null()) << base.out;
  const Ran text = RunCommand(std::string(FERRYD_PATH) + " probe --model " + Quote(kModel) + " --adapter " +
                              Quote(kAdapter) + " --ids '1,2,3;4,5,6,7' --threads 1");
  ASSERT_EQ(text.exit_code, 0) << text.out;
  char want_text[256];
  std::snprintf(want_text, sizeof(want_text), "%.9g %.9g\n%.9g %.9g %.9g\n", want[0][0], want[0][1], want[1][0],
                want[1][1], want[1][2]);
  EXPECT_EQ(text.out, want_text);
}

TEST(FerrydProbeTest, OneShotErrorsNameTheInput) {
  Ran r = RunCommand(std::string(FERRYD_PATH) + " probe --model " + Quote(kModel) + " --ids '1,2;3,x' 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("--ids: sequence 1, token 1: \"x\" is not a token id"), std::string::npos) << r.out;
  r = RunCommand(std::string(FERRYD_PATH) + " probe --model " + Quote(kModel) + " --ids '1,2;3' 2>&1");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("sequence 1 has 1 token(s)"), std::string::npos) << r.out;
  r = RunCommand(std::string(FERRYD_PATH) + " probe --serve --model " + Quote(kModel) + " 2>&1 </dev/null");
  EXPECT_NE(r.exit_code, 0) << r.out;
}

}  // namespace
}  // namespace ferry::runtime
