// `ferry verify PATH --db DB [--version V]`: are the weights in PATH a recorded version?
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/store_common.h"

namespace ferry::cli {
namespace {

using Json = nlohmann::ordered_json;

struct VerifyPathFlags {
  std::string path, db, version;
  bool json = false;
};

struct Comparison {
  std::vector<std::string> mismatched;  // both have it, digests differ
  std::vector<std::string> missing;     // recorded, not in PATH
  std::vector<std::string> extra;       // in PATH, not recorded
  std::vector<std::string> aux_differ;  // auxiliary files that differ or exist on one side
  int64_t matched = 0;
  bool tensors_equal() const { return mismatched.empty() && missing.empty() && extra.empty(); }
};

Comparison Compare(const store::VersionRecord& got, const store::VersionRecord& recorded) {
  Comparison c;
  std::map<std::string, store::Digest> rec;
  for (const auto& t : recorded.tensors) rec[t.name] = t.digest;
  for (const auto& t : got.tensors) {
    auto it = rec.find(t.name);
    if (it == rec.end()) {
      c.extra.push_back(t.name);
      continue;
    }
    if (it->second == t.digest) {
      ++c.matched;
    } else {
      c.mismatched.push_back(t.name);
    }
    rec.erase(it);
  }
  for (const auto& [name, d] : rec) c.missing.push_back(name);
  std::map<std::string, store::Digest> aux;
  for (const auto& a : recorded.aux) aux[a.name] = a.digest;
  for (const auto& a : got.aux) {
    auto it = aux.find(a.name);
    if (it == aux.end() || it->second != a.digest) c.aux_differ.push_back(a.name);
    if (it != aux.end()) aux.erase(it);
  }
  for (const auto& [name, d] : aux) c.aux_differ.push_back(name);
  return c;
}

std::string Describe(const store::VersionRecord& v) {
  return ShortId(v.id) + " (run " + v.run + ", seq " + std::to_string(v.sequence) + ", " +
         std::string(store::KindName(v.kind)) + ")";
}

// The names, comma-separated; after `limit` names, "and N more".
std::string JoinNames(const std::vector<std::string>& v, size_t limit = SIZE_MAX) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < limit; ++i) s += (s.empty() ? "" : ", ") + v[i];
  if (v.size() > limit) s += " and " + std::to_string(v.size() - limit) + " more";
  return s;
}

