#include "daemon/run/checkpoint_state.h"

#include <nlohmann/json.hpp>

#include <charconv>
#include <cmath>
#include <limits>

#include "core/file_util.h"
#include "core/mapped_file.h"
#include "core/text.h"

namespace ferry::run {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

constexpr int64_t kMaxExactInteger = int64_t{1} << 53;

// Reads the fields of one JSON object, each error naming the file and the field's path.
class Fields {
 public:
  Fields(const json& j, std::string where, std::string path)
      : j_(j), where_(std::move(where)), path_(std::move(path)) {}

  Status Error(const std::string& key, const std::string& what) const {
    return Status::Corruption(where_ + ": field '" + Path(key) + "' " + what);
  }
  std::string Path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  Result<const json*> Get(const std::string& key, json::value_t type) const {
    auto it = j_.find(key);
    if (it == j_.end()) return Error(key, "is missing");
    const bool ok = type == json::value_t::number_integer
                        ? it->is_number_integer()
                        : (type == json::value_t::number_float ? it->is_number() : it->type() == type);
    if (!ok) return Error(key, "has the wrong type");
    return &*it;
  }
  Result<int64_t> Int(const std::string& key, int64_t max) const {
    FERRY_ASSIGN_OR_RETURN(const json* v, Get(key, json::value_t::number_integer));
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(max)) return Error(key, "is too large");
    const int64_t x = v->get<int64_t>();
    if (x < 0 || x > max) return Error(key, "is out of range (" + v->dump() + ")");
    return x;
  }
  Result<std::string> String(const std::string& key, size_t max_bytes) const {
    FERRY_ASSIGN_OR_RETURN(const json* v, Get(key, json::value_t::string));
    const std::string& s = v->get_ref<const std::string&>();
    if (s.size() > max_bytes) return Error(key, "is longer than " + std::to_string(max_bytes) + " bytes");
    return s;
  }
  Result<std::string> Hex(const std::string& key, size_t exact_or_zero, size_t max_bytes) const {
    FERRY_ASSIGN_OR_RETURN(std::string s, String(key, max_bytes));
    if (exact_or_zero != 0 && s.size() != exact_or_zero) {
      return Error(key, "is not " + std::to_string(exact_or_zero) + " hex characters");
    }
    if (s.size() % 2 != 0) return Error(key, "has an odd number of hex characters");
    for (char c : s) {
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return Error(key, "is not lowercase hex");
    }
    return s;
  }
  Result<store::Digest> Digest(const std::string& key) const {
    FERRY_ASSIGN_OR_RETURN(std::string s, Hex(key, 32, 32));
    auto d = store::Digest::FromHex(s);
    if (!d.ok()) return Error(key, "is not a digest");
    return *d;
  }
  const std::string& where() const { return where_; }

 private:
  const json& j_;
  std::string where_;
  std::string path_;
};

// A metric value: a number, or null for NaN (JSON has none; nlohmann writes NaN as null).
Result<double> MetricValue(const json& v, const Fields& f, const std::string& key) {
  if (v.is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!v.is_number()) return f.Error(key, "holds a value that is not a number or null");
  return v.get<double>();
}

Result<std::map<std::string, double>> Metrics(const json& obj, const Fields& f, const std::string& key) {
  if (!obj.is_object()) return f.Error(key, "is not an object");
  if (obj.size() > 4096) return f.Error(key, "has more than 4096 metrics");
  std::map<std::string, double> out;
  for (const auto& [name, v] : obj.items()) {
    FERRY_ASSIGN_OR_RETURN(out[name], MetricValue(v, f, key + "." + name));
  }
  return out;
}

Result<CheckpointFile> ParseFileRecord(const json& j, const std::string& where, const std::string& path) {
  if (!j.is_object()) return Status::Corruption(where + ": field '" + path + "' is not an object");
  Fields f(j, where, path);
  CheckpointFile out;
  FERRY_ASSIGN_OR_RETURN(int64_t size, f.Int("size", std::numeric_limits<int64_t>::max()));
  out.size = static_cast<uint64_t>(size);
  FERRY_ASSIGN_OR_RETURN(out.digest, f.Digest("digest"));
  if (auto it = j.find("tensors"); it != j.end()) {
    if (!it->is_object()) return f.Error("tensors", "is not an object");
    if (it->size() > kMaxRecordedTensors) return f.Error("tensors", "has too many entries");
    Fields tf(*it, where, f.Path("tensors"));
    for (const auto& [name, v] : it->items()) {
      (void)v;
      FERRY_ASSIGN_OR_RETURN(out.tensors[name], tf.Digest(name));
    }
  }
  return out;
}

