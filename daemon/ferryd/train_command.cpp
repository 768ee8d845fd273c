// ferryd train: a GRPO run in the foreground (daemon/grpo/trainer.h).
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <unistd.h>

#include "daemon/ferryd/commands.h"
#include "daemon/grpo/trainer.h"

namespace ferry::ferryd {
namespace {

namespace fs = std::filesystem;

struct TrainFlags {
  fs::path config;
  fs::path dir;
  int64_t max_steps = 0;
  bool json = false;
};

// "step 40/800  reward 0.612  loss 0.0031  kl -  len 4.0  0.07 s/step  eta 53 s"
std::string ProgressLine(const nlohmann::json& j, int64_t total, double per_step) {
  auto num = [&](const char* k, int precision) -> std::string {
    if (!j.contains(k) || !j[k].is_number()) return "-";
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.*f", precision, j[k].get<double>());
    return buf;
  };
  const int64_t step = j.value("step", int64_t{0});
  char line[512];
  std::snprintf(line, sizeof(line), "step %lld/%lld  reward %s (std %s)  loss %s  grad_norm %s  lr %s  len %s  %.3f s/step  eta %.0f s",
                static_cast<long long>(step), static_cast<long long>(total), num("reward", 3).c_str(),
                num("reward_std", 3).c_str(), num("loss", 4).c_str(), num("grad_norm", 3).c_str(),
                num("learning_rate", 6).c_str(), num("completions/mean_length", 1).c_str(), per_step,
                per_step * static_cast<double>(total - step));
  return line;
}

Status RunTrain(const TrainFlags& f) {
  grpo::TrainOptions o;
  o.config = f.config;
  o.dir = f.dir;
  if (f.max_steps > 0) o.max_steps = f.max_steps;
  const auto start = std::chrono::steady_clock::now();
  int64_t total = 0;
  int64_t first_step = 0;
  o.on_message = [](const std::string& m) { std::fprintf(stderr, "ferryd: %s\n", m.c_str()); };
  o.on_log = [&](const std::string& line) {
    if (f.json) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
      return;
    }
    const auto j = nlohmann::json::parse(line, nullptr, false);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const int64_t done = std::max<int64_t>(1, j.value("step", int64_t{0}) - first_step);
    std::fprintf(stderr, "%s\n", ProgressLine(j, total, elapsed / static_cast<double>(done)).c_str());
  };
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<grpo::Trainer> trainer, grpo::Trainer::Create(o));
  total = trainer->total_steps();
  first_step = trainer->step();
  std::fprintf(stderr, "ferryd: training %s for %lld steps (from step %lld) in %s\n",
               trainer->config().model_name_or_path.string().c_str(), static_cast<long long>(total),
               static_cast<long long>(first_step), trainer->dir().string().c_str());
  FERRY_RETURN_IF_ERROR(trainer->Run());
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "ferryd: done: %lld steps in %.1f s; metrics in %s, checkpoints in %s, store in %s\n",
               static_cast<long long>(trainer->step() - first_step), elapsed,
               (trainer->dir() / "metrics.jsonl").string().c_str(), trainer->dir().string().c_str(),
               (trainer->config().store.path.empty() ? trainer->dir() / "store" : trainer->config().store.path).string().c_str());
  return Status::OK();
}

}  // namespace

void SetTrainCommand(CLI::App& app) {
  auto f = std::make_shared<TrainFlags>();
  CLI::App* cmd = app.add_subcommand("train", "Run GRPO training in the foreground (resumes from the newest checkpoint)");
  cmd->add_option("--config", f->config, "the run's TOML file (TRL GRPOConfig / PEFT LoraConfig names)")->required();
  cmd->add_option("--dir", f->dir, "run directory (default: the config's output_dir)");
  cmd->add_option("--max-steps", f->max_steps, "stop after this many optimizer steps in total")->check(CLI::PositiveNumber);
  cmd->add_flag("--json", f->json, "print each metrics line (as metrics.jsonl gets it) to stdout");
  cmd->callback([f] {
    Status s = RunTrain(*f);
    if (!s.ok()) Fail(s);
  });
}

}  // namespace ferry::ferryd
