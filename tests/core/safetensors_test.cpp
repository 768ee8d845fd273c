// SafetensorsWriter round trips (single file and sharded), atomicity on every failure
// path including a crash, every dtype, empty and scalar tensors, and the cast helpers.
#include "core/safetensors.h"

#include <gtest/gtest.h>

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
#include "tests/temp_dir.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/checkpoint.h"
#include "core/tensor.h"
#include "kernels/cast.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

// Each test gets its own directory, removed afterwards.
class TempDir : public testing::ScopedTempDir {
 public:
  TempDir() : ScopedTempDir("ferry_st_") {}
};

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> Listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

uint64_t Le64At(const std::string& s) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[static_cast<size_t>(i)]);
  return v;
}

// A tensor of `dtype`/`shape` whose bytes are (seed + 7 i) mod 256.
Tensor Pattern(DType dtype, Shape shape, uint8_t seed) {
  Tensor t = Tensor::Empty(dtype, std::move(shape)).value();
  for (size_t i = 0; i < t.nbytes(); ++i) t.mutable_data()[i] = static_cast<std::byte>(seed + 7 * i);
  return t;
}

std::string Bytes(const Tensor& t) { return std::string(reinterpret_cast<const char*>(t.data()), t.nbytes()); }

struct Named {
  std::string name;
  Tensor t;
};

std::vector<TensorSpec> SpecsOf(const std::vector<Named>& ts) {
  std::vector<TensorSpec> specs;
  for (const auto& n : ts) specs.push_back({n.name, n.t.dtype(), n.t.shape()});
  return specs;
}

Status WriteAll(SafetensorsWriter& w, const std::vector<Named>& ts) {
  for (const auto& n : ts) FERRY_RETURN_IF_ERROR(w.Write(n.name, n.t));
  return w.Finish();
}

void ExpectSameTensors(const Checkpoint& ck, const std::vector<Named>& ts) {
  ASSERT_EQ(ck.size(), ts.size());
  for (const auto& n : ts) {
    auto got = ck.Get(n.name);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(got->dtype(), n.t.dtype()) << n.name;
    EXPECT_EQ(got->shape(), n.t.shape()) << n.name;
    EXPECT_EQ(Bytes(*got), Bytes(n.t)) << n.name;
  }
}

// Every dtype the brief lists; odd byte sizes put later tensors at odd offsets.
std::vector<Named> AllDTypes() {
  return {
      {"f32", Pattern(DType::kF32, {2, 3}, 1)},      {"i8", Pattern(DType::kI8, {3}, 2)},
      {"f16", Pattern(DType::kF16, {5}, 3)},         {"u8", Pattern(DType::kU8, {1, 1}, 4)},
      {"bf16", Pattern(DType::kBF16, {2, 2}, 5)},    {"bool", Pattern(DType::kBool, {3}, 6)},
      {"f64", Pattern(DType::kF64, {3}, 7)},         {"i16", Pattern(DType::kI16, {3}, 8)},
      {"i32", Pattern(DType::kI32, {2}, 9)},         {"i64", Pattern(DType::kI64, {2}, 10)},
      {"f8_e4m3", Pattern(DType::kF8E4M3, {7}, 11)}, {"f8_e5m2", Pattern(DType::kF8E5M2, {3}, 12)},
      {"f4", Pattern(DType::kF4, {2, 3}, 13)},       {"f4_pair", Pattern(DType::kF4, {2}, 14)},
  };
}

TEST(SafetensorsWriter, SingleFileRoundTripEveryDType) {
  TempDir dir;
  const fs::path path = dir.path() / "all.safetensors";
  const auto ts = AllDTypes();
  auto w = SafetensorsWriter::CreateFile(path, SpecsOf(ts));
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE(WriteAll(**w, ts).ok());
  EXPECT_EQ((*w)->OutputPaths(), std::vector<fs::path>{path});
  EXPECT_EQ(Listing(dir.path()), std::vector<std::string>{"all.safetensors"});

  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(ck->format(), CheckpointFormat::kSafetensorsFile);
  ExpectSameTensors(*ck, ts);
  EXPECT_EQ(ck->Info("f4")->nbytes(), 3u);  // 6 x 4 bits
  EXPECT_EQ(ck->Info("f4_pair")->nbytes(), 1u);
  EXPECT_EQ(ck->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));

  // On disk: header padded with spaces so that the data section starts 8-byte aligned,
  // the JSON names every tensor and __metadata__ is {"format": "pt"}; no trailing bytes.
  const std::string file = ReadFile(path);
  const uint64_t n = Le64At(file);
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header = file.substr(8, n);
  ASSERT_EQ(header.front(), '{');
  const size_t close = header.find_last_of('}');
  EXPECT_EQ(header.substr(close + 1), std::string(header.size() - close - 1, ' '));
  auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["__metadata__"], nlohmann::json({{"format", "pt"}}));
  EXPECT_EQ(j["f16"]["dtype"], "F16");
  EXPECT_EQ(j["f16"]["shape"], nlohmann::json({5}));
  EXPECT_EQ(j["f8_e4m3"]["dtype"], "F8_E4M3");
  // Declared order: f32 [0,24), i8 [24,27), f16 [27,37).
  EXPECT_EQ(j["f16"]["data_offsets"], nlohmann::json({27, 37}));
  uint64_t total = 0;
  for (const auto& nt : ts) total += nt.t.nbytes();
  EXPECT_EQ(file.size(), 8 + n + total);
  EXPECT_EQ(file.substr(8 + n + 24, 3), Bytes(ts[1].t));
}

