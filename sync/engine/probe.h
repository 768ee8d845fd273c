// The proof that an inference engine runs a weight version, from the engine's own answers.
//
// vLLM's weight checker hashes nothing useful on a CPU (its linear layers are repacked and
// `layer.weight` left empty) and never sees a LoRA adapter; only an answer computed by the
// served model says what it runs. So: a probe of fixed token-id sequences; Ferry's runtime
// computes their prompt log-probabilities under the version (and under the version before
// it); the engine is asked for the same under the version's served name. The version is
// proven when
//   max |engine - reference(version)| <= tolerance          (it runs this version), and
//   that distance is smaller than max |engine - reference(previous)|   (not the one before),
// unless the two references are themselves within the tolerance of each other (the version
// does not change the model's answers measurably: then the first condition is the proof).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ferry::engine {

using Sequences = std::vector<std::vector<int32_t>>;
using LogProbs = std::vector<std::vector<double>>;  // [sequence][position - 1]

struct ProbeOptions {
  // One long sequence: one request to the engine (vLLM is asked one prompt at a time,
  // sync/engine/vllm_client.h). Callers cap the length below the model's positions (the
  // engine generates one token after the prompt).
  int sequences = 1;       // Default: 1
  int length = 64;         // tokens per sequence (>= 2). Default: 64
  uint64_t seed = 0x5eed;  // Default: a constant, so every party draws the same probe
};

// The probe's length for a model of `layers` decoder layers of width `hidden`: 64 tokens for
// small models, fewer (down to 16) as h^2 * L grows, so that the engine's forward over the
// probe stays a fraction of a second on a CPU (the 0.5B shape: 16; its 64-token request took
// 1.5-1.8 s on one vLLM CPU thread). Unknown sizes (<= 0): 64.
int ProbeLengthFor(int64_t hidden, int64_t layers);

// Deterministic pseudo-random token ids in [0, vocab_size): the same for the same options and
// vocabulary on every machine. kInvalidArgument for vocab_size < 2 or bad options.
[[nodiscard]] Result<Sequences> ProbeSequences(int64_t vocab_size, const ProbeOptions& options = {});

// The largest absolute difference between two sets of log-probabilities of the same shape
// (kInvalidArgument naming the sequence when the shapes differ; a NaN anywhere gives +inf).
[[nodiscard]] Result<double> MaxAbsDiff(const LogProbs& a, const LogProbs& b);

// The tolerance that fits a server's dtype: its rounding of the logits, with room for a
// different reduction order. "float32" 1e-4 (vLLM's CPU answers matched transformers to
// 1.3e-5 with a LoRA), "float16" 2e-2, "bfloat16" 1e-1. kInvalidArgument for others.
[[nodiscard]] Result<double> ToleranceForDtype(std::string_view dtype);

struct ProofFigures {
  double tolerance = 0;
  double max_diff = 0;                    // engine vs this version's reference
  std::optional<double> previous_diff;    // engine vs the previous version's reference
  std::optional<double> references_diff;  // the two references against each other
  int tokens = 0;                         // log-probabilities compared
  bool proven = false;
  std::string why;  // when not proven: what failed, with the figures
};

// Judges an engine's answer against the references (see the top of this file).
// `previous` is absent for the first version a server adopts.
[[nodiscard]] Result<ProofFigures> Judge(const LogProbs& engine, const LogProbs& reference, const LogProbs* previous,
                                         double tolerance);

}  // namespace ferry::engine
