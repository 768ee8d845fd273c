// Snapshot builder (sync/snapshot.h) against the committed PEFT fixtures: the merge equals
// PEFT's merged/, the snapshot never aliases its source, names are normalised, the fused
// layout stacks the hf tensors, and the digests agree with the store's.
#include "sync/snapshot.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include <gtest/gtest.h>

#include "tests/sync/sync_test_util.h"
#include "tests/temp_dir.h"

#include "convert/converter.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "store/materialize.h"
#include "sync/handoff.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

const fs::path kCase = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_lora_all_linear_f32";

// Each test gets its own directory, removed afterwards.
class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry-sync-test-") {}
};

// Every tensor of the checkpoint at `path`, copied into owned, writable buffers (as live
// parameters would be).
std::map<std::string, Tensor> OwnedCopies(const fs::path& path) {
  auto ckpt = Checkpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  std::map<std::string, Tensor> out;
  for (const auto& name : ckpt->names()) {
    Tensor t = ckpt->Get(name).value();
    Tensor copy = Tensor::Empty(t.dtype(), t.shape()).value();
    std::memcpy(copy.mutable_data(), t.data(), t.nbytes());
    out.emplace(name, copy);
  }
  return out;
}

std::vector<float> Values(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  EXPECT_TRUE(ReadAsF32(t, v).ok());
  return v;
}

std::string ReadText(const fs::path& p) { return ReadSmallFile(p).value(); }

// A new store under `dir` that does not fsync its objects (tests).
Result<std::unique_ptr<store::Store>> OpenTestStore(const fs::path& dir) {
  store::StoreOptions so;
  so.create_if_missing = true;
  so.sync_objects = false;
  return store::Store::Open(dir / "db", so);
}

// The fixture's base + adapter as a snapshot source with owned buffers.
SnapshotSource FixtureSource() {
  SnapshotSource s;
  s.tensors = OwnedCopies(kCase / "base");
  s.adapter_tensors = OwnedCopies(kCase / "adapter");
  auto cfg = LoadPeftConfig(kCase / "adapter");
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  s.adapter_config = *cfg;
  return s;
}

// The auxiliary files the store collects beside the fixture's base weights.
AuxFiles BaseAux() {
  AuxFiles aux;
  for (const char* n : {"config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                        "tokenizer_config.json"}) {
    aux.emplace_back(n, ReadText(kCase / "base" / n));
  }
  return aux;
}

std::shared_ptr<const Snapshot> Build(const SnapshotSource& s, Layout layout = Layout::kHf) {
  SnapshotOptions o;
  o.layout = layout;
  o.threads = 2;
  auto snap = BuildSnapshot(s, o);
  EXPECT_TRUE(snap.ok()) << snap.status().ToString();
  return snap.ok() ? *snap : nullptr;
}

// Every tensor of `snap` equals the checkpoint at `ref` within 1e-5 of the tensor's scale
// (the largest magnitude), and the name sets are identical.
void ExpectMatches(const Snapshot& snap, const fs::path& ref) {
  Checkpoint want = Checkpoint::Open(ref).value();
  ASSERT_EQ(snap.checkpoint().names(), want.names());
  for (const auto& name : want.names()) {
    Tensor got = snap.checkpoint().Get(name).value();
    Tensor exp = want.Get(name).value();
    ASSERT_EQ(got.dtype(), exp.dtype()) << name;
    ASSERT_EQ(got.shape(), exp.shape()) << name;
    const std::vector<float> g = Values(got), e = Values(exp);
    float scale = 0;
    for (float x : e) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < e.size(); ++i) {
      ASSERT_NEAR(g[i], e[i], 1e-5f * scale) << name << " element " << i;
    }
  }
}

TEST(SnapshotTest, MergedEqualsPeftMergeWithGeneratorNames) {
  SnapshotSource src = FixtureSource();
  auto snap = Build(src);
  ASSERT_NE(snap, nullptr);
  EXPECT_TRUE(snap->merged());
  EXPECT_EQ(snap->layout(), Layout::kHf);
  ExpectMatches(*snap, kCase / "merged");
  EXPECT_EQ(snap->checkpoint().size(), 21u);
  for (const auto& name : snap->checkpoint().names()) {
    EXPECT_EQ(name.find("lora"), std::string::npos) << name;
    EXPECT_EQ(name.find("base_layer"), std::string::npos) << name;
    EXPECT_EQ(name.find("base_model"), std::string::npos) << name;
  }
  // 2 x (q 64x64 + k 32x64 + v 32x64 + o 64x64 + gate/up 128x64 each + down 64x128) + embed,
  // lm_head 128x64 + 5 norms of 64, all F32.
  const uint64_t per_layer = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64;
  EXPECT_EQ(snap->bytes(), 4u * (2 * per_layer + 2 * 128 * 64 + 5 * 64));
  EXPECT_EQ(snap->digests().size(), 21u);

  // One weight by hand, in double: W + (alpha / r) * B @ A.
  const PeftConfig& cfg = *src.adapter_config;
  const double scaling = cfg.lora_alpha / cfg.r;
  const std::string m = "model.layers.1.self_attn.v_proj";
  const std::vector<float> w = Values(src.tensors.at(m + ".weight"));
  const std::vector<float> a = Values(src.adapter_tensors.at("base_model.model." + m + ".lora_A.weight"));
  const std::vector<float> b = Values(src.adapter_tensors.at("base_model.model." + m + ".lora_B.weight"));
  const std::vector<float> got = Values(snap->checkpoint().Get(m + ".weight").value());
  const int64_t out = 32, in = 64, r = 8;
  double max_delta = 0;
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      double d = 0;
      for (int64_t k = 0; k < r; ++k) d += static_cast<double>(b[o * r + k]) * a[k * in + i];
      const double want = w[o * in + i] + scaling * d;
      max_delta = std::max(max_delta, std::fabs(scaling * d));
      ASSERT_NEAR(got[o * in + i], want, 1e-5) << o << "," << i;
    }
  }
  EXPECT_GT(max_delta, 1e-3) << "the adapter must actually change the weight for this test to mean anything";
}

