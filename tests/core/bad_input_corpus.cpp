#include "tests/core/bad_input_corpus.h"

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <system_error>
#include <utility>

namespace ferry::corpus {
namespace {

constexpr char kFile[] = "model.safetensors";
constexpr char kIndex[] = "model.safetensors.index.json";
constexpr char kShard1[] = "model-00001-of-00002.safetensors";
constexpr char kShard2[] = "model-00002-of-00002.safetensors";

// One header entry: "name": {"dtype": .., "shape": .., "data_offsets": [b, e]}.
std::string Entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t begin,
                  uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

struct Spec {
  std::string name;
  std::string dtype;
  std::string shape;
  uint64_t nbytes;
};

// A valid file holding `specs` back to back; the data bytes count up from `seed`.
std::string ValidFile(const std::vector<Spec>& specs, uint8_t seed = 1) {
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  uint64_t offset = 0;
  for (const auto& s : specs) {
    header += "," + Entry(s.name, s.dtype, s.shape, offset, offset + s.nbytes);
    offset += s.nbytes;
  }
  header += "}";
  std::string data(offset, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(seed + i);
  return SafetensorsBytes(header, data);
}

std::string Index(const std::vector<std::pair<std::string, std::string>>& weight_map, uint64_t total) {
  std::string j = "{\"metadata\":{\"total_size\":" + std::to_string(total) + "},\"weight_map\":{";
  for (size_t i = 0; i < weight_map.size(); ++i) {
    if (i) j += ",";
    j += "\"" + weight_map[i].first + "\":\"" + weight_map[i].second + "\"";
  }
  return j + "}}";
}

// A single-file case: model.safetensors holding `bytes`, opened as a file.
BadInputCase Single(std::string name, std::string bytes, StatusCode code, std::vector<std::string> extra = {}) {
  BadInputCase c;
  c.name = std::move(name);
  c.files[kFile] = std::move(bytes);
  c.open = kFile;
  c.code = code;
  c.message_contains = {std::string("{root}/") + kFile};
  for (auto& e : extra) c.message_contains.push_back(std::move(e));
  c.culprit = kFile;
  return c;
}

// A single-file case with header text `header` and `data`.
BadInputCase Header(std::string name, const std::string& header, const std::string& data, StatusCode code,
                    std::vector<std::string> extra = {}) {
  return Single(std::move(name), SafetensorsBytes(header, data), code, std::move(extra));
}

// A sharded case: the index and the two shards given, opened through the directory.
BadInputCase Sharded(std::string name, std::string index, std::string shard1, std::string shard2, StatusCode code,
                     std::string culprit, std::vector<std::string> contains) {
  BadInputCase c;
  c.name = std::move(name);
  c.files[kIndex] = std::move(index);
  if (!shard1.empty()) c.files[kShard1] = std::move(shard1);
  if (!shard2.empty()) c.files[kShard2] = std::move(shard2);
  c.open = "";
  c.code = code;
  c.culprit = std::move(culprit);
  c.message_contains = std::move(contains);
  return c;
}

}  // namespace

std::string Le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

std::string SafetensorsBytes(const std::string& header_json, const std::string& data) {
  return Le64(header_json.size()) + header_json + data;
}

std::vector<BadInputCase> BadInputCases() {
  using SC = StatusCode;
  const std::string w = "layers.0.weight";
  const std::string w8 = std::string(8, '\x11');
  const std::string f32x2 = "{" + Entry(w, "F32", "[2]", 0, 8) + "}";
  std::vector<BadInputCase> cases;

  // --- The 8-byte length prefix.
  cases.push_back(Single("empty_file", "", SC::kCorruption, {"too short"}));
  cases.push_back(Single("seven_bytes", std::string("\x10\0\0\0\0\0\0", 7), SC::kCorruption, {"too short"}));
  cases.push_back(Single("length_only", Le64(0), SC::kCorruption, {"header is empty"}));
  cases.push_back(Single("header_past_end", Le64(100) + "{\"a\":1}", SC::kCorruption, {"runs past the end"}));
  cases.push_back(Single("header_over_limit", Le64(200'000'000) + "{}", SC::kCorruption, {"exceeds the limit"}));
  cases.push_back(Single("header_length_max_u64", Le64(std::numeric_limits<uint64_t>::max()) + "{}      ",
                         SC::kCorruption, {"exceeds the limit"}));
  cases.push_back(Single("header_length_wraps_plus_8", Le64(std::numeric_limits<uint64_t>::max() - 7) + "{}",
                         SC::kCorruption, {"exceeds the limit"}));

  // --- The JSON text.
  cases.push_back(Header("header_not_json", "{this is not json}", "", SC::kCorruption, {"not valid UTF-8 JSON"}));
  cases.push_back(Header("header_not_brace", "  \"x\"", "", SC::kCorruption, {"does not start with '{'"}));
  cases.push_back(Header("header_json_array", "[" + Entry(w, "F32", "[2]", 0, 8) + "]", w8, SC::kCorruption,
                         {"does not start with '{'"}));
  cases.push_back(Header("header_invalid_utf8_name", "{" + Entry("bad\xff\xfe", "F32", "[2]", 0, 8) + "}", w8,
                         SC::kCorruption, {"not valid UTF-8 JSON"}));
  cases.push_back(Header("header_truncated_json", f32x2.substr(0, f32x2.size() - 3), "", SC::kCorruption,
                         {"not valid UTF-8 JSON"}));
  cases.push_back(Header("header_nested_too_deep",
                         "{\"" + w + "\":" + std::string(50, '[') + std::string(50, ']') + "}", "", SC::kCorruption,
                         {"nested too deeply"}));
  // Half a million '[': refused by a linear scan before any JSON is built.
  cases.push_back(Header("header_nesting_bomb", "{\"" + w + "\":" + std::string(500'000, '['), "", SC::kCorruption,
                         {"nested too deeply"}));
  cases.push_back(Header("duplicate_tensor_name",
                         "{" + Entry(w, "F32", "[2]", 0, 8) + "," + Entry(w, "F32", "[2]", 8, 16) + "}",
                         std::string(16, '\x22'), SC::kCorruption, {"duplicate tensor name", w}));

  // --- One entry.
  cases.push_back(Header("entry_not_object", "{\"" + w + "\":[1,2]}", "", SC::kCorruption, {w, "not a JSON object"}));
  cases.push_back(Header("missing_dtype", "{\"" + w + "\":{\"shape\":[2],\"data_offsets\":[0,8]}}", w8, SC::kCorruption,
                         {w, "dtype"}));
  cases.push_back(Header("missing_shape", "{\"" + w + "\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", w8,
                         SC::kCorruption, {w, "shape"}));
  cases.push_back(Header("missing_data_offsets", "{\"" + w + "\":{\"dtype\":\"F32\",\"shape\":[2]}}", w8,
                         SC::kCorruption, {w, "data_offsets"}));
  cases.push_back(Header("three_data_offsets",
                         "{\"" + w + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4,8]}}", w8,
                         SC::kCorruption, {w, "data_offsets"}));
  cases.push_back(Header("extra_unknown_field",
                         "{\"" + w + "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"scale\":2}}", w8,
                         SC::kCorruption, {w, "unknown field 'scale'"}));
  cases.push_back(Header("unknown_dtype_f7", "{" + Entry(w, "F7", "[2]", 0, 8) + "}", w8, SC::kUnsupported,
                         {w, "unknown dtype 'F7'"}));
  cases.push_back(Header("dtype_not_string", "{\"" + w + "\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", w8,
                         SC::kCorruption, {w, "dtype"}));
  cases.push_back(
      Header("negative_dim", "{" + Entry(w, "F32", "[-2,1]", 0, 8) + "}", w8, SC::kCorruption, {w, "non-negative"}));
  cases.push_back(Header("float_dim", "{" + Entry(w, "F32", "[2.0]", 0, 8) + "}", w8, SC::kCorruption,
                         {w, "non-negative integers"}));
  cases.push_back(Header("dim_past_int64", "{" + Entry(w, "U8", "[9223372036854775808]", 0, 8) + "}", w8,
                         SC::kCorruption, {w, "too large"}));
  cases.push_back(Header("shape_overflow_int64max_x2", "{" + Entry(w, "F32", "[9223372036854775807,2]", 0, 8) + "}", w8,
                         SC::kCorruption, {w, "overflows"}));
  cases.push_back(Header("shape_overflow_2p32_cubed",
                         "{" + Entry(w, "U8", "[4294967296,4294967296,4294967296]", 0, 8) + "}", w8, SC::kCorruption,
                         {w, "overflows"}));
  cases.push_back(Header("byte_count_overflow_f64", "{" + Entry(w, "F64", "[2305843009213693952,2]", 0, 8) + "}", w8,
                         SC::kCorruption, {w, "overflows"}));
  std::string dims65 = "[1";
  for (int i = 1; i < 65; ++i) dims65 += ",1";
  dims65 += "]";
  cases.push_back(
      Header("too_many_dims", "{" + Entry(w, "U8", dims65, 0, 1) + "}", "\x01", SC::kCorruption, {w, "65 dimensions"}));
  cases.push_back(Header("dtype_size_mismatch", "{" + Entry(w, "F32", "[2,2]", 0, 8) + "}", w8, SC::kCorruption,
                         {w, "needs 16 bytes"}));
  cases.push_back(Header("f4_odd_count", "{" + Entry(w, "F4", "[3]", 0, 2) + "}", "\x12\x34", SC::kCorruption,
                         {w, "byte boundary"}));
  cases.push_back(Header("offsets_end_before_begin", "{" + Entry(w, "U8", "[0]", 8, 0) + "}", w8, SC::kCorruption,
                         {w, "before begin"}));
  cases.push_back(Header("negative_offset", "{\"" + w + "\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[-8,0]}}",
                         w8, SC::kCorruption, {w, "data_offsets"}));
  cases.push_back(Header(
      "offsets_near_u64_max",
      "{" + Entry(w, "F32", "[1]", std::numeric_limits<uint64_t>::max() - 4, std::numeric_limits<uint64_t>::max()) +
          "}",
      "", SC::kCorruption, {w, "gap"}));
  cases.push_back(Header("offsets_past_u64_max",
                         "{\"" + w +
                             "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[18446744073709551616,"
                             "18446744073709551617]}}",
                         "", SC::kCorruption, {w, "data_offsets"}));

