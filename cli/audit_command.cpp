// `ferry audit --db DB [--run NAME]`: the post-run report (store/audit.h) as text, JSON
// (cli/audit_text.h) or HTML (cli/audit_html.h).
#include <cstdio>
#include <optional>
#include <string>

#include "cli/audit_html.h"
#include "cli/audit_text.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "cli/store_common.h"
#include "core/mapped_file.h"
#include "store/audit.h"

namespace ferry::cli {
namespace {

constexpr int kExitAnomalies = 2;

struct AuditFlags {
  std::string db, run, html;
  double jump_factor = 10.0;
  store::AuditOptions steps;  // the training-run rules' thresholds
  bool json = false;
  bool strict = false;
};

void RunAuditCommand(const AuditFlags& f) {
  if (!(f.jump_factor > 1.0)) Fail("--jump-factor must be greater than 1");
  auto s = OpenStoreOrFail(f.db, false);
  store::AuditOptions o = f.steps;
  if (!f.run.empty()) o.run = f.run;
  o.jump_factor = f.jump_factor;
  auto report = store::RunAudit(*s, o);
  if (!report.ok()) Fail("store " + f.db + ": audit: " + report.status().message());
  if (!f.html.empty()) {
    const std::string title = "Ferry audit of " + f.db + (f.run.empty() ? std::string() : " (run " + f.run + ")");
    Status w = WriteFileAtomic(f.html, AuditToHtml(*report, title));
    if (!w.ok()) Fail(w.WithContext("--html " + f.html));
  }
  if (f.json) {
    std::printf("%s\n", AuditToJson(*report).c_str());
  } else {
    std::fputs(AuditToText(*report).c_str(), stdout);
    if (!f.html.empty()) std::printf("\nwrote %s\n", f.html.c_str());
  }
  std::fflush(stdout);
  if (f.strict && !report->anomalies.empty()) throw CLI::RuntimeError(kExitAnomalies);
}

}  // namespace

void SetAuditCommand(CLI::App& app) {
  auto f = std::make_shared<AuditFlags>();
  CLI::App* cmd = app.add_subcommand("audit", "Post-run report: version timeline, receivers, gaps and anomalies");
  cmd->add_option("--db", f->db, "Store directory")->required();
  cmd->add_option("--run", f->run, "Only this run");
  cmd->add_option("--html", f->html, "Also write a self-contained HTML report (inline SVG plots) to FILE");
  cmd->add_option("--jump-factor", f->jump_factor,
                  "delta_jump rule: flag an adapter update whose delta norm exceeds this many times the median of the "
                  "run's previous deltas (default 10)");
  cmd->add_option("--lag-threshold", f->steps.lag_threshold,
                  "generator_behind rule (with --run): flag a generator more than this many steps behind the trainer "
                  "(default 2)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--reward-window", f->steps.reward_window,
                  "reward_collapse rule: the reward's moving mean over this many steps (default 10)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--reward-drop", f->steps.reward_drop,
                  "reward_collapse rule: flag the moving mean falling more than this below its best (default 0.2)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--zero-std-steps", f->steps.zero_std_steps,
                  "reward_collapse rule: flag this many consecutive steps whose every group has reward std 0 "
                  "(default 5)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--grad-spike-factor", f->steps.grad_spike_factor,
                  "grad_norm_spike rule: flag a grad norm above this many times the median of the previous 100 steps "
                  "(default 10)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", f->json, "Print the report as JSON");
  cmd->add_flag("--strict", f->strict, "Exit 2 when any anomaly is found");
  cmd->footer(
      "Anomalies: merged_equals_base (a merge that left the base unchanged although the adapter is non-zero),\n"
      "zero_adapter, nonfinite (NaN/Inf), delta_jump, unpublished_ack (a receiver loaded a version never\n"
      "published), digest_mismatch (a receiver computed another digest), recorded (logged by sync/daemon).\n"
      "With --run, a training run's steps (adapter and merged version, metrics, which generator acknowledged\n"
      "which version when, the lag in steps) and: generator_behind, reward_collapse, nonfinite_loss,\n"
      "grad_norm_spike; the HTML plots reward, kl, entropy, completion length, the sampling mismatch and\n"
      "the learning rate per step.\n"
      "See docs/store.md for the exact rules. Exit code 0 (2 with --strict and anomalies), 1 on error.");
  cmd->callback([f] { RunAuditCommand(*f); });
}

}  // namespace ferry::cli
