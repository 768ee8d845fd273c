// The prompts of a training run: a JSONL file, and the seeded order it is read in.
//
// Format. UTF-8, one JSON object per line ("\n" or "\r\n"); lines holding only spaces and
// tabs are skipped (they still count in line numbers); a UTF-8 byte-order mark before the
// first line is skipped. Each object has exactly one of:
//   "prompt": "text"                                 a plain-text prompt (not empty), or
//   "prompt": [{"role": "...", "content": "..."}]    TRL's conversational prompt, or
//   "messages": [{"role": ..., "content": ...}, ...]  TRL's conversational format,
// plus any other fields (the rewards read them: daemon/run/rewards.h). Messages have a role
// "system", "user" or "assistant" and a string content (other keys of a message are
// ignored); the list must not be empty and its LAST message must be a "user" message:
// ferryd generates the assistant turn, so a trailing assistant message (TRL would continue
// it) is an error, not dropped — put the reference answer in a field of its own.
// Conversational prompts need a chat template (RunConfig::chat_template other than "none").
//
// Errors name the file, the line and the field: "FILE:LINE: field 'prompt[1].role': ...".
// kCorruption for a malformed line (not JSON, not an object, a field of the wrong type or
// value, a field a reward needs that is missing or not a string / number); kUnsupported for
// the limits of DatasetOptions; kInvalidArgument for a dataset without examples; kNotFound
// / kIOError for the file itself.
//
// Order. Epoch e (0, 1, 2, ...) reads the examples in the order EpochOrder(n, seed, e):
//   1. SplitMix64 with state x = seed XOR (e * 0x9E3779B97F4A7C15) (mod 2^64); each output is
//        x += 0x9E3779B97F4A7C15; z = x; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
//        z = (z ^ (z >> 27)) * 0x94D049BB133111EB; output z ^ (z >> 31)     (all mod 2^64)
//   2. xoshiro256** with state s[0..3] = the first four SplitMix64 outputs; each output is
//        r = rotl(s[1] * 5, 7) * 9; t = s[1] << 17; s[2] ^= s[0]; s[3] ^= s[1];
//        s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t; s[3] = rotl(s[3], 45); output r
//   3. Uniform(m), an integer in [0, m): draw r until r >= (2^64 - m) mod m, return r mod m
//      (unbiased rejection).
//   4. Fisher-Yates from the identity [0, 1, ..., n-1]: for i = n-1 down to 1,
//      j = Uniform(i + 1), swap(order[i], order[j]).
// With shuffle off (shuffle_dataset = false) every epoch is the identity. Integer
// arithmetic only, so every platform gives the same order (fixtures/run has the order of
// an independent Python implementation, checked by the tests). DatasetSampler::Next(k)
// continues across epoch boundaries: no example is skipped (TRL's RepeatSampler drops an
// incomplete last batch of each epoch instead).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"
#include "daemon/run/config.h"

namespace ferry::run {

struct ChatMessage {
  std::string role;  // "system" | "user" | "assistant"
  std::string content;
};

struct Example {
  size_t index = 0;                   // 0-based, in file order
  uint64_t line = 0;                  // 1-based line of the file
  std::string prompt;                 // the plain-text prompt; empty when conversational
  std::vector<ChatMessage> messages;  // the conversational prompt (ends with a user message)
  std::string json;                   // the line's JSON object, as written in the file
  // Top-level string and number fields as text (a string as is, a number as JSON writes
  // it: 42, -3.5, 1e+20), sorted by name.
  std::vector<std::pair<std::string, std::string>> fields;

  bool conversational() const { return !messages.empty(); }
  // The field's text, or nullptr when it is absent or not a string or a number.
  const std::string* Field(std::string_view name) const;
};

struct DatasetOptions {
  size_t max_file_bytes = size_t{1} << 30;  // Default: 1 GiB
  size_t max_line_bytes = size_t{1} << 20;  // Default: 1 MiB
  size_t max_examples = size_t{1} << 24;    // at most 2^32. Default: 16,777,216
  int max_json_depth = 32;                  // nesting of arrays / objects. Default: 32
  // Fields every example must have as a string or a number (the rewards' fields). Default: none.
  std::vector<std::string> required_fields;
  // false: conversational prompts are refused (chat_template = "none"). Default: true.
  bool allow_messages = true;
};

// The options a run's config implies: its answer_match / digit_match fields, and whether
// its chat_template allows conversational prompts.
DatasetOptions DatasetOptionsFor(const RunConfig& config);

// The examples of one JSONL file, immutable once loaded.
class Dataset {
 public:
  // Reads and checks `path` (a regular file). Errors as described at the top of this file.
  [[nodiscard]] static Result<std::shared_ptr<const Dataset>> Load(const std::filesystem::path& path,
                                                                   const DatasetOptions& options);
  // Parses `text` as the file `source` (used in messages; nothing is read).
  [[nodiscard]] static Result<std::shared_ptr<const Dataset>> Parse(std::string_view text, std::string source,
                                                                    const DatasetOptions& options);

  size_t size() const { return examples_.size(); }
  // REQUIRES: i < size().
  const Example& operator[](size_t i) const { return examples_[i]; }
  const std::vector<Example>& examples() const { return examples_; }
  const std::string& source() const { return source_; }
  // XXH3-128 (seed 0) of the file's bytes, 32 lowercase hex digits: a resumed run compares it.
  const std::string& digest() const { return digest_; }

 private:
  Dataset() = default;
  std::string source_;
  std::string digest_;
  std::vector<Example> examples_;
};

// Where a sampler stands: the next example read is EpochOrder(n, seed, epoch)[index].
// REQUIRES (as a saved value): index < the dataset's size.
struct DatasetPosition {
  uint64_t epoch = 0;
  uint64_t index = 0;
  bool operator==(const DatasetPosition&) const = default;
};

// The order of epoch `epoch` over `n` examples (the algorithm at the top of this file;
// the identity when !shuffle). REQUIRES: n <= 2^32.
std::vector<uint32_t> EpochOrder(uint64_t n, uint64_t seed, uint64_t epoch, bool shuffle = true);

// Reads a dataset in the seeded order, epoch after epoch. Not thread-safe.
class DatasetSampler {
 public:
  // Starts at {epoch 0, index 0}. REQUIRES: dataset non-null and non-empty (Dataset
  // guarantees it).
  DatasetSampler(std::shared_ptr<const Dataset> dataset, uint64_t seed, bool shuffle);
  // seed and shuffle_dataset of `config`.
  DatasetSampler(std::shared_ptr<const Dataset> dataset, const RunConfig& config);

  // The next `k` examples, continuing into the next epoch(s) as needed. The pointers live
  // as long as the dataset.
  std::vector<const Example*> Next(size_t k);
  // The same, as indices into the dataset.
  std::vector<size_t> NextIndices(size_t k);

  // The position of the next example to be read (index < size; after the last example of
  // an epoch it is {epoch + 1, 0}).
  DatasetPosition position() const;
  // Continues from a saved position(). kInvalidArgument when position.index >= size(); the
  // sampler is unchanged then.
  [[nodiscard]] Status Seek(DatasetPosition position);

  const Dataset& dataset() const { return *dataset_; }

 private:
  void EnterEpoch(uint64_t epoch);

  std::shared_ptr<const Dataset> dataset_;
  uint64_t seed_;
  bool shuffle_;
  uint64_t epoch_ = 0;
  uint64_t index_ = 0;
  std::vector<uint32_t> order_;  // of epoch_
};

}  // namespace ferry::run
