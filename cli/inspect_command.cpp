// `ferry inspect PATH`: what a safetensors file, model directory or PEFT adapter holds.
#include <cctype>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/output.h"
#include "convert/inspect.h"
#include "core/text.h"

namespace ferry::cli {
namespace {

constexpr size_t kDefaultTextLimit = 50;

struct InspectArgs {
  std::string path;
  std::string base;  // --base: the base model to resolve an adapter onto
  bool json = false;
  bool tensors = true;
  int64_t limit = -1;  // -1: the default (kDefaultTextLimit for text, all for --json)
};

using Table = std::vector<std::vector<std::string>>;

// Prints rows with every column padded to its widest cell; the first row is the header.
void PrintTable(const Table& rows, const char* indent) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line = indent;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    line.erase(line.find_last_not_of(' ') + 1);
    std::printf("%s\n", line.c_str());
  }
}

std::string Join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::string SelectorText(const ModuleSelector& s) {
  switch (s.form) {
    case ModuleSelector::Form::kNone: return "-";
    case ModuleSelector::Form::kList: return "[" + Join(s.names, ", ") + "]";
    case ModuleSelector::Form::kRegex: return "regex \"" + s.pattern + "\"";
    case ModuleSelector::Form::kAllLinear: return s.pattern;
  }
  return "-";
}

void PrintSummary(const InspectReport& r) {
  std::printf("path:     %s\n", r.path.c_str());
  std::printf("kind:     %s (%s)\n", std::string(InspectKindName(r.kind)).c_str(), r.format.c_str());
  for (size_t i = 0; i < r.files.size(); ++i)
    std::printf("%s%s\n", i ? "          " : "files:    ", r.files[i].c_str());
  std::printf("tensors:  %llu, %s, %llu params\n", static_cast<unsigned long long>(r.totals.count),
              HumanBytes(r.totals.bytes).c_str(), static_cast<unsigned long long>(r.totals.params));
  Table t = {{"DTYPE", "TENSORS", "BYTES", "PARAMS"}};
  for (const DTypeTotal& d : r.totals.by_dtype) {
    t.push_back(
        {std::string(DTypeName(d.dtype)), std::to_string(d.count), HumanBytes(d.bytes), std::to_string(d.params)});
  }
  PrintTable(t, "  ");
}

void PrintModelConfig(const ModelConfigSummary& c) {
  const std::string tie = !c.tie_word_embeddings.has_value() ? "-" : (*c.tie_word_embeddings ? "true" : "false");
  const std::string quant = c.has_quantization_config ? (c.quant_method.empty() ? "yes" : c.quant_method) : "none";
  std::printf("\nconfig.json: model_type %s, architectures [%s], dtype %s, tie_word_embeddings %s, quantization %s\n",
              c.model_type.empty() ? "-" : c.model_type.c_str(), Join(c.architectures, ", ").c_str(),
              c.dtype.empty() ? "-" : c.dtype.c_str(), tie.c_str(), quant.c_str());
}

void PrintAdapter(const AdapterSummary& a, size_t limit) {
  const PeftConfig& c = a.config;
  std::printf("\nadapter:  %s r=%d lora_alpha=%s use_rslora=%s use_dora=%s bias=%s\n",
              c.peft_type.empty() ? "-" : c.peft_type.c_str(), c.r, FormatNumber(c.lora_alpha, 6).c_str(),
              c.use_rslora ? "true" : "false", c.use_dora ? "true" : "false",
              std::string(PeftBiasName(c.bias)).c_str());
  std::printf("  target_modules:  %s\n", SelectorText(c.target_modules).c_str());
  if (!c.exclude_modules.empty()) std::printf("  exclude_modules: %s\n", SelectorText(c.exclude_modules).c_str());
  std::printf("  modules_to_save: %s\n", c.modules_to_save.empty() ? "-" : Join(c.modules_to_save, ", ").c_str());
  std::printf("  mergeable:       %s\n", a.mergeable.ok() ? "yes" : ("no: " + a.mergeable.message()).c_str());
  if (a.modules.empty()) return;
  Table t = {{"MODULE", "KIND", "RANK", "CONFIG_RANK", "ALPHA", "SCALING", ""}};
  for (size_t i = 0; i < a.modules.size() && (limit == 0 || i < limit); ++i) {
    const AdapterModuleRow& m = a.modules[i];
    t.push_back({m.module, m.embedding ? "embedding" : "linear",
                 m.tensor_rank.has_value() ? std::to_string(*m.tensor_rank) : "-", std::to_string(m.config_rank),
                 FormatNumber(m.alpha, 6), FormatNumber(m.scaling, 6), m.rank_mismatch ? "RANK MISMATCH" : ""});
  }
  std::printf("\n");
  PrintTable(t, "  ");
  if (limit != 0 && a.modules.size() > limit)
    std::printf("  ... %zu more modules (--limit)\n", a.modules.size() - limit);
}

