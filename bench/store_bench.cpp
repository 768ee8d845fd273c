// Store import speed against `cp -r && sync`, and deduplication.
//
// 1. Speed (the target: import <= 1.30x the copy). Side by side, interleaved (the order
//    alternates every repetition), --reps times each, on one BF16 model directory (--model,
//    or a generated Llama-shaped one of --size-mb, default 800):
//      peer    `cp -r MODEL OUT` then `sync OUT/* OUT` (coreutils sync of the copied files
//              and the directory: fsync each, so the copy is as durable as the store's
//              objects; the whole-machine `sync` would also flush other processes' dirty
//              pages into the peer's time)
//      ferry   Store::Open + Import(MODEL) + close of an empty store created beforehand
//              (untimed: creating a store is a one-time cost, ~0.3 s of RocksDB files and
//              fsyncs, printed apart): what `ferry store import MODEL --db DB` does after
//              its start-up (objects fdatasynced, directories fsynced, one synced commit)
//    Before each timed run the filesystem's dirty pages are flushed (syncfs, untimed) and
//    the previous output is removed. Prints every run, min and median, and the ratios
//    ferry / peer of the medians (the target) and of the minimums.
// 2. Deduplication: into one store, import the model, the same model again (expected: 0 new
//    bytes), and a fine-tune of it with 2 tensors changed (expected: exactly those 2 tensors'
//    bytes). Generated models only (--model is used for step 1 alone).
// Exit status: 0 when the ratio and the dedup checks pass, 1 otherwise, 2 on an error.
//
// Usage: ferry_bench_store [--model DIR] [--size-mb N] [--reps N] [--dir DIR]
//   --dir DIR  work in DIR (created; removed at the end). Default: a temporary directory.
#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/safetensors.h"
#include "store/store.h"

extern char** environ;

