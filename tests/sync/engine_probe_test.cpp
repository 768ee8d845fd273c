// The probe's sequences and its judgement (sync/engine/probe.h), and the client's handling of
// an answer no vLLM sends (a hostile server on a real socket); the real server is in
// engine_vllm_test.cpp.
#include "sync/engine/probe.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <thread>

#include "sync/engine/vllm_client.h"

namespace ferry::engine {
namespace {

TEST(ProbeSequencesTest, AreDeterministicInRangeAndDifferBySeed) {
  auto a = ProbeSequences(14);
  auto b = ProbeSequences(14);
  ASSERT_TRUE(a.ok()) << a.status().message();
  ASSERT_EQ(a->size(), 1u);
  EXPECT_EQ(*a, *b);
  int distinct = 0;
  std::vector<bool> seen(14, false);
  for (const auto& s : *a) {
    ASSERT_EQ(s.size(), 64u);
    for (int32_t id : s) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, 14);
      if (!seen[static_cast<size_t>(id)]) ++distinct;
      seen[static_cast<size_t>(id)] = true;
    }
  }
  EXPECT_GE(distinct, 12) << "64 draws over 14 ids should reach nearly all of them";
  ProbeOptions other;
  other.seed = 7;
  EXPECT_NE(*ProbeSequences(14, other), *a);
}

TEST(ProbeSequencesTest, RefusesBadVocabularyAndShape) {
  auto v = ProbeSequences(1);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("vocabulary size 1"), std::string::npos) << v.status().message();
  ProbeOptions o;
  o.length = 1;
  auto s = ProbeSequences(100, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("1 sequences of 1 tokens"), std::string::npos) << s.status().message();
}

TEST(ProbeMaxAbsDiffTest, TakesTheLargestAndNamesAShapeMismatch) {
  EXPECT_DOUBLE_EQ(*MaxAbsDiff({{-1.0, -2.0}, {-3.0}}, {{-1.5, -2.0}, {-3.25}}), 0.5);
  auto nan = MaxAbsDiff({{std::nan("")}}, {{0.0}});
  ASSERT_TRUE(nan.ok());
  EXPECT_TRUE(std::isinf(*nan));
  auto bad = MaxAbsDiff({{1.0, 2.0}, {1.0}}, {{1.0, 2.0}, {1.0, 2.0}});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sequence 1 has 1 log-probabilities against 2"), std::string::npos)
      << bad.status().message();
}

TEST(ProbeJudgeTest, ProvesOnlyTheNearerVersionWithinTolerance) {
  const LogProbs version = {{-1.0, -2.0, -3.0}};
  const LogProbs previous = {{-1.2, -2.0, -3.1}};
  // Within the tolerance of the version, far from the previous one.
  auto ok = Judge({{-1.00001, -2.00002, -3.0}}, version, &previous, 1e-4);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->proven) << ok->why;
  EXPECT_EQ(ok->tokens, 3);
  EXPECT_NEAR(ok->max_diff, 2e-5, 1e-9);
  EXPECT_NEAR(*ok->previous_diff, 0.2, 1e-4);
  EXPECT_NEAR(*ok->references_diff, 0.2, 1e-12);
  // The engine still answers as the previous version.
  auto stale = Judge(previous, version, &previous, 1e-4);
  ASSERT_TRUE(stale.ok());
  EXPECT_FALSE(stale->proven);
  EXPECT_NE(stale->why.find("differs from the version's by 0.2"), std::string::npos) << stale->why;
  EXPECT_NE(stale->why.find("it matches the previous version's"), std::string::npos) << stale->why;
  // No previous version: the tolerance alone decides.
  EXPECT_TRUE(Judge(version, version, nullptr, 1e-4)->proven);
  EXPECT_FALSE(Judge({{-1.001, -2.0, -3.0}}, version, nullptr, 1e-4)->proven);
  // Two versions that answer alike cannot be told apart: within the tolerance is the proof.
  const LogProbs same = {{-1.00003, -2.0, -3.0}};
  auto alike = Judge({{-1.00004, -2.0, -3.0}}, version, &same, 1e-4);
  EXPECT_TRUE(alike->proven) << alike->why;
  // Nearer to the previous one although within the tolerance of both, when they differ by more.
  const LogProbs close_previous = {{-1.00015, -2.0, -3.0}};
  auto between = Judge({{-1.00009, -2.0, -3.0}}, version, &close_previous, 1e-4);
  EXPECT_FALSE(between->proven);
  EXPECT_NE(between->why.find("no nearer to the version"), std::string::npos) << between->why;
  // A NaN from the engine is never a match.
  EXPECT_FALSE(Judge({{std::nan(""), -2.0, -3.0}}, version, nullptr, 1e-4)->proven);
}

