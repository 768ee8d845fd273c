// `ferry store import PATH --db DB`: records weights as a version of the store (store/store.h).
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/store_common.h"

namespace ferry::cli {
namespace {

struct ImportFlags {
  std::string path, db, run = "default", kind, layout = "hf", base_version, adapter_version, parent;
  std::optional<int64_t> step;
  std::vector<std::string> metrics;
  bool json = false;
};

void RunImport(const ImportFlags& f) {
  store::ImportOptions o;
  o.run = f.run;
  auto layout = ParseLayout(f.layout);
  if (!layout.ok()) Fail("--layout '" + f.layout + "' is not one of hf, fused, lora");
  o.layout = *layout;
  std::error_code ec;
  if (!std::filesystem::exists(f.path, ec)) Fail(f.path + ": no such file or directory");
  const bool adapter = std::filesystem::is_directory(f.path, ec) &&
                       std::filesystem::exists(std::filesystem::path(f.path) / "adapter_config.json", ec);
  if (f.kind.empty()) {
    o.kind = adapter ? store::VersionKind::kAdapter : store::VersionKind::kFull;
  } else {
    auto kind = store::ParseKind(f.kind);
    if (!kind.ok()) Fail("--kind: " + kind.status().message());
    o.kind = *kind;
    if (adapter && o.kind != store::VersionKind::kAdapter) {
      Fail(f.path + " is a PEFT adapter (it holds adapter_config.json); --kind " + f.kind + " is refused");
    }
  }
  o.step = f.step;
  o.metrics = ParseMetricsOrFail(f.metrics);
  auto s = OpenStoreOrFail(f.db, /*writable=*/true, /*create=*/true);
  if (!f.base_version.empty()) o.base_version = GetVersionOrFail(*s, f.base_version, "--base-version").id;
  if (!f.adapter_version.empty()) {
    store::VersionRecord a = GetVersionOrFail(*s, f.adapter_version, "--adapter-version");
    if (a.kind != store::VersionKind::kAdapter) {
      Fail("--adapter-version " + ShortId(a.id) + " is a " + std::string(store::KindName(a.kind)) +
           " version, not an adapter");
    }
    o.adapter_version = a.id;
  }
  if (!f.parent.empty()) o.parent = GetVersionOrFail(*s, f.parent, "--parent").id;
  if (o.kind == store::VersionKind::kMerged && o.adapter_version && !o.base_version) {
    Fail("--adapter-version needs --base-version for a merged version");
  }
  std::optional<Progress> progress;
  uint64_t last = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    if (!progress) progress.emplace("import", total, !f.json);
    progress->Add(done - last);
    last = done;
  };
  auto r = s->Import(f.path, o);
  if (progress) progress->Done();
  if (!r.ok()) Fail(r.status());
  const store::VersionRecord& v = r->record;
  if (r->already_present && o.base_version && v.id == *o.base_version) {
    std::fprintf(stderr,
                 "ferry: warning: %s holds exactly the weights and files of its base version %s: it is "
                 "recorded as that version (a merge that changed nothing?)\n",
                 f.path.c_str(), ShortId(v.id).c_str());
  }
  if (f.json) {
    nlohmann::ordered_json j = VersionJson(v, false);
    j["bytes_written"] = r->bytes_written;
    j["objects_written"] = r->objects_written;
    j["already_present"] = r->already_present;
    j["was_derived"] = r->was_derived;
    std::printf("%s\n", JsonText(j, 2).c_str());
    return;
  }
  std::printf("%s\n", v.id.Hex().c_str());
  std::fprintf(
      stderr, "%s %s as %s version %s (run %s, seq %llu): %zu tensors, %s, %s written%s\n",
      r->was_derived ? "stored the bytes of derived version:" : (r->already_present ? "already stored:" : "imported"),
      f.path.c_str(), std::string(store::KindName(v.kind)).c_str(), ShortId(v.id).c_str(), v.run.c_str(),
      static_cast<unsigned long long>(v.sequence), v.tensors.size(), HumanBytes(v.total_bytes).c_str(),
      HumanBytes(r->bytes_written).c_str(), r->already_present && !r->was_derived ? " (nothing new)" : "");
}

}  // namespace

void SetStoreCommand(CLI::App& app) {
  CLI::App* store = app.add_subcommand("store", "Record weights in a Ferry store (content-addressed, verifiable)");
  store->require_subcommand(1);
  auto f = std::make_shared<ImportFlags>();
  CLI::App* cmd =
      store->add_subcommand("import", "Record a safetensors file, model directory or PEFT adapter as a version");
  cmd->footer(
      "Prints the version id (the manifest digest: the same weights and configs always get the same id).\n"
      "A directory holding adapter_config.json is recorded as kind adapter; --kind base, merged or full on an\n"
      "adapter (or --kind adapter on anything else) is refused.\n"
      "The store is created when --db does not exist yet. Exit code 1 on error.");
  cmd->add_option("PATH", f->path, "safetensors file, model directory (sharded or not) or PEFT adapter directory")
      ->required();
  cmd->add_option("--db", f->db, "Store directory")->required();
  cmd->add_option("--run", f->run, "Run the version belongs to (default: default)");
  cmd->add_option("--kind", f->kind, "base | adapter | merged | full (default: adapter for PEFT adapters, else full)");
  cmd->add_option("--layout", f->layout, "Layout of the weights: hf | fused | lora (default hf)");
  cmd->add_option("--base-version", f->base_version,
                  "Version (id or prefix) an adapter applies to / a merge came from");
  cmd->add_option("--adapter-version", f->adapter_version, "For merged versions: the adapter version merged in");
  cmd->add_option("--parent", f->parent, "Parent version (default: the run's latest)");
  cmd->add_option("--step", f->step, "Training step");
  cmd->add_option("--metric", f->metrics, "Metric key=value (repeatable), e.g. --metric reward_mean=0.41");
  cmd->add_flag("--json", f->json,
                "Print the version as JSON (id, run, sequence, bytes_written, already_present, ...)");
  cmd->callback([f] { RunImport(*f); });
}

}  // namespace ferry::cli
