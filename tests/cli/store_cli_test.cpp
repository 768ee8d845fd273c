// `ferry store import`, `ferry versions ...`, `ferry verify` and `ferry audit` end to end on
// the PEFT fixture llama_lora_all_linear_f32 (base, adapter, PEFT's merged output).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "convert/converter.h"
#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "store/internal.h"
#include "store/store.h"
#include "tests/cli/cli_runner.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using testing::RunFerry;
const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";
const char* kQProj = "model.layers.0.self_attn.q_proj.weight";

class StoreCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("ferry_store_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    db_ = (dir_ / "db").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `ferry args...` expecting exit 0; returns stdout parsed as JSON.
  nlohmann::json Json(const std::vector<std::string>& args) {
    auto r = RunFerry(args);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json();
  }

  // Imports base, adapter (step 10) and PEFT's merged output; returns their ids.
  void ImportAll() {
    auto b = RunFerry({"store", "import", (kCase / "base").string(), "--db", db_, "--kind", "base", "--run", "r1"});
    ASSERT_EQ(b.exit_code, 0) << b.err;
    base_ = b.out.substr(0, 32);
    ASSERT_EQ(b.out, base_ + "\n");
    auto a = Json({"store", "import", (kCase / "adapter").string(), "--db", db_, "--run", "r1", "--base-version",
                   base_.substr(0, 8), "--step", "10", "--metric", "reward_mean=0.5", "--json"});
    adapter_ = a["id"];
    EXPECT_EQ(a["kind"], "adapter");  // detected from adapter_config.json
    EXPECT_EQ(a["sequence"], 2);
    EXPECT_EQ(a["base_version"], base_);
    EXPECT_EQ(a["already_present"], false);
    EXPECT_GT(a["bytes_written"].get<int64_t>(), 0);
    auto m = Json({"store", "import", (kCase / "merged").string(), "--db", db_, "--run", "r1", "--kind", "merged",
                   "--base-version", base_, "--adapter-version", adapter_, "--step", "10", "--json"});
    merged_ = m["id"];
    EXPECT_EQ(m["adapter_version"], adapter_);
  }

  fs::path dir_;
  // Flips a bit of byte `offset` of the stored object of tensor digest `hex` (a file or a
  // small object's row) while no ferry process has the store open.
  void DamageObject(const std::string& hex, uint64_t offset) {
    auto store = store::Store::Open(db_, store::StoreOptions{});
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    Status s = store::internal::DamageObjectForTesting(**store, store::Digest::FromHex(hex).value(), offset);
    ASSERT_TRUE(s.ok()) << s.ToString();
  }

  std::string db_, base_, adapter_, merged_;
};

TEST_F(StoreCli, ImportListShowAndReimport) {
  ImportAll();
  auto list = Json({"versions", "list", "--db", db_, "--json"});
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0]["id"], base_);
  EXPECT_EQ(list[1]["metrics"]["reward_mean"], 0.5);
  EXPECT_EQ(list[2]["kind"], "merged");
  auto adapters = Json({"versions", "list", "--db", db_, "--kind", "adapter", "--json"});
  ASSERT_EQ(adapters.size(), 1u);
  EXPECT_EQ(adapters[0]["id"], adapter_);

  auto show = Json({"versions", "show", adapter_.substr(0, 10), "--db", db_, "--json"});
  EXPECT_EQ(show["id"], adapter_);
  EXPECT_EQ(show["step"], 10);
  EXPECT_EQ(show["tensors"].size(), 28u);
  EXPECT_FALSE(show["adapter_config"].get<std::string>().empty());

  // Same weights again: same id, nothing written.
  auto again = Json({"store", "import", (kCase / "base").string(), "--db", db_, "--kind", "base", "--json"});
  EXPECT_EQ(again["id"], base_);
  EXPECT_EQ(again["already_present"], true);
  EXPECT_EQ(again["bytes_written"], 0);

  auto text = RunFerry({"versions", "list", "--db", db_, "--run", "r1"});
  EXPECT_EQ(text.exit_code, 0);
  EXPECT_NE(text.out.find(base_.substr(0, 12)), std::string::npos);
  EXPECT_NE(text.out.find("reward_mean=0.5"), std::string::npos);
}

