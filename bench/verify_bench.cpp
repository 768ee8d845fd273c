// `ferry verify PATH --db DB` against raw XXH3-128 over the same files (target: <= 1.10x),
// measured side by side (interleaved repetitions, min and median), page cache warm.
//
//   raw      the model's files memory-mapped and cut into 64 MiB blocks, each block hashed
//            with XXH3_128 (the same AVX2-dispatched xxHash build as Ferry's digests) by one
//            of as many threads as `ferry verify` uses (all hardware threads): the hashing
//            floor for these bytes on this machine, with nothing else done
//   HashPath store::HashPath(PATH), in this process: what `ferry verify` computes
//   command  `ferry verify PATH --db DB` as a process (store opened read-only, the version
//            looked up, one line printed) against this program re-run as a process in its
//            raw mode (`--raw FILE...`), so both sides pay a process start
// The model is imported into a store first (untimed); `ferry verify` must find it.
//
// Usage: ferry_bench_verify [--model DIR] [--size-gb GB] [--reps N] [--ferry PATH]
//   --model DIR   a model directory to use (default: generate BF16 tensors under /tmp)
//   --size-gb GB  size of the generated model (default 0.8)
//   --ferry PATH  the ferry binary (default: ../cli/ferry beside this program)
// Exit status: 0 when both ratios pass, 1 when one fails, 2 on an error.
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "core/safetensors.h"
#include "kernels/hash.h"
#include "store/store.h"

extern char** environ;

namespace fs = std::filesystem;

namespace {

using ferry::bench::Median;
using ferry::bench::Min;
using ferry::bench::RunsText;
using ferry::bench::Seconds;

constexpr double kTargetRatio = 1.10;
constexpr size_t kBlock = size_t{64} << 20;

[[noreturn]] void Die(const std::string& m) {
  std::fprintf(stderr, "ferry_bench_verify: %s\n", m.c_str());
  std::exit(2);
}

// BF16 tensors of 64 MiB with random finite values, in 1 GiB shards.
void Generate(const fs::path& dir, double size_gb) {
  fs::create_directories(dir);
  const int64_t rows = 8192, cols = 4096;  // 64 MiB of BF16
  const int n = std::max(1, static_cast<int>(size_gb * 1024 / 64));
  std::vector<ferry::TensorSpec> specs;
  for (int i = 0; i < n; ++i) {
    specs.push_back({"model.layers." + std::to_string(i) + ".w.weight", ferry::DType::kBF16, {rows, cols}});
  }
  ferry::WriterOptions o;
  o.max_shard_bytes = 1ull << 30;
  o.sync = false;
  auto w = ferry::SafetensorsWriter::CreateInDirectory(dir, specs, o);
  if (!w.ok()) Die(w.status().message());
  std::vector<uint16_t> buf(static_cast<size_t>(rows * cols));
  std::mt19937 rng(1);
  for (int i = 0; i < n; ++i) {
    for (auto& x : buf) x = static_cast<uint16_t>(rng() & 0x3fff);
    if (auto s = (*w)->Append(std::as_bytes(std::span<const uint16_t>(buf))); !s.ok()) Die(s.message());
  }
  if (auto s = (*w)->Finish(); !s.ok()) Die(s.message());
}

// Every regular file of `dir`, sorted.
std::vector<fs::path> FilesOf(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

// Raw XXH3-128 of every 64 MiB block of `files`, on every hardware thread. Returns the bytes.
uint64_t RawHash(const std::vector<fs::path>& files) {
  struct Map {
    const std::byte* p = nullptr;
    size_t n = 0;
  };
  std::vector<Map> maps;
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Die(f.string() + ": " + std::strerror(errno));
    struct stat st {};
    ::fstat(fd, &st);
    Map m;
    m.n = static_cast<size_t>(st.st_size);
    if (m.n > 0) {
      void* p = ::mmap(nullptr, m.n, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) Die(f.string() + ": mmap: " + std::strerror(errno));
      m.p = static_cast<const std::byte*>(p);
    }
    ::close(fd);
    maps.push_back(m);
  }
  std::vector<std::pair<size_t, size_t>> blocks;  // (map, offset)
  uint64_t total = 0;
  for (size_t i = 0; i < maps.size(); ++i) {
    for (size_t off = 0; off < maps[i].n; off += kBlock) blocks.push_back({i, off});
    total += maps[i].n;
  }
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> sink{0};
  auto worker = [&] {
    uint64_t acc = 0;
    for (size_t b = next++; b < blocks.size(); b = next++) {
      const Map& m = maps[blocks[b].first];
      const size_t off = blocks[b].second;
      acc ^= ferry::kernels::Xxh3_128(m.p + off, std::min(kBlock, m.n - off)).lo;
    }
    sink ^= acc;
  };
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned k = 1; k < threads; ++k) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  for (const Map& m : maps) {
    if (m.n > 0) ::munmap(const_cast<std::byte*>(m.p), m.n);
  }
  return total + (sink.load() & 0);
}