TEST(SafetensorsWriter, EmptyAndScalarTensors) {
  TempDir dir;
  const fs::path path = dir.path() / "model.safetensors";
  std::vector<Named> ts = {
      {"empty_first", Pattern(DType::kF32, {0}, 0)},      {"scalar", Pattern(DType::kF32, {}, 1)},
      {"empty_mid", Pattern(DType::kBF16, {2, 0, 3}, 0)}, {"vec", Pattern(DType::kI8, {3}, 2)},
      {"scalar_f64", Pattern(DType::kF64, {}, 3)},        {"empty_last", Pattern(DType::kU8, {0, 5}, 0)},
  };
  auto w = SafetensorsWriter::CreateFile(path, SpecsOf(ts));
  ASSERT_TRUE(w.ok());
  for (const auto& n : ts) ASSERT_TRUE((*w)->Write(n.name, n.t).ok()) << n.name;
  ASSERT_TRUE((*w)->Finish().ok());
  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSameTensors(*ck, ts);
  EXPECT_EQ(ck->Info("scalar")->shape, Shape{});
  EXPECT_EQ(ck->Info("scalar")->nbytes(), 4u);
  EXPECT_EQ(ck->Info("empty_mid")->shape, (Shape{2, 0, 3}));
  EXPECT_EQ(ck->Info("empty_mid")->nbytes(), 0u);
  EXPECT_EQ(ck->total_bytes(), 4u + 3u + 8u);
}

TEST(SafetensorsWriter, EmptyTensorsNeedNotBeWritten) {
  TempDir dir;
  const fs::path path = dir.path() / "model.safetensors";
  std::vector<Named> ts = {{"e0", Pattern(DType::kF32, {0}, 0)},
                           {"a", Pattern(DType::kF32, {2}, 1)},
                           {"e1", Pattern(DType::kF32, {0, 2}, 0)}};
  auto w = SafetensorsWriter::CreateFile(path, SpecsOf(ts));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("a", ts[1].t).ok());
  ASSERT_TRUE((*w)->Finish().ok());
  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSameTensors(*ck, ts);
}

TEST(SafetensorsWriter, AppendInPieces) {
  TempDir dir;
  const fs::path path = dir.path() / "pieces.safetensors";
  // "big" is larger than half the writer's 8 MB buffer, so it takes the direct path.
  std::vector<Named> ts = {{"a", Pattern(DType::kU8, {10}, 1)},
                           {"big", Pattern(DType::kF32, {1600000}, 2)},
                           {"c", Pattern(DType::kBF16, {3}, 3)}};
  auto w = SafetensorsWriter::CreateFile(path, SpecsOf(ts));
  ASSERT_TRUE(w.ok());
  auto piece = [&](const Tensor& t, size_t from, size_t len) { return t.bytes().subspan(from, len); };
  ASSERT_TRUE((*w)->Append(piece(ts[0].t, 0, 1)).ok());
  ASSERT_TRUE((*w)->Append(piece(ts[0].t, 1, 3)).ok());
  ASSERT_TRUE((*w)->Append({}).ok());
  // A piece may not cross into the next tensor.
  std::vector<std::byte> cross(10);
  Status st = (*w)->Append(cross);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'a'"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("6 bytes left"), std::string::npos) << st.message();
  ASSERT_TRUE((*w)->Append(piece(ts[0].t, 4, 6)).ok());
  ASSERT_TRUE((*w)->Append(piece(ts[1].t, 0, 4500000)).ok());
  ASSERT_TRUE((*w)->Append(piece(ts[1].t, 4500000, 1900000)).ok());
  ASSERT_TRUE((*w)->Append(piece(ts[1].t, 6400000, 0)).ok());
  ASSERT_TRUE((*w)->Write("c", ts[2].t).ok());
  // Everything declared is written: one more byte is refused.
  std::vector<std::byte> extra(1);
  EXPECT_EQ((*w)->Append(extra).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*w)->Finish().ok());
  EXPECT_EQ((*w)->Finish().code(), StatusCode::kFailedPrecondition);
  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSameTensors(*ck, ts);
}

TEST(SafetensorsWriter, WriteOutOfOrderOrMismatchedIsAnError) {
  TempDir dir;
  std::vector<Named> ts = {{"first", Pattern(DType::kF32, {2}, 1)}, {"second", Pattern(DType::kF32, {2}, 2)}};
  auto w = SafetensorsWriter::CreateFile(dir.path() / "m.safetensors", SpecsOf(ts));
  ASSERT_TRUE(w.ok());
  Status st = (*w)->Write("second", ts[1].t);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'second'"), std::string::npos);
  EXPECT_NE(st.message().find("out of the declared order"), std::string::npos);
  st = (*w)->Write("first", Pattern(DType::kBF16, {2}, 1));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("declared F32 [2] but got BF16 [2]"), std::string::npos) << st.message();
  st = (*w)->Write("first", Pattern(DType::kF32, {1, 2}, 1));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  st = (*w)->Write("nobody", ts[0].t);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("'nobody'"), std::string::npos);
  ASSERT_TRUE((*w)->Write("first", ts[0].t).ok());
  st = (*w)->Write("first", ts[0].t);  // twice
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

