// Materialising a stored version as a loadable directory (`ferry versions materialize`).
//
//   base / full / merged versions: Store::Export (layout hf only: the stored tensors are
//   written as they are).
//   adapter versions: the adapter and its base_version are exported into a temporary
//   directory beside `out`, merged with the converter's maths (ferry::Convert, convert/
//   converter.h) in the requested layout, and the temporary directory is removed. When the
//   store holds a merged version with the same base_version and adapter_version (and the
//   layout is hf), the result is checked against it: every tensor is first compared by
//   digest; tensors whose digests differ are compared by value (the recorded merge may come
//   from another implementation, e.g. PEFT, that rounds differently) and must agree within
//   |a - b| <= atol + rtol * |b| or max_ulp ULPs. Any other difference (a missing, extra,
//   re-shaped or out-of-tolerance tensor) is kCorruption naming the tensors, and nothing is
//   left at `out`. A recorded merged version that is derived is compared by digest only
//   (its bytes are defined as this very merge).
//   derived versions (store.h, "Derived versions"): the base_version and adapter_version are
//   exported into a temporary directory beside `out` and merged by the converter in the
//   version's recorded layout (hf or fused); the result is hashed (HashPath) and its id must
//   be exactly the version's: kCorruption naming both ids (and the first tensors that
//   differ) otherwise, and nothing is left at `out`. A damaged base or adapter object fails
//   the export with kCorruption naming that version and the derived one. options.layout
//   must be hf (the recorded layout is used); tolerances do not apply.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "convert/converter.h"
#include "core/status.h"
#include "store/store.h"

namespace ferry::store {

struct MaterializeOptions {
  Layout layout = Layout::kHf;  // Default: hf (fused and lora only for adapter versions)
  bool force = false;           // replace an existing `out`. Default: false.
  int threads = 0;              // merge threads. Default: 0 = all hardware threads.
  // Value check against a recorded merged version (see above). Defaults suit merges of the
  // same weights by different implementations: f32 rounding noise and one ULP of bf16/f16.
  double atol = 1e-6;   // Default: 1e-6
  double rtol = 1e-5;   // Default: 1e-5
  int64_t max_ulp = 1;  // Default: 1
  bool exact = false;   // require identical digests. Default: false.
};

struct MaterializeResult {
  VersionRecord version;  // the version materialised
  std::filesystem::path out;
  bool merged = false;                    // an adapter merged into its base (derived versions too)
  std::optional<Digest> checked_against;  // the recorded merged version compared with (a
                                          // derived version: itself, by id)
  int64_t tensors_identical = 0;          // digests equal to the recorded merged version
  int64_t tensors_within_tolerance = 0;   // digests differ, values within tolerance
  double max_abs_diff = 0;                // over the tolerance-checked tensors
};

// Materialises `version` at `out` (see above). Errors name the version (prefix) and, for a
// failed check, the tensors; on error nothing is left at `out`.
Result<MaterializeResult> Materialize(Store& store, const Digest& version, const std::filesystem::path& out,
                                      const MaterializeOptions& options);

}  // namespace ferry::store