TEST(SnapshotTest, MutatingAndDroppingTheSourceCannotChangeTheSnapshot) {
  auto src = std::make_unique<SnapshotSource>(FixtureSource());
  auto snap = Build(*src);
  ASSERT_NE(snap, nullptr);
  const store::Digest id = snap->manifest_id();
  const auto digests = snap->digests();
  for (auto* map : {&src->tensors, &src->adapter_tensors}) {
    for (auto& [name, t] : *map) {
      ASSERT_NE(t.mutable_data(), nullptr) << name;
      std::memset(t.mutable_data(), 0xAB, t.nbytes());
    }
  }
  src.reset();
  EXPECT_EQ(snap->manifest_id(), id);
  for (const auto& name : snap->checkpoint().names()) {
    EXPECT_EQ(store::TensorDigest(snap->checkpoint().Get(name).value()), digests.at(name)) << name;
  }
  ExpectMatches(*snap, kCase / "merged");
}

// share_unchanged over a read-only mapping: the tensors the adapter does not touch are the
// mapping's own bytes (kept alive by the snapshot), the merged ones new buffers; the ids and
// digests are those of the copying build.
TEST(SnapshotTest, ShareUnchangedKeepsUntouchedTensorsAsViewsWithTheSameIds) {
  SnapshotSource src = FixtureSource();
  auto base = std::make_unique<Checkpoint>(Checkpoint::Open(kCase / "base").value());
  src.tensors.clear();
  for (const std::string& name : base->names()) src.tensors.emplace(name, base->Get(name).value());
  auto copied = Build(src);
  ASSERT_NE(copied, nullptr);
  SnapshotOptions opts;
  opts.threads = 2;
  opts.share_unchanged = true;
  auto shared = BuildSnapshot(src, opts);
  ASSERT_TRUE(shared.ok()) << shared.status().ToString();
  EXPECT_EQ((*shared)->manifest_id(), copied->manifest_id());
  EXPECT_EQ((*shared)->digests(), copied->digests());
  size_t views = 0, merged = 0;
  for (const std::string& name : (*shared)->checkpoint().names()) {
    const Tensor held = (*shared)->checkpoint().Get(name).value();
    const bool lora_target = name.find("_proj.") != std::string::npos;
    if (lora_target) {
      EXPECT_NE(held.data(), base->Get(name).value().data()) << name;
      ++merged;
    } else {
      EXPECT_EQ(held.data(), base->Get(name).value().data()) << name;
      EXPECT_NE(held.data(), copied->checkpoint().Get(name).value().data()) << name;
      ++views;
    }
  }
  EXPECT_EQ(merged, 14u);  // 7 linears x 2 layers
  EXPECT_EQ(views, 7u);    // embed, lm_head, 5 norms
  // The snapshot keeps the mapping alive after the caller drops it.
  src.tensors.clear();
  base.reset();
  auto recomputed = ComputeManifestId(**shared);
  ASSERT_TRUE(recomputed.ok()) << recomputed.status().ToString();
  EXPECT_EQ(*recomputed, copied->manifest_id());
}

TEST(SnapshotTest, UnmergedSnapshotCopiesAndMatchesTheStoresHashOfTheBaseDirectory) {
  SnapshotSource src;
  src.tensors = OwnedCopies(kCase / "base");
  src.aux_files = BaseAux();
  auto snap = Build(src);
  ASSERT_NE(snap, nullptr);
  EXPECT_FALSE(snap->merged());
  for (auto& [name, t] : src.tensors) std::memset(t.mutable_data(), 0x5A, t.nbytes());
  src.tensors.clear();
  auto rec = store::HashPath(kCase / "base");
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(snap->manifest_id(), rec->id);
  ASSERT_EQ(rec->tensors.size(), snap->digests().size());
  for (const auto& row : rec->tensors) EXPECT_EQ(snap->digests().at(row.name), row.digest) << row.name;
  // Aux files are kept verbatim when nothing is merged.
  ASSERT_EQ(snap->aux_files().size(), 5u);
  EXPECT_EQ(snap->aux_files()[0].name, "config.json");
  EXPECT_EQ(snap->aux_files()[0].contents, ReadText(kCase / "base" / "config.json"));
}