TEST(SafetensorsWriter, BadSpecsAreRefusedBeforeAnyFileExists) {
  TempDir dir;
  const fs::path path = dir.path() / "m.safetensors";
  auto dup = SafetensorsWriter::CreateFile(path, {{"x", DType::kF32, {1}}, {"x", DType::kF32, {2}}});
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("duplicate tensor name 'x'"), std::string::npos);
  auto reserved = SafetensorsWriter::CreateFile(path, {{"__metadata__", DType::kF32, {1}}});
  EXPECT_EQ(reserved.status().code(), StatusCode::kInvalidArgument);
  auto odd = SafetensorsWriter::CreateFile(path, {{"half", DType::kF4, {3}}});
  EXPECT_EQ(odd.status().code(), StatusCode::kCorruption);
  EXPECT_NE(odd.status().message().find("'half'"), std::string::npos) << odd.status().message();
  auto huge = SafetensorsWriter::CreateFile(path, {{"h", DType::kF32, {std::numeric_limits<int64_t>::max(), 2}}});
  EXPECT_EQ(huge.status().code(), StatusCode::kCorruption);
  // Sizes that fit one by one but whose offsets overflow together.
  // (2^61 - 1 bytes is the largest size whose bit count fits 64 bits; nine of them do not.)
  std::vector<TensorSpec> nine;
  for (int i = 0; i < 9; ++i) nine.push_back({"t" + std::to_string(i), DType::kU8, {(int64_t{1} << 61) - 1}});
  auto wrap = SafetensorsWriter::CreateFile(path, nine);
  EXPECT_EQ(wrap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrap.status().message().find("'t8'"), std::string::npos) << wrap.status().message();
  WriterOptions sharded;
  sharded.max_shard_bytes = 10;
  EXPECT_EQ(SafetensorsWriter::CreateFile(path, {}, sharded).status().code(), StatusCode::kInvalidArgument);
  auto nodir = SafetensorsWriter::CreateInDirectory(dir.path() / "missing", {});
  EXPECT_EQ(nodir.status().code(), StatusCode::kNotFound);
  EXPECT_NE(nodir.status().message().find((dir.path() / "missing").string()), std::string::npos);
  EXPECT_TRUE(Listing(dir.path()).empty());
}

// Names go into the JSON header: text that is not UTF-8 (nlohmann's dump would throw) or
// holds a control character is refused before any file exists, naming it escaped.
TEST(SafetensorsWriter, NamesThatAreNotPrintableUtf8AreRefusedNamingThemEscaped) {
  TempDir dir;
  const fs::path path = dir.path() / "m.safetensors";
  struct Bad {
    std::string name;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {"layer.\xff.weight", "tensor name 'layer.\\xff.weight' is not valid UTF-8"},
      {"x\xc0\xaf", "tensor name 'x\\xc0\\xaf' is not valid UTF-8"},           // overlong '/'
      {"q\xed\xa0\x80", "tensor name 'q\\xed\\xa0\\x80' is not valid UTF-8"},  // a surrogate
      {"lm\x01head", "tensor name 'lm\\x01head' contains a control character"},
      {std::string("a\0b", 3), "tensor name 'a\\x00b' contains a control character"},
      {"tab\there\x7f", "tensor name 'tab\\x09here\\x7f' contains a control character"},
  };
  for (const Bad& b : bad) {
    auto file = SafetensorsWriter::CreateFile(path, {{"ok", DType::kF32, {1}}, {b.name, DType::kF32, {2}}});
    ASSERT_FALSE(file.ok()) << b.message;
    EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument) << b.message;
    EXPECT_EQ(file.status().message(), path.string() + ": " + b.message);
    auto in_dir = SafetensorsWriter::CreateInDirectory(dir.path(), {{b.name, DType::kF32, {2}}});
    ASSERT_FALSE(in_dir.ok()) << b.message;
    EXPECT_EQ(in_dir.status().message(), dir.path().string() + ": " + b.message);
    auto header = SerializeSafetensorsHeader({{b.name, DType::kF32, {2}}}, {{"format", "pt"}});
    ASSERT_FALSE(header.ok()) << b.message;
    EXPECT_EQ(header.status().message(), b.message);
  }
  WriterOptions meta;
  meta.metadata = {{"format", "pt"}, {"note", "caf\xe9"}};
  auto bad_meta = SafetensorsWriter::CreateFile(path, {{"ok", DType::kF32, {1}}}, meta);
  EXPECT_EQ(bad_meta.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad_meta.status().message(), path.string() + ": metadata value of 'note' 'caf\\xe9' is not valid UTF-8");
  EXPECT_TRUE(Listing(dir.path()).empty());
  // Well-formed multi-byte UTF-8 is a name like any other.
  const std::string unicode = "emb.\xe6\x97\xa5\xf0\x9f\x98\x80";
  auto ok = SafetensorsWriter::CreateFile(path, {{unicode, DType::kU8, {1}}});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  const std::byte one{1};
  ASSERT_TRUE((*ok)->Append({&one, 1}).ok());
  ASSERT_TRUE((*ok)->Finish().ok());
  auto back = Checkpoint::Open(path);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->Contains(unicode));
}

TEST(SafetensorsWriter, FinishWithUnwrittenTensorLeavesNothing) {
  TempDir dir;
  const fs::path path = dir.path() / "m.safetensors";
  std::vector<Named> ts = {{"a", Pattern(DType::kF32, {4}, 1)}, {"b", Pattern(DType::kF32, {4}, 2)}};
  auto w = SafetensorsWriter::CreateFile(path, SpecsOf(ts));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("a", ts[0].t).ok());
  ASSERT_TRUE((*w)->Append(ts[1].t.bytes().subspan(0, 5)).ok());
  Status st = (*w)->Finish();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("'b'"), std::string::npos);
  EXPECT_NE(st.message().find("5 of 16 bytes"), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(Listing(dir.path()).empty()) << "temporary files left behind";
  // The writer is dead after a failed Finish.
  EXPECT_EQ((*w)->Append(ts[1].t.bytes().subspan(5)).code(), StatusCode::kFailedPrecondition);
}

