#include "cli/sync_engine.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "cli/output.h"
#include "core/text.h"
#include "store/store.h"

namespace ferry::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr int kMaxBackoffMs = 30000;
constexpr auto kCheckEvery = std::chrono::seconds(5);
// The longest the periodic check may hold the receiver's loop: a server that accepts but never
// answers is warned about, instead of stalling the receiver for --engine-timeout-ms each time.
constexpr auto kCheckTimeout = std::chrono::seconds(10);

std::string Figure(double v) { return FormatNumber(v, 3); }

}  // namespace

void AddEngineFlags(CLI::App* receive, EngineFlags& f) {
  receive->add_option("--engine", f.engine,
                      "Make an inference engine beside this receiver adopt and prove every version: vllm");
  receive->add_option("--engine-url", f.url, "The engine's base URL, e.g. http://127.0.0.1:8000 (with --engine)");
  receive->add_option("--engine-mode", f.mode,
                      "auto (adapter when the publisher serves adapters, else merged), adapter (POST "
                      "/v1/load_lora_adapter) or merged (dev mode: /collective_rpc reload_weights) (default: auto)");
  receive->add_option("--engine-model", f.base_name, "The server's --served-model-name (default: base)");
  receive->add_option("--engine-dtype", f.dtype,
                      "The server's --dtype, which sets the probe's tolerance: float32, bfloat16 or float16 "
                      "(default: float32)");
  receive->add_option("--engine-tolerance", f.tolerance,
                      "Largest difference of a prompt log-probability accepted as a match (default: the dtype's)");
  receive->add_option("--engine-timeout-ms", f.timeout_ms,
                      "Longest wait for one request to the engine (default: 240000)");
}

EngineDriver::EngineDriver(const EngineFlags& f, fs::path dir, std::string id, bool json)
    : flags_(f), dir_(std::move(dir)), id_(std::move(id)), json_(json) {}

EngineDriver::~EngineDriver() = default;

std::unique_ptr<EngineDriver> EngineDriver::CreateOrFail(const EngineFlags& f, const fs::path& receiver_dir,
                                                         const std::string& receiver_id, bool json) {
  if (f.engine.empty()) {
    if (!f.url.empty()) Fail("--engine-url needs --engine vllm");
    return nullptr;
  }
  if (f.engine != "vllm") Fail("--engine '" + f.engine + "' is not one of: vllm");
  if (f.url.empty()) Fail("--engine vllm needs --engine-url URL (the vLLM server, e.g. http://127.0.0.1:8000)");
  if (f.mode != "auto" && f.mode != "adapter" && f.mode != "merged") {
    Fail("--engine-mode '" + f.mode + "' is not one of: auto, adapter, merged");
  }
  if (f.tolerance < 0) Fail("--engine-tolerance must not be negative");
  auto tolerance = engine::ToleranceForDtype(f.dtype);
  if (!tolerance.ok()) Fail(tolerance.status().WithContext("--engine-dtype"));
  auto probe = engine::VllmClient::Create({f.url, f.timeout_ms});  // checks the URL now, not at the first version
  if (!probe.ok()) Fail(probe.status().WithContext("--engine-url"));
  return std::unique_ptr<EngineDriver>(new EngineDriver(f, receiver_dir, receiver_id, json));
}

void EngineDriver::OnSynced(const sync::SyncResult& r, sync::Receiver& receiver) {
  const bool adapter = r.adapter_base_dir.has_value();
  if (!follower_) {
    engine::VllmFollowerOptions o;
    o.client = {flags_.url, flags_.timeout_ms};
    const bool served_adapters = receiver.served_mode() == sync::PublishMode::kAdapter;
    // Adapter mode needs adapters: every merged version would be "served" as the base, never
    // proven, an anomaly every 30 s for good.
    if (flags_.mode == "adapter" && !served_adapters) {
      const std::string mode =
          receiver.served_mode() ? std::string(sync::PublishModeName(*receiver.served_mode())) : "unknown";
      Fail("--engine-mode adapter: the publisher serves merged versions (mode " + mode +
           "), which vLLM can only take as weights: use --engine-mode merged (or auto) with a server in dev mode");
    }
    o.mode = flags_.mode == "merged" || (flags_.mode == "auto" && !served_adapters) ? engine::EngineMode::kMerged
                                                                                    : engine::EngineMode::kAdapter;
    o.base_name = flags_.base_name;
    o.work_dir = dir_ / "engine";
    o.tolerance = flags_.tolerance > 0 ? flags_.tolerance : *engine::ToleranceForDtype(flags_.dtype);
    engine::ReferenceOptions ro;
    ro.ferryd = FerrydPathOrFail();
    auto reference = engine::ReferenceProber::Start(ro);
    if (!reference.ok()) Fail(reference.status());
    auto follower = engine::VllmFollower::Create(o, std::move(*reference));
    if (!follower.ok()) Fail(follower.status());
    follower_ = std::move(*follower);
  }
  engine::EngineVersion v;
  v.id = r.active;
  v.merged_dir = dir_ / "versions" / r.active.Hex();
  if (adapter) {
    v.adapter_dir = dir_ / "versions" / r.version.Hex();
    v.base_dir = r.adapter_base_dir;
  }
  if (follower_->proven() && follower_->proven()->version == v.id) return;  // already served and proven
  pending_ = v;
  backoff_ms_ = 1000;
  next_try_ = Clock::now();
  TryAdopt(receiver);
}

