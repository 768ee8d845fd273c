// ferryd data-parallel on c10d (issue 33's speed target): completions trained per second by 2
// ranks of one thread each (`ferryd train --nproc-per-node 2`) against one process of one thread,
// at the same per-rank batch, on the bundled demo (fixtures/demo: tiny Llama, LoRA r 8 on all
// 7 projections, 8 completions per prompt, 4 tokens). The two settings alternate, --reps times
// each; per run, the steps after --warmup are timed from ferryd's --json lines (one per step,
// stamped as the bench reads them), so start-up is left out. Printed per setting: the median
// seconds per step and completions per second, then the ratio (target >= 1.7) and, from the
// 2-rank runs' metrics, the share of a step spent in the collectives (timing/communication:
// the rollout gather, the gradient all-reduce and the end-of-step gather, waiting for the
// slower rank included; target <= 5%) and where the rest goes (timing/*). Then the same
// collectives alone, between two threads of this process over loopback with nothing else
// running: the gradient all-reduce (the demo adapter's size), the rollout gather and the
// end-of-step gather, each the median of 200: what the collectives themselves cost a step.
//
// The machine's own ceiling is measured in the same reps: two independent one-process runs at
// once (no collective, nothing shared but the machine), whose completions per second against
// one run alone bound what any 2-rank run can reach here. The 2-rank ratio is printed against
// it too: the part of the machine's parallelism the ranks keep.
//
// A GEMM calibration (F32 at::mm 512 x 1024 x 1024 on one thread, the median GFLOP/s of 7) is
// printed before and after: other work on the machine shows as a drop.
//
// Usage: ferry_bench_dp [--reps 3] [--steps 60] [--warmup 10] [--batch 64] [--work DIR] [--keep]
//   --batch: completions per rank and step (per_device_train_batch_size; 8 per prompt).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "bench/torch_calibration.h"
#include "daemon/dist/process_group.h"

namespace {

namespace fs = std::filesystem;
using ferry::bench::CalibrationGflops;
using ferry::bench::Median;
using ferry::bench::Now;
using ferry::bench::Seconds;

struct Run {
  double seconds_per_step = 0;
  double cores = 0;                      // CPU seconds (user + system, every process and thread) per second of the run
  std::map<std::string, double> timing;  // mean of timing/* and step_time over the timed steps
};

double ChildCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_CHILDREN, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// One `ferryd train` run; the seconds between the --json lines of the timed steps. `cores` is
// left 0 (the caller measures it around runs that overlap).
Run TrainOnce(const fs::path& config, const fs::path& dir, int nproc, int steps, int warmup) {
  std::string cmd = std::string(FERRYD_PATH) + " train --json --config " + config.string() + " --dir " + dir.string() +
                    " --max-steps " + std::to_string(steps);
  if (nproc > 1) cmd += " --nproc-per-node " + std::to_string(nproc);
  cmd += " 2>" + (dir.string() + ".log");
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    std::fprintf(stderr, "cannot run %s\n", cmd.c_str());
    std::exit(1);
  }
  std::vector<double> stamps;
  std::vector<nlohmann::json> lines;
  char buf[1 << 16];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) {
    stamps.push_back(Now());
    lines.push_back(nlohmann::json::parse(buf, nullptr, false));
  }
  if (::pclose(p) != 0 || static_cast<int>(lines.size()) != steps) {
    std::fprintf(stderr, "ferryd failed or logged %zu of %d steps; see %s.log\n", lines.size(), steps,
                 dir.string().c_str());
    std::exit(1);
  }
  Run r;
  r.seconds_per_step = (stamps.back() - stamps[static_cast<size_t>(warmup) - 1]) / static_cast<double>(steps - warmup);
  for (size_t i = static_cast<size_t>(warmup); i < lines.size(); ++i) {
    for (const auto& [k, v] : lines[i].items()) {
      if ((k.starts_with("timing/") || k == "step_time") && v.is_number()) {
        r.timing[k] += v.get<double>() / static_cast<double>(steps - warmup);
      }
    }
  }
  return r;
}

// TrainOnce with the cores busy over the run.
Run TrainMeasured(const fs::path& config, const fs::path& dir, int nproc, int steps, int warmup) {
  const double cpu = ChildCpuSeconds(), start = Now();
  Run r = TrainOnce(config, dir, nproc, steps, warmup);
  r.cores = (ChildCpuSeconds() - cpu) / (Now() - start);
  return r;
}

// Two independent one-process runs at once: the seconds per step of each, and the cores busy.
std::pair<double, double> TrainPair(const fs::path& config, const fs::path& dir, int steps, int warmup) {
  const double cpu = ChildCpuSeconds(), start = Now();
  Run other;
  std::thread t([&] { other = TrainOnce(config, dir.string() + "-b", 1, steps, warmup); });
  const Run one = TrainOnce(config, dir.string() + "-a", 1, steps, warmup);
  t.join();
  const double cores = (ChildCpuSeconds() - cpu) / (Now() - start);
  // Completions per second of the pair, as seconds per step of one run producing them all.
  return {2.0 / (1.0 / one.seconds_per_step + 1.0 / other.seconds_per_step), cores};
}

