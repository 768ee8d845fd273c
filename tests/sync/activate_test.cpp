// Receiver-side activation (sync/activate.h) against the committed PEFT fixtures: an adapter
// merged onto a local base hashes to the publisher's merged id (computed independently with
// the snapshot builder and with the converter) and equals PEFT's merged/; hf -> fused equals
// `ferry convert --layout fused`; bad plans and bad inputs fail with the specific error and
// leave nothing at `out`.
#include "sync/activate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "convert/converter.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "sync/snapshot.h"
#include "tests/temp_dir.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

const fs::path kCases = fs::path(FERRY_FIXTURES_DIR) / "cases";
const fs::path kCase = kCases / "llama_lora_all_linear_f32";

class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry-activate-test-") {}
};

std::string ReadText(const fs::path& p) { return ReadSmallFile(p).value(); }

// Every tensor of the checkpoint at `path`, copied into owned buffers.
std::map<std::string, Tensor> OwnedCopies(const fs::path& path) {
  auto ckpt = Checkpoint::Open(path);
  EXPECT_TRUE(ckpt.ok()) << ckpt.status().ToString();
  std::map<std::string, Tensor> out;
  if (!ckpt.ok()) return out;
  for (const auto& name : ckpt->names()) {
    Tensor t = ckpt->Get(name).value();
    Tensor copy = Tensor::Empty(t.dtype(), t.shape()).value();
    if (t.nbytes() > 0) std::memcpy(copy.mutable_data(), t.data(), t.nbytes());
    out.emplace(name, copy);
  }
  return out;
}

// The fixture base directory's auxiliary files: every file but the weights and the README.
AuxFiles DirAux(const fs::path& dir) {
  auto aux = CollectAuxFiles(dir);
  EXPECT_TRUE(aux.ok()) << aux.status().ToString();
  return aux.ok() ? *aux : AuxFiles{};
}

// BuildSnapshot of `case_dir`'s base + adapter (+ the base's aux files): the publisher's side.
std::shared_ptr<const Snapshot> PublisherSnapshot(const fs::path& case_dir, Layout layout, bool tied = false) {
  SnapshotSource s;
  s.tensors = OwnedCopies(case_dir / "base");
  s.adapter_tensors = OwnedCopies(case_dir / "adapter");
  auto cfg = LoadPeftConfig(case_dir / "adapter");
  EXPECT_TRUE(cfg.ok()) << cfg.status().ToString();
  if (!cfg.ok()) return nullptr;
  s.adapter_config = *cfg;
  s.aux_files = DirAux(case_dir / "base");
  SnapshotOptions o;
  o.layout = layout;
  o.threads = 2;
  o.tie_word_embeddings = tied;
  auto snap = BuildSnapshot(s, o);
  EXPECT_TRUE(snap.ok()) << snap.status().ToString();
  return snap.ok() ? *snap : nullptr;
}

// What a receiver holds after receiving an adapter version: the adapter weights, its config
// and an aux file the publisher stored with it.
fs::path ReceivedAdapter(const fs::path& root, const fs::path& case_dir) {
  const fs::path dir = root / "received";
  fs::create_directories(dir);
  fs::copy_file(case_dir / "adapter" / "adapter_model.safetensors", dir / "adapter_model.safetensors");
  fs::copy_file(case_dir / "adapter" / "adapter_config.json", dir / "adapter_config.json");
  fs::copy_file(case_dir / "base" / "tokenizer_config.json", dir / "tokenizer_config.json");
  return dir;
}

// `ferry convert` of `case_dir` into root/name; returns the output directory.
fs::path Converted(const fs::path& root, const fs::path& case_dir, Layout layout, const std::string& name) {
  ConvertOptions co;
  co.base = case_dir / "base";
  co.adapter = case_dir / "adapter";
  co.out = root / name;
  co.layout = layout;
  co.threads = 2;
  auto r = Convert(co);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return co.out;
}

store::Digest IdOf(const fs::path& dir) {
  auto rec = store::HashPath(dir);
  EXPECT_TRUE(rec.ok()) << rec.status().ToString();
  return rec.ok() ? rec->id : store::Digest{};
}

ActivationPlan AdapterPlan(const store::Digest& merged, const fs::path& base_dir, Layout want) {
  ActivationPlan p;
  p.served_kind = store::VersionKind::kAdapter;
  p.served_layout = Layout::kLora;
  p.merged_version = merged;
  p.base_dir = base_dir;
  p.want_layout = want;
  p.threads = 2;
  return p;
}

