// Makes a running vLLM server adopt each version a receiver activated, and proves from the
// server's own answers (sync/engine/probe.h) that it runs it.
//
//   adapter mode (the server runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1):
//     the received adapter is written as the converter's lora layout (a clean PEFT adapter with
//     generator-ready names) into WORK/<name>/ and loaded with /v1/load_lora_adapter under
//     <name> = "ferry-<12 hex of the version>-<n>": a name is never reloaded in place (stale
//     prefix-cache blocks, vllm#42125), and a version adopted again after a failed proof or
//     a restarted server gets a new n. A version is unloaded once it is two versions old.
//   merged mode (the server runs with VLLM_SERVER_DEV_MODE=1): /pause, /collective_rpc
//     reload_weights from the merged directory, /reset_prefix_cache, /update_weight_version,
//     /resume; the version is served under the base's name.
// A version that fails its proof is unloaded (adapter mode) or the last proven one reloaded
// (merged mode): the server keeps serving the last proven version.
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "core/status.h"
#include "store/store.h"
#include "sync/engine/probe.h"
#include "sync/engine/reference.h"
#include "sync/engine/vllm_client.h"

namespace ferry::engine {

enum class EngineMode { kAdapter, kMerged };
std::string_view EngineModeName(EngineMode m);

struct VllmFollowerOptions {
  VllmClientOptions client;  // the server's URL and the request timeout
  EngineMode mode = EngineMode::kAdapter;
  std::string base_name = "base";  // the server's --served-model-name
  std::filesystem::path work_dir;  // where adapters for the server are written. REQUIRED
  double tolerance = 1e-4;         // Default: F32's (ToleranceForDtype)
  ProbeOptions probe;
};

// One version to adopt.
struct EngineVersion {
  store::Digest id;                  // the version (the merged id in adapter mode)
  std::filesystem::path merged_dir;  // its merged weights, hf layout: the reference's model
  // Adapter mode: the PEFT adapter as received (none: the version is the base the server
  // was started with, served under its base name)
  std::optional<std::filesystem::path> adapter_dir;
  std::optional<std::filesystem::path> base_dir;  // adapter mode: the base it applies to
  // Merged mode: the directory the server reloads, when not merged_dir (a 4-bit version's
  // dequantised weights). Default: merged_dir
  std::optional<std::filesystem::path> load_dir;
};

// What a proven (or refused) adoption found.
struct Adoption {
  store::Digest version;
  std::string served_name;  // the model name the server answers for it under
  ProofFigures proof;
  double seconds = 0;  // from Adopt's call to its answer
  double reference_seconds = 0;
  double load_seconds = 0;
};

class VllmFollower {
 public:
  [[nodiscard]] static Result<std::unique_ptr<VllmFollower>> Create(VllmFollowerOptions options,
                                                                    std::unique_ptr<ReferenceProber> reference);
  ~VllmFollower();

  // Loads `v` into the server and proves it. OK with proof.proven true: the server serves v
  // under served_name. OK with proof.proven false: it answered for something else (the
  // version was unloaded again; the last proven one is still served). An error: the server
  // or the reference could not be asked (kUnavailable when the server does not answer: retry
  // later), nothing changed that the next call does not redo.
  [[nodiscard]] Result<Adoption> Adopt(const EngineVersion& v);

  // The last proven version and its served name (none before the first proof).
  const std::optional<Adoption>& proven() const { return proven_; }
  VllmClient& client() { return *client_; }

  // Forgets what the server held (it restarted: /v1/models lacks the names it should list),
  // so the next Adopt loads again from nothing.
  void ForgetServerState();
  // Asks the server again for the probe under the proven version's name: false when it no
  // longer answers as that version (a restarted server lost the adapter, or reloaded its
  // base weights); kUnavailable when it does not answer.
  [[nodiscard]] Result<bool> StillServesProven();
  // The version the proven one was (for re-adopting it after a restart).
  const std::optional<EngineVersion>& proven_version() const { return proven_version_; }

 private:
  VllmFollower(VllmFollowerOptions options, std::unique_ptr<VllmClient> client,
               std::unique_ptr<ReferenceProber> reference, Sequences probe);
  Result<LogProbs> ReferenceFor(const EngineVersion& v);
  Result<std::string> LoadAdapter(const EngineVersion& v);
  Status LoadMerged(const EngineVersion& v);
  // After a version was loaded but not proven (refused, or its probe failed): its adapter
  // unloaded, or in merged mode the proven weights loaded again.
  void GoBack(const std::string& served_name);
  void UnloadEarlier();
  void UnloadOld();

  VllmFollowerOptions options_;
  std::unique_ptr<VllmClient> client_;
  std::unique_ptr<ReferenceProber> reference_;
  Sequences probe_;
  // The references of the last versions asked for (the previous one judges the next).
  struct Cached {
    store::Digest id;
    LogProbs logprobs;
  };
  std::deque<Cached> references_;
  std::optional<Adoption> proven_;
  std::optional<EngineVersion> proven_version_;
  // The proven version's reference, kept apart from the cache: the versions that arrive while a
  // server is down would evict it, and its directory may be pruned by then.
  std::optional<LogProbs> proven_reference_;
  std::deque<std::string> loaded_;  // adapter names loaded, oldest first
  // Adapters an earlier process of this receiver loaded (their directories were left in
  // work_dir): unloaded once the server answers, before the first adoption.
  std::vector<std::string> earlier_;
  uint64_t loads_ = 0;
  uint32_t instance_ = NewInstanceTag();
};

}  // namespace ferry::engine