TEST(SnapshotTest, PeftWrappedNamesAreNormalised) {
  SnapshotSource plain = FixtureSource();
  SnapshotSource wrapped = plain;
  wrapped.tensors.clear();
  for (const auto& [name, t] : plain.tensors) {
    std::string n = "base_model.model." + name;
    const bool lora_target = name.find("_proj.weight") != std::string::npos;
    if (lora_target) n = n.substr(0, n.size() - std::string(".weight").size()) + ".base_layer.weight";
    wrapped.tensors.emplace(n, t);
  }
  ASSERT_TRUE(wrapped.tensors.count("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"));
  auto a = Build(plain);
  auto b = Build(wrapped);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->checkpoint().names(), a->checkpoint().names());
  EXPECT_TRUE(b->checkpoint().Contains("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_EQ(b->manifest_id(), a->manifest_id());

  // A PeftModel state_dict: LoRA tensors (with the adapter name) among the parameters.
  SnapshotSource state_dict = wrapped;
  state_dict.adapter_tensors.clear();
  for (const auto& [name, t] : plain.adapter_tensors) {
    std::string n = name;
    n.insert(n.size() - std::string(".weight").size(), ".default");
    state_dict.tensors.emplace(n, t);
  }
  ASSERT_TRUE(state_dict.tensors.count("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"));
  auto c = Build(state_dict);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->manifest_id(), a->manifest_id());

  // The same without an adapter config: the LoRA tensor is named in the error.
  state_dict.adapter_config.reset();
  auto d = BuildSnapshot(state_dict, SnapshotOptions{});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("lora_A.default.weight"), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find("no adapter config"), std::string::npos) << d.status().message();
}

TEST(SnapshotTest, PeftStateDictWithModulesToSaveIsNormalised) {
  // PeftModel.state_dict() of a modules_to_save adapter: the frozen copy under
  // "original_module", the trained one under "modules_to_save.default", LoRA tensors beside.
  const fs::path dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_modules_to_save_f32";
  SnapshotSource plain;
  plain.tensors = OwnedCopies(dir / "base");
  plain.adapter_tensors = OwnedCopies(dir / "adapter");
  plain.adapter_config = LoadPeftConfig(dir / "adapter").value();
  auto want = Build(plain);
  ASSERT_NE(want, nullptr);
  ExpectMatches(*want, dir / "merged");

  SnapshotSource state_dict;
  state_dict.adapter_config = plain.adapter_config;
  for (const auto& [name, t] : plain.tensors) {
    const bool saved = name == "lm_head.weight" || name == "model.embed_tokens.weight";
    std::string n = "base_model.model." + name;
    if (saved) n.insert(n.size() - std::string(".weight").size(), ".original_module");
    state_dict.tensors.emplace(n, t);
  }
  for (const auto& [name, t] : plain.adapter_tensors) {
    std::string n = name;
    if (name.find("lora_") == std::string::npos) {
      n.insert(n.size() - std::string(".weight").size(), ".modules_to_save.default");
    }
    state_dict.tensors.emplace(n, t);
  }
  ASSERT_TRUE(state_dict.tensors.count("base_model.model.lm_head.original_module.weight"));
  ASSERT_TRUE(state_dict.tensors.count("base_model.model.lm_head.modules_to_save.default.weight"));
  auto got = Build(state_dict);
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->checkpoint().names(), want->checkpoint().names());
  EXPECT_EQ(got->manifest_id(), want->manifest_id());
}

TEST(SnapshotTest, TwoNamesNormalisingToOneAreRefused) {
  SnapshotSource src = FixtureSource();
  src.tensors.emplace("base_model.model.model.norm.weight", src.tensors.at("model.norm.weight"));
  auto snap = BuildSnapshot(src, SnapshotOptions{});
  ASSERT_FALSE(snap.ok());
  EXPECT_EQ(snap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(snap.status().message().find("'base_model.model.model.norm.weight'"), std::string::npos);
  EXPECT_NE(snap.status().message().find("'model.norm.weight'"), std::string::npos);
}

TEST(SnapshotTest, FusedLayoutStacksTheHfTensors) {
  SnapshotSource src = FixtureSource();
  auto hf = Build(src);
  auto fused = Build(src, Layout::kFused);
  ASSERT_NE(hf, nullptr);
  ASSERT_NE(fused, nullptr);
  EXPECT_EQ(fused->layout(), Layout::kFused);
  EXPECT_EQ(fused->checkpoint().size(), 21u - 2 * 5 + 2 * 2);
  EXPECT_EQ(fused->bytes(), hf->bytes());
  EXPECT_NE(fused->manifest_id(), hf->manifest_id());
  for (const auto& name : fused->checkpoint().names()) {
    for (const char* gone : {".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj"}) {
      EXPECT_EQ(name.find(gone), std::string::npos) << name;
    }
  }
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    const std::vector<std::pair<std::string, std::vector<std::string>>> groups = {
        {"self_attn.qkv_proj.weight",
         {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}},
        {"mlp.gate_up_proj.weight", {"mlp.gate_proj.weight", "mlp.up_proj.weight"}}};
    for (const auto& [fused_name, parts] : groups) {
      Tensor f = fused->checkpoint().Get(p + fused_name).value();
      std::string want;
      for (const auto& part : parts) {
        Tensor t = hf->checkpoint().Get(p + part).value();
        want.append(reinterpret_cast<const char*>(t.data()), t.nbytes());
      }
      EXPECT_EQ(f.shape(), (Shape{fused_name.find("qkv") != std::string::npos ? 128 : 256, 64})) << fused_name;
      ASSERT_EQ(f.nbytes(), want.size());
      EXPECT_EQ(std::memcmp(f.data(), want.data(), want.size()), 0) << p + fused_name;
    }
    EXPECT_EQ(store::TensorDigest(fused->checkpoint().Get(p + "self_attn.o_proj.weight").value()),
              hf->digests().at(p + "self_attn.o_proj.weight"));
  }
}