// The names in `dir` (hidden temporaries included).
std::set<std::string> Entries(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::vector<float> Values(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  EXPECT_TRUE(ReadAsF32(t, v).ok());
  return v;
}

// Every tensor at `got` equals the one at `ref` within 1e-5 of the tensor's largest magnitude
// (the snapshot tests' tolerance against PEFT), with identical names, dtypes and shapes.
void ExpectMatches(const fs::path& got_path, const fs::path& ref) {
  Checkpoint got = Checkpoint::Open(got_path).value();
  Checkpoint want = Checkpoint::Open(ref).value();
  ASSERT_EQ(got.names(), want.names());
  for (const auto& name : want.names()) {
    Tensor g = got.Get(name).value();
    Tensor e = want.Get(name).value();
    ASSERT_EQ(g.dtype(), e.dtype()) << name;
    ASSERT_EQ(g.shape(), e.shape()) << name;
    const std::vector<float> gv = Values(g), ev = Values(e);
    float scale = 0;
    for (float x : ev) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < ev.size(); ++i) ASSERT_NEAR(gv[i], ev[i], 1e-5f * scale) << name << " element " << i;
  }
}

TEST(ActivateTest, NeedsPreparationTruthTable) {
  using K = store::VersionKind;
  struct Row {
    K kind;
    Layout served;
    Layout want;
    bool needs;
  };
  const Row rows[] = {
      {K::kFull, Layout::kHf, Layout::kHf, false},       {K::kMerged, Layout::kHf, Layout::kHf, false},
      {K::kFull, Layout::kFused, Layout::kFused, false}, {K::kFull, Layout::kHf, Layout::kFused, true},
      {K::kMerged, Layout::kHf, Layout::kFused, true},   {K::kFull, Layout::kFused, Layout::kHf, true},
      {K::kAdapter, Layout::kLora, Layout::kHf, true},   {K::kAdapter, Layout::kLora, Layout::kFused, true},
      {K::kAdapter, Layout::kHf, Layout::kHf, true},
  };
  for (const Row& r : rows) {
    ActivationPlan p;
    p.served_kind = r.kind;
    p.served_layout = r.served;
    p.want_layout = r.want;
    EXPECT_EQ(NeedsPreparation(p), r.needs)
        << store::KindName(r.kind) << " " << LayoutName(r.served) << " -> " << LayoutName(r.want);
  }
  EXPECT_FALSE(NeedsPreparation(ActivationPlan{})) << "the defaults (full, hf -> hf) need nothing";
}

TEST(ActivateTest, AdapterMergedOntoLocalBaseHashesToThePublishersMergedId) {
  TempDir tmp;
  auto ref = PublisherSnapshot(kCase, Layout::kHf);
  ASSERT_NE(ref, nullptr);
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  const fs::path out = tmp.path() / "active";
  auto prepared = PrepareActivation(received, AdapterPlan(ref->manifest_id(), kCase / "base", Layout::kHf), out);
  ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();

  EXPECT_EQ(IdOf(out), ref->manifest_id());
  EXPECT_EQ(prepared->id, ref->manifest_id());
  ASSERT_TRUE(prepared->proven.has_value());
  EXPECT_EQ(*prepared->proven, ref->manifest_id());
  // The converter's output of the same base and adapter has the same id.
  EXPECT_EQ(IdOf(Converted(tmp.path(), kCase, Layout::kHf, "converted")), ref->manifest_id());
  // The merged weights equal PEFT's merge_and_unload().
  ExpectMatches(out, kCase / "merged");
  // Aux files: the base's, with config.json as the converter rewrites it (not the adapter's).
  EXPECT_EQ(ReadText(out / "config.json"), ReadText(tmp.path() / "converted" / "config.json"));
  for (const char* n :
       {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}) {
    EXPECT_EQ(ReadText(out / n), ReadText(kCase / "base" / n)) << n;
  }
  EXPECT_FALSE(fs::exists(out / "adapter_config.json"));
  EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"active", "converted", "received"}))
      << "no temporary directory is left beside the output";
}

