// ferryd's rollouts from a running vLLM server (TRL's server mode: use_vllm = true,
// vllm_mode = "server"), with every version proven on the server before it samples a step.
//
//   trainer:  optimizer.step() -> WeightPublisher::Publish (the merged snapshot, recorded in
//             the store as with the co-located generator)
//             -> VllmGenerator::Adopt(adapter, snapshot id):
//                  the adapter written in PEFT's format, then as the converter's lora layout
//                  (generator-ready names, one global scaling) into DIR/vllm/<name>;
//                  POST /v1/load_lora_adapter under <name> = "ferry-<12 hex>-<n>" (never a name
//                  reloaded in place: vllm#42125);
//                  the probe (sync/engine/probe.h): the trainer's own model with this adapter
//                  gives the reference prompt log-probabilities, the server is asked for them
//                  under <name>; proven when within the tolerance and nearer to this version
//                  than to the one before;
//                  an `engine` store event (or an `engine_mismatch` anomaly, the name unloaded,
//                  a retry under a new name until vllm_server_timeout runs out: then the step
//                  fails naming the server).
//   rollout:  VllmGenerator::Generate: one /v1/completions request of the step's prompt token
//             ids (ferryd's tokenizer: both sides see the same ids), n = num_generations, the
//             run's temperature, top_p, top_k and the step's seed, per-token log-probabilities
//             and token ids back, under the proven name only.
// A server that does not answer, answers malformed JSON or errs: the call waits and retries
// within vllm_server_timeout, then fails naming the server and the request; the step applies
// nothing (resume works as after any failure).
#pragma once

#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "daemon/runtime/generator.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "store/store.h"
#include "sync/engine/probe.h"
#include "sync/engine/vllm_client.h"

namespace ferry::grpo {

struct VllmGeneratorOptions {
  std::string url;                   // the server. REQUIRED
  double timeout_seconds = 240;      // vllm_server_timeout
  std::filesystem::path work_dir;    // DIR/vllm: the adapters the server loads. REQUIRED
  std::filesystem::path base_dir;    // the base model directory (the lora layout's base). REQUIRED
  std::string receiver_id = "vllm";  // names the server in store events
  double tolerance = 1e-4;           // the probe's (F32; sync/engine/probe.h)
  engine::ProbeOptions probe;
  // LibTorch threads for the probe's reference on a CPU model. It is computed while the server
  // answers the probe; a server on this machine computes at the same time, and OpenMP threads
  // that outnumber the free cores stall at every barrier (on 2 cores, 2 threads beside the
  // server's took the 0.5B reference from 0.47 s on one thread to 1.07 s). 0: the process's
  // setting. The trainer gives half its threads when the server's address is a loopback one.
  int reference_threads = 0;
};

// VllmGeneratorOptions::tolerance: the looser of the trainer's dtype's and the server's
// (`server_dtype`, as engine::ToleranceForDtype spells it; "" = the trainer's). A BF16 server
// never matches an F32 trainer to F32's 1e-4. kInvalidArgument for another dtype.
[[nodiscard]] Result<double> ProbeToleranceFor(at::ScalarType trainer, const std::string& server_dtype);

// VllmGeneratorOptions::reference_threads for a server at `url`: half of `threads` (at least
// one) when its host is this machine's loopback (localhost, 127.0.0.0/8, [::1]), so the server
// and the reference each have half the cores; 0 (all) otherwise.
int ReferenceThreadsFor(const std::string& url, int threads);

// The processes under `proc` (/proc) that are the model workers of a vLLM started with its
// default multiprocess executor (vLLM titles them "VLLM::Worker..."; the prefix is
// VLLM_PROCESS_NAME_PREFIX's, possibly empty): their pids, ascending. Any server's, not only the
// one a run uses: a warning's evidence, not a proof. On a CPU server such a worker spins on a
// core for a second after every message from its engine (docs/vllm.md), which a trainer on the
// same machine loses. scripts/vllm.sh runs a CPU server's model in its engine process instead.
std::vector<int64_t> VllmWorkerProcesses(const std::filesystem::path& proc = "/proc");

class VllmGenerator {
 public:
  // Checks the server answers (/v1/models) within the timeout and takes its base model's name
  // (the first it lists). kUnavailable naming the URL when it does not.
  [[nodiscard]] static Result<std::unique_ptr<VllmGenerator>> Create(VllmGeneratorOptions options,
                                                                     const runtime::CausalLM* model,
                                                                     store::Store* store);
  ~VllmGenerator();

  // Makes the server serve `adapter` as it is now and proves it (see the top of this file);
  // `version` is the merged snapshot's id the store records for it. `before_probe`, when set,
  // is called once the adapter is loaded and before the probe request: the probe must run
  // alone on the server (vLLM 0.32's CPU LoRA path crashes its engine when a prompt_logprobs
  // request shares a batch), so a caller with a generation in flight waits for it there.
  [[nodiscard]] Status Adopt(const runtime::LoraAdapter& adapter, const store::Digest& version,
                             const std::function<void()>& before_probe = {});

  // Samples n completions of each prompt under the proven version. kFailedPrecondition before
  // the first Adopt.
  [[nodiscard]] Result<std::vector<runtime::Completion>> Generate(const std::vector<std::vector<int32_t>>& prompts,
                                                                  int n, const runtime::SamplingParams& params);
  // The same under the served name `name` (a version proven earlier and still loaded), from
  // another thread than Adopt's (max_staleness 1): its own connection. One caller at a time.
  [[nodiscard]] Result<std::vector<runtime::Completion>> GenerateUnder(const std::string& name,
                                                                       const std::vector<std::vector<int32_t>>& prompts,
                                                                       int n, const runtime::SamplingParams& params);

  const std::string& served_name() const { return served_name_; }
  const std::optional<store::Digest>& proven() const { return proven_; }
  // The newest proof's figures and when it was recorded (ns since the epoch; 0: none yet).
  const engine::ProofFigures& last_proof() const { return last_proof_; }
  int64_t proven_at_ns() const { return proven_at_ns_; }
  const std::string& url() const { return options_.url; }

 private:
  VllmGenerator(VllmGeneratorOptions options, std::unique_ptr<engine::VllmClient> client,
                const runtime::CausalLM* model, store::Store* store);
  // The server lost the proven version's adapter (it restarted): loads it again from
  // DIR/vllm/<served name> under a new name and proves it against its kept reference.
  Status Readopt();
  Status Record(const store::Digest& version, const std::string& name, const engine::ProofFigures& proof,
                double seconds);

  VllmGeneratorOptions options_;
  std::unique_ptr<engine::VllmClient> client_;      // adoption (the trainer's thread)
  std::unique_ptr<engine::VllmClient> gen_client_;  // completions
  const runtime::CausalLM* model_;
  store::Store* store_;
  engine::Sequences probe_;
  std::optional<engine::LogProbs> previous_;  // the proven version's reference
  std::optional<store::Digest> proven_;
  std::string served_name_;
  engine::ProofFigures last_proof_;
  int64_t proven_at_ns_ = 0;
  std::deque<std::string> loaded_;  // oldest first
  uint64_t loads_ = 0;
  uint32_t instance_ = engine::NewInstanceTag();
};

}  // namespace ferry::grpo