namespace {

using ferry::bench::Median;
using ferry::bench::Min;
using ferry::bench::RunsText;
using ferry::bench::Seconds;

namespace fs = std::filesystem;
using ferry::Status;

constexpr double kTargetRatio = 1.30;

[[noreturn]] void Die(const std::string& m) {
  std::fprintf(stderr, "ferry_bench_store: %s\n", m.c_str());
  std::exit(2);
}

struct Spec {
  std::string name;
  ferry::Shape shape;
};

// Llama-like layers: per layer 4 attention matrices 1024x1024 and 3 MLP matrices 2816x1024
// (BF16: 2 MiB + 5.5 MiB each), as many layers as fill `size_mb`.
std::vector<Spec> LayerSpecs(uint64_t size_mb) {
  std::vector<Spec> specs;
  const uint64_t layer_bytes = 4ull * 1024 * 1024 * 2 + 3ull * 2816 * 1024 * 2;
  const uint64_t layers = std::max<uint64_t>(1, (size_mb << 20) / layer_bytes);
  for (uint64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"})
      specs.push_back({p + "self_attn." + m + ".weight", {1024, 1024}});
    for (const char* m : {"gate_proj", "up_proj"}) specs.push_back({p + "mlp." + m + ".weight", {2816, 1024}});
    specs.push_back({p + "mlp.down_proj.weight", {1024, 2816}});
  }
  return specs;
}

uint64_t Bytes(const Spec& s) { return static_cast<uint64_t>(s.shape[0] * s.shape[1]) * 2; }

Status WriteModel(const fs::path& dir, const std::vector<Spec>& specs, uint32_t changed_seed,
                  const std::vector<size_t>& changed) {
  fs::create_directories(dir);
  std::vector<ferry::TensorSpec> ts;
  for (const auto& s : specs) ts.push_back({s.name, ferry::DType::kBF16, s.shape});
  ferry::WriterOptions wo;
  wo.sync = false;
  FERRY_ASSIGN_OR_RETURN(auto w, ferry::SafetensorsWriter::CreateFile(dir / "model.safetensors", ts, wo));
  std::vector<std::byte> buf;
  for (size_t i = 0; i < specs.size(); ++i) {
    buf.resize(Bytes(specs[i]));
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
  return ferry::WriteFileAtomic(dir / "config.json", config, /*sync=*/false);
}

void Run(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) Die("cannot run " + args[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die(args[0] + " " + args[1] + " ... failed");
}

// `cp -r src dst && sync dst/* dst`.
void CopyAndSync(const fs::path& src, const fs::path& dst) {
  Run({"cp", "-r", src.string(), dst.string()});
  std::vector<std::string> args = {"sync"};
  for (const auto& e : fs::directory_iterator(dst)) args.push_back(e.path().string());
  args.push_back(dst.string());
  Run(args);
}

void CreateStore(const fs::path& db) {
  ferry::store::StoreOptions so;
  so.create_if_missing = true;
  auto store = ferry::store::Store::Open(db, so);
  if (!store.ok()) Die(store.status().ToString());
}

void Import(const fs::path& model, const fs::path& db) {
  auto store = ferry::store::Store::Open(db, ferry::store::StoreOptions{});
  if (!store.ok()) Die(store.status().ToString());
  auto r = (*store)->Import(model, ferry::store::ImportOptions{});
  if (!r.ok()) Die(r.status().ToString());
  if (r->already_present) Die("a fresh store already held " + model.string());
}

// Flushes the filesystem's dirty pages (untimed) so that no writeback left over from the
// previous step lands inside the next one.
void Settle(const fs::path& dir) {
  if (const int err = ferry::bench::SettleFilesystem(dir)) Die(dir.string() + ": " + std::strerror(err));
}

void PrintRow(const char* label, const std::vector<double>& runs, uint64_t bytes) {
  const std::string all = RunsText(runs);
  std::printf("  %-36s %8.3f %8.3f %8.2f   %s\n", label, Min(runs), Median(runs),
              static_cast<double>(bytes) / 1e9 / Median(runs), all.c_str());
}

uint64_t DirBytes(const fs::path& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file()) n += e.file_size();
  }
  return n;
}

bool SpeedRatio(const fs::path& model, const fs::path& work, int reps) {
  const uint64_t bytes = DirBytes(model);
  std::printf("import vs cp -r && sync: %s (%.2f GB), %d interleaved runs each\n", model.c_str(),
              static_cast<double>(bytes) / 1e9, reps);
  const fs::path out = work / "copy", db = work / "db";
  std::vector<double> peer, ferry, create;
  for (int r = 0; r < reps; ++r) {
    for (int k = 0; k < 2; ++k) {
      const bool peer_turn = (k == 0) == (r % 2 == 0);
      fs::remove_all(out);
      fs::remove_all(db);
      Settle(work);
      if (!peer_turn) {
        create.push_back(Seconds([&] { CreateStore(db); }));
        Settle(work);
      }
      if (peer_turn) {
        peer.push_back(Seconds([&] { CopyAndSync(model, out); }));
      } else {
        ferry.push_back(Seconds([&] { Import(model, db); }));
      }
    }
  }
  fs::remove_all(out);
  fs::remove_all(db);
  std::printf("  %-36s %8s %8s %8s   %s\n", "", "min s", "median s", "GB/s", "runs (s)");
  PrintRow("cp -r && sync (files + dir)", peer, bytes);
  PrintRow("Store::Open + Import + close", ferry, bytes);
  PrintRow("(apart: creating the empty store)", create, 0);
  const double ratio = Median(ferry) / Median(peer);
  const bool pass = ratio <= kTargetRatio;
  std::printf("  ratio import / copy: median %.3f, min %.3f   %s (target <= %.2f, medians)\n", ratio,
              Min(ferry) / Min(peer), pass ? "PASS" : "FAIL", kTargetRatio);
  return pass;
}

bool Dedup(const fs::path& dir, const std::vector<Spec>& specs) {
  const std::vector<size_t> changed = {1, specs.size() - 2};  // a k_proj and the last gate/up
  uint64_t changed_bytes = 0;
  for (size_t c : changed) changed_bytes += Bytes(specs[c]);
  if (Status s = WriteModel(dir / "finetune", specs, 1000, changed); !s.ok()) Die(s.ToString());
  ferry::store::StoreOptions so;
  so.create_if_missing = true;
  auto store = ferry::store::Store::Open(dir / "dedup-db", so);
  if (!store.ok()) Die(store.status().ToString());
  struct Step {
    const char* label;
    fs::path path;
  };
  uint64_t written[3] = {0, 0, 0};
  int i = 0;
  std::printf("deduplication:\n");
  for (const Step& step : {Step{"first import", dir / "base"}, Step{"same model again", dir / "base"},
                           Step{"fine-tune, 2 tensors changed", dir / "finetune"}}) {
    auto t0 = std::chrono::steady_clock::now();
    auto r = (*store)->Import(step.path, ferry::store::ImportOptions{});
    double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!r.ok()) Die(r.status().ToString());
    written[i++] = r->bytes_written;
    std::printf("  %-30s %12llu bytes written (%lld objects)  %.2f s  %s%s\n", step.label,
                static_cast<unsigned long long>(r->bytes_written), static_cast<long long>(r->objects_written), sec,
                r->record.id.Hex().c_str(), r->already_present ? " (already present)" : "");
  }
  uint64_t model_bytes = 0;
  for (const auto& s : specs) model_bytes += Bytes(s);
  std::printf("  model: %zu tensors, %llu bytes; changed tensors: %llu bytes\n", specs.size(),
              static_cast<unsigned long long>(model_bytes), static_cast<unsigned long long>(changed_bytes));
  const bool ok = written[1] == 0 && written[2] == changed_bytes;
  std::printf("  second import wrote %llu (expected 0), fine-tune wrote %llu (expected %llu): %s\n",
              static_cast<unsigned long long>(written[1]), static_cast<unsigned long long>(written[2]),
              static_cast<unsigned long long>(changed_bytes), ok ? "PASS" : "FAIL");
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t size_mb = 800;
  int reps = 5;
  fs::path dir, model;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--size-mb") {
      size_mb = std::strtoull(value().c_str(), nullptr, 10);
    } else if (a == "--dir") {
      dir = value();
    } else if (a == "--model") {
      model = value();
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(value().c_str()));
    } else {
      std::fprintf(stderr, "usage: %s [--model DIR] [--size-mb N] [--reps N] [--dir DIR]\n", argv[0]);
      return 2;
    }
  }
  if (dir.empty()) {
    std::string tmpl = (fs::temp_directory_path() / "ferry-store-bench-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) Die("cannot create " + tmpl);
    dir = tmpl;
  }
  fs::create_directories(dir);
  const std::vector<Spec> specs = LayerSpecs(size_mb);
  if (Status s = WriteModel(dir / "base", specs, 0, {}); !s.ok()) Die(s.ToString());
  const bool fast = SpeedRatio(model.empty() ? dir / "base" : model, dir, reps);
  const bool dedup = Dedup(dir, specs);
  std::error_code ec;
  fs::remove_all(dir, ec);
  return fast && dedup ? 0 : 1;
}
