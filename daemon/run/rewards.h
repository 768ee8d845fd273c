// Scoring completions: the built-in verifiable rewards and external reward commands.
//
// The trainer calls RewardScorer::ScoreAll once per step with the step's N completions and
// gets a RewardMatrix [N, F] (F reward functions in config order, NaN where a function gave
// no reward), plus the names (metrics rewards/<name>/mean) and the weights. Aggregation
// (TRL's weighted nansum, advantages) is the GRPO maths' job, not this file's.
//
// Built-in rewards (config keys in config.h's RewardSpec):
//   answer_match  The completion's answer is the text of capture group `group` of the LAST
//                 match of `pattern` (RE2, unanchored, matches taken left to right without
//                 overlap; default pattern: kDefaultAnswerPattern, the last number). 1.0 when
//                 it equals the example's `field`, else 0.0 (also when nothing matches).
//                 normalize = "auto": both sides trimmed of ASCII whitespace; when both then
//                 read as decimal numbers (sign, digits with optional thousands commas, an
//                 optional fraction, an optional exponent e/E) they are compared by exact
//                 decimal value ("42" = "42.0" = "+042" = "4.2e1", "1,000" = "1000",
//                 "-0" = "0"), otherwise as text, byte for byte. normalize = "none": the
//                 extracted text and the field must be byte-identical.
//   digit_match   Partial credit for the same extracted answer a (trimmed) against the
//                 field r (trimmed), compared character by character (UTF-8 code points):
//                 matches / max(len(a), len(r)), positions lined up from the left (align =
//                 "left") or from the right ("right"). 0.0 when nothing matches the
//                 pattern; 1.0 when both are empty. r = "123": a = "123" -> 1, "124" -> 2/3,
//                 "12" -> 2/3 (left) or 0 (right), "1234" -> 3/4 (left) or 0 (right).
//   regex         1.0 when `pattern` matches the whole completion (match = "full") or
//                 anywhere in it ("search"), else 0.0. RE2 syntax: "." does not match "\n"
//                 unless the pattern starts with (?s) (Python's re.DOTALL).
//   length        1 - min(1, |n - target| / target), n = the completion's token count:
//                 1.0 at the target, 0.5 at half or one and a half times it, 0.0 at 0 and
//                 from twice the target up.
//
// External reward command (type "command"). The process is started once, by Create, with
// argv `command` (no shell), in the config file's directory, in a process group of its own,
// ferryd's environment, stdin and stdout connected to ferryd, stderr to ferryd's stderr or
// `stderr_file` (appended). It is kept for the run. Protocol, UTF-8 JSON lines:
//   ferryd -> command, one line per completion:
//     {"index": I, "prompt_index": P, "completion_tokens": T, "last_in_batch": B,
//      "prompt": "...", "completion": "...", "example": {the dataset line's object}}
//     I counts the completions of this ScoreAll call from 0; P is RewardInput::prompt_index;
//     B is true on the last line of a batch (batch_size lines, or all of the call when
//     batch_size is 0). Invalid UTF-8 in prompt or completion becomes U+FFFD.
//   command -> ferryd, one line per completion, in order: {"reward": R}, R a finite number,
//     null or NaN (Python's json.dumps writes NaN); null and NaN mean "no reward" (NaN in
//     the matrix, skipped by TRL's nansum). Other keys are ignored.
// ferryd writes a batch and reads its replies at the same time (a command may answer line
// by line or after "last_in_batch"), then the next batch. The command must flush each line.
// Failures stop ScoreAll with an error naming the reward, its argv and the reply line
// (1-based over this call, a truncated copy): kCorruption for a reply that is not a JSON
// object with a "reward" that is a finite number, null or NaN, a line longer than
// max_reply_bytes, or more lines than completions; kUnavailable when the command exits (its
// status, or the signal that killed it) or closes its stdout before answering every line,
// or a batch takes longer than timeout_seconds. After a failure the process group is killed;
// later calls fail with kFailedPrecondition until Restart() starts the commands again.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/run/config.h"
#include "daemon/run/dataset.h"

namespace ferry::run {

// One completion to score.
struct RewardInput {
  std::string prompt;                // the prompt as the model saw it
  std::string completion;            // the completion's text
  int64_t completion_tokens = 0;     // its length in tokens
  const Example* example = nullptr;  // its prompt's dataset example. REQUIRES: non-null
  int64_t prompt_index = 0;          // which prompt of the step it answers
};

// Rewards of N completions by F functions.
struct RewardMatrix {
  size_t rows = 0;                 // N
  std::vector<std::string> names;  // F, config order
  std::vector<double> weights;     // F, the resolved weights
  std::vector<double> values;      // N * F, row-major; NaN: no reward

  size_t cols() const { return names.size(); }
  // REQUIRES: i < rows, f < cols().
  double at(size_t i, size_t f) const { return values[i * names.size() + f]; }
};

struct RewardScorerOptions {
  size_t max_reply_bytes = 64u << 10;  // a command's reply line. Default: 64 KiB
  // How long a stopping command may take to exit after its stdin closes before it is
  // killed. Default: 2 s.
  double stop_grace_seconds = 2.0;
};

class RewardCommand;

// Scores completions with a run's reward functions. Not thread-safe (one step at a time).
class RewardScorer {
 public:
  // Compiles the built-in rewards and starts the command processes. Errors: kNotFound /
  // kIOError naming a reward whose command cannot be started; kInvalidArgument for a spec
  // that does not hold (config.h's parser never makes one).
  [[nodiscard]] static Result<std::unique_ptr<RewardScorer>> Create(const std::vector<RewardSpec>& specs,
                                                                    const RewardScorerOptions& options = {});
  [[nodiscard]] static Result<std::unique_ptr<RewardScorer>> Create(const RunConfig& config,
                                                                    const RewardScorerOptions& options = {});
  // Closes the commands' stdin, waits stop_grace_seconds, then kills their process groups.
  ~RewardScorer();
  RewardScorer(const RewardScorer&) = delete;
  RewardScorer& operator=(const RewardScorer&) = delete;

  // Scores `inputs` with every function (built-ins, then each command in turn, all in
  // config order in the matrix). Errors as described at the top of this file, and
  // kInvalidArgument for an input without an example or whose example lacks a field a
  // reward reads.
  [[nodiscard]] Result<RewardMatrix> ScoreAll(const std::vector<RewardInput>& inputs);

  // Checks, before a run creates anything, that every function can score: one input made of
  // `example` (its prompt, or its last message's content) and an empty completion is scored
  // by all of them, so a command that hangs past its timeout, exits, or answers with
  // anything but a finite number, null or NaN is refused now, with the error ScoreAll
  // would give at the first step (see the top of this file). The command sees the probe as
  // an ordinary one-line call (index 0, last_in_batch true).
  [[nodiscard]] Status Probe(const Example& example);

  // Starts again every command that failed (or all of them with `all`). The caller chooses
  // whether a failed step is retried.
  [[nodiscard]] Status Restart(bool all = false);

  const std::vector<std::string>& names() const { return names_; }
  const std::vector<double>& weights() const { return weights_; }

 private:
  struct Function;
  RewardScorer() = default;

  std::vector<std::string> names_;
  std::vector<double> weights_;
  std::vector<std::unique_ptr<Function>> functions_;
};

}  // namespace ferry::run
