// Store deduplication and import throughput.
//
//   1. import a synthetic BF16 model (--size-mb, default 512 MiB) into an empty store
//   2. import the same model again: expected 0 new bytes (already present)
//   3. import a fine-tune of it with 2 tensors changed: expected exactly those 2 tensors' bytes
// Prints the bytes written and the time of each import (objects fsynced, as by default).
// Exit status: 0 when steps 2 and 3 write what is expected, 1 otherwise, 2 on an error.
//
// Usage: ferry_bench_store [--size-mb N] [--dir DIR]
//   --dir DIR  work in DIR (created; removed at the end). Default: a temporary directory.
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "store/store.h"

namespace {

using ferry::Status;

struct Spec {
  std::string name;
  ferry::Shape shape;
};

Status WriteModel(const std::filesystem::path& dir, const std::vector<Spec>& specs, uint32_t changed_seed,
                  const std::vector<size_t>& changed) {
  std::filesystem::create_directories(dir);
  std::vector<ferry::TensorSpec> ts;
  for (const auto& s : specs) ts.push_back({s.name, ferry::DType::kBF16, s.shape});
  FERRY_ASSIGN_OR_RETURN(auto w, ferry::SafetensorsWriter::CreateFile(dir / "model.safetensors", ts));
  std::vector<std::byte> buf;
  for (size_t i = 0; i < specs.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : specs[i].shape) numel *= d;
    buf.resize(static_cast<size_t>(numel) * 2);
    uint32_t seed = static_cast<uint32_t>(i) + 1;
    for (size_t c : changed) {
      if (c == i) seed += changed_seed;
    }
    uint32_t x = seed * 2654435761u;
    for (size_t j = 0; j < buf.size(); j += 2) {
      x = x * 1664525u + 1013904223u;
      uint16_t v = static_cast<uint16_t>(0x3c00 | ((x >> 20) & 0x3ff));  // small finite BF16 values
      std::memcpy(buf.data() + j, &v, 2);
    }
    FERRY_RETURN_IF_ERROR(w->Append(buf));
  }
  FERRY_RETURN_IF_ERROR(w->Finish());
  std::string config = "{\"model_type\": \"llama\", \"torch_dtype\": \"bfloat16\"}";
  return ferry::WriteFileAtomic(dir / "config.json", config);
}

int Error(const Status& s) {
  std::fprintf(stderr, "ferry_bench_store: %s\n", s.ToString().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t size_mb = 512;
  std::filesystem::path dir;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--size-mb" && i + 1 < argc) {
      size_mb = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--size-mb N] [--dir DIR]\n", argv[0]);
      return 2;
    }
  }
  if (dir.empty()) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ferry-store-bench-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return 2;
    dir = tmpl;
  }
  std::filesystem::create_directories(dir);
  // Llama-like layers: per layer 4 attention matrices 1024x1024 and 3 MLP matrices 2816x1024
  // (BF16: 2 MiB + 5.5 MiB each); as many layers as fill the size.
  std::vector<Spec> specs;
  const uint64_t layer_bytes = 4ull * 1024 * 1024 * 2 + 3ull * 2816 * 1024 * 2;
  const uint64_t layers = std::max<uint64_t>(1, (size_mb << 20) / layer_bytes);
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"}) specs.push_back({p + "self_attn." + m + ".weight", {1024, 1024}});
    for (const char* m : {"gate_proj", "up_proj"}) specs.push_back({p + "mlp." + m + ".weight", {2816, 1024}});
    specs.push_back({p + "mlp.down_proj.weight", {1024, 2816}});
  }
  const std::vector<size_t> changed = {1, specs.size() - 2};  // a k_proj and the last gate/up
  uint64_t changed_bytes = 0;
  for (size_t c : changed) changed_bytes += static_cast<uint64_t>(specs[c].shape[0] * specs[c].shape[1]) * 2;

  int rc = 0;
  {
    if (Status s = WriteModel(dir / "base", specs, 0, {}); !s.ok()) return Error(s);
    if (Status s = WriteModel(dir / "finetune", specs, 1000, changed); !s.ok()) return Error(s);
    ferry::store::StoreOptions so;
    so.create_if_missing = true;
    auto store = ferry::store::Store::Open(dir / "db", so);
    if (!store.ok()) return Error(store.status());
    struct Step {
      const char* label;
      std::filesystem::path path;
    };
    uint64_t written[3] = {0, 0, 0};
    int i = 0;
    for (const Step& step : {Step{"first import", dir / "base"}, Step{"same model again", dir / "base"},
                             Step{"fine-tune, 2 tensors changed", dir / "finetune"}}) {
      auto t0 = std::chrono::steady_clock::now();
      auto r = (*store)->Import(step.path, ferry::store::ImportOptions{});
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!r.ok()) return Error(r.status());
      written[i++] = r->bytes_written;
      std::printf("%-30s %12llu bytes written (%lld objects)  %.2f s  %.2f GB/s hashed  %s%s\n", step.label,
                  static_cast<unsigned long long>(r->bytes_written), static_cast<long long>(r->objects_written), sec,
                  static_cast<double>(r->record.total_bytes) / 1e9 / sec, r->record.id.Hex().c_str(),
                  r->already_present ? " (already present)" : "");
    }
    uint64_t model_bytes = 0;
    for (const auto& s : specs) model_bytes += static_cast<uint64_t>(s.shape[0] * s.shape[1]) * 2;
    std::printf("model: %zu tensors, %llu bytes; changed tensors: %llu bytes\n", specs.size(),
                static_cast<unsigned long long>(model_bytes), static_cast<unsigned long long>(changed_bytes));
    const bool ok = written[1] == 0 && written[2] == changed_bytes;
    std::printf("second import wrote %llu (expected 0), fine-tune wrote %llu (expected %llu): %s\n",
                static_cast<unsigned long long>(written[1]), static_cast<unsigned long long>(written[2]),
                static_cast<unsigned long long>(changed_bytes), ok ? "PASS" : "FAIL");
    rc = ok ? 0 : 1;
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return rc;
}
