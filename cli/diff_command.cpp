// `ferry diff A B`: compares two checkpoints tensor by tensor (see core/diff.h).
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/output.h"
#include "core/checkpoint.h"
#include "core/diff.h"
#include "core/text.h"

namespace ferry::cli {
namespace {

constexpr int kExitEqual = 0;
constexpr int kExitError = 1;
constexpr int kExitDifferent = 3;

struct DiffArgs {
  std::string a;
  std::string b;
  double atol = 0;
  double rtol = 0;
  int64_t max_ulp = -1;
  bool ignore_dtype = false;
  bool json = false;
  std::string show = "different";
};

// Finite numbers as JSON numbers; infinities and NaN as the strings "inf", "-inf", "nan".
nlohmann::ordered_json JsonNumber(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

std::string Join(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

nlohmann::ordered_json TensorJson(const TensorDiff& d) {
  nlohmann::ordered_json j;
  j["name"] = d.name;
  j["status"] = std::string(DiffStatusName(d.status));
  j["dtype_a"] = d.dtype_a ? nlohmann::ordered_json(std::string(DTypeName(*d.dtype_a))) : nlohmann::ordered_json();
  j["dtype_b"] = d.dtype_b ? nlohmann::ordered_json(std::string(DTypeName(*d.dtype_b))) : nlohmann::ordered_json();
  j["shape_a"] = d.dtype_a ? nlohmann::ordered_json(d.shape_a) : nlohmann::ordered_json();
  j["shape_b"] = d.dtype_b ? nlohmann::ordered_json(d.shape_b) : nlohmann::ordered_json();
  j["compared"] = std::string(CompareModeName(d.compared));
  j["numel"] = d.numel;
  j["mismatched"] = d.mismatched;
  j["outside_tolerance"] = d.outside_tolerance;
  j["max_abs_diff"] = JsonNumber(d.max_abs_diff);
  j["max_ulp_diff"] = d.max_ulp_diff >= 0 ? nlohmann::ordered_json(d.max_ulp_diff) : nlohmann::ordered_json();
  j["rel_norm"] = JsonNumber(d.rel_norm);
  if (d.max_diff_index >= 0) {
    j["max_diff_index"] = d.max_diff_index;
    j["max_diff_position"] = d.compared == CompareMode::kBytes && DTypeBits(*d.dtype_a) % 8 != 0
                                 ? nlohmann::ordered_json()
                                 : nlohmann::ordered_json(UnravelIndex(d.max_diff_index, d.shape_a));
    j["a_at_max"] = JsonNumber(d.a_at_max);
    j["b_at_max"] = JsonNumber(d.b_at_max);
  } else {
    j["max_diff_index"] = nullptr;
    j["max_diff_position"] = nullptr;
    j["a_at_max"] = nullptr;
    j["b_at_max"] = nullptr;
  }
  j["nan_mismatches"] = d.nan_mismatches;
  j["inf_mismatches"] = d.inf_mismatches;
  if (!d.note.empty()) j["note"] = d.note;
  return j;
}

void PrintJson(const DiffArgs& args, const Checkpoint& a, const Checkpoint& b, const DiffReport& r) {
  nlohmann::ordered_json j;
  j["a"] = a.path().string();
  j["b"] = b.path().string();
  j["options"] = {{"atol", args.atol},
                  {"rtol", args.rtol},
                  {"max_ulp", args.max_ulp >= 0 ? nlohmann::ordered_json(args.max_ulp) : nlohmann::ordered_json()},
                  {"ignore_dtype", args.ignore_dtype}};
  j["equal"] = r.equal_within_tolerance;
  j["counts"] = {{"tensors", r.tensors.size()},
                 {"equal", r.counts.equal},
                 {"within_tolerance", r.counts.within_tolerance},
                 {"different", r.counts.different},
                 {"dtype_changed", r.counts.dtype_changed},
                 {"shape_changed", r.counts.shape_changed},
                 {"missing_in_b", r.counts.missing_in_b},
                 {"extra_in_b", r.counts.extra_in_b}};
  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  for (const auto& d : r.tensors) tensors.push_back(TensorJson(d));
  j["tensors"] = std::move(tensors);
  std::printf("%s\n", JsonText(j, 2).c_str());
}

// The "detail" column: what changed, or where the largest difference is.
std::string Detail(const TensorDiff& d) {
  switch (d.status) {
    case DiffStatus::kMissingInB: return std::string(DTypeName(*d.dtype_a)) + " " + ShapeToString(d.shape_a);
    case DiffStatus::kExtraInB: return std::string(DTypeName(*d.dtype_b)) + " " + ShapeToString(d.shape_b);
    case DiffStatus::kShapeChanged: return ShapeToString(d.shape_a) + " -> " + ShapeToString(d.shape_b);
    case DiffStatus::kDTypeChanged:
      return std::string(DTypeName(*d.dtype_a)) + " -> " + std::string(DTypeName(*d.dtype_b));
    default: break;
  }
  if (d.max_diff_index < 0) return "";
  std::string s = std::to_string(d.mismatched) + "/" + std::to_string(d.numel) + " differ";
  if (d.compared == CompareMode::kBytes) return s;
  s += "; at " + Join(UnravelIndex(d.max_diff_index, d.shape_a)) + ": " + FormatNumber(d.a_at_max, 8) + " vs " +
       FormatNumber(d.b_at_max, 8);
  if (d.nan_mismatches > 0) s += "; " + std::to_string(d.nan_mismatches) + " NaN mismatches";
  if (d.inf_mismatches > 0) s += "; " + std::to_string(d.inf_mismatches) + " inf mismatches";
  return s;
}

void PrintTable(const DiffArgs& args, const Checkpoint& a, const Checkpoint& b, const DiffReport& r) {
  std::printf("A: %s (%zu tensors, %s)\n", a.path().c_str(), a.size(), HumanBytes(a.total_bytes()).c_str());
  std::printf("B: %s (%zu tensors, %s)\n", b.path().c_str(), b.size(), HumanBytes(b.total_bytes()).c_str());
  const bool all = args.show == "all";
  size_t width = 6;
  size_t shown = 0;
  for (const auto& d : r.tensors) {
    if (all || d.status != DiffStatus::kEqual) {
      width = std::max(width, d.name.size());
      ++shown;
    }
  }
  if (shown > 0) {
    std::printf("\n%-*s  %-16s  %10s  %10s  %10s  %s\n", static_cast<int>(width), "tensor", "status", "max abs",
                "max ulp", "rel norm", "detail");
    for (const auto& d : r.tensors) {
      if (!all && d.status == DiffStatus::kEqual) continue;
      const bool values = d.compared == CompareMode::kFloat || d.compared == CompareMode::kExact;
      std::printf("%-*s  %-16s  %10s  %10s  %10s  %s\n", static_cast<int>(width), d.name.c_str(),
                  std::string(DiffStatusName(d.status)).c_str(), values ? FormatNumber(d.max_abs_diff, 3).c_str() : "-",
                  d.max_ulp_diff >= 0 ? std::to_string(d.max_ulp_diff).c_str() : "-",
                  values ? FormatNumber(d.rel_norm, 3).c_str() : "-", Detail(d).c_str());
    }
  }
  const DiffCounts& c = r.counts;
  std::printf(
      "\n%zu tensors: %lld equal, %lld within tolerance, %lld different, %lld dtype changed, "
      "%lld shape changed, %lld missing in B, %lld extra in B (atol %g, rtol %g, max ulp %s): %s\n",
      r.tensors.size(), static_cast<long long>(c.equal), static_cast<long long>(c.within_tolerance),
      static_cast<long long>(c.different), static_cast<long long>(c.dtype_changed),
      static_cast<long long>(c.shape_changed), static_cast<long long>(c.missing_in_b),
      static_cast<long long>(c.extra_in_b), args.atol, args.rtol,
      args.max_ulp >= 0 ? std::to_string(args.max_ulp).c_str() : "unused",
      r.equal_within_tolerance ? "EQUAL within tolerance" : "DIFFERENT");
}

void RunDiff(const DiffArgs& args) {
  if (args.a.empty() || args.b.empty()) {
    Fail("diff needs two checkpoints: ferry diff A B (see ferry diff --help)", kExitError);
  }
  if (args.show != "all" && args.show != "different") {
    Fail("--show must be 'all' or 'different', not '" + args.show + "'", kExitError);
  }
  auto a = Checkpoint::Open(args.a);
  if (!a.ok()) Fail(a.status(), kExitError);
  auto b = Checkpoint::Open(args.b);
  if (!b.ok()) Fail(b.status(), kExitError);
  DiffOptions options;
  options.atol = args.atol;
  options.rtol = args.rtol;
  options.max_ulp = args.max_ulp;
  options.ignore_dtype = args.ignore_dtype;
  Progress progress("diff", a->total_bytes() + b->total_bytes(), !args.json);
  options.on_progress = [&progress](uint64_t bytes) { progress.Add(bytes); };
  auto report = DiffCheckpoints(*a, *b, options);
  progress.Done();
  if (!report.ok()) Fail(report.status(), kExitError);
  if (args.json) {
    PrintJson(args, *a, *b, *report);
  } else {
    PrintTable(args, *a, *b, *report);
  }
  std::fflush(stdout);
  if (!report->equal_within_tolerance) throw CLI::RuntimeError(kExitDifferent);
}

}  // namespace

void SetDiffCommand(CLI::App& app) {
  auto args = std::make_shared<DiffArgs>();
  CLI::App* cmd = app.add_subcommand("diff", "Compare two checkpoints tensor by tensor");
  // A and B are checked in RunDiff, not by CLI11, so that a missing one exits 1 like other errors.
  cmd->add_option("A", args->a, "First checkpoint: a .safetensors file, a sharded or adapter directory, or an index");
  cmd->add_option("B", args->b, "Second checkpoint (the reference for --rtol)");
  cmd->add_option("--atol", args->atol, "Absolute tolerance: |a-b| <= atol + rtol*|b| passes (default 0)");
  cmd->add_option("--rtol", args->rtol, "Relative tolerance, relative to |b| (default 0)");
  cmd->add_option(
      "--max-ulp", args->max_ulp,
      "Also accept elements at most N units in the last place apart, in the coarser dtype (default: unused)");
  cmd->add_flag("--ignore-dtype", args->ignore_dtype,
                "Compare values of tensors whose dtypes differ (float with float, integer with integer)");
  cmd->add_flag("--json", args->json,
                "Print the full report as JSON (every tensor; non-finite numbers as \"inf\", \"-inf\", \"nan\")");
  cmd->add_option("--show", args->show, "Table rows: 'different' (every tensor not equal, default) or 'all'");
  cmd->footer(
      "Float tensors are compared as values (NaN equals NaN only at the same position), integer\n"
      "and bool tensors exactly, other dtypes bytewise. Shapes and dtypes must match unless\n"
      "--ignore-dtype.\n\n"
      "Exit status: 0 when A and B are equal within tolerance (same tensor names, dtypes and\n"
      "shapes, every value within tolerance); 3 when they differ; 1 on error (a checkpoint\n"
      "that is missing or cannot be read, a missing A or B, invalid option values). The JSON\n"
      "report says the same in \"equal\".");
  cmd->callback([args] { RunDiff(*args); });
}

}  // namespace ferry::cli
