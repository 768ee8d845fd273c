// JSON encodings of version records, tensor rows and events (the values of the "versions",
// "tensors" and "events" column families), and auxiliary-file discovery.
#include <algorithm>
#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/mapped_file.h"
#include "store/internal.h"

namespace ferry::store::internal {
namespace {

using nlohmann::json;

json DigestOrNull(const std::optional<Digest>& d) { return d ? json(d->Hex()) : json(nullptr); }

// Field access that turns a malformed record into kCorruption naming the field.
class Reader {
 public:
  Reader(const json& j, std::string what) : j_(j), what_(std::move(what)) {}

  template <typename T>
  Status Get(const char* key, T& out) const {
    auto it = j_.find(key);
    if (it == j_.end()) return Status::Corruption(what_ + ": field '" + key + "' is missing");
    try {
      out = it->get<T>();
    } catch (const json::exception& e) {
      return Status::Corruption(what_ + ": field '" + key + "': " + e.what());
    }
    return Status::OK();
  }
  // A double that may be null (JSON has no Inf): null reads as `null_value`.
  Status GetDouble(const char* key, double& out, double null_value) const {
    auto it = j_.find(key);
    if (it != j_.end() && it->is_null()) {
      out = null_value;
      return Status::OK();
    }
    return Get(key, out);
  }
  Status GetDigest(const char* key, Digest& out) const {
    std::string hex;
    FERRY_RETURN_IF_ERROR(Get(key, hex));
    auto d = Digest::FromHex(hex);
    if (!d.ok()) return Status::Corruption(what_ + ": field '" + key + "': " + d.status().message());
    out = *d;
    return Status::OK();
  }
  Status GetOptionalDigest(const char* key, std::optional<Digest>& out) const {
    auto it = j_.find(key);
    if (it == j_.end() || it->is_null()) {
      out.reset();
      return Status::OK();
    }
    Digest d;
    FERRY_RETURN_IF_ERROR(GetDigest(key, d));
    out = d;
    return Status::OK();
  }
  const json& raw() const { return j_; }
  const std::string& what() const { return what_; }

 private:
  const json& j_;
  std::string what_;
};

bool IsControl(unsigned char c) { return IsControlByte(c); }

// j.dump(), or kInternal naming `what` when j holds text that is not UTF-8 (the callers
// validate first, so this is a missed check, not bad input to report).
Result<std::string> Dump(const json& j, const char* what) {
  try {
    return j.dump();
  } catch (const json::exception& e) {
    return Status::Internal(std::string(what) + " cannot be encoded as JSON: " + e.what());
  }
}

Result<json> ParseObject(std::string_view text, const std::string& what) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption(what + ": not a JSON object");
  return j;
}

template <typename E>
Result<E> ParseEnum(const std::string& s, std::initializer_list<E> values, std::string_view (*name)(E),
                    const std::string& what) {
  for (E v : values) {
    if (name(v) == s) return v;
  }
  return Status::Corruption(what + ": unknown value '" + s + "'");
}

}  // namespace

Result<std::string> EncodeVersion(const VersionRecord& r) {
  json j;
  j["id"] = r.id.Hex();
  j["run"] = r.run;
  j["sequence"] = r.sequence;
  j["parent"] = DigestOrNull(r.parent);
  j["kind"] = std::string(KindName(r.kind));
  j["layout"] = std::string(LayoutName(r.layout));
  j["source"] = std::string(SourceName(r.source));
  j["time_ns"] = r.time_ns;
  j["step"] = r.step ? json(*r.step) : json(nullptr);
  j["base_version"] = DigestOrNull(r.base_version);
  j["adapter_version"] = DigestOrNull(r.adapter_version);
  j["adapter_config"] = r.adapter_config;
  json metrics = json::object();
  for (const auto& [k, v] : r.metrics) metrics[k] = std::isfinite(v) ? json(v) : json(nullptr);
  j["metrics"] = metrics;
  json aux = json::array();
  for (const AuxFile& a : r.aux) aux.push_back({{"name", a.name}, {"digest", a.digest.Hex()}, {"size", a.size}});
  j["aux"] = aux;
  j["tensor_count"] = r.tensors.size();
  j["total_bytes"] = r.total_bytes;
  if (r.derived) j["derived"] = true;  // absent: stored (records older than derived versions too)
  return Dump(j, "version record");
}

