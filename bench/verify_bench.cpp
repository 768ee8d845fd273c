// `ferry verify PATH` speed: hashing a multi-GB model directory (store::HashPath, which
// `ferry verify` runs: XXH3-128 per tensor plus the per-tensor statistics) against a plain
// sequential read() of the same files, measured side by side (interleaved, median of N),
// page cache warm for both. Prints the ratio; the issue asks for "close to" the read speed.
//
// Usage: ferry_bench_verify [--dir DIR] [--size-gb GB] [--reps N]
//   --dir DIR     a model directory to use (default: generate one under /tmp)
//   --size-gb GB  size of the generated model (default 2)
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "store/store.h"

namespace fs = std::filesystem;

namespace {

[[noreturn]] void Die(const std::string& m) {
  std::fprintf(stderr, "ferry_bench_verify: %s\n", m.c_str());
  std::exit(2);
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// BF16 tensors of 64 MiB with random bytes, in 1 GiB shards.
void Generate(const fs::path& dir, double size_gb) {
  fs::create_directories(dir);
  const int64_t rows = 8192, cols = 4096;  // 64 MiB of BF16
  const int n = std::max(1, static_cast<int>(size_gb * 1024 / 64));
  std::vector<ferry::TensorSpec> specs;
  for (int i = 0; i < n; ++i) specs.push_back({"model.layers." + std::to_string(i) + ".w.weight", ferry::DType::kBF16, {rows, cols}});
  ferry::WriterOptions o;
  o.max_shard_bytes = 1ull << 30;
  o.sync = false;
  auto w = ferry::SafetensorsWriter::CreateInDirectory(dir, specs, o);
  if (!w.ok()) Die(w.status().message());
  std::vector<uint16_t> buf(static_cast<size_t>(rows * cols));
  std::mt19937 rng(1);
  for (int i = 0; i < n; ++i) {
    for (auto& x : buf) x = static_cast<uint16_t>(rng() & 0x3fff);  // finite bf16 values
    if (auto s = (*w)->Append(std::as_bytes(std::span<const uint16_t>(buf))); !s.ok()) Die(s.message());
  }
  if (auto s = (*w)->Finish(); !s.ok()) Die(s.message());
}

uint64_t PlainRead(const fs::path& dir) {
  std::vector<char> buf(8u << 20);
  uint64_t acc = 0, total = 0;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) Die(f.string() + ": cannot open");
    ssize_t r;
    while ((r = ::read(fd, buf.data(), buf.size())) > 0) {
      for (ssize_t i = 0; i < r; i += 64) acc ^= static_cast<unsigned char>(buf[static_cast<size_t>(i)]);
      total += static_cast<uint64_t>(r);
    }
    ::close(fd);
  }
  return total + (acc & 0);
}

}  // namespace

int main(int argc, char** argv) {
  fs::path dir;
  double size_gb = 2;
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else if (a == "--size-gb" && i + 1 < argc) size_gb = std::atof(argv[++i]);
    else if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
    else {
      std::printf("Usage: ferry_bench_verify [--dir DIR] [--size-gb GB] [--reps N]\n");
      return a == "--help" ? 0 : 2;
    }
  }
  bool generated = false;
  if (dir.empty()) {
    dir = fs::temp_directory_path() / ("ferry-verify-bench-" + std::to_string(::getpid()));
    std::printf("generating %.1f GB model in %s\n", size_gb, dir.c_str());
    Generate(dir, size_gb);
    generated = true;
  }
  uint64_t bytes = PlainRead(dir);  // warm the page cache
  std::vector<double> read_s, hash_s;
  std::string id;
  for (int r = 0; r < reps; ++r) {
    read_s.push_back(Seconds([&] { bytes = PlainRead(dir); }));
    hash_s.push_back(Seconds([&] {
      auto rec = ferry::store::HashPath(dir);
      if (!rec.ok()) Die(rec.status().message());
      id = rec->id.Hex();
    }));
  }
  std::sort(read_s.begin(), read_s.end());
  std::sort(hash_s.begin(), hash_s.end());
  const double rd = read_s[read_s.size() / 2], hs = hash_s[hash_s.size() / 2];
  const double gb = static_cast<double>(bytes) / 1e9;
  std::printf("model: %.2f GB in %s (manifest %s), page cache warm, median of %d\n", gb, dir.c_str(), id.c_str(), reps);
  std::printf("  plain sequential read():     %6.3f s  %5.2f GB/s\n", rd, gb / rd);
  std::printf("  HashPath (ferry verify):     %6.3f s  %5.2f GB/s\n", hs, gb / hs);
  std::printf("  ratio verify / read: %.2f  (1.0 = as fast as reading the files)\n", hs / rd);
  if (generated) fs::remove_all(dir);
  return 0;
}
