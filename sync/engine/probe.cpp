#include "sync/engine/probe.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/text.h"

namespace ferry::engine {

int ProbeLengthFor(int64_t hidden, int64_t layers) {
  if (hidden <= 0 || layers <= 0) return 64;
  const double cost = static_cast<double>(hidden) * static_cast<double>(hidden) * static_cast<double>(layers);
  return static_cast<int>(std::clamp(std::floor(268435456.0 / cost), 16.0, 64.0));
}

Result<Sequences> ProbeSequences(int64_t vocab_size, const ProbeOptions& options) {
  if (vocab_size < 2 || vocab_size > INT32_MAX) {
    return Status(StatusCode::kInvalidArgument,
                  "probe: vocabulary size " + std::to_string(vocab_size) + " is not in [2, 2^31)");
  }
  if (options.sequences < 1 || options.sequences > 64 || options.length < 2 || options.length > 4096) {
    return Status(StatusCode::kInvalidArgument, "probe: " + std::to_string(options.sequences) + " sequences of " +
                                                    std::to_string(options.length) +
                                                    " tokens is outside 1..64 sequences of 2..4096 tokens");
  }
  Sequences out(static_cast<size_t>(options.sequences));
  for (int s = 0; s < options.sequences; ++s) {
    for (int t = 0; t < options.length; ++t) {
      const uint64_t key[2] = {static_cast<uint64_t>(s), static_cast<uint64_t>(t)};
      const uint64_t h = XXH3_64bits_withSeed(key, sizeof(key), options.seed);
      out[s].push_back(static_cast<int32_t>(h % static_cast<uint64_t>(vocab_size)));
    }
  }
  return out;
}

Result<double> MaxAbsDiff(const LogProbs& a, const LogProbs& b) {
  if (a.size() != b.size()) {
    return Status(StatusCode::kInvalidArgument,
                  "probe: " + std::to_string(a.size()) + " sequences against " + std::to_string(b.size()));
  }
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) {
      return Status(StatusCode::kInvalidArgument, "probe: sequence " + std::to_string(i) + " has " +
                                                      std::to_string(a[i].size()) + " log-probabilities against " +
                                                      std::to_string(b[i].size()));
    }
    for (size_t t = 0; t < a[i].size(); ++t) {
      const double d = std::fabs(a[i][t] - b[i][t]);
      if (std::isnan(d)) return std::numeric_limits<double>::infinity();
      worst = std::max(worst, d);
    }
  }
  return worst;
}

Result<double> ToleranceForDtype(std::string_view dtype) {
  if (dtype == "float32" || dtype == "F32" || dtype == "fp32") return 1e-4;
  if (dtype == "float16" || dtype == "F16" || dtype == "fp16" || dtype == "half") return 2e-2;
  if (dtype == "bfloat16" || dtype == "BF16" || dtype == "bf16") return 1e-1;
  return Status(StatusCode::kInvalidArgument,
                "probe: no tolerance for the dtype " + Quote(dtype) + " (float32, float16 or bfloat16)");
}

Result<ProofFigures> Judge(const LogProbs& engine, const LogProbs& reference, const LogProbs* previous,
                           double tolerance) {
  ProofFigures f;
  f.tolerance = tolerance;
  auto d = MaxAbsDiff(engine, reference);
  if (!d.ok()) return d.status();
  f.max_diff = *d;
  for (const auto& s : engine) f.tokens += static_cast<int>(s.size());
  if (previous != nullptr) {
    auto p = MaxAbsDiff(engine, *previous);
    if (!p.ok()) return p.status();
    auto r = MaxAbsDiff(reference, *previous);
    if (!r.ok()) return r.status();
    f.previous_diff = *p;
    f.references_diff = *r;
  }
  if (!(f.max_diff <= tolerance)) {
    f.why = "the engine's answer differs from the version's by " + FormatNumber(f.max_diff, 3) + " (tolerance " +
            FormatNumber(tolerance, 3) + ")";
    if (f.previous_diff && *f.previous_diff <= tolerance) f.why += "; it matches the previous version's";
    return f;
  }
  if (f.previous_diff && *f.references_diff > tolerance && !(f.max_diff < *f.previous_diff)) {
    f.why = "the engine's answer is no nearer to the version (" + FormatNumber(f.max_diff, 3) +
            ") than to the previous one (" + FormatNumber(*f.previous_diff, 3) + ")";
    return f;
  }
  f.proven = true;
  return f;
}

}  // namespace ferry::engine