  // --- The data section.
  const std::string a = "layers.0.a";
  const std::string b = "layers.0.b";
  cases.push_back(Header("overlapping_offsets",
                         "{" + Entry(a, "F32", "[2]", 0, 8) + "," + Entry(b, "F32", "[2]", 4, 12) + "}",
                         std::string(12, '\x01'), SC::kCorruption, {b, "overlap"}));
  cases.push_back(Header("gap_between_tensors",
                         "{" + Entry(a, "F32", "[2]", 0, 8) + "," + Entry(b, "F32", "[2]", 12, 20) + "}",
                         std::string(20, '\x01'), SC::kCorruption, {b, "gap"}));
  cases.push_back(Header("data_not_from_zero", "{" + Entry(a, "F32", "[2]", 4, 12) + "}", std::string(12, '\x01'),
                         SC::kCorruption, {a, "gap"}));
  cases.push_back(Header("trailing_bytes", f32x2, w8 + "junk", SC::kCorruption, {"4 trailing bytes"}));
  cases.push_back(
      Header("truncated_data", "{" + Entry(w, "F32", "[4]", 0, 16) + "}", w8, SC::kCorruption, {"truncated"}));
  cases.push_back(Single("truncated_mid_header", ValidFile({{w, "F32", "[4]", 16}}).substr(0, 30), SC::kCorruption,
                         {"runs past the end"}));