TEST(SnapshotTest, IdEqualsTheStoreIdOfTheConvertersOutputAndOfAWrittenCopy) {
  TempDir tmp;
  SnapshotSource src = FixtureSource();
  src.aux_files = BaseAux();
  auto snap = Build(src);
  ASSERT_NE(snap, nullptr);

  ConvertOptions co;
  co.base = kCase / "base";
  co.adapter = kCase / "adapter";
  co.out = tmp.path() / "converted";
  co.threads = 2;
  auto conv = Convert(co);
  ASSERT_TRUE(conv.ok()) << conv.status().ToString();
  auto converted = store::HashPath(co.out);
  ASSERT_TRUE(converted.ok()) << converted.status().ToString();
  EXPECT_EQ(snap->manifest_id(), converted->id);

  // The snapshot written out tensor by tensor hashes to its own id.
  const fs::path dir = tmp.path() / "written";
  fs::create_directories(dir);
  std::vector<TensorSpec> specs;
  for (const auto& name : snap->checkpoint().names()) {
    const TensorInfo* info = snap->checkpoint().Info(name);
    specs.push_back({name, info->dtype, info->shape});
  }
  auto w = SafetensorsWriter::CreateFile(dir / "model.safetensors", specs);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& name : snap->checkpoint().names()) {
    ASSERT_TRUE((*w)->Write(name, snap->checkpoint().Get(name).value()).ok());
  }
  ASSERT_TRUE((*w)->Finish().ok());
  for (const auto& [name, contents] : snap->aux_files()) ASSERT_TRUE(WriteFileAtomic(dir / name, contents).ok());
  auto written = store::HashPath(dir);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  EXPECT_EQ(written->id, snap->manifest_id());
}

TEST(SnapshotTest, RecordSnapshotStoresTheVersionUnderTheManifestId) {
  TempDir tmp;
  auto st = OpenTestStore(tmp.path());
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  SnapshotSource src = FixtureSource();
  src.aux_files = BaseAux();
  auto snap = Build(src, Layout::kFused);
  ASSERT_NE(snap, nullptr);
  store::ImportOptions io;
  io.run = "rl";
  io.step = 7;
  auto rec = RecordSnapshot(**st, *snap, io);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_FALSE(rec->already_present);
  EXPECT_EQ(rec->record.id, snap->manifest_id());
  EXPECT_EQ(rec->record.kind, store::VersionKind::kMerged);
  EXPECT_EQ(rec->record.source, store::VersionSource::kDaemon);
  EXPECT_EQ(rec->record.layout, Layout::kFused);
  EXPECT_EQ(rec->record.run, "rl");
  EXPECT_EQ(rec->record.sequence, 1u);
  EXPECT_EQ(rec->record.step, std::optional<int64_t>(7));
  EXPECT_EQ(rec->record.total_bytes, snap->bytes());
  ASSERT_EQ(rec->record.tensors.size(), snap->digests().size());
  for (const auto& row : rec->record.tensors) EXPECT_EQ(row.digest, snap->digests().at(row.name)) << row.name;
  auto again = RecordSnapshot(**st, *snap, io);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->already_present);
  auto stored = (*st)->GetVersion(snap->manifest_id().Hex());
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  EXPECT_EQ(stored->id, snap->manifest_id());
}

TEST(SnapshotTest, AdapterOnlyExpectedManifestEqualsTheMergedSnapshotAndReceiversProveIt) {
  SnapshotSource src = FixtureSource();
  src.aux_files = BaseAux();
  auto merged = Build(src);
  ASSERT_NE(merged, nullptr);
  auto a = BuildAdapterSnapshot(src, SnapshotOptions{});
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->expected_merged_id, merged->manifest_id());
  ASSERT_EQ(a->adapter->size(), 28u);
  ASSERT_EQ(a->adapter_digests.size(), 28u);
  // The adapter tensors are copies: scribbling over the source changes nothing.
  for (auto& [name, t] : src.adapter_tensors) std::memset(t.mutable_data(), 0xCD, t.nbytes());
  Checkpoint fixture_adapter = Checkpoint::Open(kCase / "adapter").value();
  for (const auto& name : fixture_adapter.names()) {
    EXPECT_EQ(store::TensorDigest(a->adapter->Get(name).value()),
              store::TensorDigest(fixture_adapter.Get(name).value()))
        << name;
    EXPECT_EQ(a->adapter_digests.at(name), store::TensorDigest(fixture_adapter.Get(name).value())) << name;
  }

  // A receiver holding the same base merges locally and gets the publisher's id.
  SnapshotSource receiver;
  receiver.tensors = OwnedCopies(kCase / "base");
  receiver.aux_files = BaseAux();
  auto local = ApplyAdapterSnapshot(*a, receiver, SnapshotOptions{});
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  EXPECT_EQ((*local)->manifest_id(), merged->manifest_id());
  ExpectMatches(**local, kCase / "merged");

  // A receiver whose base differs in one element cannot prove it.
  receiver.tensors.at("model.norm.weight").mutable_data_as<float>()[3] += 1.0f;
  auto bad = ApplyAdapterSnapshot(*a, receiver, SnapshotOptions{});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kCorruption);
  EXPECT_NE(bad.status().message().find(merged->manifest_id().Hex()), std::string::npos) << bad.status().message();

  SnapshotSource no_adapter;
  no_adapter.tensors = receiver.tensors;
  auto none = BuildAdapterSnapshot(no_adapter, SnapshotOptions{});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("adapter config"), std::string::npos) << none.status().message();
}