bool IsSafetensors(const std::string& name) {
  constexpr std::string_view kExt = ".safetensors";
  return name.size() > kExt.size() && name.compare(name.size() - kExt.size(), kExt.size(), kExt) == 0;
}

}  // namespace

Result<TrainerState> ParseTrainerState(std::string_view text, const std::string& where) {
  if (text.size() > kMaxTrainerStateBytes) {
    return Status::Corruption(where + ": larger than " + std::to_string(kMaxTrainerStateBytes) + " bytes");
  }
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(where + ": not a JSON object");
  Fields f(j, where, "");
  TrainerState st;
  FERRY_ASSIGN_OR_RETURN(st.global_step, f.Int("global_step", kMaxExactInteger));
  FERRY_ASSIGN_OR_RETURN(st.micro_step, f.Int("micro_step", kMaxExactInteger));
  FERRY_ASSIGN_OR_RETURN(st.last_logged, f.Int("last_logged", kMaxExactInteger));
  if (st.last_logged > st.global_step) return f.Error("last_logged", "is past global_step");
  FERRY_ASSIGN_OR_RETURN(const json* tokens, f.Get("num_tokens", json::value_t::number_float));
  st.num_tokens = tokens->get<double>();
  if (!std::isfinite(st.num_tokens) || st.num_tokens < 0) return f.Error("num_tokens", "is not a count");

  FERRY_ASSIGN_OR_RETURN(const json* ds, f.Get("dataset", json::value_t::object));
  Fields df(*ds, where, "dataset");
  FERRY_ASSIGN_OR_RETURN(int64_t epoch, df.Int("epoch", kMaxExactInteger));
  FERRY_ASSIGN_OR_RETURN(int64_t index, df.Int("index", kMaxExactInteger));
  st.dataset_epoch = static_cast<uint64_t>(epoch);
  st.dataset_index = static_cast<uint64_t>(index);
  FERRY_ASSIGN_OR_RETURN(st.dataset_digest, df.String("digest", 256));
  FERRY_ASSIGN_OR_RETURN(st.config_fingerprint, f.String("config_fingerprint", 256));

  FERRY_ASSIGN_OR_RETURN(const json* pending, f.Get("pending_metrics", json::value_t::object));
  if (pending->size() > 4096) return f.Error("pending_metrics", "has more than 4096 metrics");
  for (const auto& [name, values] : pending->items()) {
    const std::string key = "pending_metrics." + name;
    if (!values.is_array()) return f.Error(key, "is not an array");
    if (values.size() > static_cast<size_t>(st.global_step - st.last_logged)) {
      return f.Error(key, "holds more values than steps since the last log line");
    }
    std::vector<double>& out = st.pending_metrics[name];
    for (const json& v : values) {
      FERRY_ASSIGN_OR_RETURN(double x, MetricValue(v, f, key));
      out.push_back(x);
    }
  }
  FERRY_ASSIGN_OR_RETURN(st.generator_version, f.Hex("generator_version", 32, 32));
  FERRY_ASSIGN_OR_RETURN(st.torch_rng_state, f.Hex("torch_rng_state", 0, 1 << 16));

  if (auto it = j.find("rollout"); it != j.end()) {
    if (!it->is_object()) return f.Error("rollout", "is not an object");
    Fields rf(*it, where, "rollout");
    RolloutState r;
    FERRY_ASSIGN_OR_RETURN(r.num_items, rf.Int("num_items", kMaxExactInteger));
    FERRY_ASSIGN_OR_RETURN(const json* metrics, rf.Get("metrics", json::value_t::object));
    FERRY_ASSIGN_OR_RETURN(r.metrics, Metrics(*metrics, rf, "metrics"));
    FERRY_ASSIGN_OR_RETURN(const json* rows, rf.Get("rows", json::value_t::array));
    if (rows->size() > 65536) return rf.Error("rows", "has more than 65536 micro-batches");
    size_t total = 0;
    for (const json& mb : *rows) {
      if (!mb.is_array()) return rf.Error("rows", "holds a micro-batch that is not an array");
      total += mb.size();
      if (total > (size_t{1} << 24)) return rf.Error("rows", "holds more than 2^24 rows");
      std::vector<int64_t>& out = r.rows.emplace_back();
      for (const json& x : mb) {
        if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() >= (int64_t{1} << 24)) {
          return rf.Error("rows", "holds a row index that is not an integer in [0, 2^24)");
        }
        out.push_back(x.get<int64_t>());
      }
    }
    st.rollout = std::move(r);
  }

  if (auto it = j.find("files"); it != j.end()) {
    if (!it->is_object()) return f.Error("files", "is not an object");
    if (it->size() > kMaxCheckpointFiles) return f.Error("files", "names too many files");
    for (const auto& [name, rec] : it->items()) {
      if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
          name.find('\0') != std::string::npos || name == "trainer_state.json") {
        return f.Error("files", "names '" + EscapeForMessage(name) + "', not a file of the checkpoint");
      }
      FERRY_ASSIGN_OR_RETURN(st.files[name], ParseFileRecord(rec, where, "files." + name));
    }
  }
  return st;
}

