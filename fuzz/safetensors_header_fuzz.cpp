// libFuzzer target: ParseSafetensorsHeader over arbitrary bytes, in memory.
//
// Beyond "no crash, no sanitizer report", every accepted header must satisfy the
// invariants the rest of Ferry relies on: the data section lies inside the input, tensors
// are sorted, contiguous from 0 and end exactly at the end of the input, and each one's
// byte length matches its dtype and shape.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <span>
#include <string>

#include "core/safetensors.h"
#include "core/tensor.h"

namespace {

void Check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> file(reinterpret_cast<const std::byte*>(data), size);
  auto h = ferry::ParseSafetensorsHeader(file, size);
  if (!h.ok()) {
    Check(!h.status().message().empty());
    return 0;
  }
  Check(h->data_offset >= 8 && h->data_offset <= size);
  Check(h->data_offset - 8 <= ferry::kMaxSafetensorsHeaderBytes);
  uint64_t expect = 0;
  std::set<std::string> names;
  for (const auto& t : h->tensors) {
    Check(t.name != "__metadata__");
    Check(names.insert(t.name).second);
    Check(t.begin == expect && t.end >= t.begin);
    auto need = ferry::CheckedByteSize(t.dtype, t.shape);
    Check(need.ok() && *need == t.nbytes());
    Check(t.end <= size - h->data_offset);
    // A zero-copy view over the input must be constructible for every tensor.
    auto view = ferry::Tensor::Wrap(t.dtype, t.shape, file.subspan(h->data_offset + t.begin, t.nbytes()), nullptr);
    Check(view.ok());
    if (ferry::CanReadAsF32(t.dtype) && view->numel() <= 4096) {
      std::vector<float> out(static_cast<size_t>(view->numel()));
      Check(ferry::ReadAsF32(*view, out).ok());
    }
    expect = t.end;
  }
  Check(h->data_offset + expect == size);
  return 0;
}