// 16-bit bases take the fused kernel path (each piece merged, hashed and written by a
// worker); a sharded base is read across its shards. Each result is bit-identical to the
// publisher's snapshot and the converter's output, in the hf layout and, written directly
// with q/k/v and gate/up stacked, in the fused one (proving the hf id all the same).
TEST(ActivateTest, SixteenBitAndShardedBasesProveThePublishersMergedId) {
  for (const char* name : {"llama_rslora_bf16", "qwen2_patterns_f16", "llama_sharded_bf16"}) {
    SCOPED_TRACE(name);
    const fs::path case_dir = kCases / name;
    TempDir tmp;
    const store::Digest converted = IdOf(Converted(tmp.path(), case_dir, Layout::kHf, "converted"));
    // DirAux is the one aux rule (core/aux_files.h): a shard index is not an aux file.
    auto ref = PublisherSnapshot(case_dir, Layout::kHf);
    ASSERT_NE(ref, nullptr);
    EXPECT_EQ(ref->manifest_id(), converted);
    const fs::path received = ReceivedAdapter(tmp.path(), case_dir);
    const fs::path out = tmp.path() / "active";
    auto prepared = PrepareActivation(received, AdapterPlan(converted, case_dir / "base", Layout::kHf), out);
    ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
    EXPECT_EQ(prepared->proven, std::optional<store::Digest>(converted));
    EXPECT_EQ(IdOf(out), converted);
    EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"active", "converted", "received"}));

    const store::Digest fused = IdOf(Converted(tmp.path(), case_dir, Layout::kFused, "converted-fused"));
    ASSERT_NE(fused, converted);
    const fs::path out_fused = tmp.path() / "active-fused";
    auto stacked = PrepareActivation(received, AdapterPlan(converted, case_dir / "base", Layout::kFused), out_fused);
    ASSERT_TRUE(stacked.ok()) << stacked.status().ToString();
    EXPECT_EQ(stacked->proven, std::optional<store::Digest>(converted));
    EXPECT_EQ(stacked->id, fused);
    EXPECT_EQ(IdOf(out_fused), fused);
    EXPECT_TRUE(Checkpoint::Open(out_fused).value().Contains("model.layers.0.self_attn.qkv_proj.weight"));
    EXPECT_EQ(Entries(tmp.path()),
              (std::set<std::string>{"active", "active-fused", "converted", "converted-fused", "received"}));
  }
}

// Writes `tensors` as dir/model.safetensors.
void WriteSafetensors(const fs::path& dir, const std::map<std::string, Tensor>& tensors) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, x] : tensors) specs.push_back({name, x.dtype(), x.shape()});
  auto w = SafetensorsWriter::CreateFile(dir / "model.safetensors", specs);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& [name, x] : tensors) ASSERT_TRUE((*w)->Write(name, x).ok());
  ASSERT_TRUE((*w)->Finish().ok());
}

// The receiver merges a 16-bit weight a piece of rows at a time (256 KiB per merge thread),
// hashing each piece while it is in cache. A weight of 20,000 rows of 32 bytes takes three
// pieces on one thread (the last one partial) and two on two; the result must still be the
// publisher's.
TEST(ActivateTest, AWeightMergedInSeveralRowPiecesProvesThePublishersMergedId) {
  constexpr int64_t kOut = 20000, kIn = 16, kRank = 4;
  TempDir tmp;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto random_tensor = [&](DType dtype, std::vector<int64_t> shape, float scale) {
    Tensor t = Tensor::Empty(dtype, shape).value();
    const int64_t n = t.numel();
    for (int64_t i = 0; i < n; ++i) {
      const float v = scale * normal(rng);
      if (dtype == DType::kF32) {
        t.mutable_data_as<float>()[i] = v;
      } else {
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        t.mutable_data_as<uint16_t>()[i] = static_cast<uint16_t>(bits >> 16);
      }
    }
    return t;
  };
  const fs::path base = tmp.path() / "base", received = tmp.path() / "received";
  fs::create_directories(base);
  fs::create_directories(received);
  const std::string weight = "model.layers.0.mlp.down_proj.weight";
  std::map<std::string, Tensor> base_tensors{{weight, random_tensor(DType::kBF16, {kOut, kIn}, 0.05f)},
                                             {"model.norm.weight", random_tensor(DType::kBF16, {kIn}, 1.0f)}};
  WriteSafetensors(base, base_tensors);
  const std::string prefix = "base_model.model.model.layers.0.mlp.down_proj.";
  std::map<std::string, Tensor> adapter_tensors{
      {prefix + "lora_A.weight", random_tensor(DType::kF32, {kRank, kIn}, 0.1f)},
      {prefix + "lora_B.weight", random_tensor(DType::kF32, {kOut, kRank}, 0.1f)}};
  WriteSafetensors(received, adapter_tensors);
  fs::rename(received / "model.safetensors", received / "adapter_model.safetensors");
  ASSERT_TRUE(WriteFileAtomic(received / "adapter_config.json",
                              R"({"peft_type": "LORA", "r": 4, "lora_alpha": 12, "target_modules": ["down_proj"],)"
                              R"( "use_rslora": true, "bias": "none"})")
                  .ok());

  SnapshotSource s;
  s.tensors = base_tensors;
  s.adapter_tensors = OwnedCopies(received);
  s.adapter_config = LoadPeftConfig(received).value();
  auto ref = BuildSnapshot(s, SnapshotOptions{});
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();
  ASSERT_NE((*ref)->manifest_id(), IdOf(base)) << "the adapter changes the weight";
  for (int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    const fs::path out = tmp.path() / ("active" + std::to_string(threads));
    ActivationPlan plan = AdapterPlan((*ref)->manifest_id(), base, Layout::kHf);
    plan.threads = threads;
    auto prepared = PrepareActivation(received, plan, out);
    ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
    EXPECT_EQ(prepared->proven, std::optional<store::Digest>((*ref)->manifest_id()));
    EXPECT_EQ(IdOf(out), (*ref)->manifest_id());
  }
}

