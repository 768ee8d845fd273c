// The built-in chat formats against transformers' apply_chat_template (fixtures/tokenizers/
// chat.json), their detection from a tokenizer's special tokens, and their refusals.
#include "daemon/text/chat_format.h"

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/daemon/text_test_util.h"

namespace ferry::text {
namespace {

using testing::LoadFixture;
using testing::TokenizerFixtures;

nlohmann::json ChatFixture() {
  std::ifstream in(TokenizerFixtures() / "chat.json");
  return nlohmann::json::parse(in);
}

std::vector<ChatMessage> Messages(const nlohmann::json& conversation) {
  std::vector<ChatMessage> out;
  for (const auto& m : conversation) out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  return out;
}

TEST(ChatFormatTest, MatchesTransformersApplyChatTemplate) {
  const auto fixture = ChatFixture();
  const auto& conversations = fixture["conversations"];
  ASSERT_GE(conversations.size(), 9u);
  for (const auto& [name, format] :
       {std::pair{"chatml", ChatFormat::kChatML}, std::pair{"llama3", ChatFormat::kLlama3}}) {
    const auto& expected = fixture[name];
    ASSERT_EQ(expected.size(), conversations.size());
    for (size_t i = 0; i < conversations.size(); ++i) {
      const auto messages = Messages(conversations[i]);
      for (const bool gen : {false, true}) {
        auto text = ApplyChatTemplate(format, messages, gen);
        ASSERT_TRUE(text.ok()) << text.status().ToString();
        EXPECT_EQ(*text, expected[i][gen ? "generation" : "plain"].get<std::string>())
            << name << " conversation " << i << (gen ? " with" : " without") << " generation prompt";
      }
    }
  }
}

TEST(ChatFormatTest, KnownText) {
  const std::vector<ChatMessage> chat = {{"system", "Be brief."}, {"user", "  Hi  "}};
  EXPECT_EQ(*ApplyChatTemplate(ChatFormat::kChatML, chat, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  Hi  <|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(*ApplyChatTemplate(ChatFormat::kLlama3, chat, false),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
}

TEST(ChatFormatTest, DetectedFromSpecialTokens) {
  auto qwen = Tokenizer::FromDirectory(TokenizerFixtures() / "qwen2-style");
  ASSERT_TRUE(qwen.ok());
  EXPECT_EQ(*DetectChatFormat(*qwen), ChatFormat::kChatML);
  EXPECT_EQ(*DetectChatFormat(LoadFixture("qwen2")), ChatFormat::kChatML);
  auto llama3 = Tokenizer::FromDirectory(TokenizerFixtures() / "llama3-style");
  ASSERT_TRUE(llama3.ok());
  EXPECT_EQ(*DetectChatFormat(*llama3), ChatFormat::kLlama3);
  EXPECT_EQ(ChatFormatName(ChatFormat::kLlama3), "llama3");
  EXPECT_EQ(ChatFormatName(ChatFormat::kChatML), "chatml");
}

TEST(ChatFormatTest, TokenizerWithoutChatTokensIsUnsupportedNamingItsFile) {
  for (const char* name : {"gpt2", "llama2-legacy", "mistral-style"}) {
    const Tokenizer tok = LoadFixture(name);
    auto format = DetectChatFormat(tok);
    ASSERT_FALSE(format.ok()) << name;
    EXPECT_EQ(format.status().code(), StatusCode::kUnsupported);
    EXPECT_EQ(format.status().message().rfind(tok.source() + ": cannot express a chat", 0), 0u)
        << format.status().message();
  }
}

TEST(ChatFormatTest, RefusesOtherRolesBadTextAndEmptyChats) {
  auto role = ApplyChatTemplate(ChatFormat::kChatML, std::vector<ChatMessage>{{"user", "a"}, {"tool", "b"}}, false);
  ASSERT_FALSE(role.ok());
  EXPECT_EQ(role.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(role.status().message(), "chat message 1: role \"tool\" is not system, user or assistant");
  auto text = ApplyChatTemplate(ChatFormat::kLlama3, std::vector<ChatMessage>{{"user", "a\xff"}}, false);
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(text.status().message(), "chat message 0: content is not valid UTF-8 at byte 1");
  auto empty = ApplyChatTemplate(ChatFormat::kChatML, std::vector<ChatMessage>{}, true);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::text
