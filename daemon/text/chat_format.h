// Built-in chat formats, equal to transformers' apply_chat_template(messages,
// tokenize=False, add_generation_prompt) with these Jinja templates:
//
// kChatML (Qwen and others; the ChatML template transformers used as its class-level
// default_chat_template, also OpenHermes-2.5's; no default system message):
//   {% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']
//   + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n'
//   }}{% endif %}
//
// kLlama3 (Meta-Llama-3-8B-Instruct's tokenizer_config.json; not the 3.1 template):
//   {% set loop_messages = messages %}{% for message in loop_messages %}{% set content =
//   '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim
//   + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}
//   {{ content }}{% endfor %}{% if add_generation_prompt %}{{
//   '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
//   with bos_token "<|begin_of_text|>"; `trim` strips Python's str.isspace() characters.
//
// The text contains the BOS token where the template does (Llama-3): encode it with
// add_special_tokens=false, or the post-processor adds a second BOS.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "core/status.h"
#include "daemon/text/tokenizer.h"

namespace ferry::text {

enum class ChatFormat { kChatML, kLlama3 };

// "chatml" / "llama3".
std::string_view ChatFormatName(ChatFormat format);

struct ChatMessage {
  std::string role;     // "system", "user" or "assistant"
  std::string content;  // valid UTF-8
};

// The chat format a tokenizer can express, from its tokens: ChatML needs <|im_start|> and
// <|im_end|>; Llama-3 needs <|begin_of_text|>, <|start_header_id|>, <|end_header_id|> and
// <|eot_id|>. When both fit, the tokenizer's chat_template text decides (the one whose
// header token it mentions). kUnsupported naming the tokenizer's file when neither fits
// (or both fit and nothing decides).
Result<ChatFormat> DetectChatFormat(const Tokenizer& tokenizer);

// The conversation as text. kInvalidArgument for no messages (transformers refuses them too),
// and naming the message index for a role other than system/user/assistant or content that
// is not valid UTF-8.
Result<std::string> ApplyChatTemplate(ChatFormat format, std::span<const ChatMessage> messages,
                                      bool add_generation_prompt);

}  // namespace ferry::text