TEST(ActivateTest, AdapterIntoFusedLayoutProvesTheHfIdAndMatchesConvertFused) {
  TempDir tmp;
  auto hf = PublisherSnapshot(kCase, Layout::kHf);
  auto fused = PublisherSnapshot(kCase, Layout::kFused);
  ASSERT_NE(hf, nullptr);
  ASSERT_NE(fused, nullptr);
  ASSERT_NE(hf->manifest_id(), fused->manifest_id());
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  const fs::path out = tmp.path() / "active";
  auto prepared = PrepareActivation(received, AdapterPlan(hf->manifest_id(), kCase / "base", Layout::kFused), out);
  ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
  ASSERT_TRUE(prepared->proven.has_value());
  EXPECT_EQ(*prepared->proven, hf->manifest_id());
  EXPECT_EQ(prepared->id, fused->manifest_id());
  EXPECT_EQ(IdOf(out), fused->manifest_id());
  EXPECT_EQ(IdOf(Converted(tmp.path(), kCase, Layout::kFused, "converted")), fused->manifest_id());
  Checkpoint written = Checkpoint::Open(out).value();
  EXPECT_TRUE(written.Contains("model.layers.0.self_attn.qkv_proj.weight"));
  EXPECT_TRUE(written.Contains("model.layers.1.mlp.gate_up_proj.weight"));
  EXPECT_FALSE(written.Contains("model.layers.0.self_attn.q_proj.weight"));
}

TEST(ActivateTest, TiedLmHeadAdapterMatchesTheConvertersUntiedOutput) {
  const fs::path tied_case = kCases / "llama_tied_lmhead_lora_f32";
  TempDir tmp;
  const store::Digest converted = IdOf(Converted(tmp.path(), tied_case, Layout::kHf, "converted"));
  auto ref = PublisherSnapshot(tied_case, Layout::kHf, /*tied=*/true);
  ASSERT_NE(ref, nullptr);
  ASSERT_EQ(ref->manifest_id(), converted);
  const fs::path received = ReceivedAdapter(tmp.path(), tied_case);
  const fs::path out = tmp.path() / "active";
  auto prepared = PrepareActivation(received, AdapterPlan(converted, tied_case / "base", Layout::kHf), out);
  ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
  EXPECT_EQ(IdOf(out), converted);
  EXPECT_NE(ReadText(out / "config.json").find("\"tie_word_embeddings\": false"), std::string::npos);
}

// A copy of the fixture base with one element of one weight changed.
fs::path WrongBase(const fs::path& root) {
  const fs::path dir = root / "wrong_base";
  fs::create_directories(dir);
  for (const auto& [name, contents] : DirAux(kCase / "base")) EXPECT_TRUE(WriteFileAtomic(dir / name, contents).ok());
  std::map<std::string, Tensor> tensors = OwnedCopies(kCase / "base");
  Tensor& t = tensors.at("model.layers.0.mlp.down_proj.weight");
  t.mutable_data_as<float>()[0] += 0.25f;
  WriteSafetensors(dir, tensors);
  return dir;
}