TEST(SafetensorsWriter, ShardedFinishWithUnwrittenTensorLeavesNothing) {
  TempDir dir;
  std::vector<Named> ts = {
      {"a", Pattern(DType::kU8, {8}, 1)}, {"b", Pattern(DType::kU8, {8}, 2)}, {"c", Pattern(DType::kU8, {8}, 3)}};
  WriterOptions o;
  o.max_shard_bytes = 8;
  auto w = SafetensorsWriter::CreateInDirectory(dir.path(), SpecsOf(ts), o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Write("a", ts[0].t).ok());
  ASSERT_TRUE((*w)->Write("b", ts[1].t).ok());  // shards 1 and 2 have been opened
  EXPECT_EQ((*w)->Finish().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Listing(dir.path()).empty());
}

TEST(SafetensorsWriter, DestroyedWithoutFinishLeavesNothing) {
  TempDir dir;
  std::vector<Named> ts = {{"a", Pattern(DType::kU8, {8}, 1)}, {"b", Pattern(DType::kU8, {8}, 2)}};
  {
    auto w = SafetensorsWriter::CreateFile(dir.path() / "m.safetensors", SpecsOf(ts));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write("a", ts[0].t).ok());
    ASSERT_TRUE((*w)->Write("b", ts[1].t).ok());  // complete but never finished
    EXPECT_FALSE(Listing(dir.path()).empty());    // the temporary file exists meanwhile
  }
  EXPECT_TRUE(Listing(dir.path()).empty());
  {
    WriterOptions o;
    o.max_shard_bytes = 8;
    auto w = SafetensorsWriter::CreateInDirectory(dir.path(), SpecsOf(ts), o);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Write("a", ts[0].t).ok());
  }
  EXPECT_TRUE(Listing(dir.path()).empty());
}

TEST(SafetensorsWriter, CrashMidWriteLeavesOnlyATempFileThatReadersIgnore) {
  TempDir dir;
  // A previous, complete version is in place; the crashed writer must not disturb it.
  std::vector<Named> old_ts = {{"w", Pattern(DType::kF32, {4}, 9)}};
  {
    auto w = SafetensorsWriter::CreateFile(dir.path() / "model.safetensors", SpecsOf(old_ts));
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE(WriteAll(**w, old_ts).ok());
  }
  std::vector<Named> ts = {{"w", Pattern(DType::kF32, {1 << 20}, 1)}, {"v", Pattern(DType::kF32, {1 << 20}, 2)}};
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto w = SafetensorsWriter::CreateFile(dir.path() / "model.safetensors", SpecsOf(ts));
    if (!w.ok() || !(*w)->Write("w", ts[0].t).ok()) ::_exit(3);
    ::_exit(0);  // no destructors, no Finish: as if killed
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus));
  ASSERT_EQ(WEXITSTATUS(wstatus), 0);

  const auto names = Listing(dir.path());
  ASSERT_EQ(names.size(), 2u) << ::testing::PrintToString(names);
  EXPECT_EQ(names[1], "model.safetensors");
  EXPECT_EQ(names[0].rfind(".model.safetensors.tmp-", 0), 0u) << names[0];
  EXPECT_GT(fs::file_size(dir.path() / names[0]), 0u);
  // The final name still holds the old version; opening the directory ignores the temp.
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSameTensors(*ck, old_ts);

  // Without the old version the directory holds no weights at all.
  fs::remove(dir.path() / "model.safetensors");
  auto none = Checkpoint::Open(dir.path());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_NE(none.status().message().find(dir.path().string()), std::string::npos);
  // The temp file itself is not a valid checkpoint either.
  auto tmp = Checkpoint::Open(dir.path() / names[0]);
  EXPECT_FALSE(tmp.ok());
}

TEST(SafetensorsWriter, ShardedLayoutIndexAndOversizedTensor) {
  TempDir dir;
  // Limit 100: [a b] (80), [c] (40 + 200 > 100), [big] (200 > limit: alone), [d].
  std::vector<Named> ts = {{"layer.a", Pattern(DType::kF32, {10}, 1)},
                           {"layer.b", Pattern(DType::kF32, {10}, 2)},
                           {"layer.c", Pattern(DType::kF32, {10}, 3)},
                           {"big", Pattern(DType::kF32, {50}, 4)},
                           {"d", Pattern(DType::kF32, {10}, 5)}};
  WriterOptions o;
  o.max_shard_bytes = 100;
  auto w = SafetensorsWriter::CreateInDirectory(dir.path(), SpecsOf(ts), o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE(WriteAll(**w, ts).ok());
  const std::vector<std::string> shard_names = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                                "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"};
  std::vector<fs::path> expect_out;
  for (const auto& s : shard_names) expect_out.push_back(dir.path() / s);
  expect_out.push_back(dir.path() / "model.safetensors.index.json");
  EXPECT_EQ((*w)->OutputPaths(), expect_out);
  std::vector<std::string> listing = shard_names;
  listing.push_back("model.safetensors.index.json");
  EXPECT_EQ(Listing(dir.path()), listing);

  const auto index = nlohmann::json::parse(ReadFile(dir.path() / "model.safetensors.index.json"));
  const nlohmann::json expect_index = {{"metadata", {{"total_size", 360}}},
                                       {"weight_map",
                                        {{"layer.a", shard_names[0]},
                                         {"layer.b", shard_names[0]},
                                         {"layer.c", shard_names[1]},
                                         {"big", shard_names[2]},
                                         {"d", shard_names[3]}}}};
  EXPECT_EQ(index, expect_index);

  // Each shard is a complete safetensors file with its own header and metadata.
  auto s0 = SafetensorsFile::Open(dir.path() / shard_names[0]);
  ASSERT_TRUE(s0.ok());
  ASSERT_EQ((*s0)->tensors().size(), 2u);
  EXPECT_EQ((*s0)->metadata().at("format"), "pt");
  EXPECT_EQ((*s0)->data_offset() % 8, 0u);
  auto s2 = SafetensorsFile::Open(dir.path() / shard_names[2]);
  ASSERT_TRUE(s2.ok());
  ASSERT_EQ((*s2)->tensors().size(), 1u);
  EXPECT_EQ((*s2)->tensors()[0].name, "big");

  for (const fs::path& open : {dir.path(), dir.path() / "model.safetensors.index.json"}) {
    auto ck = Checkpoint::Open(open);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    EXPECT_EQ(ck->format(), CheckpointFormat::kSafetensorsSharded);
    EXPECT_EQ(ck->path(), open);
    ExpectSameTensors(*ck, ts);
    EXPECT_EQ(ck->FileOf("big"), dir.path() / shard_names[2]);
    EXPECT_EQ(ck->files().size(), 4u);
    EXPECT_EQ(ck->total_bytes(), 360u);
  }
}