std::string TrainerStateJson(const TrainerState& st) {
  ojson j;
  j["global_step"] = st.global_step;
  j["micro_step"] = st.micro_step;
  j["num_tokens"] = st.num_tokens;
  j["dataset"] = {{"epoch", st.dataset_epoch}, {"index", st.dataset_index}, {"digest", st.dataset_digest}};
  j["config_fingerprint"] = st.config_fingerprint;
  ojson pending = ojson::object();
  for (const auto& [name, values] : st.pending_metrics) {
    ojson a = ojson::array();
    for (double x : values) a.push_back(std::isfinite(x) ? ojson(x) : ojson(nullptr));
    pending[name] = std::move(a);
  }
  j["pending_metrics"] = std::move(pending);
  j["last_logged"] = st.last_logged;
  j["generator_version"] = st.generator_version;
  j["torch_rng_state"] = st.torch_rng_state;
  if (st.rollout) {
    ojson metrics = ojson::object();
    for (const auto& [k, v] : st.rollout->metrics) metrics[k] = std::isfinite(v) ? ojson(v) : ojson(nullptr);
    j["rollout"] = {{"num_items", st.rollout->num_items}, {"metrics", std::move(metrics)}, {"rows", st.rollout->rows}};
  }
  ojson files = ojson::object();
  for (const auto& [name, rec] : st.files) {
    ojson r = {{"size", rec.size}, {"digest", rec.digest.Hex()}};
    if (!rec.tensors.empty()) {
      ojson t = ojson::object();
      for (const auto& [tn, d] : rec.tensors) t[tn] = d.Hex();
      r["tensors"] = std::move(t);
    }
    files[name] = std::move(r);
  }
  j["files"] = std::move(files);
  return j.dump(2) + "\n";
}

Result<CheckpointFile> RecordCheckpointFile(const fs::path& dir, const std::string& name) {
  const fs::path path = dir / name;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::Open(path));
  const auto bytes = file->bytes();
  CheckpointFile rec;
  rec.size = bytes.size();
  rec.digest = store::AuxDigest(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  if (IsSafetensors(name)) {
    FERRY_ASSIGN_OR_RETURN(Checkpoint ckpt, Checkpoint::Open(path));
    for (const std::string& t : ckpt.names()) {
      FERRY_ASSIGN_OR_RETURN(Tensor v, ckpt.Get(t));
      rec.tensors[t] = store::TensorDigest(v);
    }
  }
  return rec;
}