TEST_F(StoreCli, DiffComparesByDigest) {
  ImportAll();
  auto d = Json({"versions", "diff", base_, merged_, "--db", db_, "--json"});
  // The merge changes the 14 targeted projections and leaves 7 tensors (norms, embeddings) alone.
  EXPECT_EQ(d["counts"]["changed"], 14);
  EXPECT_EQ(d["counts"]["unchanged"], 7);
  EXPECT_EQ(d["counts"]["added"], 0);
  EXPECT_EQ(d["counts"]["removed"], 0);
  bool saw_q = false;
  for (const auto& t : d["tensors"]) saw_q = saw_q || (t["name"] == kQProj && t["status"] == "changed");
  EXPECT_TRUE(saw_q);
  auto ad = Json({"versions", "diff", base_, adapter_, "--db", db_, "--json"});
  EXPECT_EQ(ad["counts"]["added"], 28);
  EXPECT_EQ(ad["counts"]["removed"], 21);
  // --exit-code: 3 when the versions differ, 0 for a version against itself.
  EXPECT_EQ(RunFerry({"versions", "diff", base_, merged_, "--db", db_}).exit_code, 0);
  EXPECT_EQ(RunFerry({"versions", "diff", base_, merged_, "--db", db_, "--exit-code"}).exit_code, 3);
  EXPECT_EQ(RunFerry({"versions", "diff", base_, merged_, "--db", db_, "--exit-code", "--json"}).exit_code, 3);
  auto same = RunFerry({"versions", "diff", base_, base_, "--db", db_, "--exit-code"});
  EXPECT_EQ(same.exit_code, 0) << same.err;
  EXPECT_NE(same.out.find("(identical versions)"), std::string::npos) << same.out;
}