TEST(SafetensorsWriter, OversizedFirstTensorAndExactFit) {
  TempDir dir;
  // [big] alone first; then a + b fill exactly 16 = limit; then c.
  std::vector<Named> ts = {{"big", Pattern(DType::kU8, {40}, 1)},
                           {"a", Pattern(DType::kU8, {8}, 2)},
                           {"b", Pattern(DType::kU8, {8}, 3)},
                           {"c", Pattern(DType::kU8, {1}, 4)}};
  WriterOptions o;
  o.max_shard_bytes = 16;
  o.basename = "adapter";
  auto w = SafetensorsWriter::CreateInDirectory(dir.path(), SpecsOf(ts), o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(WriteAll(**w, ts).ok());
  EXPECT_EQ(Listing(dir.path()),
            (std::vector<std::string>{"adapter-00001-of-00003.safetensors", "adapter-00002-of-00003.safetensors",
                                      "adapter-00003-of-00003.safetensors", "adapter.safetensors.index.json"}));
  const auto index = nlohmann::json::parse(ReadFile(dir.path() / "adapter.safetensors.index.json"));
  EXPECT_EQ(index["weight_map"]["b"], "adapter-00002-of-00003.safetensors");
  EXPECT_EQ(index["metadata"]["total_size"], 57);
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ExpectSameTensors(*ck, ts);
}

TEST(SafetensorsWriter, ShardedButFitsInOneFile) {
  TempDir dir;
  std::vector<Named> ts = {{"a", Pattern(DType::kU8, {8}, 2)}, {"b", Pattern(DType::kU8, {8}, 3)}};
  WriterOptions o;
  o.max_shard_bytes = 1000;
  auto w = SafetensorsWriter::CreateInDirectory(dir.path(), SpecsOf(ts), o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(WriteAll(**w, ts).ok());
  EXPECT_EQ(Listing(dir.path()), std::vector<std::string>{"model.safetensors"});
  auto ck = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ck.ok());
  ExpectSameTensors(*ck, ts);
}

TEST(SafetensorsWriter, NoTensorsStillMakesAValidFile) {
  TempDir dir;
  auto w = SafetensorsWriter::CreateFile(dir.path() / "e.safetensors", {});
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->Finish().ok());
  auto ck = Checkpoint::Open(dir.path() / "e.safetensors");
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  EXPECT_EQ(ck->size(), 0u);
}

