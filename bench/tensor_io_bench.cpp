// Tensor-file I/O against the plain-file floor, side by side in one run.
//
//   (a) read:  read() of every file into an 8 MiB buffer, XOR-accumulating every byte,
//              vs Checkpoint::Open + Get of every tensor, XOR-accumulating every byte.
//              Target: reader / plain <= 1.10.
//   (b) write: `cp -r` of the model directory vs writing the same tensors, in the same
//              order and sharding, through SafetensorsWriter into a new directory.
//              Target: writer / cp <= 1.10. Neither side fsyncs by default
//              (WriterOptions::sync = false); --fsync makes both durable (the writer
//              fdatasyncs each shard; cp is followed by fdatasync of every file it wrote).
//
// The model is a synthetic Llama-shaped BF16 checkpoint (hidden 2048, intermediate 5632,
// 8 KV heads of 64, vocab 32000), sharded with a limit of a third of its size (4 shards at
// 2 GiB); the layer count fills --size-gb.
// Every measurement runs warm (files in the page cache; caches are never dropped), each is
// repeated --reps times, interleaved (plain, ferry, plain, ferry, ...), and the median is
// reported. Exit status: 0 when both ratios pass, 1 when one fails, 2 on an error.
//
// Usage: ferry_bench_tensor_io [--dir DIR] [--size-gb GB] [--reps N] [--fsync]
//   --dir DIR    use the model in DIR when there is one, else create it there and keep it
//                (default: a temporary directory, removed at the end)
//   --size-gb GB model size (default 2)
//   --reps N     repetitions per measurement (default 3)
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"

extern char** environ;

namespace {

using ferry::bench::Median;
using ferry::bench::RunsText;
using ferry::bench::Seconds;

namespace fs = std::filesystem;
using ferry::Checkpoint;
using ferry::DType;
using ferry::Status;

constexpr size_t kReadBuffer = 8u << 20;
constexpr double kTargetRatio = 1.10;

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "ferry_bench_tensor_io: error: %s\n", msg.c_str());
  std::exit(2);
}

void Check(const Status& s) {
  if (!s.ok()) Die(s.message());
}

// XOR of every byte, 8 at a time; the same code touches bytes in both read paths.
uint64_t XorBytes(const std::byte* p, size_t n) {
  uint64_t acc = 0;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    acc ^= w;
  }
  for (; i < n; ++i) acc ^= static_cast<uint64_t>(p[i]) << (8 * (i % 8));
  return acc;
}

std::vector<ferry::TensorSpec> LlamaSpecs(double size_gb) {
  constexpr int64_t kHidden = 2048, kInter = 5632, kKv = 512, kVocab = 32000;
  auto bytes = [](const ferry::Shape& s) {
    int64_t n = 2;
    for (int64_t d : s) n *= d;
    return n;
  };
  std::vector<ferry::TensorSpec> layer = {
      {"input_layernorm.weight", DType::kBF16, {kHidden}},
      {"self_attn.q_proj.weight", DType::kBF16, {kHidden, kHidden}},
      {"self_attn.k_proj.weight", DType::kBF16, {kKv, kHidden}},
      {"self_attn.v_proj.weight", DType::kBF16, {kKv, kHidden}},
      {"self_attn.o_proj.weight", DType::kBF16, {kHidden, kHidden}},
      {"post_attention_layernorm.weight", DType::kBF16, {kHidden}},
      {"mlp.gate_proj.weight", DType::kBF16, {kInter, kHidden}},
      {"mlp.up_proj.weight", DType::kBF16, {kInter, kHidden}},
      {"mlp.down_proj.weight", DType::kBF16, {kHidden, kInter}},
  };
  int64_t layer_bytes = 0;
  for (const auto& s : layer) layer_bytes += bytes(s.shape);
  const int64_t fixed = 2 * bytes({kVocab, kHidden}) + bytes({kHidden});
  const auto target = static_cast<int64_t>(size_gb * 1024.0 * 1024.0 * 1024.0);
  const int64_t layers = std::max<int64_t>(1, (target - fixed + layer_bytes / 2) / layer_bytes);
  std::vector<ferry::TensorSpec> specs = {{"model.embed_tokens.weight", DType::kBF16, {kVocab, kHidden}}};
  for (int64_t i = 0; i < layers; ++i) {
    for (const auto& s : layer) {
      specs.push_back({"model.layers." + std::to_string(i) + "." + s.name, s.dtype, s.shape});
    }
  }
  specs.push_back({"model.norm.weight", DType::kBF16, {kHidden}});
  specs.push_back({"lm_head.weight", DType::kBF16, {kVocab, kHidden}});
  return specs;
}

