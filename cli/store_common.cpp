#include "cli/store_common.h"

#include <cmath>
#include <cstdio>
#include <ctime>

#include "cli/output.h"

namespace ferry::cli {

using Json = nlohmann::ordered_json;

std::unique_ptr<store::Store> OpenStoreOrFail(const std::string& db, bool writable, bool create) {
  store::StoreOptions o;
  o.read_only = !writable;
  o.create_if_missing = create;
  const std::filesystem::path dir(db);
  auto s = store::Store::Open(dir, o);
  if (!s.ok()) {
    const std::string m = s.status().message();
    Fail(m.find(db) != std::string::npos ? m : "store " + db + ": " + m);
  }
  return std::move(*s);
}

store::VersionRecord GetVersionOrFail(store::Store& s, const std::string& id_or_prefix, const std::string& flag) {
  auto v = s.GetVersion(id_or_prefix);
  if (!v.ok()) Fail(flag.empty() ? v.status().message() : flag + ": " + v.status().message());
  return std::move(*v);
}

std::string FormatTime(int64_t time_ns) {
  const std::time_t secs = static_cast<std::time_t>(time_ns / 1'000'000'000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string FormatTimeMillis(int64_t time_ns) {
  const std::time_t secs = static_cast<std::time_t>(time_ns / 1'000'000'000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>((time_ns / 1'000'000) % 1000));
  return buf;
}

std::map<std::string, double> ParseMetricsOrFail(const std::vector<std::string>& args) {
  std::map<std::string, double> out;
  for (const auto& a : args) {
    const size_t eq = a.find('=');
    if (eq == std::string::npos || eq == 0) Fail("--metric '" + a + "' is not key=value");
    const std::string value = a.substr(eq + 1);
    char* end = nullptr;
    const double v = std::strtod(value.c_str(), &end);
    if (value.empty() || end != value.c_str() + value.size()) {
      Fail("--metric '" + a + "': '" + value + "' is not a number");
    }
    out[a.substr(0, eq)] = v;
  }
  return out;
}

namespace {
Json OptDigest(const std::optional<store::Digest>& d) { return d ? Json(d->Hex()) : Json(); }
Json Number(double v) { return std::isfinite(v) ? Json(v) : Json(std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf")); }
}  // namespace

Json VersionJson(const store::VersionRecord& v, bool with_tensors) {
  Json j;
  j["id"] = v.id.Hex();
  j["run"] = v.run;
  j["sequence"] = v.sequence;
  j["parent"] = OptDigest(v.parent);
  j["kind"] = std::string(store::KindName(v.kind));
  j["layout"] = std::string(LayoutName(v.layout));
  j["source"] = std::string(store::SourceName(v.source));
  j["time_ns"] = v.time_ns;
  j["time"] = FormatTime(v.time_ns);
  j["step"] = v.step ? Json(*v.step) : Json();
  j["base_version"] = OptDigest(v.base_version);
  j["adapter_version"] = OptDigest(v.adapter_version);
  Json metrics = Json::object();
  for (const auto& [k, value] : v.metrics) metrics[k] = Number(value);
  j["metrics"] = std::move(metrics);
  j["tensor_count"] = v.tensors.size();
  j["total_bytes"] = v.total_bytes;
  j["derived"] = v.derived;
  if (!with_tensors) return j;
  if (!v.adapter_config.empty()) j["adapter_config"] = v.adapter_config;
  Json tensors = Json::array();
  for (const auto& t : v.tensors) {
    tensors.push_back({{"name", t.name},
                       {"dtype", std::string(DTypeName(t.dtype))},
                       {"shape", t.shape},
                       {"digest", t.digest.Hex()},
                       {"nbytes", t.nbytes},
                       {"l2_norm", Number(t.l2_norm)},
                       {"nonfinite", t.nonfinite},
                       {"all_zero", t.all_zero}});
  }
  j["tensors"] = std::move(tensors);
  Json aux = Json::array();
  for (const auto& a : v.aux) aux.push_back({{"name", a.name}, {"digest", a.digest.Hex()}, {"size", a.size}});
  j["aux"] = std::move(aux);
  return j;
}

Json EventJson(const store::Event& e) {
  return {{"type", std::string(store::EventTypeName(e.type))},
          {"time_ns", e.time_ns},
          {"time", FormatTime(e.time_ns)},
          {"receiver", e.receiver},
          {"version", e.version.Hex()},
          {"computed", OptDigest(e.computed)},
          {"detail", e.detail}};
}

}  // namespace ferry::cli