TEST(SnapshotTest, MissingTensorsAreExactlyThoseWhoseDigestTheReceiverLacks) {
  auto snap = Build(FixtureSource());
  ASSERT_NE(snap, nullptr);
  // A receiver holding the base: every LoRA-merged projection is missing, nothing else.
  auto base = store::HashPath(kCase / "base");
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  std::set<store::Digest> has;
  for (const auto& row : base->tensors) has.insert(row.digest);
  std::vector<std::string> want;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    for (const char* m : {"mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                          "self_attn.q_proj", "self_attn.v_proj"}) {
      want.push_back(p + m + ".weight");
    }
  }
  EXPECT_EQ(MissingTensors(*snap, has), want);
  EXPECT_EQ(MissingTensors(*snap, {}), snap->checkpoint().names());
  std::set<store::Digest> all;
  for (const auto& [name, d] : snap->digests()) all.insert(d);
  EXPECT_TRUE(MissingTensors(*snap, all).empty());
  // Holding only lm_head's digest (unchanged by the adapter) removes exactly lm_head.
  std::set<store::Digest> one = {snap->digests().at("lm_head.weight")};
  std::vector<std::string> rest = snap->checkpoint().names();
  rest.erase(std::find(rest.begin(), rest.end(), "lm_head.weight"));
  EXPECT_EQ(MissingTensors(*snap, one), rest);
}

TEST(SnapshotTest, BadAuxFileNamesAreRefusedByName) {
  SnapshotSource src;
  src.tensors = OwnedCopies(kCase / "base");
  src.aux_files = {{"sub/config.json", "{}"}};
  auto a = BuildSnapshot(src, SnapshotOptions{});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("'sub/config.json'"), std::string::npos) << a.status().message();
  src.aux_files = {{"config.json", "{}"}, {"config.json", "{}"}};
  auto b = BuildSnapshot(src, SnapshotOptions{});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("'config.json' is given twice"), std::string::npos) << b.status().message();
}

TEST(SnapshotTest, AdapterErrorsFromThePlanNameTheTensor) {
  SnapshotSource src = FixtureSource();
  src.tensors.erase("model.layers.1.self_attn.o_proj.weight");
  auto snap = BuildSnapshot(src, SnapshotOptions{});
  ASSERT_FALSE(snap.ok());
  EXPECT_EQ(snap.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(snap.status().message().rfind("snapshot: <snapshot adapter>: adapter tensor "
                                          "'base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight'",
                                          0),
            0u)
      << snap.status().message();
}

// ---- LazySnapshot --------------------------------------------------------------------

TEST(LazySnapshotTest, SameIdAsBuildSnapshotAndMakesOnlyWhatChanges) {
  SnapshotSource src = FixtureSource();
  src.aux_files = BaseAux();
  for (Layout layout : {Layout::kHf, Layout::kFused}) {
    auto snap = Build(src, layout);
    ASSERT_NE(snap, nullptr);
    SnapshotOptions o;
    o.layout = layout;
    o.threads = 2;
    auto lazy = LazySnapshot::Plan(src, o);
    ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
    const Checkpoint& c = (*lazy)->checkpoint();
    EXPECT_EQ(c.names(), snap->checkpoint().names());
    EXPECT_EQ((*lazy)->bytes(), snap->bytes());
    EXPECT_EQ((*lazy)->aux_files(), snap->aux_files());
    EXPECT_TRUE((*lazy)->merged());
    for (const auto& name : c.names()) {
      Tensor t = c.Get(name).value();
      EXPECT_EQ(store::TensorDigest(t), snap->digests().at(name)) << name;
    }
    TempDir tmp;
    auto st = OpenTestStore(tmp.path());
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    auto rec = (*lazy)->Record(**st, {});
    ASSERT_TRUE(rec.ok()) << rec.status().ToString();
    EXPECT_EQ(rec->record.id, snap->manifest_id());
  }
  // hf layout: a tensor no LoRA touches is the source's own buffer (nothing copied), a
  // merged one is new on every Get.
  SnapshotOptions o;
  o.threads = 2;
  auto lazy = LazySnapshot::Plan(src, o).value();
  const std::string untouched = "model.norm.weight";
  const std::string merged = "model.layers.0.self_attn.q_proj.weight";
  ASSERT_TRUE(src.tensors.count(untouched));
  EXPECT_EQ(lazy->checkpoint().Get(untouched).value().data(), src.tensors.at(untouched).data());
  const Tensor m1 = lazy->checkpoint().Get(merged).value(), m2 = lazy->checkpoint().Get(merged).value();
  EXPECT_NE(m1.data(), src.tensors.at(merged).data());
  EXPECT_NE(m1.data(), m2.data());
  EXPECT_EQ(std::memcmp(m1.data(), m2.data(), m1.nbytes()), 0);
}

TEST(LazySnapshotTest, PlanFailsBeforeAnythingIsMade) {
  SnapshotSource src = FixtureSource();
  // lora_B of one layer with a rank that disagrees with its lora_A.
  const std::string key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
  ASSERT_TRUE(src.adapter_tensors.count(key));
  const Tensor b = src.adapter_tensors.at(key);
  src.adapter_tensors[key] = Tensor::Empty(b.dtype(), {b.shape()[0], b.shape()[1] + 1}).value();
  auto lazy = LazySnapshot::Plan(src, {});
  ASSERT_FALSE(lazy.ok());
  EXPECT_EQ(lazy.status().code(), StatusCode::kInvalidArgument) << lazy.status().ToString();
  EXPECT_NE(lazy.status().message().find("q_proj"), std::string::npos) << lazy.status().ToString();

  // A merged tensor of a dtype the merge cannot write back is refused at planning too.
  SnapshotSource ints = FixtureSource();
  const std::string w = "model.layers.0.self_attn.q_proj.weight";
  const Tensor f = ints.tensors.at(w);
  ints.tensors[w] = Tensor::Empty(DType::kI32, f.shape()).value();
  auto bad = LazySnapshot::Plan(ints, {});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kUnsupported) << bad.status().ToString();
  EXPECT_NE(bad.status().message().find(w), std::string::npos) << bad.status().ToString();
}