// A path the OS allows but that is not UTF-8 is printed in --json with U+FFFD, not an
// abort (nlohmann's dump throws on invalid UTF-8 by default).
TEST_F(StoreCli, VerifyJsonOfANonUtf8PathReplacesTheBadByte) {
  ImportAll();
  const fs::path odd = dir_ / "model-\xff";
  fs::create_directories(odd);
  fs::copy_file(kCase / "merged" / "model.safetensors", odd / "model.safetensors");
  auto r = RunFerry({"verify", odd.string(), "--db", db_, "--json"});
  EXPECT_LT(r.exit_code, 2) << r.err;  // a verdict (match or not), no crash
  EXPECT_NE(r.out.find("model-\xef\xbf\xbd"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
}

TEST_F(StoreCli, VerifyDirectoryAgainstTheStore) {
  ImportAll();
  auto same = RunFerry({"verify", (kCase / "merged").string(), "--db", db_});
  EXPECT_EQ(same.exit_code, 0) << same.err;
  EXPECT_NE(same.out.find("is version " + merged_.substr(0, 12)), std::string::npos) << same.out;

  auto pinned = RunFerry({"verify", (kCase / "base").string(), "--db", db_, "--version", base_});
  EXPECT_EQ(pinned.exit_code, 0) << pinned.err;

  // Same tensors, different aux files: the base's weights without its tokenizer files.
  fs::create_directories(dir_ / "bare");
  fs::copy_file(kCase / "base" / "model.safetensors", dir_ / "bare" / "model.safetensors");
  auto bare = RunFerry({"verify", (dir_ / "bare").string(), "--db", db_});
  EXPECT_EQ(bare.exit_code, 0) << bare.err;
  EXPECT_NE(
      bare.out.find("same tensors as version " + base_.substr(0, 12) + " (run r1, seq 1, base), different aux files"),
      std::string::npos)
      << bare.out;

  auto wrong = RunFerry({"verify", (kCase / "merged").string(), "--db", db_, "--version", base_});
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_NE(wrong.err.find("does not match version " + base_.substr(0, 12)), std::string::npos) << wrong.err;
  EXPECT_NE(wrong.err.find("14 differ"), std::string::npos) << wrong.err;
  EXPECT_NE(wrong.err.find(std::string("tensor ") + kQProj + ": digest differs"), std::string::npos) << wrong.err;

  // Weights recorded nowhere: a merge by Ferry rounds differently from PEFT's.
  ASSERT_EQ(RunFerry({"convert", "--base", (kCase / "base").string(), "--adapter", (kCase / "adapter").string(),
                      "--out", (dir_ / "ours").string()})
                .exit_code,
            0);
  auto none = RunFerry({"verify", (dir_ / "ours").string(), "--db", db_});
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_NE(none.err.find("matches no version in store " + db_), std::string::npos) << none.err;

  auto missing = RunFerry({"verify", (kCase / "base").string(), "--db", db_, "--version", "ffffff"});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find("ffffff"), std::string::npos) << missing.err;
}

TEST_F(StoreCli, MaterializeAdapterEqualsPeftMergeWithinTolerance) {
  ImportAll();
  const fs::path out = dir_ / "mat";
  auto m = Json({"versions", "materialize", adapter_, "--db", db_, "--out", out.string(), "--json"});
  EXPECT_EQ(m["merged"], true);
  EXPECT_EQ(m["checked_against"], merged_);
  EXPECT_EQ(m["tensors_identical"].get<int>() + m["tensors_within_tolerance"].get<int>(), 21);
  // Independent check against PEFT's merged weights.
  auto ours = Checkpoint::Open(out);
  auto peft = Checkpoint::Open(kCase / "merged");
  ASSERT_TRUE(ours.ok() && peft.ok());
  ASSERT_EQ(ours->names(), peft->names());
  for (const auto& name : peft->names()) {
    auto a = ours->Get(name);
    auto b = peft->Get(name);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->dtype(), DType::kF32);
    for (int64_t i = 0; i < b->numel(); ++i) {
      ASSERT_NEAR(a->data_as<float>()[i], b->data_as<float>()[i], 1e-6) << name << " at " << i;
    }
  }
  // The tempdir is gone: only the output is left beside it.
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_TRUE(e.path().filename() == "db" || e.path().filename() == "mat") << e.path();
  }
  // Base versions export as stored; other layouts are refused for them.
  auto base = RunFerry({"versions", "materialize", base_, "--db", db_, "--out", (dir_ / "b").string()});
  EXPECT_EQ(base.exit_code, 0) << base.err;
  EXPECT_TRUE(fs::exists(dir_ / "b" / "model.safetensors"));
  auto fused =
      RunFerry({"versions", "materialize", base_, "--db", db_, "--out", (dir_ / "f").string(), "--layout", "fused"});
  EXPECT_EQ(fused.exit_code, 1);
  EXPECT_NE(fused.err.find("applies only to adapter versions"), std::string::npos) << fused.err;
  EXPECT_FALSE(fs::exists(dir_ / "f"));
  auto exists = RunFerry({"versions", "materialize", adapter_, "--db", db_, "--out", out.string()});
  EXPECT_EQ(exists.exit_code, 1);
  EXPECT_NE(exists.err.find(out.string() + " exists"), std::string::npos) << exists.err;
}

TEST_F(StoreCli, CorruptedObjectIsNamedByVersionsVerify) {
  ImportAll();
  auto ok = RunFerry({"versions", "verify", "--db", db_});
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  auto show = Json({"versions", "show", base_, "--db", db_, "--json"});
  std::string digest;
  for (const auto& t : show["tensors"]) {
    if (t["name"] == kQProj) digest = t["digest"];
  }
  ASSERT_EQ(digest.size(), 32u);
  DamageObject(digest, 100);
  auto bad = RunFerry({"versions", "verify", base_.substr(0, 8), "--db", db_});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find(std::string("tensor ") + kQProj + " is corrupted"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find(base_.substr(0, 12)), std::string::npos) << bad.err;
}

