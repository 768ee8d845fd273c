// `ferry sync receive --engine vllm --engine-url URL`: a receiver that makes a vLLM server
// beside it adopt every version it activates and proves it from the server's own answers
// (sync/engine/vllm_follower.h), reporting each proof (or mismatch) to the publisher, which
// records it in its store (an `engine` event, or an `engine_mismatch` anomaly).
#pragma once

#include <CLI/CLI.hpp>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "sync/engine/vllm_follower.h"
#include "sync/receiver.h"

namespace ferry::cli {

struct EngineFlags {
  std::string engine;         // "" (none) or "vllm"
  std::string url;            // the server's base URL
  std::string mode = "auto";  // auto (as the publisher serves), adapter or merged
  std::string base_name = "base";
  std::string dtype = "float32";
  double tolerance = 0;  // 0: the dtype's
  int timeout_ms = 240000;
};

void AddEngineFlags(CLI::App* receive, EngineFlags& f);

// Drives one engine for a receiver. Adoption failures are retried with backoff (1 s doubling
// to 30 s) while the receiver follows; a newer version replaces a pending one. A server that
// stops answering as the proven version (restarted) is brought back to the newest version.
class EngineDriver {
 public:
  // Fails (exits) on bad flags; nullptr when --engine is not given.
  static std::unique_ptr<EngineDriver> CreateOrFail(const EngineFlags& f, const std::filesystem::path& receiver_dir,
                                                    const std::string& receiver_id, bool json);
  ~EngineDriver();

  // After a sync: the version now active is the one to adopt.
  void OnSynced(const sync::SyncResult& r, sync::Receiver& receiver);
  // From the follow loop (about twice a second): retries a pending adoption when due, and
  // every few seconds checks the proven version is still what the server answers as.
  void Poll(sync::Receiver& receiver);
  // Whether the newest activated version is proven on the server.
  bool caught_up() const { return !pending_; }

 private:
  EngineDriver(const EngineFlags& f, std::filesystem::path dir, std::string id, bool json);
  void TryAdopt(sync::Receiver& receiver);
  void Report(sync::Receiver& receiver, const engine::Adoption& a);

  EngineFlags flags_;
  std::filesystem::path dir_;
  std::string id_;
  bool json_;
  std::unique_ptr<engine::VllmFollower> follower_;
  std::optional<engine::EngineVersion> pending_;
  std::chrono::steady_clock::time_point next_try_{};
  std::chrono::steady_clock::time_point next_check_{};
  int backoff_ms_ = 1000;
  bool warned_unavailable_ = false;
};

}  // namespace ferry::cli