  // --- __metadata__.
  cases.push_back(Header("metadata_non_string",
                         "{\"__metadata__\":{\"format\":\"pt\",\"step\":7}," + Entry(w, "F32", "[2]", 0, 8) + "}", w8,
                         SC::kCorruption, {"__metadata__", "step"}));
  cases.push_back(Header("metadata_not_object", "{\"__metadata__\":[\"pt\"]," + Entry(w, "F32", "[2]", 0, 8) + "}", w8,
                         SC::kCorruption, {"__metadata__"}));

  // --- Sharded checkpoints (opened through the directory).
  const std::string s1 = ValidFile({{a, "F32", "[2]", 8}}, 1);
  const std::string s2 = ValidFile({{b, "F32", "[2]", 8}}, 9);
  cases.push_back(Sharded("index_missing_shard", Index({{a, kShard1}, {b, kShard2}}, 16), s1, "", SC::kNotFound, kIndex,
                          {std::string("{root}/") + kIndex, kShard2}));
  cases.push_back(Sharded("index_tensor_not_in_shard", Index({{a, kShard1}, {b, kShard2}, {"layers.9.c", kShard2}}, 24),
                          s1, s2, SC::kNotFound, kIndex, {std::string("{root}/") + kIndex, "layers.9.c", kShard2}));
  cases.push_back(Sharded("shard_tensor_not_indexed", Index({{a, kShard1}}, 8), s1, "", SC::kCorruption, kShard1, {}));
  // A shard with a tensor the index does not list: shard 1 holds a and an extra x.
  cases.back().files[kShard1] = ValidFile({{a, "F32", "[2]", 8}, {"extra.x", "U8", "[4]", 4}}, 1);
  cases.back().message_contains = {std::string("{root}/") + kShard1, "extra.x"};
  cases.push_back(Sharded("index_not_json", "{\"weight_map\": {\"a\": ", s1, s2, SC::kCorruption, kIndex,
                          {std::string("{root}/") + kIndex}));
  cases.push_back(Sharded("index_is_array", "[\"" + std::string(kShard1) + "\"]", s1, s2, SC::kCorruption, kIndex,
                          {std::string("{root}/") + kIndex, "JSON object"}));
  cases.push_back(Sharded("index_nesting_bomb", "{\"weight_map\":" + std::string(500'000, '['), s1, s2, SC::kCorruption,
                          kIndex, {std::string("{root}/") + kIndex, "nested too deeply"}));
  cases.push_back(Sharded("index_without_weight_map", "{\"metadata\":{\"total_size\":16}}", s1, s2, SC::kCorruption,
                          kIndex, {std::string("{root}/") + kIndex, "weight_map"}));
  cases.push_back(Sharded("index_entry_not_string", "{\"weight_map\":{\"" + a + "\":1}}", s1, s2, SC::kCorruption,
                          kIndex, {std::string("{root}/") + kIndex, a}));
  cases.push_back(Sharded("index_path_traversal", Index({{a, kShard1}, {b, "../etc/passwd"}}, 16), s1, s2,
                          SC::kCorruption, kIndex, {std::string("{root}/") + kIndex, "../etc/passwd"}));
  cases.push_back(Sharded("index_absolute_path", Index({{a, kShard1}, {b, "/etc/passwd"}}, 16), s1, s2, SC::kCorruption,
                          kIndex, {std::string("{root}/") + kIndex, "/etc/passwd"}));
  cases.push_back(Sharded("index_dotdot_shard", Index({{a, kShard1}, {b, ".."}}, 16), s1, s2, SC::kCorruption, kIndex,
                          {std::string("{root}/") + kIndex, "'..'"}));
  cases.push_back(Sharded("index_nul_in_shard_name", Index({{a, kShard1}, {b, std::string(kShard2) + "\\u0000.x"}}, 16),
                          s1, s2, SC::kCorruption, kIndex, {std::string("{root}/") + kIndex, "invalid shard file"}));
  cases.push_back(Sharded("index_duplicate_key", Index({{a, kShard1}, {b, kShard2}, {a, kShard2}}, 16), s1, s2,
                          SC::kCorruption, kIndex, {std::string("{root}/") + kIndex, a, "twice"}));
  // Both shards hold `a`; the index can name only one of them.
  cases.push_back(Sharded("same_tensor_in_two_shards", Index({{a, kShard1}, {b, kShard2}}, 16), s1,
                          ValidFile({{a, "F32", "[2]", 8}, {b, "F32", "[2]", 8}}, 9), SC::kCorruption, kShard2,
                          {std::string("{root}/") + kShard2, a}));
  cases.push_back(Sharded("corrupt_shard", Index({{a, kShard1}, {b, kShard2}}, 16), s1, s2.substr(0, s2.size() - 1),
                          SC::kCorruption, kShard2, {std::string("{root}/") + kShard2, "truncated"}));

  // --- Paths and directories.
  {
    BadInputCase c;
    c.name = "missing_path";
    c.open = "does_not_exist.safetensors";
    c.code = SC::kNotFound;
    c.message_contains = {"{root}/does_not_exist.safetensors"};
    c.culprit = "does_not_exist.safetensors";
    cases.push_back(std::move(c));
  }
  {
    BadInputCase c;
    c.name = "directory_without_weights";
    c.files["README.md"] = "# nothing here\n";
    c.files["config.json"] = "{}";
    c.open = "";
    c.code = SC::kNotFound;
    c.message_contains = {"{root}", "no safetensors weights"};
    cases.push_back(std::move(c));
  }
  {
    BadInputCase c;
    c.name = "directory_only_temp_file";  // what a crashed writer leaves behind
    c.files[".model.safetensors.tmp-4242-0"] = s1.substr(0, 20);
    c.open = "";
    c.code = SC::kNotFound;
    c.message_contains = {"{root}", "no safetensors weights"};
    cases.push_back(std::move(c));
  }
  {
    BadInputCase c;
    c.name = "directory_two_files_no_index";
    c.files["first.safetensors"] = s1;
    c.files["second.safetensors"] = s2;
    c.open = "";
    c.code = SC::kInvalidArgument;
    c.message_contains = {"{root}", "no index"};
    cases.push_back(std::move(c));
  }
  {
    BadInputCase c;
    c.name = "directory_with_bad_weights";
    c.files[kFile] = SafetensorsBytes("{" + Entry(w, "F32", "[4]", 0, 16) + "}", w8);
    c.open = "";
    c.code = SC::kCorruption;
    c.message_contains = {std::string("{root}/") + kFile, "truncated"};
    c.culprit = kFile;
    cases.push_back(std::move(c));
  }
  {
    BadInputCase c;
    c.name = "weights_name_is_directory";
    c.files["adapter_model.safetensors/placeholder"] = "x";
    c.open = "adapter_model.safetensors";
    c.code = SC::kNotFound;
    c.message_contains = {"{root}/adapter_model.safetensors", "no safetensors weights"};
    c.culprit = "adapter_model.safetensors";
    cases.push_back(std::move(c));
  }
  return cases;
}

void PrintTo(const BadInputCase& c, std::ostream* os) { *os << c.name; }

std::string ExpandRoot(const std::string& text, const std::filesystem::path& root) {
  const std::string key = "{root}";
  std::string out = text;
  for (size_t pos = out.find(key); pos != std::string::npos; pos = out.find(key, pos)) {
    out.replace(pos, key.size(), root.string());
    pos += root.string().size();
  }
  return out;
}

std::filesystem::path OpenPath(const BadInputCase& c, const std::filesystem::path& root) {
  return c.open.empty() ? root : root / c.open;
}

Status WriteCase(const BadInputCase& c, const std::filesystem::path& root) {
  for (const auto& [rel, bytes] : c.files) {
    const std::filesystem::path p = root / rel;
    std::error_code ec;
    std::filesystem::create_directories(p.parent_path(), ec);
    if (ec) return Status::IOError(p.parent_path().string() + ": " + ec.message());
    std::FILE* f = std::fopen(p.c_str(), "wb");
    if (f == nullptr) return Status::IOError(p.string() + ": cannot create");
    const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (std::fclose(f) != 0 || !ok) return Status::IOError(p.string() + ": write failed");
  }
  return Status::OK();
}

Status WriteCorpus(const std::filesystem::path& root) {
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  if (ec) return Status::IOError(root.string() + ": " + ec.message());
  for (const auto& c : BadInputCases()) {
    const auto dir = root / c.name;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::IOError(dir.string() + ": " + ec.message());
    FERRY_RETURN_IF_ERROR(WriteCase(c, dir));
  }
  return Status::OK();
}

}  // namespace ferry::corpus