uint64_t TotalBytes(const std::vector<ferry::TensorSpec>& specs) {
  uint64_t total = 0;
  for (const auto& s : specs) total += *ferry::CheckedByteSize(s.dtype, s.shape);
  return total;
}

uint64_t ShardLimit(uint64_t total) { return (total + 2) / 3; }

// Writes the synthetic model: BF16 values of magnitude around 2^-7, as trained weights are.
void CreateModel(const fs::path& dir, double size_gb) {
  const auto specs = LlamaSpecs(size_gb);
  ferry::WriterOptions opts;
  opts.max_shard_bytes = ShardLimit(TotalBytes(specs));
  opts.sync = false;
  auto w = ferry::SafetensorsWriter::CreateInDirectory(dir, specs, opts);
  if (!w.ok()) Die(w.status().message());
  std::vector<uint16_t> buf(kReadBuffer / 2);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (const auto& s : specs) {
    uint64_t left = *ferry::CheckedByteSize(s.dtype, s.shape);
    while (left > 0) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, kReadBuffer));
      for (size_t i = 0; i < n / 2; ++i) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        buf[i] = static_cast<uint16_t>((state & 0x807f) | 0x3c00);
      }
      Check((*w)->Append({reinterpret_cast<const std::byte*>(buf.data()), n}));
      left -= n;
    }
  }
  Check((*w)->Finish());
}

std::vector<fs::path> FilesIn(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

uint64_t DirBytes(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& f : FilesIn(dir)) total += fs::file_size(f);
  return total;
}

volatile uint64_t g_sink = 0;

uint64_t PlainRead(const fs::path& dir) {
  static std::vector<std::byte> buf(kReadBuffer);
  uint64_t acc = 0;
  uint64_t bytes = 0;
  for (const auto& f : FilesIn(dir)) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) Die(f.string() + ": " + std::strerror(errno));
    for (;;) {
      const ssize_t r = ::read(fd, buf.data(), buf.size());
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) Die(f.string() + ": " + std::strerror(errno));
      if (r == 0) break;
      acc ^= XorBytes(buf.data(), static_cast<size_t>(r));
      bytes += static_cast<uint64_t>(r);
    }
    ::close(fd);
  }
  g_sink = g_sink + acc;
  return bytes;
}

uint64_t CheckpointRead(const fs::path& dir) {
  auto c = Checkpoint::Open(dir);
  if (!c.ok()) Die(c.status().message());
  uint64_t acc = 0;
  uint64_t bytes = 0;
  for (const auto& name : c->names()) {
    auto t = c->Get(name);
    if (!t.ok()) Die(t.status().message());
    acc ^= XorBytes(t->data(), t->nbytes());
    bytes += t->nbytes();
  }
  g_sink = g_sink + acc;
  return bytes;
}

// Names in on-disk order (file, then offset), so a rewrite reproduces the layout.
std::vector<std::string> DiskOrder(const Checkpoint& c) {
  std::vector<std::string> names = c.names();
  std::sort(names.begin(), names.end(), [&](const std::string& x, const std::string& y) {
    const auto fx = c.FileOf(x), fy = c.FileOf(y);
    if (fx != fy) return fx < fy;
    return c.Info(x)->begin < c.Info(y)->begin;
  });
  return names;
}

