// ferry convert: PEFT checkpoints to generator-ready layouts.
#include <cstdio>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/output.h"
#include "convert/converter.h"

namespace ferry::cli {
namespace {

struct ConvertFlags {
  std::string base, adapter, out, layout = "hf", dtype, max_shard_size;
  bool force = false;
  bool json = false;
  bool no_fsync = false;
  int threads = 0;
};

void RunConvert(const ConvertFlags& f) {
  ConvertOptions o;
  o.base = f.base;
  o.adapter = f.adapter;
  o.out = f.out;
  auto layout = ParseLayout(f.layout);
  if (!layout.ok()) Fail(layout.status());
  o.layout = *layout;
  if (!f.dtype.empty()) {
    std::string d = f.dtype;
    for (auto& c : d) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (d == "FLOAT32" || d == "FP32") d = "F32";
    if (d == "FLOAT16" || d == "FP16") d = "F16";
    if (d == "BFLOAT16") d = "BF16";
    auto parsed = ParseDType(d);
    if (!parsed || !CanWriteFromF32(*parsed)) Fail("--dtype '" + f.dtype + "' is not one of f32, f16, bf16");
    o.dtype = *parsed;
  }
  if (!f.max_shard_size.empty()) {
    auto size = ParseByteSize(f.max_shard_size);
    if (!size.ok()) Fail(size.status().WithContext("--max-shard-size"));
    o.max_shard_bytes = *size;
  }
  o.force = f.force;
  o.threads = f.threads;
  o.sync = !f.no_fsync;
  std::optional<Progress> progress;
  uint64_t last = 0;
  o.progress = [&](uint64_t done, uint64_t total) {
    if (!progress) progress.emplace("convert", total, !f.json);
    progress->Add(done - last);
    last = done;
  };
  ConvertRemedy remedy = ConvertRemedy::kNone;
  auto summary = Convert(o, &remedy);
  if (progress) progress->Done();
  if (!summary.ok()) {
    switch (remedy) {
      case ConvertRemedy::kMergedLayout:
        FailWithHint(summary.status(), summary.status().code(), "use --layout hf (or --layout fused)");
      case ConvertRemedy::kReplaceOutput:
        FailWithHint(summary.status(), summary.status().code(), "pass --force to replace it");
      case ConvertRemedy::kNone: break;
    }
    Fail(summary.status());
  }
  if (f.json) {
    std::printf("%s\n", ConvertSummaryToJson(*summary).c_str());
    return;
  }
  for (const auto& w : summary->warnings) std::fprintf(stderr, "ferry: warning: %s\n", w.c_str());
  std::printf(
      "wrote %s (layout %s): %lld tensors, %lld changed, %lld LoRA modules%s%s, %s in %.2f s\n", summary->out.c_str(),
      std::string(LayoutName(summary->layout)).c_str(), static_cast<long long>(summary->tensors_written),
      static_cast<long long>(summary->tensors_changed), static_cast<long long>(summary->lora_modules),
      summary->dequantized ? (", " + std::to_string(summary->dequantized) + " 4-bit weights dequantized").c_str() : "",
      summary->untied_lm_head ? ", lm_head untied" : "", HumanBytes(summary->bytes_written).c_str(), summary->seconds);
  if (summary->layout == Layout::kLora) {
    std::printf("global rank %lld, lora_alpha %.9g (scaling %.9g); per-module scalings baked into lora_A, factors %s",
                static_cast<long long>(summary->global_rank), summary->global_alpha, summary->global_scaling,
                std::string(DTypeName(summary->lora_factor_dtype)).c_str());
    if (summary->lora_inexact_modules > 0) {
      std::printf(" (%lld modules' scalings are not a power of two apart from the global one)",
                  static_cast<long long>(summary->lora_inexact_modules));
    }
    std::printf("\n");
  }
  for (const auto& file : summary->files) std::printf("  %s\n", file.c_str());
}

}  // namespace

void SetConvertCommand(CLI::App& app) {
  auto flags = std::make_shared<ConvertFlags>();
  CLI::App* cmd = app.add_subcommand(
      "convert", "Merge a PEFT adapter into its base model, clean it for an engine, or dequantize a 4-bit base");
  cmd->footer(
      "Layouts:\n"
      "  hf     merged model with Hugging Face names (what PEFT merge_and_unload + save_pretrained produce)\n"
      "  fused  as hf, with q/k/v stacked into qkv_proj and gate/up into gate_up_proj (vLLM's internal layout)\n"
      "  lora   a clean adapter engines can hot-load: lora_A/lora_B only, one global rank and scaling\n"
      "The output appears only when complete; on any error nothing is left at --out. Exit code 1 on error.");
  cmd->add_option("--base", flags->base, "Base model directory (safetensors, sharded or single, or bitsandbytes 4-bit)")
      ->required();
  cmd->add_option("--adapter", flags->adapter,
                  "PEFT adapter directory (adapter_config.json + adapter_model.*). Without it the base alone is "
                  "written (hf or fused): a 4-bit base dequantized, for an engine to serve adapters on");
  cmd->add_option("--out", flags->out, "Output directory (must not exist unless --force)")->required();
  cmd->add_option("--layout", flags->layout, "hf | fused | lora (default hf)");
  cmd->add_option("--dtype", flags->dtype, "Output dtype for floating tensors: f32 | f16 | bf16 (default: the base's)");
  cmd->add_option("--max-shard-size", flags->max_shard_size,
                  "Shard limit, e.g. 5GB or 500MiB (default: shard like the base)");
  cmd->add_option("--threads", flags->threads, "Merge threads (default: all cores)");
  cmd->add_flag("--force", flags->force, "Replace an existing output directory");
  cmd->add_flag("--no-fsync", flags->no_fsync,
                "Do not fsync the output (it still appears only when complete; a power failure may lose it)");
  cmd->add_flag("--json", flags->json, "Print a JSON summary on stdout");
  cmd->callback([flags] { RunConvert(*flags); });
}

}  // namespace ferry::cli