// Recording a lazy snapshot holds one merged tensor at a time; building it in memory holds
// them all. Four 40 MiB BF16 projections with a LoRA each (above glibc's largest mmap
// threshold, so every buffer is returned to the system when freed).
TEST(LazySnapshotTest, RecordHoldsOneMergedTensorAtATime) {
  if (RssAnonBytes() == 0) GTEST_SKIP() << "no RssAnon in /proc/self/status";
  constexpr int64_t kOut = 2560, kIn = 8192, kRank = 8, kLayers = 4;
  constexpr uint64_t kTensorBytes = kOut * kIn * 2;
  SnapshotSource src;
  auto cfg = ParsePeftConfig(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})",
                             "test adapter_config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  src.adapter_config = *cfg;
  for (int l = 0; l < kLayers; ++l) {
    const std::string m = "model.layers." + std::to_string(l) + ".self_attn.q_proj";
    Tensor w = Tensor::Empty(DType::kBF16, {kOut, kIn}).value();
    uint16_t* p = w.mutable_data_as<uint16_t>();
    for (int64_t i = 0; i < kOut * kIn; ++i) p[i] = static_cast<uint16_t>(0x3c00 + (i % 251));
    src.tensors.emplace(m + ".weight", w);
    Tensor a = Tensor::Empty(DType::kF32, {kRank, kIn}).value();
    Tensor b = Tensor::Empty(DType::kF32, {kOut, kRank}).value();
    for (int64_t i = 0; i < kRank * kIn; ++i) a.mutable_data_as<float>()[i] = 0.001f * static_cast<float>(i % 7);
    for (int64_t i = 0; i < kOut * kRank; ++i) b.mutable_data_as<float>()[i] = 0.002f * static_cast<float>(i % 5);
    src.adapter_tensors.emplace("base_model.model." + m + ".lora_A.weight", a);
    src.adapter_tensors.emplace("base_model.model." + m + ".lora_B.weight", b);
  }
  TempDir tmp;
  auto st = OpenTestStore(tmp.path()).value();
  SnapshotOptions o;
  o.threads = 2;

  auto lazy = LazySnapshot::Plan(src, o).value();
  const uint64_t before = RssAnonBytes();
  uint64_t peak = before;
  store::ImportOptions io;
  io.progress = [&](uint64_t, uint64_t) { peak = std::max(peak, RssAnonBytes()); };
  auto rec = lazy->Record(*st, io);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  const uint64_t streamed = peak > before ? peak - before : 0;
  EXPECT_LT(streamed, 2 * kTensorBytes) << "peak anonymous memory while recording: " << streamed;

  // The measurement sees a model held in memory: BuildSnapshot keeps every merged tensor.
  const uint64_t before_build = RssAnonBytes();
  auto snap = BuildSnapshot(src, o);
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  const uint64_t built = RssAnonBytes() - std::min(RssAnonBytes(), before_build);
  EXPECT_GE(built, static_cast<uint64_t>(kLayers) * kTensorBytes * 9 / 10) << built;
  EXPECT_EQ((*snap)->manifest_id(), rec->record.id);
}

// Every mergeable fixture: the snapshot (built from owned copies of the base and adapter),
// and the same snapshot recorded lazily, have exactly the store id of `ferry convert`'s
// output for the same base and adapter, in both layouts. The converter's output is an
// independent execution of the same plan.
class SnapshotVsConverterTest : public ::testing::TestWithParam<std::tuple<std::string, Layout>> {};

AuxFiles AuxBeside(const fs::path& dir) {
  auto aux = CollectAuxFiles(dir);
  EXPECT_TRUE(aux.ok()) << aux.status().ToString();
  return aux.ok() ? *aux : AuxFiles{};
}