void FsyncTree(const fs::path& dir) {
  for (const auto& f : FilesIn(dir)) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fdatasync(fd) != 0) Die(f.string() + ": fsync: " + std::strerror(errno));
    ::close(fd);
  }
  Check(ferry::SyncDirectory(dir));
}

void WriterCopy(const fs::path& src, const fs::path& dst, bool sync) {
  auto c = Checkpoint::Open(src);
  if (!c.ok()) Die(c.status().message());
  const auto order = DiskOrder(*c);
  std::vector<ferry::TensorSpec> specs;
  for (const auto& n : order) specs.push_back({n, c->Info(n)->dtype, c->Info(n)->shape});
  fs::create_directory(dst);
  ferry::WriterOptions opts;
  // The same files as the source (cp copies the same bytes): each tensor goes to the shard
  // that mirrors the file it comes from.
  const auto files = c->files();
  for (const auto& n : order) {
    const auto f = std::find(files.begin(), files.end(), c->FileOf(n));
    opts.shard_of.push_back(static_cast<uint32_t>(f - files.begin()));
  }
  if (files.size() <= 1) opts.shard_of.clear();  // one file: CreateInDirectory writes model.safetensors
  opts.sync = sync;
  auto w = ferry::SafetensorsWriter::CreateInDirectory(dst, specs, opts);
  if (!w.ok()) Die(w.status().message());
  for (const auto& n : order) {
    // Tensors that already sit in a file are copied inside the kernel (copy_file_range, as
    // cp does); the converter takes the same path for every unchanged tensor.
    const auto range = c->RangeOf(n);
    if (range.fd >= 0) {
      Check((*w)->AppendFileRange(range.fd, range.offset, range.length));
      continue;
    }
    auto t = c->Get(n);
    if (!t.ok()) Die(t.status().message());
    Check((*w)->Write(n, *t));
  }
  Check((*w)->Finish());
  if (sync) Check(ferry::SyncDirectory(dst));
}

void CpCopy(const fs::path& src, const fs::path& dst, bool sync) {
  std::vector<std::string> args = {"cp", "-r", src.string(), dst.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, "cp", nullptr, nullptr, argv.data(), environ) != 0) Die("cannot run cp");
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) Die("cp -r " + src.string() + " failed");
  if (sync) FsyncTree(dst);
}

// Flushes dirty pages of the filesystem holding `dir` (untimed), so that writeback left
// over from a previous step does not land inside the next measurement.
void Settle(const fs::path& dir) {
  if (const int err = ferry::bench::SettleFilesystem(dir)) Die(dir.string() + ": " + std::strerror(err));
}

struct Row {
  std::string label;
  std::vector<double> runs;
  uint64_t bytes = 0;
};

void PrintRow(const Row& r) {
  const double med = Median(r.runs);
  const std::string runs = RunsText(r.runs);
  std::printf("  %-44s %9.3f %9.2f   %s\n", r.label.c_str(), med,
              static_cast<double>(r.bytes) / (1024.0 * 1024.0 * 1024.0) / med, runs.c_str());
}

