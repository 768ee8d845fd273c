#include "daemon/text/chat_format.h"

#include "daemon/text/unicode.h"

namespace ferry::text {
namespace {

// Python's str.strip(): Python whitespace removed from both ends.
std::string_view PythonStrip(std::string_view s) {
  size_t begin = 0;
  while (begin < s.size()) {
    size_t i = begin;
    if (!IsPythonSpace(NextCodePoint(s, &i))) break;
    begin = i;
  }
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t i = start;
    if (!IsPythonSpace(NextCodePoint(s, &i))) break;
    end = start;
  }
  return s.substr(begin, end - begin);
}

bool HasAll(const Tokenizer& t, std::initializer_list<std::string_view> tokens) {
  for (std::string_view s : tokens) {
    if (!t.TokenId(s)) return false;
  }
  return true;
}

}  // namespace

std::string_view ChatFormatName(ChatFormat format) {
  switch (format) {
    case ChatFormat::kChatML: return "chatml";
    case ChatFormat::kLlama3: return "llama3";
  }
  return "?";
}

Result<ChatFormat> DetectChatFormat(const Tokenizer& tokenizer) {
  const bool chatml = HasAll(tokenizer, {"<|im_start|>", "<|im_end|>"});
  const bool llama3 =
      HasAll(tokenizer, {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"});
  if (chatml && !llama3) return ChatFormat::kChatML;
  if (llama3 && !chatml) return ChatFormat::kLlama3;
  const std::string& tmpl = tokenizer.chat_template();
  if (chatml && llama3) {
    const bool mentions_chatml = tmpl.find("<|im_start|>") != std::string::npos;
    const bool mentions_llama3 = tmpl.find("<|start_header_id|>") != std::string::npos;
    if (mentions_chatml != mentions_llama3) return mentions_chatml ? ChatFormat::kChatML : ChatFormat::kLlama3;
    return Status::Unsupported(tokenizer.source() +
                               ": has the special tokens of both ChatML and Llama-3 chat and no chat_template "
                               "that picks one");
  }
  return Status::Unsupported(tokenizer.source() +
                             ": cannot express a chat: it has neither the ChatML tokens (<|im_start|>, <|im_end|>) "
                             "nor the Llama-3 tokens (<|begin_of_text|>, <|start_header_id|>, <|end_header_id|>, "
                             "<|eot_id|>); give plain-text prompts instead");
}

Result<std::string> ApplyChatTemplate(ChatFormat format, std::span<const ChatMessage> messages,
                                      bool add_generation_prompt) {
  if (messages.empty()) return Status::InvalidArgument("a chat needs at least one message");
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant") {
      std::string shown = m.role.size() > 40 ? m.role.substr(0, 40) + "..." : m.role;
      if (FirstInvalidUtf8(shown)) shown = Utf8Lossy(shown);
      return Status::InvalidArgument("chat message " + std::to_string(i) + ": role \"" + shown +
                                     "\" is not system, user or assistant");
    }
    if (const auto bad = FirstInvalidUtf8(m.content)) {
      return Status::InvalidArgument("chat message " + std::to_string(i) + ": content is not valid UTF-8 at byte " +
                                     std::to_string(*bad));
    }
    switch (format) {
      case ChatFormat::kChatML:
        out += "<|im_start|>";
        out += m.role;
        out += '\n';
        out += m.content;
        out += "<|im_end|>\n";
        break;
      case ChatFormat::kLlama3:
        if (i == 0) out += "<|begin_of_text|>";
        out += "<|start_header_id|>";
        out += m.role;
        out += "<|end_header_id|>\n\n";
        out += PythonStrip(m.content);
        out += "<|eot_id|>";
        break;
    }
  }
  if (add_generation_prompt) {
    out +=
        format == ChatFormat::kChatML ? "<|im_start|>assistant\n" : "<|start_header_id|>assistant<|end_header_id|>\n\n";
  }
  return out;
}

}  // namespace ferry::text