TEST(ActivateTest, WrongBaseIsCorruptionNamingBothIdsAndTheBaseAndLeavesNothing) {
  TempDir tmp;
  auto ref = PublisherSnapshot(kCase, Layout::kHf);
  ASSERT_NE(ref, nullptr);
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  const fs::path wrong = WrongBase(tmp.path());
  // What the wrong base merges to, computed independently.
  SnapshotSource s;
  s.tensors = OwnedCopies(wrong);
  s.adapter_tensors = OwnedCopies(received);
  s.adapter_config = LoadPeftConfig(received).value();
  s.aux_files = DirAux(wrong);
  auto local = BuildSnapshot(s, SnapshotOptions{});
  ASSERT_TRUE(local.ok()) << local.status().ToString();
  ASSERT_NE((*local)->manifest_id(), ref->manifest_id());

  const fs::path out = tmp.path() / "active";
  for (Layout want : {Layout::kHf, Layout::kFused}) {
    auto prepared = PrepareActivation(received, AdapterPlan(ref->manifest_id(), wrong, want), out);
    ASSERT_FALSE(prepared.ok()) << LayoutName(want);
    EXPECT_EQ(prepared.status().code(), StatusCode::kCorruption) << prepared.status().ToString();
    const std::string msg = prepared.status().message();
    EXPECT_NE(msg.find(ref->manifest_id().Hex()), std::string::npos) << msg;
    EXPECT_NE(msg.find((*local)->manifest_id().Hex()), std::string::npos) << msg;
    EXPECT_NE(msg.find(wrong.string()), std::string::npos) << msg;
    EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"received", "wrong_base"})) << LayoutName(want);
  }
}

TEST(ActivateTest, AdapterWithoutAUsableBaseDirIsFailedPrecondition) {
  TempDir tmp;
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  const fs::path out = tmp.path() / "active";
  const store::Digest some{1, 2};

  ActivationPlan no_base = AdapterPlan(some, kCase / "base", Layout::kHf);
  no_base.base_dir.reset();
  auto r1 = PrepareActivation(received, no_base, out);
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.status().code(), StatusCode::kInvalidArgument) << r1.status().ToString();
  EXPECT_NE(r1.status().message().find("base_dir"), std::string::npos) << r1.status().message();

  const fs::path missing = tmp.path() / "no-such-base";
  auto r2 = PrepareActivation(received, AdapterPlan(some, missing, Layout::kHf), out);
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.status().code(), StatusCode::kFailedPrecondition) << r2.status().ToString();
  EXPECT_NE(r2.status().message().find(missing.string()), std::string::npos) << r2.status().message();

  // A base directory without weights cannot be read either.
  const fs::path empty = tmp.path() / "empty-base";
  fs::create_directories(empty);
  auto r3 = PrepareActivation(received, AdapterPlan(some, empty, Layout::kHf), out);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), StatusCode::kFailedPrecondition) << r3.status().ToString();
  EXPECT_NE(r3.status().message().find(empty.string()), std::string::npos) << r3.status().message();

  EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"received", "empty-base"}));
}

TEST(ActivateTest, AdapterWithoutMergedVersionIsInvalidArgument) {
  TempDir tmp;
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  ActivationPlan p = AdapterPlan(store::Digest{}, kCase / "base", Layout::kHf);
  p.merged_version.reset();
  auto r = PrepareActivation(received, p, tmp.path() / "active");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("merged_version"), std::string::npos) << r.status().message();
  EXPECT_FALSE(fs::exists(tmp.path() / "active"));
}

TEST(ActivateTest, FusedToHfAndUnknownLayoutsAreInvalidArgument) {
  TempDir tmp;
  const fs::path received = Converted(tmp.path(), kCase, Layout::kFused, "received");
  const fs::path out = tmp.path() / "active";
  ActivationPlan p;
  p.served_kind = store::VersionKind::kMerged;
  p.served_layout = Layout::kFused;
  p.want_layout = Layout::kHf;
  auto r = PrepareActivation(received, p, out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("'fused'"), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("'hf'"), std::string::npos) << r.status().message();

  p.served_layout = Layout::kHf;
  p.want_layout = Layout::kLora;
  r = PrepareActivation(received, p, out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("want_layout 'lora'"), std::string::npos) << r.status().message();

  p.served_layout = Layout::kLora;
  p.want_layout = Layout::kFused;
  r = PrepareActivation(received, p, out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  EXPECT_NE(r.status().message().find("served_layout 'lora'"), std::string::npos) << r.status().message();
  EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"received"}));
}