std::string TargetText(const PlanTarget& t) {
  std::string out = t.tensor + " " + ShapeToString(t.shape) + " " + std::string(DTypeName(t.dtype));
  if (t.partial) out += " rows [" + std::to_string(t.row_begin) + ", " + std::to_string(t.row_end) + ")";
  if (!t.part.empty()) {
    out += " (part " + t.part + ": lora_B rows [" + std::to_string(t.b_row_begin) + ", " + std::to_string(t.b_row_end) +
           "))";
  }
  if (!t.quantization.empty()) {
    std::string q = t.quantization;
    for (char& c : q) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    out += " (4-bit " + q + ", dequantized)";
  }
  if (!t.source.empty()) out += " (tied: starts from " + t.source + ")";
  return out;
}

std::string FlagsText(const PlanModuleRow& m) {
  std::vector<std::string> flags;
  if (m.dora) flags.push_back("DoRA");
  if (m.lora_bias) flags.push_back("lora_bias -> " + m.bias_target);
  if (m.fan_in_fan_out) flags.push_back("fan_in_fan_out");
  return Join(flags, ", ");
}

void PrintPlan(const AdapterPlanReport& p, size_t limit) {
  std::printf("\nplan onto base %s (tie_word_embeddings %s):\n", p.base.c_str(),
              p.tie_word_embeddings ? "true" : "false");
  if (!p.error.ok()) {
    std::printf("  cannot be planned: %s\n", p.error.message().c_str());
    return;
  }
  Table t = {{"MODULE", "KIND", "RANK", "SCALING", "BASE TENSOR", "FLAGS"}};
  size_t shown = 0;
  for (const PlanModuleRow& m : p.modules) {
    if (limit != 0 && shown++ >= limit) break;
    for (size_t i = 0; i < m.targets.size(); ++i) {
      t.push_back({i == 0 ? m.module : "", i == 0 ? (m.embedding ? "embedding" : "linear") : "",
                   i == 0 ? std::to_string(m.rank) : "", i == 0 ? FormatNumber(m.scaling, 6) : "",
                   TargetText(m.targets[i]), i == 0 ? FlagsText(m) : ""});
    }
  }
  PrintTable(t, "  ");
  if (limit != 0 && p.modules.size() > limit)
    std::printf("  ... %zu more modules (--limit)\n", p.modules.size() - limit);
  if (!p.replacements.empty()) {
    Table r = {{"REPLACED BASE TENSOR", "BY ADAPTER TENSOR", "WHY", "SHAPE", "DTYPE", ""}};
    for (const PlanReplacementRow& x : p.replacements) {
      r.push_back({x.base_tensor, x.adapter_key, x.why, ShapeToString(x.shape), std::string(DTypeName(x.dtype)),
                   x.equals_base ? "equals the base" : ""});
    }
    std::printf("\n");
    PrintTable(r, "  ");
  }
  for (const PlanTokenRows& x : p.token_rows) {
    std::vector<std::string> rows;
    for (int64_t i : x.rows) rows.push_back(std::to_string(i));
    std::printf("  trainable tokens: rows [%s] of %s from %s\n", Join(rows, ", ").c_str(), x.base_tensor.c_str(),
                x.adapter_key.c_str());
  }
  if (p.untie) {
    std::printf(
        "  untied lm_head: the base ties %s to %s; the adapter changes it, so a merged model stores %s "
        "separately (tie_word_embeddings false)\n",
        p.lm_head.c_str(), p.tied_source.c_str(), p.lm_head.c_str());
  }
  if (p.quantized_targets > 0) {
    std::printf("  %zu target(s) are bitsandbytes 4-bit in the base: merging dequantizes them\n", p.quantized_targets);
  }
  for (const std::string& w : p.warnings) std::printf("  warning: %s\n", w.c_str());
}