Result<VersionRecord> DecodeVersion(std::string_view text) {
  FERRY_ASSIGN_OR_RETURN(json j, ParseObject(text, "version record"));
  std::string what = "version record";
  if (auto it = j.find("id"); it != j.end() && it->is_string()) what += " " + it->get<std::string>();
  Reader rd(j, what);
  VersionRecord r;
  FERRY_RETURN_IF_ERROR(rd.GetDigest("id", r.id));
  FERRY_RETURN_IF_ERROR(rd.Get("run", r.run));
  FERRY_RETURN_IF_ERROR(rd.Get("sequence", r.sequence));
  FERRY_RETURN_IF_ERROR(rd.GetOptionalDigest("parent", r.parent));
  std::string kind, source;
  FERRY_RETURN_IF_ERROR(rd.Get("kind", kind));
  FERRY_ASSIGN_OR_RETURN(
      r.kind, ParseEnum(kind, {VersionKind::kBase, VersionKind::kAdapter, VersionKind::kMerged, VersionKind::kFull},
                        &KindName, what + ": field 'kind'"));
  std::string layout;
  FERRY_RETURN_IF_ERROR(rd.Get("layout", layout));
  FERRY_ASSIGN_OR_RETURN(r.layout, ParseEnum(layout, {Layout::kHf, Layout::kFused, Layout::kLora}, &LayoutName,
                                             what + ": field 'layout'"));
  FERRY_RETURN_IF_ERROR(rd.Get("source", source));
  FERRY_ASSIGN_OR_RETURN(
      r.source,
      ParseEnum(source, {VersionSource::kConvert, VersionSource::kImport, VersionSource::kDaemon, VersionSource::kSync},
                &SourceName, what + ": field 'source'"));
  FERRY_RETURN_IF_ERROR(rd.Get("time_ns", r.time_ns));
  if (auto it = j.find("step"); it != j.end() && !it->is_null()) {
    int64_t step = 0;
    FERRY_RETURN_IF_ERROR(rd.Get("step", step));
    r.step = step;
  }
  FERRY_RETURN_IF_ERROR(rd.GetOptionalDigest("base_version", r.base_version));
  FERRY_RETURN_IF_ERROR(rd.GetOptionalDigest("adapter_version", r.adapter_version));
  FERRY_RETURN_IF_ERROR(rd.Get("adapter_config", r.adapter_config));
  if (auto it = j.find("metrics"); it != j.end()) {
    if (!it->is_object()) return Status::Corruption(what + ": field 'metrics' is not an object");
    for (const auto& [k, v] : it->items()) {
      if (v.is_null()) {
        r.metrics[k] = std::numeric_limits<double>::quiet_NaN();
      } else if (v.is_number()) {
        r.metrics[k] = v.get<double>();
      } else {
        return Status::Corruption(what + ": metric '" + k + "' is not a number");
      }
    }
  }
  auto aux = j.find("aux");
  if (aux == j.end() || !aux->is_array()) return Status::Corruption(what + ": field 'aux' is missing");
  for (const json& a : *aux) {
    if (!a.is_object()) return Status::Corruption(what + ": an 'aux' entry is not an object");
    Reader ar(a, what + ": aux entry");
    AuxFile f;
    FERRY_RETURN_IF_ERROR(ar.Get("name", f.name));
    FERRY_RETURN_IF_ERROR(ar.GetDigest("digest", f.digest));
    FERRY_RETURN_IF_ERROR(ar.Get("size", f.size));
    r.aux.push_back(std::move(f));
  }
  FERRY_RETURN_IF_ERROR(rd.Get("total_bytes", r.total_bytes));
  if (j.contains("derived")) FERRY_RETURN_IF_ERROR(rd.Get("derived", r.derived));
  return r;
}

Result<std::string> EncodeTensorRow(const TensorRow& row) {
  json j;
  j["name"] = row.name;
  j["dtype"] = std::string(DTypeName(row.dtype));
  j["shape"] = row.shape;
  j["digest"] = row.digest.Hex();
  j["nbytes"] = row.nbytes;
  j["l2_norm"] = std::isfinite(row.l2_norm) ? json(row.l2_norm) : json(nullptr);
  j["nonfinite"] = row.nonfinite;
  j["all_zero"] = row.all_zero;
  return Dump(j, "tensor row");
}