void EngineDriver::Poll(sync::Receiver& receiver) {
  const auto now = Clock::now();
  if (pending_ && now >= next_try_) TryAdopt(receiver);
  if (pending_ || !follower_ || !follower_->proven() || now < next_check_) return;
  next_check_ = now + kCheckEvery;
  follower_->client().SetDeadline(now + kCheckTimeout);
  auto still = follower_->StillServesProven();
  follower_->client().SetDeadline(std::nullopt);
  if (still.ok() && *still) return;
  if (!still.ok()) {
    if (!warned_unavailable_) std::fprintf(stderr, "ferry: warning: %s\n", still.status().message().c_str());
    warned_unavailable_ = true;
    return;
  }
  // A restarted server (or one someone else reloaded): bring it back to the newest version.
  std::fprintf(stderr, "ferry: vLLM %s no longer answers as %s (%s): adopting it again\n", flags_.url.c_str(),
               store::ShortId(follower_->proven()->version).c_str(), follower_->proven()->served_name.c_str());
  pending_ = follower_->proven_version();
  follower_->ForgetServerState();
  backoff_ms_ = 1000;
  next_try_ = now;
  TryAdopt(receiver);
}

void EngineDriver::TryAdopt(sync::Receiver& receiver) {
  auto a = follower_->Adopt(*pending_);
  if (!a.ok()) {
    // The server down or restarting, or the reference unavailable: try again later.
    if (a.status().code() != StatusCode::kUnavailable || !warned_unavailable_) {
      std::fprintf(stderr, "ferry: warning: adopting %s on vLLM %s: %s (retrying in %d s)\n",
                   store::ShortId(pending_->id).c_str(), flags_.url.c_str(), a.status().message().c_str(),
                   backoff_ms_ / 1000);
    }
    warned_unavailable_ = a.status().code() == StatusCode::kUnavailable;
    next_try_ = Clock::now() + std::chrono::milliseconds(backoff_ms_);
    backoff_ms_ = std::min(backoff_ms_ * 2, kMaxBackoffMs);
    return;
  }
  warned_unavailable_ = false;
  Report(receiver, *a);
  if (a->proof.proven) {
    pending_.reset();
    return;
  }
  next_try_ = Clock::now() + std::chrono::milliseconds(backoff_ms_);
  backoff_ms_ = std::min(backoff_ms_ * 2, kMaxBackoffMs);
}

void EngineDriver::Report(sync::Receiver& receiver, const engine::Adoption& a) {
  const auto& p = a.proof;
  json j = {{"receiver", id_},        {"engine", "vllm"},
            {"url", flags_.url},      {"model", a.served_name},
            {"proven", p.proven},     {"tolerance", p.tolerance},
            {"max_diff", p.max_diff}, {"previous_diff", p.previous_diff ? json(*p.previous_diff) : json(nullptr)},
            {"tokens", p.tokens},     {"seconds", a.seconds}};
  if (!p.proven) j["why"] = p.why;
  // The publisher records it; one that cannot be told (gone, or older than ENGINE) is warned
  // about and the proof still stands here.
  if (Status s = receiver.ReportEngine(a.version, j.dump()); !s.ok()) {
    std::fprintf(stderr, "ferry: warning: the publisher did not record the engine's answer: %s\n", s.message().c_str());
  }
  if (json_) {
    json out = j;
    out["version"] = a.version.Hex();
    out["event"] = "engine";
    std::printf("%s\n", JsonText(out).c_str());
  } else if (p.proven) {
    std::printf("vLLM %s serves %s as %s, proven (largest difference %s, tolerance %s, %d tokens, %.3f s)\n",
                flags_.url.c_str(), a.version.Hex().c_str(), a.served_name.c_str(), Figure(p.max_diff).c_str(),
                Figure(p.tolerance).c_str(), p.tokens, a.seconds);
  } else {
    std::fprintf(stderr, "ferry: anomaly: vLLM %s did not answer as %s under %s: %s; it keeps serving %s\n",
                 flags_.url.c_str(), a.version.Hex().c_str(), a.served_name.c_str(), p.why.c_str(),
                 follower_->proven() ? store::ShortId(follower_->proven()->version).c_str() : "what it served before");
  }
  std::fflush(stdout);
}

}  // namespace ferry::cli