TEST_P(SnapshotVsConverterTest, IdEqualsConvertedOutput) {
  const auto& [name, layout] = GetParam();
  const fs::path dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / name;
  SnapshotSource src;
  src.tensors = OwnedCopies(dir / "base");
  src.adapter_tensors = OwnedCopies(dir / "adapter");
  src.adapter_config = LoadPeftConfig(dir / "adapter").value();
  src.aux_files = AuxBeside(dir / "base");
  SnapshotOptions o;
  o.layout = layout;
  o.threads = 2;
  o.tie_word_embeddings =
      ReadText(dir / "base" / "config.json").find("\"tie_word_embeddings\": true") != std::string::npos;
  auto snap = BuildSnapshot(src, o);
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();

  TempDir tmp;
  ConvertOptions co;
  co.base = dir / "base";
  co.adapter = dir / "adapter";
  co.out = tmp.path() / "converted";
  co.layout = layout;
  co.threads = 2;
  auto conv = Convert(co);
  ASSERT_TRUE(conv.ok()) << conv.status().ToString();
  auto converted = store::HashPath(co.out);
  ASSERT_TRUE(converted.ok()) << converted.status().ToString();
  ASSERT_EQ(converted->tensors.size(), (*snap)->digests().size());
  for (const auto& row : converted->tensors) {
    ASSERT_TRUE((*snap)->digests().count(row.name)) << row.name;
    EXPECT_EQ((*snap)->digests().at(row.name), row.digest) << row.name;
  }
  EXPECT_EQ((*snap)->manifest_id(), converted->id);

  // The streamed path (LazySnapshot::Record, what --watch uses) records exactly that too.
  auto lazy = LazySnapshot::Plan(src, o);
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  auto st = OpenTestStore(tmp.path());
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  auto rec = (*lazy)->Record(**st, {});
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->record.id, converted->id);
  EXPECT_EQ(rec->record.kind, store::VersionKind::kMerged);
  EXPECT_EQ(rec->record.layout, layout);
  EXPECT_EQ(rec->record.total_bytes, (*lazy)->bytes());
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, SnapshotVsConverterTest,
    ::testing::Combine(::testing::Values("gemma_lora_f32", "gpt2_conv1d_f32", "llama_embedding_lora_f32",
                                         "llama_layers_to_transform_f32", "llama_lora_all_linear_f32",
                                         "llama_lora_bias_f32", "llama_modules_to_save_f32", "llama_regex_targets_f32",
                                         "llama_rslora_bf16", "llama_sharded_bf16", "llama_tied_lmhead_lora_f32",
                                         "llama_trainable_tokens_f32", "mistral_dora_f32", "phi3_lora_f32",
                                         "qwen2_bias_all_f32", "qwen2_patterns_f16", "llama_nf4", "llama_nf4_dq",
                                         "llama_fp4", "llama_fp4_dq"),
                       ::testing::Values(Layout::kHf, Layout::kFused)),
    [](const auto& param_info) {
      return std::get<0>(param_info.param) + (std::get<1>(param_info.param) == Layout::kFused ? "_fused" : "_hf");
    });

// A 4-bit base alone: every packed weight dequantised exactly as bitsandbytes'
// dequantize_4bit does (the fixture's base_dequant/, made by bitsandbytes itself), the quant
// companions dropped, everything else copied; config.json as the converter writes it, and
// the whole snapshot equal to `ferry convert` of the base with an adapter that changes
// nothing (no LoRA tensors).
class QuantizedBaseSnapshotTest : public ::testing::TestWithParam<std::string> {};

TEST_P(QuantizedBaseSnapshotTest, DequantisedBaseEqualsBitsandbytesAndTheConverter) {
  const fs::path dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / GetParam();
  SnapshotSource src;
  src.tensors = OwnedCopies(dir / "base");
  src.aux_files = AuxBeside(dir / "base");
  auto snap = BuildSnapshot(src, {});
  ASSERT_TRUE(snap.ok()) << snap.status().ToString();
  EXPECT_FALSE((*snap)->merged());

  Checkpoint dequant = Checkpoint::Open(dir / "base_dequant").value();
  ASSERT_EQ((*snap)->checkpoint().names(), dequant.names());
  for (const auto& name : dequant.names()) {
    EXPECT_EQ((*snap)->digests().at(name), store::TensorDigest(dequant.Get(name).value())) << name;
  }
  std::string config;
  for (const auto& [name, contents] : (*snap)->aux_files()) {
    if (name == "config.json") config = contents;
  }
  ASSERT_FALSE(config.empty());
  EXPECT_EQ(config.find("quantization_config"), std::string::npos) << config;
  EXPECT_NE(ReadText(dir / "base" / "config.json").find("quantization_config"), std::string::npos);

  // The converter with an adapter of no tensors writes the same version.
  TempDir tmp;
  const fs::path empty = tmp.path() / "empty_adapter";
  fs::create_directories(empty);
  ASSERT_TRUE(WriteFileAtomic(empty / "adapter_config.json",
                              R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})")
                  .ok());
  auto writer = SafetensorsWriter::CreateFile(empty / "adapter_model.safetensors", {});
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  ASSERT_TRUE((*writer)->Finish().ok());
  ConvertOptions co;
  co.base = dir / "base";
  co.adapter = empty;
  co.out = tmp.path() / "converted";
  co.threads = 2;
  auto conv = Convert(co);
  ASSERT_TRUE(conv.ok()) << conv.status().ToString();
  auto converted = store::HashPath(co.out);
  ASSERT_TRUE(converted.ok()) << converted.status().ToString();
  EXPECT_EQ((*snap)->manifest_id(), converted->id);

  // Streamed: the same version.
  auto lazy = LazySnapshot::Plan(src, {});
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  auto st = OpenTestStore(tmp.path());
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  auto rec = (*lazy)->Record(**st, {});
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(rec->record.id, converted->id);
  EXPECT_EQ(rec->record.kind, store::VersionKind::kFull);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, QuantizedBaseSnapshotTest,
                         ::testing::Values("llama_nf4", "llama_nf4_dq", "llama_fp4", "llama_fp4_dq"),
                         [](const auto& param_info) { return param_info.param; });

