// `ferry versions list|show|diff|verify|materialize|gc`: reading and maintaining a store.
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/store_common.h"
#include "convert/converter.h"
#include "core/text.h"
#include "store/materialize.h"

namespace ferry::cli {
namespace {

using Json = nlohmann::ordered_json;

std::string Metrics(const store::VersionRecord& v) {
  std::string s;
  for (const auto& [k, value] : v.metrics) s += (s.empty() ? "" : " ") + k + "=" + FormatNumber(value, 6);
  return s;
}

// ---------------------------------------------------------------------------------------
struct ListFlags {
  std::string db, run, kind;
  bool json = false;
};

void RunList(const ListFlags& f) {
  std::optional<store::VersionKind> kind;
  if (!f.kind.empty()) {
    auto k = store::ParseKind(f.kind);
    if (!k.ok()) Fail("--kind: " + k.status().message());
    kind = *k;
  }
  auto s = OpenStoreOrFail(f.db, false);
  if (!f.run.empty()) {
    auto runs = s->ListRuns();
    if (!runs.ok()) Fail(runs.status());
    if (std::find(runs->begin(), runs->end(), f.run) == runs->end()) {
      Fail("store " + f.db + ": no run named '" + f.run + "'");
    }
  }
  auto versions = s->ListVersions(f.run.empty() ? std::nullopt : std::optional<std::string>(f.run));
  if (!versions.ok()) Fail(versions.status());
  std::vector<const store::VersionRecord*> shown;
  for (const auto& v : *versions) {
    if (!kind || v.kind == *kind) shown.push_back(&v);
  }
  if (f.json) {
    Json j = Json::array();
    for (const auto* v : shown) j.push_back(VersionJson(*v, false));
    std::printf("%s\n", JsonText(j, 2).c_str());
    return;
  }
  if (shown.empty()) {
    std::printf("no versions\n");
    return;
  }
  std::printf("%-12s  %-12s %5s %8s  %-8s  %-8s  %10s  %-20s  %s\n", "id", "run", "seq", "step", "kind", "source",
              "size", "time", "metrics");
  bool any_derived = false;
  for (const auto* v : shown) {
    any_derived = any_derived || v->derived;
    std::printf("%-12s  %-12s %5llu %8s  %-8s  %-8s  %10s  %-20s  %s\n", ShortId(v->id).c_str(), v->run.c_str(),
                static_cast<unsigned long long>(v->sequence), v->step ? std::to_string(*v->step).c_str() : "-",
                (std::string(store::KindName(v->kind)) + (v->derived ? "*" : "")).c_str(),
                std::string(store::SourceName(v->source)).c_str(), HumanBytes(v->total_bytes).c_str(),
                FormatTime(v->time_ns).c_str(), Metrics(*v).c_str());
  }
  if (any_derived) {
    std::printf(
        "* derived: recorded by its digests only; `ferry versions materialize` rebuilds it from its base "
        "and adapter\n");
  }
}

// ---------------------------------------------------------------------------------------
struct ShowFlags {
  std::string db, version;
  bool json = false;
};

void RunShow(const ShowFlags& f) {
  auto s = OpenStoreOrFail(f.db, false);
  store::VersionRecord v = GetVersionOrFail(*s, f.version, "");
  auto events = s->ListEvents(v.id);
  if (!events.ok()) Fail(events.status());
  if (f.json) {
    Json j = VersionJson(v, true);
    Json ev = Json::array();
    for (const auto& e : *events) ev.push_back(EventJson(e));
    j["events"] = std::move(ev);
    std::printf("%s\n", JsonText(j, 2).c_str());
    return;
  }
  std::printf("version   %s\n", v.id.Hex().c_str());
  std::printf("run       %s (sequence %llu)\n", v.run.c_str(), static_cast<unsigned long long>(v.sequence));
  std::printf("kind      %s, layout %s, source %s\n", std::string(store::KindName(v.kind)).c_str(),
              std::string(LayoutName(v.layout)).c_str(), std::string(store::SourceName(v.source)).c_str());
  std::printf("time      %s\n", FormatTime(v.time_ns).c_str());
  if (v.step) std::printf("step      %lld\n", static_cast<long long>(*v.step));
  if (v.parent) std::printf("parent    %s\n", v.parent->Hex().c_str());
  if (v.base_version) std::printf("base      %s\n", v.base_version->Hex().c_str());
  if (v.adapter_version) std::printf("adapter   %s\n", v.adapter_version->Hex().c_str());
  if (v.derived) {
    std::printf(
        "derived   no tensor bytes stored: the merge of its adapter onto its base "
        "(`ferry versions materialize` rebuilds it)\n");
  }
  if (!v.metrics.empty()) std::printf("metrics   %s\n", Metrics(v).c_str());
  std::printf("size      %s in %zu tensors\n", HumanBytes(v.total_bytes).c_str(), v.tensors.size());
  size_t width = 6;
  for (const auto& t : v.tensors) width = std::max(width, t.name.size());
  std::printf("\n%-*s  %-6s  %-16s  %10s  %12s  %s\n", static_cast<int>(width), "tensor", "dtype", "shape", "size",
              "l2_norm", "digest");
  for (const auto& t : v.tensors) {
    std::string flags;
    if (t.nonfinite > 0) flags += "  " + std::to_string(t.nonfinite) + " NaN/Inf";
    if (t.all_zero) flags += "  all zero";
    std::printf("%-*s  %-6s  %-16s  %10s  %12s  %s%s\n", static_cast<int>(width), t.name.c_str(),
                std::string(DTypeName(t.dtype)).c_str(), ShapeToString(t.shape).c_str(), HumanBytes(t.nbytes).c_str(),
                FormatNumber(t.l2_norm, 6).c_str(), t.digest.Hex().c_str(), flags.c_str());
  }
  if (!v.aux.empty()) {
    std::printf("\nauxiliary files\n");
    for (const auto& a : v.aux)
      std::printf("  %-28s %10s  %s\n", a.name.c_str(), HumanBytes(a.size).c_str(), a.digest.Hex().c_str());
  }
  if (!events->empty()) {
    std::printf("\nevents\n");
    for (const auto& e : *events) {
      std::printf("  %s  %-12s %s%s%s\n", FormatTime(e.time_ns).c_str(),
                  std::string(store::EventTypeName(e.type)).c_str(), e.receiver.c_str(),
                  e.computed ? (*e.computed == e.version ? " (digest matched)" : " (digest MISMATCH)") : "",
                  e.detail.empty() ? "" : (" " + e.detail).c_str());
    }
  }
}

// ---------------------------------------------------------------------------------------
struct DiffFlags {
  std::string db, a, b;
  bool json = false;
  bool all = false;
  bool exit_code = false;
};

constexpr int kExitVersionsDiffer = 3;  // as `ferry diff`

void RunDiff(const DiffFlags& f) {
  auto s = OpenStoreOrFail(f.db, false);
  store::VersionRecord a = GetVersionOrFail(*s, f.a, "V1");
  store::VersionRecord b = GetVersionOrFail(*s, f.b, "V2");
  std::map<std::string, const store::TensorRow*> ra, rb;
  for (const auto& t : a.tensors) ra[t.name] = &t;
  for (const auto& t : b.tensors) rb[t.name] = &t;
  std::set<std::string> names;
  for (const auto& [n, t] : ra) names.insert(n);
  for (const auto& [n, t] : rb) names.insert(n);
  struct Row {
    std::string name, status;
    const store::TensorRow* a;
    const store::TensorRow* b;
  };
  std::vector<Row> rows;
  int64_t changed = 0, added = 0, removed = 0, unchanged = 0;
  for (const auto& n : names) {
    auto ia = ra.find(n);
    auto ib = rb.find(n);
    const store::TensorRow* ta = ia == ra.end() ? nullptr : ia->second;
    const store::TensorRow* tb = ib == rb.end() ? nullptr : ib->second;
    std::string status;
    if (!ta) {
      status = "added", ++added;
    } else if (!tb) {
      status = "removed", ++removed;
    } else if (ta->digest != tb->digest) {
      status = "changed", ++changed;
    } else {
      status = "unchanged", ++unchanged;
    }
    rows.push_back({n, status, ta, tb});
  }
  std::set<std::string> aux_changed;
  {
    std::map<std::string, store::Digest> xa, xb;
    for (const auto& x : a.aux) xa[x.name] = x.digest;
    for (const auto& x : b.aux) xb[x.name] = x.digest;
    for (const auto& [n, d] : xa) {
      if (!xb.count(n) || xb[n] != d) aux_changed.insert(n);
    }
    for (const auto& [n, d] : xb) {
      if (!xa.count(n)) aux_changed.insert(n);
    }
  }
  if (f.json) {
    Json j;
    j["a"] = a.id.Hex();
    j["b"] = b.id.Hex();
    j["identical"] = a.id == b.id;
    j["counts"] = {{"changed", changed}, {"added", added}, {"removed", removed}, {"unchanged", unchanged}};
    Json tensors = Json::array();
    for (const auto& r : rows) {
      if (r.status == "unchanged" && !f.all) continue;
      Json t;
      t["name"] = r.name;
      t["status"] = r.status;
      t["digest_a"] = r.a ? Json(r.a->digest.Hex()) : Json();
      t["digest_b"] = r.b ? Json(r.b->digest.Hex()) : Json();
      t["dtype_a"] = r.a ? Json(std::string(DTypeName(r.a->dtype))) : Json();
      t["dtype_b"] = r.b ? Json(std::string(DTypeName(r.b->dtype))) : Json();
      t["shape_a"] = r.a ? Json(r.a->shape) : Json();
      t["shape_b"] = r.b ? Json(r.b->shape) : Json();
      t["l2_norm_a"] = r.a ? Json(r.a->l2_norm) : Json();
      t["l2_norm_b"] = r.b ? Json(r.b->l2_norm) : Json();
      tensors.push_back(std::move(t));
    }
    j["tensors"] = std::move(tensors);
    j["aux_changed"] = aux_changed;
    std::printf("%s\n", JsonText(j, 2).c_str());
    if (f.exit_code && a.id != b.id) throw CLI::RuntimeError(kExitVersionsDiffer);
    return;
  }
  std::printf("A: %s (run %s, seq %llu, %s)\n", a.id.Hex().c_str(), a.run.c_str(),
              static_cast<unsigned long long>(a.sequence), std::string(store::KindName(a.kind)).c_str());
  std::printf("B: %s (run %s, seq %llu, %s)\n", b.id.Hex().c_str(), b.run.c_str(),
              static_cast<unsigned long long>(b.sequence), std::string(store::KindName(b.kind)).c_str());
  size_t width = 6;
  for (const auto& r : rows) width = std::max(width, r.name.size());
  bool header = false;
  for (const auto& r : rows) {
    if (r.status == "unchanged" && !f.all) continue;
    if (!header) {
      std::printf("\n%-*s  %-9s  %12s  %12s  %s\n", static_cast<int>(width), "tensor", "status", "l2_norm A",
                  "l2_norm B", "detail");
      header = true;
    }
    std::string detail;
    if (r.a && r.b && (r.a->dtype != r.b->dtype || r.a->shape != r.b->shape)) {
      detail = std::string(DTypeName(r.a->dtype)) + " " + ShapeToString(r.a->shape) + " -> " +
               std::string(DTypeName(r.b->dtype)) + " " + ShapeToString(r.b->shape);
    }
    std::printf("%-*s  %-9s  %12s  %12s  %s\n", static_cast<int>(width), r.name.c_str(), r.status.c_str(),
                r.a ? FormatNumber(r.a->l2_norm, 6).c_str() : "-", r.b ? FormatNumber(r.b->l2_norm, 6).c_str() : "-",
                detail.c_str());
  }
  for (const auto& n : aux_changed) std::printf("auxiliary file %s differs\n", n.c_str());
  std::printf("\n%lld changed, %lld added, %lld removed, %lld unchanged%s\n", static_cast<long long>(changed),
              static_cast<long long>(added), static_cast<long long>(removed), static_cast<long long>(unchanged),
              a.id == b.id ? " (identical versions)" : "");
  if (f.exit_code && a.id != b.id) throw CLI::RuntimeError(kExitVersionsDiffer);
}

// ---------------------------------------------------------------------------------------
struct VerifyFlags {
  std::string db, version;
  bool json = false;
};

void RunVerify(const VerifyFlags& f) {
  auto s = OpenStoreOrFail(f.db, false);
  std::optional<store::Digest> target;
  if (!f.version.empty()) target = GetVersionOrFail(*s, f.version, "").id;
  auto reports = s->Verify(target);
  if (!reports.ok()) Fail(reports.status());
  int64_t bad = 0;
  std::vector<std::string> problems;
  for (const auto& r : *reports) {
    if (r.ok()) continue;
    ++bad;
    for (const auto& t : r.missing)
      problems.push_back("version " + ShortId(r.version) + ": tensor " + t + " is missing");
    for (const auto& t : r.corrupted) {
      problems.push_back("version " + ShortId(r.version) + ": tensor " + t + " is corrupted");
    }
    for (const auto& d : r.dependencies) problems.push_back("derived version " + ShortId(r.version) + ": " + d);
  }
  if (f.json) {
    Json j = Json::array();
    for (const auto& r : *reports) {
      j.push_back({{"version", r.version.Hex()},
                   {"ok", r.ok()},
                   {"derived", r.derived},
                   {"missing", r.missing},
                   {"corrupted", r.corrupted},
                   {"dependencies", r.dependencies}});
    }
    std::printf("%s\n", JsonText(j, 2).c_str());
  } else {
    for (const auto& r : *reports) {
      std::string state =
          r.ok() ? "ok"
                 : std::to_string(r.corrupted.size()) + " corrupted, " + std::to_string(r.missing.size()) + " missing";
      if (r.derived) {
        state += r.dependencies.empty()
                     ? " (derived: base and adapter intact)"
                     : " (derived: " + std::to_string(r.dependencies.size()) + " problems in its base or adapter)";
      }
      std::printf("%s  %s\n", ShortId(r.version).c_str(), state.c_str());
    }
  }
  if (bad == 0) {
    if (!f.json) std::printf("%zu versions verified: every stored byte matches its digest\n", reports->size());
    return;
  }
  for (size_t i = 0; i + 1 < problems.size(); ++i) std::fprintf(stderr, "ferry: error: %s\n", problems[i].c_str());
  Fail("store " + f.db + ": " + problems.back() + " (" + std::to_string(bad) + " of " +
       std::to_string(reports->size()) + " versions failed verification)");
}

// ---------------------------------------------------------------------------------------
struct MaterializeFlags {
  std::string db, version, out, layout = "hf";
  bool force = false, exact = false, json = false;
  int threads = 0;
};

void RunMaterialize(const MaterializeFlags& f) {
  auto layout = ParseLayout(f.layout);
  if (!layout.ok()) Fail(layout.status().WithContext("--layout"));
  auto s = OpenStoreOrFail(f.db, false);
  store::VersionRecord v = GetVersionOrFail(*s, f.version, "");
  store::MaterializeOptions o;
  o.layout = *layout;
  o.force = f.force;
  o.exact = f.exact;
  o.threads = f.threads;
  auto r = store::Materialize(*s, v.id, f.out, o);
  if (!r.ok()) FailWithHint(r.status(), StatusCode::kAlreadyExists, "pass --force to replace it");
  if (f.json) {
    Json j;
    j["version"] = v.id.Hex();
    j["kind"] = std::string(store::KindName(v.kind));
    j["derived"] = v.derived;
    j["out"] = f.out;
    j["layout"] = std::string(LayoutName(*layout));
    j["merged"] = r->merged;
    j["checked_against"] = r->checked_against ? Json(r->checked_against->Hex()) : Json();
    j["tensors_identical"] = r->tensors_identical;
    j["tensors_within_tolerance"] = r->tensors_within_tolerance;
    j["max_abs_diff"] = r->max_abs_diff;
    std::printf("%s\n", JsonText(j, 2).c_str());
    return;
  }
  if (v.derived) {
    std::printf("wrote %s: derived version %s rebuilt from base %s + adapter %s (layout %s); its id matches\n",
                f.out.c_str(), ShortId(v.id).c_str(), ShortId(*v.base_version).c_str(),
                ShortId(*v.adapter_version).c_str(), std::string(LayoutName(v.layout)).c_str());
    return;
  }
  std::printf("wrote %s: %s version %s%s (layout %s)\n", f.out.c_str(), std::string(store::KindName(v.kind)).c_str(),
              ShortId(v.id).c_str(), r->merged ? (" merged into base " + ShortId(*v.base_version)).c_str() : "",
              std::string(LayoutName(*layout)).c_str());
  if (r->checked_against) {
    std::printf(
        "checked against recorded merged version %s: %lld tensors identical, %lld within tolerance "
        "(max abs diff %.3g)\n",
        ShortId(*r->checked_against).c_str(), static_cast<long long>(r->tensors_identical),
        static_cast<long long>(r->tensors_within_tolerance), r->max_abs_diff);
  } else if (r->merged) {
    std::printf("no merged version of this base and adapter is recorded: nothing to check against\n");
  }
}

// ---------------------------------------------------------------------------------------
struct GcFlags {
  std::string db;
  int64_t keep = -1;
  bool json = false;
};

void RunGc(const GcFlags& f) {
  if (f.keep < 1) Fail("--keep must be at least 1");
  auto s = OpenStoreOrFail(f.db, true);
  auto removed = s->GarbageCollect(f.keep);
  if (!removed.ok()) Fail(removed.status());
  if (f.json) {
    std::printf("%s\n", JsonText(Json({{"removed_versions", *removed}, {"keep", f.keep}}), 2).c_str());
    return;
  }
  std::printf("removed %lld versions (kept the newest %lld of each run and what they reference)\n",
              static_cast<long long>(*removed), static_cast<long long>(f.keep));
}

}  // namespace

void SetVersionsCommand(CLI::App& app) {
  CLI::App* versions =
      app.add_subcommand("versions", "List, inspect, compare, verify, materialise and collect versions");
  versions->require_subcommand(1);
  versions->footer(
      "Versions are named by id or by a unique prefix of at least 6 hex characters. Exit code 1 on error.");

  auto lf = std::make_shared<ListFlags>();
  CLI::App* list = versions->add_subcommand("list", "List versions, oldest first");
  list->add_option("--db", lf->db, "Store directory")->required();
  list->add_option("--run", lf->run, "Only this run");
  list->add_option("--kind", lf->kind, "Only this kind: base | adapter | merged | full");
  list->add_flag("--json", lf->json, "Print a JSON array");
  list->callback([lf] { RunList(*lf); });

  auto sf = std::make_shared<ShowFlags>();
  CLI::App* show =
      versions->add_subcommand("show", "Show a version: record, tensors (digests, norms), aux files, events");
  show->add_option("V", sf->version, "Version id or prefix")->required();
  show->add_option("--db", sf->db, "Store directory")->required();
  show->add_flag("--json", sf->json, "Print JSON");
  show->callback([sf] { RunShow(*sf); });

  auto df = std::make_shared<DiffFlags>();
  CLI::App* diff =
      versions->add_subcommand("diff", "Compare two versions' tensors by digest (changed/added/removed, norms)");
  diff->add_option("V1", df->a, "First version")->required();
  diff->add_option("V2", df->b, "Second version")->required();
  diff->add_option("--db", df->db, "Store directory")->required();
  diff->add_flag("--all", df->all, "Also list unchanged tensors");
  diff->add_flag("--json", df->json, "Print JSON");
  diff->add_flag("--exit-code", df->exit_code,
                 "Exit 3 when the versions differ (tensors or auxiliary files), as ferry diff");
  diff->footer("Exit code 0 whether or not the versions differ (3 when they differ with --exit-code); 1 on error.");
  diff->callback([df] { RunDiff(*df); });

  auto vf = std::make_shared<VerifyFlags>();
  CLI::App* verify = versions->add_subcommand("verify", "Re-hash stored bytes of one version (default: all versions)");
  verify->add_option("V", vf->version, "Version id or prefix (default: every version)");
  verify->add_option("--db", vf->db, "Store directory")->required();
  verify->add_flag("--json", vf->json, "Print JSON");
  verify->footer("Exit code 1 when a stored tensor is missing or corrupted; each one is named.");
  verify->callback([vf] { RunVerify(*vf); });

  auto mf = std::make_shared<MaterializeFlags>();
  CLI::App* mat = versions->add_subcommand("materialize", "Write a version out as a loadable directory");
  mat->add_option("V", mf->version, "Version id or prefix")->required();
  mat->add_option("--db", mf->db, "Store directory")->required();
  mat->add_option("--out", mf->out, "Output directory (must not exist unless --force)")->required();
  mat->add_option("--layout", mf->layout, "hf | fused | lora (adapter versions only; default hf)");
  mat->add_option("--threads", mf->threads, "Merge threads (default: all cores)");
  mat->add_flag("--force", mf->force, "Replace an existing output directory");
  mat->add_flag("--exact", mf->exact, "Require digests identical to a recorded merged version (no tolerance)");
  mat->add_flag("--json", mf->json, "Print a JSON summary");
  mat->footer(
      "An adapter version is merged into its base version with the converter (ferry convert's maths). When the store\n"
      "records a merged version of the same base and adapter, the result is checked against it: identical digests,\n"
      "or values within atol 1e-6 + rtol 1e-5 or 1 ULP (a merge by another implementation rounds differently).\n"
      "A mismatch exits 1 naming the tensors and leaves nothing at --out. A derived merged version (recorded by its\n"
      "digests only) is rebuilt from its base and adapter versions the same way and must have exactly its id.\n"
      "Other kinds are exported as stored (hf).");
  mat->callback([mf] { RunMaterialize(*mf); });

  auto gf = std::make_shared<GcFlags>();
  CLI::App* gc = versions->add_subcommand("gc", "Delete old versions and the objects no kept version uses");
  gc->add_option("--db", gf->db, "Store directory")->required();
  gc->add_option("--keep", gf->keep, "Versions to keep per run (newest), plus every version they reference")
      ->required();
  gc->add_flag("--json", gf->json, "Print JSON");
  gc->callback([gf] { RunGc(*gf); });
}

}  // namespace ferry::cli