void PrintEngine(const EngineReport& e) {
  std::printf("\nengine (vLLM):%s\n", e.findings.empty() ? " loads as is" : "");
  if (!e.findings.empty()) {
    Table t = {{"SEVERITY", "SUBJECT", "FINDING"}};
    for (const EngineFinding& f : e.findings) {
      std::string finding = f.message;
      if (f.fix_layout) finding += " [fix: `ferry convert --layout " + std::string(LayoutName(*f.fix_layout)) + "`]";
      if (f.engine_max_lora_rank > 0)
        finding += " [vLLM: --max-lora-rank " + std::to_string(f.engine_max_lora_rank) + "]";
      t.push_back({std::string(EngineSeverityName(f.severity)),
                   std::string(EngineSubjectName(f.subject_kind)) + " " + f.subject, std::move(finding)});
    }
    PrintTable(t, "  ");
  }
  if (e.lora_layout_possible.has_value()) {
    if (*e.lora_layout_possible) {
      std::printf("  `ferry convert --layout lora` can write an adapter engines load (rank %lld)\n",
                  static_cast<long long>(e.lora_layout_rank));
    } else {
      std::printf("  `ferry convert --layout lora` would refuse: %s\n", e.lora_layout_refusal.c_str());
    }
  }
}

void PrintTensors(const std::vector<InspectTensor>& tensors, size_t limit) {
  Table t = {{"NAME", "DTYPE", "SHAPE", "BYTES"}};
  for (size_t i = 0; i < tensors.size() && (limit == 0 || i < limit); ++i) {
    const InspectTensor& x = tensors[i];
    t.push_back({x.name, std::string(DTypeName(x.dtype)), ShapeToString(x.shape), std::to_string(x.bytes)});
  }
  std::printf("\n");
  PrintTable(t, "  ");
  if (limit != 0 && tensors.size() > limit) std::printf("  ... %zu more tensors (--limit)\n", tensors.size() - limit);
}

void PrintText(const InspectReport& r, const InspectArgs& args) {
  const size_t limit = args.limit < 0 ? kDefaultTextLimit : static_cast<size_t>(args.limit);
  PrintSummary(r);
  if (r.model_config.has_value()) PrintModelConfig(*r.model_config);
  if (r.adapter.has_value()) PrintAdapter(*r.adapter, limit);
  if (r.plan.has_value()) PrintPlan(*r.plan, limit);
  if (r.engine.has_value()) PrintEngine(*r.engine);
  if (args.tensors) PrintTensors(r.tensors, limit);
  std::printf("\nissues:   %s\n", r.issues.empty() ? "none" : std::to_string(r.issues.size()).c_str());
  for (const std::string& issue : r.issues) std::printf("  - %s\n", issue.c_str());
}

void RunInspect(const InspectArgs& args) {
  InspectOptions inspect_options;
  inspect_options.base = args.base;
  Result<InspectReport> report = Inspect(args.path, inspect_options);
  if (!report.ok()) Fail(report.status());
  if (args.json) {
    ReportJsonOptions options;
    options.include_tensors = args.tensors;
    options.tensor_limit = args.limit < 0 ? 0 : static_cast<size_t>(args.limit);
    std::printf("%s\n", ReportToJson(*report, options).c_str());
  } else {
    PrintText(*report, args);
  }
  std::fflush(stdout);
  // The adapter does not fit the base given: the report says why; so does the exit status.
  if (report->plan.has_value() && !report->plan->error.ok()) Fail(report->plan->error);
}

}  // namespace

void SetInspectCommand(CLI::App& app) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* cmd = app.add_subcommand(
      "inspect",
      "Show what a checkpoint holds: a .safetensors file, a model directory (single file, shards + index, "
      "config.json) or a PEFT adapter directory (adapter_config.json: rank, alpha and scaling per module, "
      "whether it can be merged, what an inference engine (vLLM) would reject or get wrong, problems found; with "
      "--base, the base tensors each module changes). Reads headers only (with --base, also compares saved copies "
      "with the base).");
  cmd->add_option("path", args->path, "file or directory to inspect")->required();
  cmd->add_option("--base", args->base,
                  "for an adapter: the base model (directory or file) to resolve it onto; shows which base tensors "
                  "each adapter module changes (shape, dtype, fused rows, 4-bit) and exits 1 when it does not fit");
  cmd->add_flag("--json", args->json, "print the report as JSON on stdout");
  cmd->add_flag("--tensors,!--no-tensors", args->tensors, "list every tensor (name, dtype, shape, bytes); default on");
  cmd->add_option("--limit", args->limit,
                  "list at most N tensors and adapter modules; 0: all (default: 50 in tables, all with --json)")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([args] { RunInspect(*args); });
}

}  // namespace ferry::cli