bool PrintRatio(const std::string& label, const Row& num, const Row& den) {
  const double ratio = Median(num.runs) / Median(den.runs);
  const bool pass = ratio <= kTargetRatio;
  std::printf("  %-44s %9.3f   %s (target <= %.2f)\n", label.c_str(), ratio, pass ? "PASS" : "FAIL", kTargetRatio);
  return pass;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir_arg;
  double size_gb = 2.0;
  int reps = 3;
  bool fsync = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--dir") {
      dir_arg = value();
    } else if (a == "--size-gb") {
      size_gb = std::atof(value().c_str());
    } else if (a == "--reps") {
      reps = std::atoi(value().c_str());
    } else if (a == "--fsync") {
      fsync = true;
    } else if (a == "--help" || a == "-h") {
      std::printf("Usage: ferry_bench_tensor_io [--dir DIR] [--size-gb GB] [--reps N] [--fsync]\n");
      return 0;
    } else {
      Die("unknown argument '" + a + "' (try --help)");
    }
  }
  if (!(size_gb > 0) || reps < 1) Die("--size-gb must be > 0 and --reps >= 1");

  // The work area holds the model (unless --dir) and the write outputs.
  const char* tmp_env = std::getenv("TMPDIR");
  std::string tmpl = (fs::path(tmp_env != nullptr ? tmp_env : "/tmp") / "ferry_bench_io_XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) Die("mkdtemp " + tmpl + ": " + std::strerror(errno));
  const fs::path work = tmpl;
  const fs::path model = dir_arg.empty() ? work / "model" : fs::path(dir_arg);

  std::error_code ec;
  if (!dir_arg.empty() && fs::is_directory(model, ec) && Checkpoint::Open(model).ok()) {
    std::printf("reusing the model in %s\n", model.c_str());
  } else {
    fs::create_directories(model, ec);
    if (ec) Die(model.string() + ": " + ec.message());
    std::printf("creating a %.2f GiB model in %s ...\n", size_gb, model.c_str());
    std::fflush(stdout);
    const double s = Seconds([&] { CreateModel(model, size_gb); });
    std::printf("  created in %.1f s\n", s);
  }

  auto ckpt = Checkpoint::Open(model);
  if (!ckpt.ok()) Die(ckpt.status().message());
  const uint64_t file_bytes = DirBytes(model);
  std::printf("\nFerry tensor I/O benchmark: %s, %zu files, %zu tensors, %.2f GiB of tensor data\n", model.c_str(),
              FilesIn(model).size(), ckpt->size(),
              static_cast<double>(ckpt->total_bytes()) / (1024.0 * 1024.0 * 1024.0));
  std::printf(
      "Warm page cache (caches are not dropped; dirty pages are synced, untimed, before each write);\n"
      "median of %d interleaved runs; writes %s.\n\n",
      reps, fsync ? "fsync'ed on both sides (--fsync)" : "not fsync'ed on either side (WriterOptions::sync = false)");

  // Warm-up: pull everything into the page cache once, untimed.
  Settle(model);
  PlainRead(model);
  CheckpointRead(model);

  Row plain{"read: read() 8 MiB buffer + XOR", {}, file_bytes};
  Row reader{"read: Checkpoint::Open + Get + XOR", {}, ckpt->total_bytes()};
  for (int r = 0; r < reps; ++r) {
    plain.runs.push_back(Seconds([&] { PlainRead(model); }));
    reader.runs.push_back(Seconds([&] { CheckpointRead(model); }));
  }

  const fs::path out_cp = work / "out_cp";
  const fs::path out_writer = work / "out_writer";
  Row cp{std::string("write: cp -r") + (fsync ? " + fdatasync" : ""), {}, file_bytes};
  Row writer{std::string("write: Checkpoint + SafetensorsWriter") + (fsync ? " (sync)" : ""), {}, 0};
  for (int r = 0; r < reps; ++r) {
    Settle(work);
    cp.runs.push_back(Seconds([&] { CpCopy(model, out_cp, fsync); }));
    fs::remove_all(out_cp, ec);
    Settle(work);
    writer.runs.push_back(Seconds([&] { WriterCopy(model, out_writer, fsync); }));
    writer.bytes = DirBytes(out_writer);
    fs::remove_all(out_writer, ec);
  }

  std::printf("  %-44s %9s %9s   %s\n", "measurement", "median s", "GiB/s", "runs (s)");
  PrintRow(plain);
  PrintRow(reader);
  const bool read_ok = PrintRatio("ratio reader / plain read", reader, plain);
  PrintRow(cp);
  PrintRow(writer);
  const bool write_ok = PrintRatio("ratio writer / cp -r", writer, cp);
  std::printf("\n(checksum %016llx)\n", static_cast<unsigned long long>(g_sink));

  fs::remove_all(work, ec);  // the write outputs, and the model unless it lives in --dir
  return read_ok && write_ok ? 0 : 1;
}