// A 4-bit weight whose companion tensors are missing is refused by name before anything is made.
TEST(QuantizedBaseRefusalTest, MissingCompanionIsRefusedByName) {
  const fs::path dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / "llama_nf4_dq";
  SnapshotSource src;
  src.tensors = OwnedCopies(dir / "base");
  const std::string absmax = "model.layers.0.self_attn.q_proj.weight.absmax";
  ASSERT_EQ(src.tensors.erase(absmax), 1u);
  auto lazy = LazySnapshot::Plan(src, {});
  ASSERT_FALSE(lazy.ok());
  EXPECT_EQ(lazy.status().code(), StatusCode::kCorruption) << lazy.status().ToString();
  EXPECT_NE(lazy.status().message().find(absmax), std::string::npos) << lazy.status().ToString();
}

// A daemon's step recorded by digests (RecordSnapshotDigests): base and adapter imported as
// the trainer saved them, the merged snapshot recorded without a tensor byte, and
// `ferry versions materialize` (store::Materialize) rebuilding exactly the snapshot's bytes
// from base + adapter: F32, BF16 and 4-bit (NF4 double quant, FP4) bases.
class DerivedSnapshotTest : public ::testing::TestWithParam<std::string> {};

int64_t CountFiles(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return 0;
  int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

TEST_P(DerivedSnapshotTest, RecordedByDigestsAndMaterializedWithTheSameId) {
  const fs::path dir = fs::path(FERRY_FIXTURES_DIR) / "cases" / GetParam();
  TempDir tmp;
  auto st = OpenTestStore(tmp.path());
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  store::Store& s = **st;
  store::ImportOptions b;
  b.run = "rl";
  b.kind = store::VersionKind::kBase;
  auto base = s.Import(dir / "base", b);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  store::ImportOptions a;
  a.run = "rl";
  a.base_version = base->record.id;
  a.step = 1;
  auto adapter = s.Import(dir / "adapter", a);
  ASSERT_TRUE(adapter.ok()) << adapter.status().ToString();
  ASSERT_EQ(adapter->record.kind, store::VersionKind::kAdapter);

  SnapshotSource src;
  src.tensors = OwnedCopies(dir / "base");
  src.adapter_tensors = OwnedCopies(dir / "adapter");
  src.adapter_config = LoadPeftConfig(dir / "adapter").value();
  src.aux_files = AuxBeside(dir / "base");
  auto snap = Build(src);
  ASSERT_NE(snap, nullptr);

  const int64_t objects_before = CountFiles(tmp.path() / "db" / "objects");
  store::ImportOptions io;
  io.run = "rl";
  io.step = 1;
  io.base_version = base->record.id;
  io.adapter_version = adapter->record.id;
  io.metrics = {{"reward", 0.25}};
  auto rec = RecordSnapshotDigests(s, *snap, io);
  ASSERT_TRUE(rec.ok()) << rec.status().ToString();
  EXPECT_EQ(CountFiles(tmp.path() / "db" / "objects"), objects_before) << "no tensor object is written";
  EXPECT_FALSE(rec->already_present);
  EXPECT_EQ(rec->record.id, snap->manifest_id());
  EXPECT_TRUE(rec->record.derived);
  EXPECT_EQ(rec->record.kind, store::VersionKind::kMerged);
  EXPECT_EQ(rec->record.source, store::VersionSource::kDaemon);
  EXPECT_EQ(rec->record.layout, Layout::kHf);
  EXPECT_EQ(rec->record.total_bytes, snap->bytes());
  EXPECT_EQ(rec->record.metrics.at("reward"), 0.25);
  // At most the rewritten config.json is new; another step adds no byte.
  EXPECT_LE(rec->objects_written, 1);

  const fs::path out = tmp.path() / "materialized";
  auto mat = store::Materialize(s, snap->manifest_id(), out, {});
  ASSERT_TRUE(mat.ok()) << mat.status().ToString();
  auto rebuilt = store::HashPath(out);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.status().ToString();
  EXPECT_EQ(rebuilt->id, snap->manifest_id());
  for (const auto& row : rebuilt->tensors) EXPECT_EQ(snap->digests().at(row.name), row.digest) << row.name;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DerivedSnapshotTest,
                         ::testing::Values("llama_lora_all_linear_f32", "llama_rslora_bf16", "llama_nf4_dq",
                                           "llama_fp4"),
                         [](const auto& param_info) { return param_info.param; });

TEST(DerivedSnapshotRefusalTest, RefusesWhatCannotBeRecordedByDigests) {
  TempDir tmp;
  auto st = OpenTestStore(tmp.path()).value();
  auto snap = Build(FixtureSource());
  ASSERT_NE(snap, nullptr);
  store::ImportOptions io;
  io.adapter_version = store::Digest{1, 2};
  auto r = RecordSnapshotDigests(*st, *snap, io);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("needs a base_version"), std::string::npos) << r.status().ToString();
  io.base_version = store::Digest{3, 4};
  r = RecordSnapshotDigests(*st, *snap, io);  // neither is recorded
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound) << r.status().ToString();
  EXPECT_NE(r.status().message().find(store::Digest{3, 4}.Hex()), std::string::npos) << r.status().ToString();

  SnapshotSource plain;
  plain.tensors = OwnedCopies(kCase / "base");
  auto unmerged = Build(plain);
  ASSERT_NE(unmerged, nullptr);
  r = RecordSnapshotDigests(*st, *unmerged, io);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("merged no adapter"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(st->ListVersions(std::nullopt).value().empty());
}

}  // namespace
}  // namespace ferry::sync