// Copies a source file's tensors with AppendFileRange (in-kernel copies). When a shard's first
// data is the start of a source's data section, the copy starts at byte 0 and the header is
// padded to the source's data offset and written over the source's header; otherwise the
// header is written first, at its natural size. Either way the output holds the declared
// tensors, byte for byte, and parses.
TEST(SafetensorsWriter, FileRangesCopyFromTheSourcesFirstByteAndPadTheHeader) {
  TempDir tmp;
  // The source: long names and metadata make its header longer than the output's.
  std::vector<Named> src_tensors = {{"model.layers.0.a_very_long_tensor_name_to_grow_the_header.weight",
                                     Pattern(DType::kF32, {4, 4}, 21)},  // 64 bytes: b starts 8-aligned
                                    {"model.layers.0.another_long_tensor_name.bias", Pattern(DType::kBF16, {7}, 22)},
                                    {"model.layers.1.third_long_tensor_name.weight", Pattern(DType::kF16, {4, 2}, 23)}};
  WriterOptions so;
  so.metadata = {{"format", "pt"}, {"padding", std::string(300, 'x')}};
  {
    auto w = SafetensorsWriter::CreateFile(tmp.path() / "src.safetensors", SpecsOf(src_tensors), so);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE(WriteAll(**w, src_tensors).ok());
  }
  auto src = SafetensorsFile::Open(tmp.path() / "src.safetensors");
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  const uint64_t src_data = (*src)->data_offset();

  // Output names are short, so its own header is shorter than the source's data offset.
  std::vector<Named> out = {{"a", src_tensors[0].t}, {"b", src_tensors[1].t}, {"c", src_tensors[2].t}};
  auto copy = [&](const fs::path& path, bool first_from_memory) {
    auto w = SafetensorsWriter::CreateFile(path, SpecsOf(out));
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    for (size_t i = 0; i < out.size(); ++i) {
      if (i == 0 && first_from_memory) {
        ASSERT_TRUE((*w)->Write(out[0].name, out[0].t).ok());
        continue;
      }
      const auto r = (*src)->RangeOf((*src)->tensors()[i]);
      ASSERT_TRUE((*w)->AppendFileRange(r.fd, r.offset, r.length).ok());
    }
    ASSERT_TRUE((*w)->Finish().ok());
  };
  copy(tmp.path() / "ranges.safetensors", false);
  copy(tmp.path() / "mixed.safetensors", true);
  // A shard whose first range starts inside the source's data (not at its start) is copied
  // from that offset with the header written first.
  {
    std::vector<Named> tail = {{"b", src_tensors[1].t}, {"c", src_tensors[2].t}};
    auto w = SafetensorsWriter::CreateFile(tmp.path() / "tail.safetensors", SpecsOf(tail));
    ASSERT_TRUE(w.ok());
    for (size_t i = 1; i < 3; ++i) {
      const auto r = (*src)->RangeOf((*src)->tensors()[i]);
      ASSERT_TRUE((*w)->AppendFileRange(r.fd, r.offset, r.length).ok());
    }
    ASSERT_TRUE((*w)->Finish().ok());
    auto ck = Checkpoint::Open(tmp.path() / "tail.safetensors");
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    ExpectSameTensors(*ck, tail);
    auto natural_tail = SerializeSafetensorsHeader(SpecsOf(tail), {{"format", "pt"}});
    ASSERT_TRUE(natural_tail.ok());
    EXPECT_EQ(fs::file_size(tmp.path() / "tail.safetensors"), natural_tail->size() + 7 * 2 + 8 * 2);
  }

  auto natural = SerializeSafetensorsHeader(SpecsOf(out), {{"format", "pt"}});
  ASSERT_TRUE(natural.ok());
  ASSERT_LT(natural->size(), src_data);  // the padded path is taken below
  for (const char* name : {"ranges.safetensors", "mixed.safetensors"}) {
    const fs::path p = tmp.path() / name;
    auto ck = Checkpoint::Open(p);
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    ExpectSameTensors(*ck, out);
    auto f = SafetensorsFile::Open(p);
    ASSERT_TRUE(f.ok());
    EXPECT_EQ((*f)->metadata().at("format"), "pt") << name;
    const std::string bytes = ReadFile(p);
    if (std::string(name) == "ranges.safetensors") {
      // Header padded with spaces to end exactly where the source's data section begins.
      EXPECT_EQ((*f)->data_offset(), src_data);
      EXPECT_EQ(Le64At(bytes), src_data - 8);
      EXPECT_EQ(bytes.substr(natural->size(), src_data - natural->size()),
                std::string(src_data - natural->size(), ' '));
      // The JSON is the natural header's, byte for byte, before the padding.
      const std::string natural_json = natural->substr(8);
      EXPECT_EQ(bytes.substr(8, natural_json.find_last_not_of(' ') + 1),
                natural_json.substr(0, natural_json.find_last_not_of(' ') + 1));
    } else {
      EXPECT_EQ((*f)->data_offset(), natural->size()) << "header written first at its natural size";
    }
    EXPECT_EQ(bytes.size(), (*f)->data_offset() + 16 * 4 + 7 * 2 + 8 * 2) << name;
  }
}

TEST(SafetensorsHeader, SerializedHeaderIsPaddedAndParses) {
  for (int count = 0; count < 12; ++count) {
    std::vector<TensorSpec> specs;
    for (int i = 0; i < count; ++i) specs.push_back({"t" + std::string(static_cast<size_t>(i), 'x'), DType::kU8, {i}});
    auto h = SerializeSafetensorsHeader(specs, {{"format", "pt"}});
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->size() % 8, 0u) << count;
    EXPECT_EQ(Le64At(*h), h->size() - 8);
    // Append the data the header promises and parse it back.
    const std::string file = *h + std::string(static_cast<size_t>(count * (count - 1) / 2), '\x5a');
    auto parsed = ParseSafetensorsHeader({reinterpret_cast<const std::byte*>(file.data()), file.size()}, file.size());
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(parsed->tensors.size(), static_cast<size_t>(count));
    EXPECT_EQ(parsed->data_offset, h->size());
  }
  EXPECT_EQ(ShardFileName("model", 0, 3), "model-00001-of-00003.safetensors");
  EXPECT_EQ(ShardFileName("x", 99998, 99999), "x-99999-of-99999.safetensors");
}

// ---------------------------------------------------------------------------------
// Casts, against the scalar reference functions of kernels/cast.h and hand-computed bits.

std::vector<float> Samples() {
  return {0.0f,
          -0.0f,
          1.0f,
          -2.5f,
          3.14159265f,
          65504.0f,
          65520.0f,
          1e-8f,
          6.0e-5f,
          1.00390625f,
          1.01171875f,
          1.00048828125f,
          -1e30f,
          std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN(),
          123456.789f,
          -7.0e-39f};
}

Tensor F32Tensor(const std::vector<float>& v) {
  Tensor t = Tensor::Empty(DType::kF32, {static_cast<int64_t>(v.size())}).value();
  std::memcpy(t.mutable_data(), v.data(), v.size() * 4);
  return t;
}