struct Collectives {
  double allreduce = 0, rollout = 0, step_end = 0;  // median seconds each
};

// The step's collectives alone between two ranks (threads of this process, loopback Gloo).
Collectives TimeCollectives(int64_t gradient_floats, int64_t rows, int64_t metrics) {
  auto free_port = ferry::dist::FreeLoopbackPort();
  if (!free_port.ok()) std::exit(1);
  const int port = *free_port;
  Collectives out;
  auto rank = [&](int r) {
    ferry::dist::Launch l;
    l.rank = r;
    l.world_size = 2;
    l.master_port = port;
    auto g = ferry::dist::ProcessGroup::Join(l, ferry::dist::GroupOptions{});
    if (!g.ok()) {
      std::fprintf(stderr, "%s\n", g.status().ToString().c_str());
      std::exit(1);
    }
    at::Tensor grads = at::ones({gradient_floats});
    const at::Tensor stats = at::ones({rows, 5}, at::kDouble);
    const at::Tensor end = at::ones({metrics + 9}, at::kDouble);
    std::vector<double> a, b, c;
    for (int i = 0; i < 220; ++i) {
      const double t0 = Now();
      if (!(*g)->AllReduceSum(grads, "bench").ok()) std::exit(1);
      const double t1 = Now();
      if (!(*g)->AllGather(stats, "bench").ok()) std::exit(1);
      const double t2 = Now();
      if (!(*g)->AllGather(end, "bench").ok()) std::exit(1);
      const double t3 = Now();
      if (i >= 20) {
        a.push_back(t1 - t0);
        b.push_back(t2 - t1);
        c.push_back(t3 - t2);
      }
    }
    if (r == 0) out = {Median(a), Median(b), Median(c)};
  };
  std::thread other(rank, 1);
  rank(0);
  other.join();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 3, steps = 60, warmup = 10, batch = 64;
  fs::path work;
  bool keep = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--reps") {
      reps = std::atoi(next().c_str());
    } else if (a == "--steps") {
      steps = std::atoi(next().c_str());
    } else if (a == "--warmup") {
      warmup = std::atoi(next().c_str());
    } else if (a == "--batch") {
      batch = std::atoi(next().c_str());
    } else if (a == "--work") {
      work = next();
    } else if (a == "--keep") {
      keep = true;
    } else {
      std::fprintf(stderr,
                   "usage: ferry_bench_dp [--reps 3] [--steps 60] [--warmup 10] [--batch 64] [--work DIR] [--keep]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (reps < 1 || warmup < 1 || steps <= warmup || batch < 8 || batch % 8 != 0) {
    std::fprintf(stderr, "need reps >= 1, 1 <= warmup < steps, batch a positive multiple of 8\n");
    return 2;
  }
  if (work.empty()) {
    char tmpl[] = "/tmp/ferry_bench_dp_XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return 1;
    work = tmpl;
  }
  fs::create_directories(work);
  // The demo, one thread per rank, a --json line per step, no checkpoint but the last.
  const fs::path demo = fs::path(FERRY_SOURCE_DIR) / "fixtures" / "demo";
  std::ifstream in(demo / "grpo.toml");
  std::ostringstream out;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("model_name_or_path")) line = "model_name_or_path = \"" + (demo / "model").string() + "\"";
    if (line.starts_with("dataset")) line = "dataset = \"" + (demo / "train.jsonl").string() + "\"";
    if (line.starts_with("threads")) line = "threads = 1";
    if (line.starts_with("per_device_train_batch_size")) {
      line = "per_device_train_batch_size = " + std::to_string(batch);
    }
    if (line.starts_with("logging_steps")) line = "logging_steps = 1";
    if (line.starts_with("save_steps")) line = "save_steps = 100000";
    out << line << "\n";
  }
  const fs::path config = work / "grpo.toml";
  std::ofstream(config) << out.str();

  at::set_num_threads(1);
  std::printf(
      "ferryd data-parallel on the demo: %d completions per rank and step, one thread per rank, %d steps "
      "(%d timed) x %d reps\n",
      batch, steps, steps - warmup, reps);
  std::printf("calibration before: F32 GEMM 512x1024x1024 %.1f GFLOP/s (1 thread)\n", CalibrationGflops());
  std::vector<double> one, two, pair, one_cores, two_cores, pair_cores;
  int64_t adapter_bytes = 0;
  std::map<std::string, std::vector<double>> one_timing, two_timing;
  for (int r = 0; r < reps; ++r) {
    for (int nproc : {1, 2}) {
      const fs::path dir = work / ("run-" + std::to_string(nproc) + "-" + std::to_string(r));
      const Run run = TrainMeasured(config, dir, nproc, steps, warmup);
      if (adapter_bytes == 0) {
        // The demo adapter's size: its checkpoint's safetensors file (the header is small).
        for (const auto& e : fs::directory_iterator(dir)) {
          if (e.path().filename().string().starts_with("checkpoint-")) {
            adapter_bytes = static_cast<int64_t>(fs::file_size(e.path() / "adapter_model.safetensors"));
          }
        }
      }
      (nproc == 1 ? one : two).push_back(run.seconds_per_step);
      for (const auto& [k, v] : run.timing) (nproc == 1 ? one_timing : two_timing)[k].push_back(v);
      std::printf("  rep %d, %d rank%s: %.4f s/step, %.0f completions/s, %.2f cores busy\n", r + 1, nproc,
                  nproc > 1 ? "s" : "", run.seconds_per_step, batch * nproc / run.seconds_per_step, run.cores);
      (nproc == 1 ? one_cores : two_cores).push_back(run.cores);
      std::fflush(stdout);
      fs::remove_all(dir);
    }
    const fs::path dir = work / ("pair-" + std::to_string(r));
    const auto [s, cores] = TrainPair(config, dir, steps, warmup);
    pair.push_back(s);
    pair_cores.push_back(cores);
    std::printf(
        "  rep %d, 2 independent runs at once: %.4f s/step each (harmonic), %.0f completions/s, %.2f cores busy\n",
        r + 1, s, 2.0 * batch / s, cores);
    std::fflush(stdout);
    fs::remove_all(dir.string() + "-a");
    fs::remove_all(dir.string() + "-b");
  }
  const double s1 = Median(one), s2 = Median(two);
  const double c1 = batch / s1, c2 = 2.0 * batch / s2, cp = 2.0 * batch / Median(pair);
  std::printf("\n%-34s %12s %14s\n", "", "s/step", "completions/s");
  std::printf("%-34s %12.4f %14.0f\n", "1 rank x 1 thread", s1, c1);
  std::printf("%-34s %12.4f %14.0f\n", "2 ranks x 1 thread (Gloo)", s2, c2);
  std::printf("%-34s %12.4f %14.0f\n", "2 independent runs at once", Median(pair), cp);
  std::printf("throughput ratio, 2 ranks / 1 rank: %.2fx (target >= 1.7x)\n", c2 / c1);
  std::printf(
      "the machine's ceiling, 2 independent runs / 1 run: %.2fx; the 2 ranks keep %.0f%% of it "
      "(per rep: ",
      cp / c1, 100.0 * (c2 / c1) / (cp / c1));
  for (int r = 0; r < reps; ++r) {
    std::printf("%s%.2fx of %.2fx", r ? ", " : "", one[r] * 2 / two[r], one[r] * 2 / pair[r]);
  }
  std::printf(")\n");
  // "One thread" is the model's: the process also runs its store record, RocksDB, the
  // generator's proof and the kernel's file work on the other core.
  std::printf(
      "cores busy (CPU seconds of every process and thread per second): 1 rank %.2f, 2 ranks %.2f, 2 runs "
      "%.2f; completions per CPU second: 1 rank %.0f, 2 ranks %.0f, 2 runs %.0f\n",
      Median(one_cores), Median(two_cores), Median(pair_cores), c1 / Median(one_cores), c2 / Median(two_cores),
      cp / Median(pair_cores));
  const double comm = Median(two_timing["timing/communication"]);
  const double step = Median(two_timing["step_time"]);
  std::printf("collectives, 2 ranks: %.4f s of a %.4f s step = %.1f%% (target <= 5%%)\n", comm, step,
              100.0 * comm / step);
  std::printf("\nwhere a step's time goes (s, medians over reps of the per-step means):\n%-28s %10s %10s\n", "",
              "1 rank", "2 ranks");
  for (const auto& [k, v] : two_timing) {
    auto it = one_timing.find(k);
    std::printf("%-28s %10s %10.4f\n", k.c_str(),
                it == one_timing.end() ? "-" : std::to_string(Median(it->second)).substr(0, 6).c_str(), Median(v));
  }
  const Collectives alone = TimeCollectives(adapter_bytes / 4, batch, 40);
  const double per_step = alone.allreduce + alone.rollout + alone.step_end;
  std::printf("\nthe collectives alone (2 threads, loopback, nothing else running; medians of 200):\n");
  std::printf("  gradient all-reduce (%lld floats)      %.5f s\n", static_cast<long long>(adapter_bytes / 4),
              alone.allreduce);
  std::printf("  rollout gather (%d rows x 5)            %.5f s\n", batch, alone.rollout);
  std::printf("  end-of-step gather (ids, 40 metrics)   %.5f s\n", alone.step_end);
  std::printf("  per step: %.5f s = %.1f%% of the 2-rank step (target <= 5%%)\n", per_step, 100.0 * per_step / step);
  std::printf("\ncalibration after: F32 GEMM 512x1024x1024 %.1f GFLOP/s (1 thread)\n", CalibrationGflops());
  if (!keep) fs::remove_all(work);
  return 0;
}