Result<TensorRow> DecodeTensorRow(std::string_view text) {
  FERRY_ASSIGN_OR_RETURN(json j, ParseObject(text, "tensor row"));
  std::string what = "tensor row";
  if (auto it = j.find("name"); it != j.end() && it->is_string()) what += " '" + it->get<std::string>() + "'";
  Reader rd(j, what);
  TensorRow row;
  FERRY_RETURN_IF_ERROR(rd.Get("name", row.name));
  std::string dtype;
  FERRY_RETURN_IF_ERROR(rd.Get("dtype", dtype));
  auto dt = ParseDType(dtype);
  if (!dt) return Status::Corruption(what + ": unknown dtype '" + dtype + "'");
  row.dtype = *dt;
  FERRY_RETURN_IF_ERROR(rd.Get("shape", row.shape));
  FERRY_RETURN_IF_ERROR(rd.GetDigest("digest", row.digest));
  FERRY_RETURN_IF_ERROR(rd.Get("nbytes", row.nbytes));
  FERRY_RETURN_IF_ERROR(rd.GetDouble("l2_norm", row.l2_norm, std::numeric_limits<double>::infinity()));
  FERRY_RETURN_IF_ERROR(rd.Get("nonfinite", row.nonfinite));
  FERRY_RETURN_IF_ERROR(rd.Get("all_zero", row.all_zero));
  return row;
}

std::string EncodeEvent(const Event& e) {
  json j;
  j["type"] = std::string(EventTypeName(e.type));
  j["time_ns"] = e.time_ns;
  j["receiver"] = e.receiver;
  j["version"] = e.version.Hex();
  j["computed"] = DigestOrNull(e.computed);
  j["detail"] = e.detail;
  if (e.anomaly != Event::Anomaly::kUnspecified) j["anomaly"] = std::string(AnomalyName(e.anomaly));
  return j.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

Result<Event> DecodeEvent(std::string_view text) {
  FERRY_ASSIGN_OR_RETURN(json j, ParseObject(text, "event"));
  Reader rd(j, "event");
  Event e;
  std::string type;
  FERRY_RETURN_IF_ERROR(rd.Get("type", type));
  FERRY_ASSIGN_OR_RETURN(e.type,
                         ParseEnum(type,
                                   {Event::Type::kPublished, Event::Type::kAcknowledged, Event::Type::kActivated,
                                    Event::Type::kAnomaly, Event::Type::kCheckpoint, Event::Type::kEngine},
                                   &EventTypeName, "event: field 'type'"));
  FERRY_RETURN_IF_ERROR(rd.Get("time_ns", e.time_ns));
  FERRY_RETURN_IF_ERROR(rd.Get("receiver", e.receiver));
  FERRY_RETURN_IF_ERROR(rd.GetDigest("version", e.version));
  FERRY_RETURN_IF_ERROR(rd.GetOptionalDigest("computed", e.computed));
  FERRY_RETURN_IF_ERROR(rd.Get("detail", e.detail));
  if (j.contains("anomaly")) {  // absent in events recorded before it existed
    std::string anomaly;
    FERRY_RETURN_IF_ERROR(rd.Get("anomaly", anomaly));
    FERRY_ASSIGN_OR_RETURN(e.anomaly, ParseEnum(anomaly,
                                                {Event::Anomaly::kUnspecified, Event::Anomaly::kReceiverLost,
                                                 Event::Anomaly::kEngineMismatch},
                                                &AnomalyName, "event: field 'anomaly'"));
  }
  return e;
}

Status ValidateRunName(const std::string& run) {
  if (run.empty()) return Status::InvalidArgument("run name is empty");
  if (run.size() > 256) {
    return Status::InvalidArgument("run name '" + EscapeForMessage(run.substr(0, 32)) +
                                   "...' is longer than 256 bytes");
  }
  if (FirstInvalidUtf8(run) != std::string_view::npos) {
    return Status::InvalidArgument("run name '" + EscapeForMessage(run) + "' is not valid UTF-8");
  }
  for (char c : run) {
    if (IsControl(static_cast<unsigned char>(c))) {
      return Status::InvalidArgument("run name '" + EscapeForMessage(run) + "' contains a control character");
    }
  }
  return Status::OK();
}

}  // namespace ferry::store::internal

namespace ferry::store {

std::string_view AnomalyName(Event::Anomaly a) {
  switch (a) {
    case Event::Anomaly::kUnspecified: return "unspecified";
    case Event::Anomaly::kReceiverLost: return "receiver_lost";
    case Event::Anomaly::kEngineMismatch: return "engine_mismatch";
  }
  return "unknown";
}

}  // namespace ferry::store
