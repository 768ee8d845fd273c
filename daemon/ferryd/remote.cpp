#include "daemon/ferryd/remote.h"

namespace ferry::ferryd {
namespace {

nlohmann::json Seconds(int64_t ns) {
  if (ns <= 0) return nullptr;
  return static_cast<double>(ns) / 1e9;
}

}  // namespace

Result<std::optional<sync::CurveOptions>> ServerCurve(const std::string& what, const std::filesystem::path& key,
                                                      const std::filesystem::path& allow) {
  if (key.empty()) return std::optional<sync::CurveOptions>();
  if (allow.empty()) {
    return Status::InvalidArgument(what + ".key needs " + what +
                                   ".allow (without an allow-list any client key would be accepted)");
  }
  FERRY_ASSIGN_OR_RETURN(sync::CurveOptions c, sync::LoadServerCurve(key, allow, {what + ".key", what + ".allow"}));
  return std::optional<sync::CurveOptions>(std::move(c));
}

Result<std::unique_ptr<RemotePublisher>> RemotePublisher::Start(store::Store* store, RemotePublisherOptions options) {
  const std::string where = "publish endpoint " + options.endpoint;
  auto endpoints = sync::ParseSyncEndpoint(options.endpoint);
  if (!endpoints.ok()) return endpoints.status().WithContext("publish");
  FERRY_RETURN_IF_ERROR(sync::CheckEndpoints(*endpoints, options.curve.has_value()).WithContext("publish"));
  sync::PublisherOptions po;
  po.endpoints = *endpoints;
  po.curve = options.curve;
  po.mode = options.mode;
  po.follow_run = options.run;
  po.follow_interval_ms = options.follow_interval_ms;
  po.on_rejected_key = options.on_rejected_key;
  // The base first, once (the follower then skips it): a receiver started before step 1
  // holds it, and every adapter applies to it. A resumed run in merged or delta mode starts
  // with the version it resumed from (derived: its snapshot offered first), never the base.
  po.publish_first = options.base_version;
  if (options.mode != sync::PublishMode::kAdapter && options.resumed &&
      store->GetVersion(options.resumed->manifest_id().Hex()).ok()) {
    po.publish_first = options.resumed->manifest_id();
    po.offer_first = options.resumed;
  }
  auto publisher = sync::Publisher::Start(store, std::move(po));
  if (!publisher.ok()) return publisher.status().WithContext(where);
  return std::unique_ptr<RemotePublisher>(
      new RemotePublisher(store, std::move(*publisher), options.base_version, options.mode));
}

void RemotePublisher::Offer(const store::Digest& version, std::shared_ptr<const sync::Snapshot> snapshot) {
  if (mode_ == sync::PublishMode::kAdapter) return;
  publisher_->Offer(version, std::move(snapshot));
}

nlohmann::json RemotePublisher::Generators(int64_t current_step) const {
  nlohmann::json out = nlohmann::json::array();
  for (const sync::ReceiverInfo& r : publisher_->Receivers()) {
    nlohmann::json j;
    j["id"] = r.id;
    j["version"] = nullptr;
    j["step"] = nullptr;
    j["lag"] = nullptr;
    if (r.acknowledged) {
      j["version"] = r.acknowledged->Hex();
      std::optional<int64_t> step;
      if (*r.acknowledged == base_) {
        step = 0;
      } else if (auto rec = store_->GetVersion(r.acknowledged->Hex()); rec.ok()) {
        step = rec->step;
      }
      if (step) {
        j["step"] = *step;
        j["lag"] = current_step - *step;
      }
    }
    j["last_ack_at"] = Seconds(r.acknowledged_ns);
    j["last_seen_at"] = Seconds(r.last_seen_ns);
    j["alive"] = r.alive;
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace ferry::ferryd