TEST(ActivateTest, ExistingOutIsAlreadyExistsAndUntouched) {
  TempDir tmp;
  auto ref = PublisherSnapshot(kCase, Layout::kHf);
  ASSERT_NE(ref, nullptr);
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  const fs::path out = tmp.path() / "active";
  fs::create_directories(out);
  ASSERT_TRUE(WriteFileAtomic(out / "marker", "keep me").ok());
  auto r = PrepareActivation(received, AdapterPlan(ref->manifest_id(), kCase / "base", Layout::kHf), out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kAlreadyExists) << r.status().ToString();
  EXPECT_NE(r.status().message().find(out.string()), std::string::npos) << r.status().message();
  EXPECT_EQ(Entries(out), (std::set<std::string>{"marker"}));
  EXPECT_EQ(ReadText(out / "marker"), "keep me");
  EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"active", "received"}));
}

TEST(ActivateTest, HfToFusedRestacksTheReceivedTensorsAsConvertFused) {
  TempDir tmp;
  const fs::path received = Converted(tmp.path(), kCase, Layout::kHf, "received");
  const fs::path reference = Converted(tmp.path(), kCase, Layout::kFused, "reference");
  const fs::path out = tmp.path() / "active";
  ActivationPlan p;
  p.served_kind = store::VersionKind::kMerged;
  p.served_layout = Layout::kHf;
  p.want_layout = Layout::kFused;
  auto prepared = PrepareActivation(received, p, out);
  ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
  EXPECT_FALSE(prepared->proven.has_value());

  // A fused snapshot of the same tensors and aux files (verbatim: nothing is merged).
  SnapshotSource s;
  s.tensors = OwnedCopies(received);
  s.aux_files = DirAux(received);
  SnapshotOptions o;
  o.layout = Layout::kFused;
  auto fused = BuildSnapshot(s, o);
  ASSERT_TRUE(fused.ok()) << fused.status().ToString();
  EXPECT_EQ(IdOf(out), (*fused)->manifest_id());
  EXPECT_EQ(prepared->id, (*fused)->manifest_id());
  EXPECT_EQ(IdOf(reference), (*fused)->manifest_id());

  // qkv_proj is q, k, v one after the other.
  Checkpoint in = Checkpoint::Open(received).value();
  Checkpoint got = Checkpoint::Open(out).value();
  Tensor qkv = got.Get("model.layers.1.self_attn.qkv_proj.weight").value();
  std::string want;
  for (const char* m : {"q_proj", "k_proj", "v_proj"}) {
    Tensor t = in.Get(std::string("model.layers.1.self_attn.") + m + ".weight").value();
    want.append(reinterpret_cast<const char*>(t.data()), t.nbytes());
  }
  EXPECT_EQ(qkv.shape(), (Shape{128, 64}));
  ASSERT_EQ(qkv.nbytes(), want.size());
  EXPECT_EQ(std::memcmp(qkv.data(), want.data(), want.size()), 0);
  EXPECT_EQ(ReadText(out / "config.json"), ReadText(received / "config.json"));
}

TEST(ActivateTest, BadAdapterOrBadReceivedWeightsLeaveNothingAtOut) {
  TempDir tmp;
  auto ref = PublisherSnapshot(kCase, Layout::kHf);
  ASSERT_NE(ref, nullptr);
  const fs::path received = ReceivedAdapter(tmp.path(), kCase);
  ASSERT_TRUE(WriteFileAtomic(received / "adapter_config.json", "{ not json").ok());
  const fs::path out = tmp.path() / "active";
  auto r = PrepareActivation(received, AdapterPlan(ref->manifest_id(), kCase / "base", Layout::kHf), out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  EXPECT_NE(r.status().message().find("adapter_config.json"), std::string::npos) << r.status().message();

  // A truncated received model file (layout mode).
  const fs::path model_dir = tmp.path() / "model";
  fs::create_directories(model_dir);
  std::string bytes = ReadText(kCase / "base" / "model.safetensors");
  bytes.resize(bytes.size() - 100);
  ASSERT_TRUE(WriteFileAtomic(model_dir / "model.safetensors", bytes).ok());
  ActivationPlan p;
  p.served_layout = Layout::kHf;
  p.want_layout = Layout::kFused;
  r = PrepareActivation(model_dir, p, out);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kCorruption) << r.status().ToString();
  EXPECT_NE(r.status().message().find("model.safetensors"), std::string::npos) << r.status().message();
  EXPECT_EQ(Entries(tmp.path()), (std::set<std::string>{"model", "received"}));
}

}  // namespace
}  // namespace ferry::sync