void RunVerifyPath(const VerifyPathFlags& f) {
  auto s = OpenStoreOrFail(f.db, false);
  std::optional<store::VersionRecord> target;
  if (!f.version.empty()) target = GetVersionOrFail(*s, f.version, "--version");
  std::optional<Progress> progress;
  uint64_t last = 0;
  auto hashed = store::HashPath(f.path, [&](uint64_t done, uint64_t total) {
    if (!progress) progress.emplace("hash", total, !f.json);
    progress->Add(done - last);
    last = done;
  });
  if (progress) progress->Done();
  if (!hashed.ok()) Fail(hashed.status());
  const store::VersionRecord& got = *hashed;

  if (target) {
    Comparison c = Compare(got, *target);
    const bool ok = c.tensors_equal();
    if (f.json) {
      Json j;
      j["path"] = f.path;
      j["computed"] = got.id.Hex();
      j["version"] = target->id.Hex();
      j["match"] = got.id == target->id;
      j["tensors_match"] = ok;
      j["mismatched"] = c.mismatched;
      j["missing"] = c.missing;
      j["extra"] = c.extra;
      j["aux_differ"] = c.aux_differ;
      std::printf("%s\n", JsonText(j, 2).c_str());
    } else if (ok) {
      std::printf("%s matches version %s: all %lld tensors%s\n", f.path.c_str(), Describe(*target).c_str(),
                  static_cast<long long>(c.matched),
                  c.aux_differ.empty() ? " and auxiliary files"
                                       : (" (auxiliary files differ: " + JoinNames(c.aux_differ) + ")").c_str());
    }
    if (ok) return;
    if (!f.json) {
      for (const auto& t : c.mismatched)
        std::fprintf(stderr, "  tensor %s: digest differs from the record\n", t.c_str());
      for (const auto& t : c.missing)
        std::fprintf(stderr, "  tensor %s: recorded but missing from %s\n", t.c_str(), f.path.c_str());
      for (const auto& t : c.extra)
        std::fprintf(stderr, "  tensor %s: in %s but not recorded\n", t.c_str(), f.path.c_str());
    }
    std::string detail;
    if (!c.mismatched.empty())
      detail += std::to_string(c.mismatched.size()) + " differ (" + JoinNames(c.mismatched, 5) + ")";
    if (!c.missing.empty())
      detail += (detail.empty() ? "" : "; ") + std::to_string(c.missing.size()) + " missing (" +
                JoinNames(c.missing, 5) + ")";
    if (!c.extra.empty())
      detail +=
          (detail.empty() ? "" : "; ") + std::to_string(c.extra.size()) + " extra (" + JoinNames(c.extra, 5) + ")";
    Fail(f.path + " does not match version " + Describe(*target) + " in store " + f.db + ": " + detail);
  }

  // The common case, PATH is a recorded version, is one lookup; only otherwise is every
  // version compared.
  std::vector<store::VersionRecord> versions;
  auto recorded = s->GetVersion(got.id.Hex());
  if (recorded.ok()) {
    versions.push_back(std::move(*recorded));
  } else if (recorded.status().code() == StatusCode::kNotFound) {
    auto all = s->ListVersions(std::nullopt);
    if (!all.ok()) Fail(all.status());
    versions = std::move(*all);
  } else {
    Fail(recorded.status());
  }
  const store::VersionRecord* exact = nullptr;
  const store::VersionRecord* same_tensors = nullptr;
  const store::VersionRecord* closest = nullptr;
  int64_t closest_matched = 0;
  Comparison same_cmp;
  for (const auto& v : versions) {
    if (v.id == got.id) {
      exact = &v;
      closest_matched = static_cast<int64_t>(got.tensors.size());
      break;
    }
    Comparison c = Compare(got, v);
    if (c.tensors_equal() && !same_tensors) {
      same_tensors = &v;
      same_cmp = c;
    }
    if (c.matched > closest_matched) {
      closest = &v;
      closest_matched = c.matched;
    }
  }
  if (f.json) {
    Json j;
    j["path"] = f.path;
    j["computed"] = got.id.Hex();
    j["match"] = exact ? Json(exact->id.Hex()) : Json();
    j["same_tensors"] = !exact && same_tensors ? Json(same_tensors->id.Hex()) : Json();
    j["aux_differ"] = !exact && same_tensors ? Json(same_cmp.aux_differ) : Json::array();
    j["closest"] = !exact && !same_tensors && closest ? Json(closest->id.Hex()) : Json();
    j["closest_matching_tensors"] = closest_matched;
    std::printf("%s\n", JsonText(j, 2).c_str());
  }
  if (exact) {
    if (!f.json) std::printf("%s is version %s\n", f.path.c_str(), Describe(*exact).c_str());
    return;
  }
  if (same_tensors) {
    if (!f.json) {
      std::printf("%s has the same tensors as version %s, different aux files (%s)\n", f.path.c_str(),
                  Describe(*same_tensors).c_str(), JoinNames(same_cmp.aux_differ).c_str());
    }
    return;
  }
  Fail(f.path + " (manifest " + ShortId(got.id) + ", " + std::to_string(got.tensors.size()) +
       " tensors) matches no version in store " + f.db +
       (closest ? "; closest: version " + Describe(*closest) + " with " + std::to_string(closest_matched) + " of " +
                      std::to_string(got.tensors.size()) + " tensors equal"
                : std::string()));
}

}  // namespace

void SetVerifyCommand(CLI::App& app) {
  auto f = std::make_shared<VerifyPathFlags>();
  CLI::App* cmd = app.add_subcommand("verify", "Check that the weights in a directory are a recorded version");
  cmd->add_option("PATH", f->path, "safetensors file, model directory or PEFT adapter directory")->required();
  cmd->add_option("--db", f->db, "Store directory")->required();
  cmd->add_option("--version", f->version, "The version PATH should be (id or prefix)");
  cmd->add_flag("--json", f->json, "Print JSON");
  cmd->footer(
      "With --version: every tensor whose digest differs, that is missing or that is extra is named; exit 1 unless\n"
      "all tensors match. Without it: says which version PATH is (same manifest id), or that it has the same\n"
      "tensors as a version but different auxiliary files (exit 0), or that it matches none (exit 1).");
  cmd->callback([f] { RunVerifyPath(*f); });
}

}  // namespace ferry::cli