uint16_t U16At(const Tensor& t, size_t i) {
  uint16_t v;
  std::memcpy(&v, t.data() + 2 * i, 2);
  return v;
}

float F32At(const Tensor& t, size_t i) {
  float v;
  std::memcpy(&v, t.data() + 4 * i, 4);
  return v;
}

void ExpectSameFloat(float got, float want, const std::string& what) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what;
  } else {
    EXPECT_EQ(kernels::F32Bits(got), kernels::F32Bits(want)) << what << ": " << got << " vs " << want;
  }
}

TEST(CastTensor, F32ToBF16AndBack) {
  const auto v = Samples();
  auto bf = CastTensor(F32Tensor(v), DType::kBF16);
  ASSERT_TRUE(bf.ok());
  EXPECT_EQ(bf->dtype(), DType::kBF16);
  EXPECT_EQ(bf->shape(), (Shape{static_cast<int64_t>(v.size())}));
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(U16At(*bf, i), kernels::F32ToBF16(v[i])) << v[i];
  // Hand-computed: 1 + 2^-8 is a tie between 0x3F80 and 0x3F81 -> even 0x3F80;
  // 1 + 3 * 2^-8 ties between 0x3F81 and 0x3F82 -> 0x3F82; 1.0 = 0x3F80; -2.5 = 0xC020.
  EXPECT_EQ(U16At(*bf, 9), 0x3F80);
  EXPECT_EQ(U16At(*bf, 10), 0x3F82);
  EXPECT_EQ(U16At(*bf, 2), 0x3F80);
  EXPECT_EQ(U16At(*bf, 3), 0xC020);
  auto back = CastTensor(*bf, DType::kF32);
  ASSERT_TRUE(back.ok());
  for (size_t i = 0; i < v.size(); ++i) {
    ExpectSameFloat(F32At(*back, i), kernels::BF16ToF32(kernels::F32ToBF16(v[i])), std::to_string(v[i]));
  }
  EXPECT_EQ(F32At(*back, 3), -2.5f);
}

TEST(CastTensor, F32ToF16AndBack) {
  const auto v = Samples();
  auto h = CastTensor(F32Tensor(v), DType::kF16);
  ASSERT_TRUE(h.ok());
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(U16At(*h, i), kernels::F32ToF16(v[i])) << v[i];
  EXPECT_EQ(U16At(*h, 2), 0x3C00);   // 1.0
  EXPECT_EQ(U16At(*h, 5), 0x7BFF);   // 65504: the largest half
  EXPECT_EQ(U16At(*h, 6), 0x7C00);   // 65520 rounds up to infinity
  EXPECT_EQ(U16At(*h, 11), 0x3C00);  // 1 + 2^-11: a tie, to even
  EXPECT_EQ(U16At(*h, 13), 0x7C00);  // inf
  EXPECT_EQ(U16At(*h, 14), 0xFC00);  // -inf
  auto back = CastTensor(*h, DType::kF32);
  ASSERT_TRUE(back.ok());
  for (size_t i = 0; i < v.size(); ++i) {
    ExpectSameFloat(F32At(*back, i), kernels::F16ToF32(kernels::F32ToF16(v[i])), std::to_string(v[i]));
  }
}

TEST(CastTensor, F16ToBF16F64AndF8Reads) {
  const auto v = Samples();
  auto h = CastTensor(F32Tensor(v), DType::kF16).value();
  auto bf = CastTensor(h, DType::kBF16);
  ASSERT_TRUE(bf.ok());
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(U16At(*bf, i), kernels::F32ToBF16(kernels::F16ToF32(U16At(h, i)))) << v[i];
  }
  auto d = CastTensor(F32Tensor(v), DType::kF64);
  ASSERT_TRUE(d.ok());
  for (size_t i = 0; i < v.size(); ++i) {
    double got;
    std::memcpy(&got, d->data() + 8 * i, 8);
    if (std::isnan(v[i])) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_EQ(got, static_cast<double>(v[i]));
    }
  }
  // All 256 F8 codes, read through a tensor.
  for (DType f8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    Tensor t = Tensor::Empty(f8, {256}).value();
    for (int i = 0; i < 256; ++i) t.mutable_data()[i] = static_cast<std::byte>(i);
    auto f = CastTensor(t, DType::kF32);
    ASSERT_TRUE(f.ok());
    for (int i = 0; i < 256; ++i) {
      const uint8_t code = static_cast<uint8_t>(i);
      const float want = f8 == DType::kF8E4M3 ? kernels::F8E4M3ToF32(code) : kernels::F8E5M2ToF32(code);
      ExpectSameFloat(F32At(*f, static_cast<size_t>(i)), want, "code " + std::to_string(i));
    }
  }
  // Hand-computed E4M3: 0x38 = 2^(7-7) = 1; 0x7E = 448 (largest); 0x01 = 2^-9.
  Tensor t = Tensor::Empty(DType::kF8E4M3, {3}).value();
  t.mutable_data()[0] = std::byte{0x38};
  t.mutable_data()[1] = std::byte{0x7E};
  t.mutable_data()[2] = std::byte{0x01};
  auto f = CastTensor(t, DType::kF32).value();
  EXPECT_EQ(F32At(f, 0), 1.0f);
  EXPECT_EQ(F32At(f, 1), 448.0f);
  EXPECT_EQ(F32At(f, 2), std::ldexp(1.0f, -9));
}