Status CheckCheckpointFile(const fs::path& dir, const std::string& name, const CheckpointFile& recorded) {
  const fs::path path = dir / name;
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::Corruption(path.string() + ": missing (the checkpoint recorded it)");
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::Open(path));
  const auto bytes = file->bytes();
  if (bytes.size() == recorded.size && store::AuxDigest(std::string_view(reinterpret_cast<const char*>(bytes.data()),
                                                                         bytes.size())) == recorded.digest) {
    return Status::OK();
  }
  std::string what = bytes.size() != recorded.size ? "is " + std::to_string(bytes.size()) + " bytes, " +
                                                         std::to_string(recorded.size) + " were written"
                                                   : "differs from what was written (its digest)";
  if (IsSafetensors(name) && !recorded.tensors.empty()) {
    auto ckpt = Checkpoint::Open(path);
    if (!ckpt.ok()) {
      std::string why = ckpt.status().message();
      if (why.rfind(path.string() + ": ", 0) == 0) why.erase(0, path.string().size() + 2);
      return Status::Corruption(path.string() + ": " + what + ", and its header no longer reads: " + why);
    }
    for (const auto& [t, digest] : recorded.tensors) {
      if (!ckpt->Contains(t)) return Status::Corruption(path.string() + ": tensor '" + t + "' is missing; " + what);
      auto v = ckpt->Get(t);
      if (!v.ok()) return v.status().WithContext(path.string());
      const store::Digest now = store::TensorDigest(*v);
      if (now != digest) {
        return Status::Corruption(path.string() + ": tensor '" + t + "' differs from what was written (digest " +
                                  now.Hex() + ", recorded " + digest.Hex() + ")");
      }
    }
    for (const std::string& t : ckpt->names()) {
      if (recorded.tensors.count(t) == 0) {
        return Status::Corruption(path.string() + ": tensor '" + t + "' was not written with the checkpoint");
      }
    }
    what = "its header differs from what was written (every tensor matches)";
  }
  return Status::Corruption(path.string() + ": " + what);
}

Status CheckAgainstVersion(const Checkpoint& file, const store::VersionRecord& version) {
  const std::string where = file.path().string();
  std::map<std::string, const store::TensorRow*> rows;
  for (const store::TensorRow& row : version.tensors) rows[row.name] = &row;
  for (const std::string& name : file.names()) {
    auto it = rows.find(name);
    if (it == rows.end()) {
      return Status::Corruption(where + ": tensor '" + name + "' is not in version " + version.id.Hex());
    }
    FERRY_ASSIGN_OR_RETURN(Tensor t, file.Get(name));
    const store::Digest d = store::TensorDigest(t);
    if (d != it->second->digest) {
      return Status::Corruption(where + ": tensor '" + name + "' differs from the store's record of version " +
                                version.id.Hex() + " (digest " + d.Hex() + ", recorded " + it->second->digest.Hex() +
                                ")");
    }
    rows.erase(it);
  }
  if (!rows.empty()) {
    return Status::Corruption(where + ": tensor '" + rows.begin()->first + "' of version " + version.id.Hex() +
                              " is missing");
  }
  return Status::OK();
}

Result<std::map<std::string, OptimizerEntry>> ReadOptimizerState(const Checkpoint& file) {
  const std::string where = file.path().string();
  std::map<std::string, OptimizerEntry> out;
  for (const auto& [k, v] : file.metadata()) {
    if (k.rfind("step.", 0) != 0) continue;
    const std::string key = k.substr(5);
    int64_t step = 0;
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), step);
    if (ec != std::errc() || end != v.data() + v.size() || step < 1 || step > kMaxExactInteger) {
      return Status::Corruption(where + ": metadata '" + EscapeForMessage(k) + "' is not a step count (\"" +
                                EscapeForMessage(v.substr(0, 32)) + "\")");
    }
    OptimizerEntry e;
    e.step = step;
    for (auto [prefix, dst] :
         {std::pair<const char*, Tensor*>{"exp_avg.", &e.exp_avg}, {"exp_avg_sq.", &e.exp_avg_sq}}) {
      const std::string name = prefix + key;
      if (!file.Contains(name)) {
        return Status::Corruption(where + ": tensor '" + EscapeForMessage(name) + "' is missing (metadata '" +
                                  EscapeForMessage(k) + "' names it)");
      }
      FERRY_ASSIGN_OR_RETURN(*dst, file.Get(name));
      if (dst->dtype() != DType::kF32) {
        return Status::Corruption(where + ": tensor '" + EscapeForMessage(name) + "' is not F32");
      }
    }
    if (e.exp_avg.shape() != e.exp_avg_sq.shape()) {
      return Status::Corruption(where + ": exp_avg and exp_avg_sq of '" + EscapeForMessage(key) +
                                "' have different shapes");
    }
    out.emplace(key, std::move(e));
  }
  for (const std::string& name : file.names()) {
    std::string key;
    if (name.rfind("exp_avg_sq.", 0) == 0) {
      key = name.substr(11);
    } else if (name.rfind("exp_avg.", 0) == 0) {
      key = name.substr(8);
    }
    if (key.empty() || out.count(key) == 0) {
      return Status::Corruption(where + ": tensor '" + EscapeForMessage(name) +
                                "' is not the state of an adapter tensor with a step count");
    }
  }
  return out;
}

}  // namespace ferry::run
