// A writer for the crash and reader tests: imports small synthetic versions into a store,
// one after another, printing each committed version id (flushed) as soon as Import returns.
//
//   ferry_store_crash_helper STORE [--count N] [--step]
//
// Version k (k = versions already in the store + 1, so a restarted helper carries on) goes
// to run "a", or "b" when k % 3 == 0; it changes two of the layer tensors, the "step" tensor
// (always) and, every fourth version, a 1 MiB tensor; config.json changes every fifth.
// Prints "ready" once the store is open. --step: wait for a line on stdin after each
// version. --count: stop after N versions (exit 0). Errors: message on stderr, exit 1.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include "store/store.h"

namespace {

using ferry::DType;
using ferry::Tensor;

Tensor Fill(DType dtype, ferry::Shape shape, uint32_t seed) {
  Tensor t = *Tensor::Empty(dtype, std::move(shape));
  uint32_t x = seed * 2654435761u + 12345;
  if (dtype == DType::kF32) {
    float* f = t.mutable_data_as<float>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      x = x * 1664525u + 1013904223u;
      f[i] = static_cast<float>(static_cast<int32_t>(x >> 8)) / 8388608.0f;
    }
  } else {
    for (size_t i = 0; i < t.nbytes(); ++i) {
      x = x * 1664525u + 1013904223u;
      t.mutable_data()[i] = static_cast<std::byte>(x >> 24);
    }
  }
  return t;
}

// Tensor i's content generation: the last version <= k that changed it.
uint32_t Generation(int i, uint64_t k) {
  for (uint64_t j = k; j > 0; --j) {
    if (static_cast<int>(j % 6) == i || static_cast<int>((j * 7 + 3) % 6) == i) return static_cast<uint32_t>(j);
  }
  return 0;
}

int Fail(const std::string& what, const ferry::Status& s) {
  std::fprintf(stderr, "crash_helper: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s STORE [--count N] [--step]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  int64_t count = -1;
  bool step = false;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--count") == 0 && i + 1 < argc) {
      count = std::stoll(argv[++i]);
    } else if (std::strcmp(argv[i], "--step") == 0) {
      step = true;
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  ferry::store::StoreOptions so;
  so.create_if_missing = true;
  auto store = ferry::store::Store::Open(dir, so);
  if (!store.ok()) return Fail("open", store.status());
  auto existing = (*store)->ListVersions(std::nullopt);
  if (!existing.ok()) return Fail("list", existing.status());
  uint64_t k = existing->size();
  std::printf("ready\n");
  std::fflush(stdout);

  for (int64_t done = 0; count < 0 || done < count; ++done) {
    ++k;
    std::map<std::string, Tensor> tensors;
    for (int i = 0; i < 6; ++i) {
      tensors["layers." + std::to_string(i) + ".weight"] = Fill(DType::kF32, {32, 64}, Generation(i, k) * 16 + i);
    }
    tensors["embed.weight"] = Fill(DType::kBF16, {128, 128}, 7);  // never changes
    tensors["big.weight"] = Fill(DType::kF32, {256, 1024}, static_cast<uint32_t>(k / 4));
    Tensor s = *Tensor::Empty(DType::kI64, {1});
    *s.mutable_data_as<int64_t>() = static_cast<int64_t>(k);
    tensors["step"] = s;
    auto ckpt = ferry::Checkpoint::FromTensors("synthetic-" + std::to_string(k), std::move(tensors));
    ferry::AuxFiles aux = {{"config.json", "{\"generation\": " + std::to_string(k / 5) + "}"}};
    ferry::store::ImportOptions io;
    io.run = k % 3 == 0 ? "b" : "a";
    io.step = static_cast<int64_t>(k);
    auto r = (*store)->ImportCheckpoint(ckpt, aux, io);
    if (!r.ok()) return Fail("import " + std::to_string(k), r.status());
    std::printf("%s\n", r->record.id.Hex().c_str());
    std::fflush(stdout);
    if (step) {
      std::string line;
      if (!std::getline(std::cin, line)) break;
    }
  }
  return 0;
}