TEST(CastTensor, UnsupportedAndEmpty) {
  auto to_f8 = CastTensor(F32Tensor({1.0f}), DType::kF8E4M3);
  EXPECT_EQ(to_f8.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(to_f8.status().message().find("F8_E4M3"), std::string::npos);
  Tensor ints = Tensor::Empty(DType::kI32, {2}).value();
  auto from_int = CastTensor(ints, DType::kF32);
  EXPECT_EQ(from_int.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(from_int.status().message().find("I32"), std::string::npos);
  Tensor empty = Tensor::Empty(DType::kF16, {0, 4}).value();
  auto e = CastTensor(empty, DType::kBF16);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->nbytes(), 0u);
  EXPECT_EQ(e->shape(), (Shape{0, 4}));
  auto same = CastTensor(ints, DType::kI32);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(Bytes(*same), Bytes(ints));
  // A default Tensor claims one F32 element but holds no bytes: refused, not read.
  std::vector<float> one(1);
  EXPECT_EQ(ReadAsF32(Tensor(), one).code(), StatusCode::kInvalidArgument);
}

// safetensors data may start at any byte offset: F16/BF16/F32 tensors behind an odd-sized
// tensor are misaligned in the mapping, and reading them must neither fault nor trip UBSan.
TEST(ReadAsF32, MisalignedTensorsInAFile) {
  TempDir dir;
  const fs::path path = dir.path() / "odd.safetensors";
  const auto v = Samples();
  const int64_t n = static_cast<int64_t>(v.size());
  auto h = CastTensor(F32Tensor(v), DType::kF16).value();
  auto bf = CastTensor(F32Tensor(v), DType::kBF16).value();
  auto f32 = F32Tensor(v);
  // A large F16 tensor too, so that the bounce-buffer loop runs several rounds.
  std::vector<float> big(10000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.25f - 1000.0f;
  auto big_h = CastTensor(F32Tensor(big), DType::kF16).value();
  // Offsets: odd [0,1), h [1,37), odd2 [37,39), bf [39,75), odd3 [75,77), f [77,149),
  // odd4 [149,151), big [151, ...): every float tensor starts at an odd address.
  std::vector<Named> ts = {
      {"odd", Pattern(DType::kU8, {1}, 1)},  {"h", h},   {"odd2", Pattern(DType::kU8, {2}, 2)}, {"bf", bf},
      {"odd3", Pattern(DType::kU8, {2}, 3)}, {"f", f32}, {"odd4", Pattern(DType::kU8, {2}, 4)}, {"big", big_h}};
  auto w = SafetensorsWriter::CreateFile(path, SpecsOf(ts));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(WriteAll(**w, ts).ok());
  auto ck = Checkpoint::Open(path);
  ASSERT_TRUE(ck.ok());
  auto mh = ck->Get("h").value();
  auto mbf = ck->Get("bf").value();
  auto mf = ck->Get("f").value();
  auto mbig = ck->Get("big").value();
  for (const Tensor* t : {&mh, &mbf, &mf, &mbig}) {
    ASSERT_NE(reinterpret_cast<uintptr_t>(t->data()) % 2, 0u) << "the layout should misalign every float tensor";
  }
  std::vector<float> out(static_cast<size_t>(n));
  ASSERT_TRUE(ReadAsF32(mh, out).ok());
  for (size_t i = 0; i < v.size(); ++i) ExpectSameFloat(out[i], kernels::F16ToF32(kernels::F32ToF16(v[i])), "h");
  ASSERT_TRUE(ReadAsF32(mbf, out).ok());
  for (size_t i = 0; i < v.size(); ++i) ExpectSameFloat(out[i], kernels::BF16ToF32(kernels::F32ToBF16(v[i])), "bf");
  ASSERT_TRUE(ReadAsF32(mf, out).ok());
  for (size_t i = 0; i < v.size(); ++i) ExpectSameFloat(out[i], v[i], "f");
  std::vector<float> big_out(big.size());
  ASSERT_TRUE(ReadAsF32(mbig, big_out).ok());
  for (size_t i = 0; i < big.size(); ++i)
    ExpectSameFloat(big_out[i], kernels::F16ToF32(kernels::F32ToF16(big[i])), "big");
  // Casting the misaligned views works too.
  auto cast = CastTensor(mbf, DType::kF16);
  ASSERT_TRUE(cast.ok());
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(U16At(*cast, i), kernels::F32ToF16(kernels::BF16ToF32(U16At(bf, i)))) << v[i];
  }
  // Wrong output size: a named error.
  std::vector<float> short_out(3);
  EXPECT_EQ(ReadAsF32(mh, short_out).code(), StatusCode::kInvalidArgument);
}

TEST(WriteFromF32, MisalignedOutput) {
  const auto v = Samples();
  std::vector<std::byte> buf(v.size() * 2 + 1);
  std::span<std::byte> out(buf.data() + 1, v.size() * 2);
  ASSERT_TRUE(WriteFromF32(v, DType::kF16, out).ok());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t got;
    std::memcpy(&got, out.data() + 2 * i, 2);
    EXPECT_EQ(got, kernels::F32ToF16(v[i])) << v[i];
  }
  ASSERT_TRUE(WriteFromF32(v, DType::kBF16, out).ok());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t got;
    std::memcpy(&got, out.data() + 2 * i, 2);
    EXPECT_EQ(got, kernels::F32ToBF16(v[i])) << v[i];
  }
  EXPECT_EQ(WriteFromF32(v, DType::kF16, std::span<std::byte>(buf)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteFromF32(v, DType::kI8, out).code(), StatusCode::kUnsupported);
  EXPECT_TRUE(WriteFromF32({}, DType::kBF16, {}).ok());
}

}  // namespace
}  // namespace ferry