int Spawn(std::vector<std::string> args, bool quiet) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (quiet) posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) Die("cannot run " + args[0] + ": " + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void PrintRow(const char* label, const std::vector<double>& runs, uint64_t bytes) {
  const std::string all = RunsText(runs);
  std::printf("  %-40s %7.3f %8.3f %7.2f   %s\n", label, Min(runs), Median(runs),
              static_cast<double>(bytes) / 1e9 / Median(runs), all.c_str());
}

bool PrintRatio(const char* label, const std::vector<double>& num, const std::vector<double>& den) {
  const double ratio = Median(num) / Median(den);
  const bool pass = ratio <= kTargetRatio;
  std::printf("  %-40s median %.3f, min %.3f   %s (target <= %.2f, medians)\n", label, ratio, Min(num) / Min(den),
              pass ? "PASS" : "FAIL", kTargetRatio);
  return pass;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--raw") {  // the raw side, as a process
    std::vector<fs::path> files(argv + 2, argv + argc);
    RawHash(files);
    return 0;
  }
  fs::path model, ferry_bin = fs::path(argv[0]).parent_path() / ".." / "cli" / "ferry";
  double size_gb = 0.8;
  int reps = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model" || a == "--dir") {
      model = value();
    } else if (a == "--size-gb") {
      size_gb = std::atof(value().c_str());
    } else if (a == "--reps") {
      reps = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--ferry") {
      ferry_bin = value();
    } else {
      std::printf("Usage: ferry_bench_verify [--model DIR] [--size-gb GB] [--reps N] [--ferry PATH]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  if (!fs::exists(ferry_bin)) Die(ferry_bin.string() + " not found (build the ferry target, or pass --ferry)");
  const fs::path work = fs::temp_directory_path() / ("ferry-verify-bench-" + std::to_string(::getpid()));
  fs::create_directories(work);
  if (model.empty()) {
    model = work / "model";
    std::printf("generating a %.1f GB model in %s\n", size_gb, model.c_str());
    Generate(model, size_gb);
  }
  const fs::path db = work / "db";
  {
    ferry::store::StoreOptions so;
    so.create_if_missing = true;
    so.sync_objects = false;
    auto store = ferry::store::Store::Open(db, so);
    if (!store.ok()) Die(store.status().ToString());
    auto r = (*store)->Import(model, ferry::store::ImportOptions{});
    if (!r.ok()) Die(r.status().ToString());
  }
  const std::vector<fs::path> files = FilesOf(model);
  std::vector<std::string> raw_cmd = {argv[0], "--raw"};
  for (const auto& f : files) raw_cmd.push_back(f.string());
  const std::vector<std::string> verify_cmd = {ferry_bin.string(), "verify", model.string(), "--db", db.string()};

  uint64_t bytes = RawHash(files);  // warms the page cache
  if (Spawn(verify_cmd, true) != 0) Die("ferry verify " + model.string() + " did not find the imported version");
  std::vector<double> raw_s, hash_s, raw_proc_s, verify_s;
  std::string id;
  for (int r = 0; r < reps; ++r) {
    auto raw = [&] { raw_s.push_back(Seconds([&] { bytes = RawHash(files); })); };
    auto lib = [&] {
      hash_s.push_back(Seconds([&] {
        auto rec = ferry::store::HashPath(model);
        if (!rec.ok()) Die(rec.status().message());
        id = rec->id.Hex();
      }));
    };
    auto raw_proc = [&] { raw_proc_s.push_back(Seconds([&] { Spawn(raw_cmd, true); })); };
    auto cmd = [&] {
      verify_s.push_back(Seconds([&] {
        if (Spawn(verify_cmd, true) != 0) Die("ferry verify failed");
      }));
    };
    if (r % 2 == 0) {
      raw(), lib(), raw_proc(), cmd();
    } else {
      lib(), raw(), cmd(), raw_proc();
    }
  }
  std::printf("model: %.2f GB in %zu file(s) of %s (manifest %s), page cache warm, %d interleaved runs, %u threads\n",
              static_cast<double>(bytes) / 1e9, files.size(), model.c_str(), id.c_str(), reps,
              std::max(1u, std::thread::hardware_concurrency()));
  std::printf("  %-40s %7s %8s %7s   %s\n", "", "min s", "median s", "GB/s", "runs (s)");
  PrintRow("raw XXH3-128, 64 MiB blocks (in process)", raw_s, bytes);
  PrintRow("store::HashPath (in process)", hash_s, bytes);
  PrintRow("raw XXH3-128 (a process)", raw_proc_s, bytes);
  PrintRow("ferry verify PATH --db DB", verify_s, bytes);
  const bool lib_ok = PrintRatio("ratio HashPath / raw", hash_s, raw_s);
  const bool cmd_ok = PrintRatio("ratio ferry verify / raw process", verify_s, raw_proc_s);
  std::error_code ec;
  fs::remove_all(work, ec);
  return lib_ok && cmd_ok ? 0 : 1;
}
