// Assertions shared by the sync tests.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include <cstring>

#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/file_util.h"
#include "core/safetensors.h"
#include "store/store.h"
#include "sync/receiver.h"
#include "sync/snapshot.h"

namespace ferry::sync {

// This process's anonymous resident memory (/proc/self/status RssAnon), in bytes; 0 where
// the kernel does not report it (Linux < 4.5).
inline uint64_t RssAnonBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoull(line.substr(8)) * 1024;
  }
  return 0;
}

// A converter fixture case (fixtures/cases/NAME: base/ and adapter/) as a snapshot source: the
// base's and the adapter's tensors copied into owned buffers, the adapter's config and the
// base's auxiliary files (config.json, generation_config.json and the tokenizer files).
inline SnapshotSource FixtureSnapshotSource(const std::filesystem::path& case_dir) {
  SnapshotSource src;
  for (const char* part : {"base", "adapter"}) {
    auto ckpt = Checkpoint::Open(case_dir / part);
    EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
    if (!ckpt.ok()) return src;
    auto& into = std::string(part) == "base" ? src.tensors : src.adapter_tensors;
    for (const auto& name : ckpt->names()) {
      Tensor t = ckpt->Get(name).value();
      Tensor copy = Tensor::Empty(t.dtype(), t.shape()).value();
      std::memcpy(copy.mutable_data(), t.data(), t.nbytes());
      into.emplace(name, copy);
    }
  }
  src.adapter_config = LoadPeftConfig(case_dir / "adapter").value();
  for (const char* n : {"config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer_config.json"}) {
    src.aux_files.emplace_back(n, ReadSmallFile(case_dir / "base" / n).value());
  }
  return src;
}

// A receiver `id` of the tests' publisher at `endpoints`, its directory root/recv-ID, with a
// 10 s timeout.
inline ReceiverOptions TestReceiverOptions(const Endpoints& endpoints, const std::filesystem::path& root,
                                           const std::string& id) {
  ReceiverOptions o;
  o.id = id;
  o.endpoints = endpoints;
  o.dir = root / ("recv-" + id);
  o.timeout_ms = 10000;
  return o;
}

// Checks that DIR/current points at versions/<v>, that the files it holds hash to `v`
// (store::HashPath, independent of the receiver's own bookkeeping) and that no temporary
// version directory (".tmp-") is left in DIR/versions. `record`, when given, receives the
// hashed record (for further checks by the caller).
inline void ExpectActiveVersion(const std::filesystem::path& dir, const store::Digest& v,
                                store::VersionRecord* record = nullptr) {
  auto active = ActiveVersion(dir);
  ASSERT_TRUE(active.ok()) << active.status().message();
  ASSERT_TRUE(active->has_value()) << dir << ": no current version";
  EXPECT_EQ(**active, v);
  auto rec = store::HashPath(dir / "current");
  ASSERT_TRUE(rec.ok()) << rec.status().message();
  EXPECT_EQ(rec->id, v);
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir / "versions", ec), end; !ec && it != end; it.increment(ec)) {
    EXPECT_EQ(it->path().filename().string().find(".tmp-"), std::string::npos) << "left behind: " << it->path();
  }
  if (record != nullptr) *record = std::move(*rec);
}

// Writes a tiny model into `dir` (created): model.safetensors with "a.weight" (F32, shape
// `a_shape`, values scale * (i + 1)) and "b.bias" (F32 [5], values -scale * i), plus a
// config.json naming the scale. Different scales give different versions.
inline void WriteTinyModel(const std::filesystem::path& dir, float scale, const Shape& a_shape) {
  std::filesystem::create_directories(dir);
  int64_t n = 1;
  for (int64_t d : a_shape) n *= d;
  std::vector<TensorSpec> specs = {{"a.weight", DType::kF32, a_shape}, {"b.bias", DType::kF32, {5}}};
  auto w = SafetensorsWriter::CreateFile(dir / "model.safetensors", specs);
  ASSERT_TRUE(w.ok()) << w.status().message();
  std::vector<float> a(static_cast<size_t>(n)), b(5);
  for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i)] = scale * static_cast<float>(i + 1);
  for (int i = 0; i < 5; ++i) b[static_cast<size_t>(i)] = -scale * static_cast<float>(i);
  ASSERT_TRUE((*w)->Append(std::as_bytes(std::span(a))).ok());
  ASSERT_TRUE((*w)->Append(std::as_bytes(std::span(b))).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  std::ofstream(dir / "config.json") << "{\"scale\": " << scale << "}\n";
}

}  // namespace ferry::sync