TEST(ProbeLengthTest, ShrinksWithTheModelsSizeWithinSixteenToSixtyFour) {
  EXPECT_EQ(ProbeLengthFor(128, 2), 64);    // the demo
  EXPECT_EQ(ProbeLengthFor(1024, 24), 16);  // the 0.5B shape: 2^28 / (1024^2 * 24) = 10.7
  EXPECT_EQ(ProbeLengthFor(4096, 32), 16);  // 7B
  EXPECT_EQ(ProbeLengthFor(512, 24), 42);   // 2^28 / (512^2 * 24) = 42.7
  EXPECT_EQ(ProbeLengthFor(0, 0), 64);
}

TEST(ProbeToleranceTest, FollowsTheServersDtype) {
  EXPECT_DOUBLE_EQ(*ToleranceForDtype("float32"), 1e-4);
  EXPECT_DOUBLE_EQ(*ToleranceForDtype("bfloat16"), 1e-1);
  EXPECT_DOUBLE_EQ(*ToleranceForDtype("float16"), 2e-2);
  auto bad = ToleranceForDtype("int8");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'int8'"), std::string::npos) << bad.status().message();
}

// A socket listening on a free loopback port (`*port`); -1 when it cannot be made.
int ListenOnLoopback(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

// An error answer whose "detail" nests 100,000 arrays (200 KB, far below the answer limit)
// is an error quoting the body, cut: the message was the detail's dump(), which recurses once
// per level and overflowed the stack.
TEST(VllmClientTest, AnErrorAnswerNestedDeeplyIsQuotedNotDumped) {
  int port = 0;
  const int fd = ListenOnLoopback(&port);
  ASSERT_GE(fd, 0);
  const std::string body = R"({"detail": )" + std::string(100000, '[') + std::string(100000, ']') + "}";
  std::thread server([&] {
    const int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    std::string request;
    char buf[4096];
    while (request.find("\r\n\r\n") == std::string::npos) {
      const ssize_t n = ::read(c, buf, sizeof buf);
      if (n <= 0) break;
      request.append(buf, static_cast<size_t>(n));
    }
    const std::string answer =
        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
        "\r\nConnection: close\r\n\r\n" + body;
    for (size_t off = 0; off < answer.size();) {
      const ssize_t n = ::write(c, answer.data() + off, answer.size() - off);
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(c);
  });
  auto client = VllmClient::Create({"http://127.0.0.1:" + std::to_string(port), 30000});
  ASSERT_TRUE(client.ok()) << client.status().message();
  auto models = (*client)->Models();
  server.join();
  ::close(fd);
  ASSERT_FALSE(models.ok());
  EXPECT_EQ(models.status().code(), StatusCode::kFailedPrecondition) << models.status().message();
  EXPECT_NE(models.status().message().find("HTTP 400 \"{\\\"detail\\\": [[[["), std::string::npos)
      << models.status().message().substr(0, 300);
  EXPECT_LT(models.status().message().size(), 1000u);
}

// A caller's deadline caps every request (a server that accepts and never answers is given up
// on at the deadline, not after the client's own 30 s), and a request after it fails at once.
TEST(VllmClientTest, ADeadlineBoundsEveryRequest) {
  int port = 0;
  const int fd = ListenOnLoopback(&port);  // the kernel accepts connections; nobody answers them
  ASSERT_GE(fd, 0);
  auto client = VllmClient::Create({"http://127.0.0.1:" + std::to_string(port), 30000});
  ASSERT_TRUE(client.ok()) << client.status().message();
  const auto start = std::chrono::steady_clock::now();
  (*client)->SetDeadline(start + std::chrono::milliseconds(1500));
  auto models = (*client)->Models();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(models.ok());
  EXPECT_EQ(models.status().code(), StatusCode::kUnavailable) << models.status().message();
  EXPECT_LT(took, 10.0) << models.status().message();
  EXPECT_GE(took, 1.0) << models.status().message();
  auto after = (*client)->Health();
  EXPECT_EQ(after.code(), StatusCode::kUnavailable);
  EXPECT_NE(after.message().find("no time left before the deadline"), std::string::npos) << after.message();
  ::close(fd);
}

}  // namespace
}  // namespace ferry::engine