TEST_F(StoreCli, AuditJsonAndHtml) {
  ImportAll();
  auto j = Json({"audit", "--db", db_, "--run", "r1", "--json"});
  for (const char* k : {"timeline", "receivers", "gaps", "never_acknowledged", "anomalies"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  ASSERT_EQ(j["timeline"].size(), 3u);
  EXPECT_EQ(j["timeline"][1]["id"], adapter_);
  EXPECT_EQ(j["timeline"][1]["metrics"]["reward_mean"], 0.5);
  EXPECT_EQ(j["timeline"][2]["parent"], adapter_);
  EXPECT_TRUE(j["anomalies"].empty()) << j["anomalies"].dump();

  const fs::path html = dir_ / "audit.html";
  auto r = RunFerry({"audit", "--db", db_, "--html", html.string()});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("Anomalies (0)"), std::string::npos) << r.out;
  std::ifstream in(html);
  const std::string page((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(page.find("<svg class=\"timeline\""), std::string::npos);
  EXPECT_NE(page.find(">reward_mean</text>"), std::string::npos);
  EXPECT_NE(page.find("id=\"receivers\""), std::string::npos);
  EXPECT_EQ(page.find("<script"), std::string::npos);

  auto unknown = RunFerry({"audit", "--db", db_, "--run", "nope"});
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_NE(unknown.err.find("run 'nope'"), std::string::npos) << unknown.err;
  auto nodb = RunFerry({"audit", "--db", (dir_ / "nodb").string()});
  EXPECT_EQ(nodb.exit_code, 1);
  EXPECT_NE(nodb.err.find((dir_ / "nodb").string()), std::string::npos) << nodb.err;
}

TEST_F(StoreCli, HelpAndUsageErrors) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> helps = {
      {{"store", "import", "--help"}, "--base-version"},
      {{"versions", "--help"}, "materialize"},
      {{"versions", "materialize", "--help"}, "--layout"},
      {{"verify", "--help"}, "--version"},
      {{"audit", "--help"}, "--html"}};
  for (const auto& [args, expected] : helps) {
    auto r = RunFerry(args);
    EXPECT_EQ(r.exit_code, 0) << args[0];
    EXPECT_NE(r.out.find(expected), std::string::npos) << args[0] << ": " << r.out;
  }
  auto kind = RunFerry({"store", "import", (kCase / "base").string(), "--db", db_, "--kind", "lora"});
  EXPECT_EQ(kind.exit_code, 1);
  EXPECT_NE(kind.err.find("--kind"), std::string::npos) << kind.err;
  auto metric = RunFerry({"store", "import", (kCase / "base").string(), "--db", db_, "--metric", "reward"});
  EXPECT_EQ(metric.exit_code, 1);
  EXPECT_NE(metric.err.find("--metric 'reward' is not key=value"), std::string::npos) << metric.err;
  for (const char* k : {"base", "merged", "full"}) {  // an adapter recorded as a model would be merged onto
    auto wrong = RunFerry({"store", "import", (kCase / "adapter").string(), "--db", db_, "--kind", k});
    EXPECT_EQ(wrong.exit_code, 1) << k;
    EXPECT_NE(wrong.err.find((kCase / "adapter").string() + " is a PEFT adapter"), std::string::npos) << wrong.err;
    EXPECT_NE(wrong.err.find(std::string("--kind ") + k), std::string::npos) << wrong.err;
  }
  auto not_adapter = RunFerry({"store", "import", (kCase / "base").string(), "--db", db_, "--kind", "adapter"});
  EXPECT_EQ(not_adapter.exit_code, 1);
  EXPECT_NE(not_adapter.err.find("is not a PEFT adapter"), std::string::npos) << not_adapter.err;
  EXPECT_EQ(RunFerry({"versions", "list", "--db", db_}).out.find("adapter"), std::string::npos);  // nothing recorded
  auto base = RunFerry({"store", "import", (kCase / "adapter").string(), "--db", db_, "--base-version", "abcdef01"});
  EXPECT_EQ(base.exit_code, 1);
  EXPECT_NE(base.err.find("--base-version"), std::string::npos) << base.err;
  EXPECT_NE(base.err.find("abcdef01"), std::string::npos) << base.err;
}

// A merged version recorded by its digests only (store::Store::RecordDerived, as the daemon
// records a step): listed and shown as derived, verified through its base and adapter,
// rebuilt by `ferry versions materialize` with exactly its id, which `ferry verify` names.
TEST_F(StoreCli, DerivedVersionIsMaterializedWithItsIdAndVerified) {
  auto b = RunFerry({"store", "import", (kCase / "base").string(), "--db", db_, "--kind", "base", "--run", "r1"});
  ASSERT_EQ(b.exit_code, 0) << b.err;
  base_ = b.out.substr(0, 32);
  adapter_ = Json({"store", "import", (kCase / "adapter").string(), "--db", db_, "--run", "r1", "--base-version", base_,
                   "--step", "1", "--json"})["id"];
  std::string derived;
  {
    ConvertOptions c;
    c.base = kCase / "base";
    c.adapter = kCase / "adapter";
    c.out = dir_ / "conv";
    c.threads = 2;
    ASSERT_TRUE(Convert(c).ok());
    auto rec = store::HashPath(c.out);
    ASSERT_TRUE(rec.ok()) << rec.status().ToString();
    auto aux = CollectAuxFiles(c.out);
    ASSERT_TRUE(aux.ok()) << aux.status().ToString();
    fs::remove_all(c.out);
    store::StoreOptions so;
    so.sync_objects = false;
    auto s = store::Store::Open(db_, so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store::ImportOptions o;
    o.run = "r1";
    o.kind = store::VersionKind::kMerged;
    o.source = store::VersionSource::kDaemon;
    o.step = 1;
    o.base_version = store::Digest::FromHex(base_).value();
    o.adapter_version = store::Digest::FromHex(adapter_).value();
    auto r = (*s)->RecordDerived(rec->tensors, *aux, o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    derived = r->record.id.Hex();
  }
  auto list = Json({"versions", "list", "--db", db_, "--json"});
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0]["derived"], false);
  EXPECT_EQ(list[1]["derived"], false);
  EXPECT_EQ(list[2]["id"], derived);
  EXPECT_EQ(list[2]["derived"], true);
  EXPECT_EQ(list[2]["kind"], "merged");
  auto show = Json({"versions", "show", derived, "--db", db_, "--json"});
  EXPECT_EQ(show["derived"], true);
  EXPECT_EQ(show["adapter_version"], adapter_);
  auto text = RunFerry({"versions", "list", "--db", db_});
  EXPECT_NE(text.out.find("merged*"), std::string::npos) << text.out;
  EXPECT_NE(text.out.find("* derived"), std::string::npos) << text.out;

  auto verify = Json({"versions", "verify", "--db", db_, "--json"});
  ASSERT_EQ(verify.size(), 3u);
  for (const auto& r : verify) {
    EXPECT_EQ(r["ok"], true) << r.dump();
    EXPECT_EQ(r["derived"], r["version"] == derived) << r.dump();
  }

  const fs::path out = dir_ / "mat";
  auto m = RunFerry({"versions", "materialize", derived.substr(0, 10), "--db", db_, "--out", out.string()});
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_NE(m.out.find("derived version " + derived.substr(0, 12) + " rebuilt from base " + base_.substr(0, 12) +
                       " + adapter " + adapter_.substr(0, 12)),
            std::string::npos)
      << m.out;
  auto v = RunFerry({"verify", out.string(), "--db", db_});
  EXPECT_EQ(v.exit_code, 0) << v.err;
  EXPECT_NE(v.out.find("is version " + derived.substr(0, 12)), std::string::npos) << v.out;

  // A damaged adapter object: materialize fails naming both ids and leaves nothing.
  auto adapter = Json({"versions", "show", adapter_, "--db", db_, "--json"});
  const std::string digest = adapter["tensors"][0]["digest"];
  DamageObject(digest, 0);
  const fs::path out2 = dir_ / "mat2";
  auto bad = RunFerry({"versions", "materialize", derived, "--db", db_, "--out", out2.string()});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find(derived), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find(adapter_), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("corrupted"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(out2));
  auto unverified = RunFerry({"versions", "verify", derived, "--db", db_});
  EXPECT_EQ(unverified.exit_code, 1);
  EXPECT_NE(unverified.err.find("derived version " + derived.substr(0, 12) + ": adapter version " + adapter_),
            std::string::npos)
      << unverified.err;
}

}  // namespace
}  // namespace ferry
