#include "sync/engine/vllm_follower.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <utility>

#include "convert/converter.h"
#include "core/text.h"

namespace ferry::engine {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// What the probe's shape depends on in config.json (text_config's for a multimodal config).
struct ProbeShape {
  int64_t vocab_size = 0;
  int64_t max_positions = 0;  // 0: not given
  int64_t hidden = 0, layers = 0;
};

Result<ProbeShape> ProbeShapeOf(const fs::path& model_dir) {
  const fs::path file = model_dir / "config.json";
  std::ifstream in(file);
  if (!in) return Status(StatusCode::kNotFound, file.string() + ": cannot be read");
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_object() && !j.contains("vocab_size") && j.contains("text_config")) j = j["text_config"];
  if (!j.is_object() || !j.contains("vocab_size") || !j["vocab_size"].is_number_integer()) {
    return Status(StatusCode::kCorruption, file.string() + ": no integer \"vocab_size\"");
  }
  ProbeShape shape;
  shape.vocab_size = j["vocab_size"].get<int64_t>();
  auto integer = [&](const char* key) -> int64_t {
    return j.contains(key) && j[key].is_number_integer() ? j[key].get<int64_t>() : 0;
  };
  shape.max_positions = integer("max_position_embeddings");
  shape.hidden = integer("hidden_size");
  shape.layers = integer("num_hidden_layers");
  return shape;
}

// At most this many adapters stay loaded: the proven one, the one before it (requests still
// naming it finish), and the one being proven.
constexpr size_t kKeepLoaded = 2;

}  // namespace

std::string_view EngineModeName(EngineMode m) { return m == EngineMode::kAdapter ? "adapter" : "merged"; }

VllmFollower::VllmFollower(VllmFollowerOptions options, std::unique_ptr<VllmClient> client,
                           std::unique_ptr<ReferenceProber> reference, Sequences probe)
    : options_(std::move(options)),
      client_(std::move(client)),
      reference_(std::move(reference)),
      probe_(std::move(probe)) {}

VllmFollower::~VllmFollower() = default;

Result<std::unique_ptr<VllmFollower>> VllmFollower::Create(VllmFollowerOptions options,
                                                           std::unique_ptr<ReferenceProber> reference) {
  if (options.work_dir.empty()) return Status(StatusCode::kInvalidArgument, "VllmFollowerOptions.work_dir is required");
  if (!reference) return Status(StatusCode::kInvalidArgument, "a vLLM follower needs a reference prober");
  if (!(options.tolerance > 0)) return Status(StatusCode::kInvalidArgument, "the probe tolerance must be positive");
  auto client = VllmClient::Create(options.client);
  if (!client.ok()) return client.status();
  std::error_code ec;
  fs::create_directories(options.work_dir, ec);
  if (ec) return Status(StatusCode::kIOError, "cannot create " + options.work_dir.string() + ": " + ec.message());
  std::vector<std::string> earlier;
  for (fs::directory_iterator it(options.work_dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("ferry-", 0) == 0 && it->is_directory()) earlier.push_back(name);
  }
  auto f = std::unique_ptr<VllmFollower>(
      new VllmFollower(std::move(options), std::move(*client), std::move(reference), Sequences{}));
  f->earlier_ = std::move(earlier);
  return f;
}

void VllmFollower::UnloadEarlier() {
  std::vector<std::string> left;
  for (const std::string& name : earlier_) {
    const Status s = client_->UnloadLoraAdapter(name);
    if (s.code() == StatusCode::kUnavailable) {  // the server is down: tried again next time
      left.push_back(name);
      continue;
    }
    std::error_code ec;  // unloaded, or the server no longer had it (a 404)
    fs::remove_all(options_.work_dir / name, ec);
  }
  earlier_ = std::move(left);
}

Result<LogProbs> VllmFollower::ReferenceFor(const EngineVersion& v) {
  for (const auto& c : references_) {
    if (c.id == v.id) return c.logprobs;
  }
  if (probe_.empty()) {
    auto shape = ProbeShapeOf(v.merged_dir);
    if (!shape.ok()) return shape.status();
    ProbeOptions probe = options_.probe;
    probe.length = std::min(probe.length, ProbeLengthFor(shape->hidden, shape->layers));
    // The prompt and the one token the engine generates after it must fit its positions.
    if (shape->max_positions > 2 && probe.length > shape->max_positions - 1) {
      probe.length = static_cast<int>(shape->max_positions - 1);
    }
    auto seqs = ProbeSequences(shape->vocab_size, probe);
    if (!seqs.ok()) return seqs.status();
    probe_ = std::move(*seqs);
  }
  auto lp = reference_->Compute(v.merged_dir, std::nullopt, probe_);
  if (!lp.ok()) return lp.status();
  references_.push_back({v.id, *lp});
  while (references_.size() > 3) references_.pop_front();
  return std::move(*lp);
}

Result<std::string> VllmFollower::LoadAdapter(const EngineVersion& v) {
  if (!v.adapter_dir || !v.base_dir) {
    return Status(StatusCode::kInvalidArgument,
                  "adapter mode: version " + v.id.Hex() + " has no adapter or base directory");
  }
  const std::string name = AdapterName(v.id.Hex(), instance_, ++loads_);
  // The clean adapter vLLM loads: generator-ready names, one global scaling (convert/lora_layout.h).
  ConvertOptions c;
  c.base = *v.base_dir;
  c.adapter = *v.adapter_dir;
  c.out = options_.work_dir / name;
  c.layout = Layout::kLora;
  c.force = true;
  c.threads = 1;
  auto converted = Convert(c);
  if (!converted.ok()) return converted.status();
  if (Status s = client_->LoadLoraAdapter(name, fs::absolute(c.out).string()); !s.ok()) {
    std::error_code ec;
    fs::remove_all(c.out, ec);
    return s;
  }
  loaded_.push_back(name);
  return name;
}

Status VllmFollower::LoadMerged(const EngineVersion& v) {
  if (Status s = client_->Pause(); !s.ok()) return s;
  Status s = client_->ReloadWeights(fs::absolute(v.load_dir.value_or(v.merged_dir)).string());
  if (s.ok()) s = client_->ResetPrefixCache();
  if (s.ok()) s = client_->UpdateWeightVersion(v.id.Hex());
  Status resumed = client_->Resume();
  return s.ok() ? resumed : s;
}

void VllmFollower::UnloadOld() {
  const std::string keep = proven_ ? proven_->served_name : std::string();
  while (loaded_.size() > kKeepLoaded) {
    auto it = std::find_if(loaded_.begin(), loaded_.end(), [&](const std::string& n) { return n != keep; });
    if (it == loaded_.end()) break;
    // A failure leaves the adapter loaded (the server's LoRA slots are an LRU): not an error.
    (void)client_->UnloadLoraAdapter(*it);
    std::error_code ec;
    fs::remove_all(options_.work_dir / *it, ec);
    loaded_.erase(it);
  }
}

Result<Adoption> VllmFollower::Adopt(const EngineVersion& v) {
  const auto start = Clock::now();
  if (!earlier_.empty()) UnloadEarlier();
  Adoption a;
  a.version = v.id;
  auto reference = ReferenceFor(v);
  if (!reference.ok()) return reference.status();
  a.reference_seconds = SecondsSince(start);
  std::optional<LogProbs> previous;
  if (proven_ && !(proven_->version == v.id)) previous = proven_reference_;
  const auto load_start = Clock::now();
  if (options_.mode == EngineMode::kAdapter && !v.adapter_dir) {
    a.served_name = options_.base_name;  // the base itself (served before the first adapter)
  } else if (options_.mode == EngineMode::kAdapter) {
    auto name = LoadAdapter(v);
    if (!name.ok()) return name.status();
    a.served_name = *name;
  } else {
    if (Status s = LoadMerged(v); !s.ok()) return s;
    a.served_name = options_.base_name;
  }
  a.load_seconds = SecondsSince(load_start);
  auto answer = client_->PromptLogProbs(a.served_name, probe_);
  Result<ProofFigures> judged = answer.ok()
                                    ? Judge(*answer, *reference, previous ? &*previous : nullptr, options_.tolerance)
                                    : Result<ProofFigures>(answer.status());
  if (judged.ok() && judged->proven) {
    a.proof = *judged;
    a.seconds = SecondsSince(start);
    proven_ = a;
    proven_version_ = v;
    proven_reference_ = std::move(*reference);
    if (options_.mode == EngineMode::kAdapter) UnloadOld();
    return a;
  }
  // Not proven (refused, or the probe failed): the server goes back to the last proven version.
  GoBack(a.served_name);
  if (!judged.ok()) return judged.status();
  a.proof = *judged;
  a.seconds = SecondsSince(start);
  return a;
}

void VllmFollower::GoBack(const std::string& served_name) {
  if (options_.mode == EngineMode::kAdapter) {
    if (served_name == options_.base_name) return;
    // A failed unload leaves it to the server's LRU; it is no longer among those kept loaded,
    // so that UnloadOld never takes the proven one's predecessor for it.
    (void)client_->UnloadLoraAdapter(served_name);
    std::error_code ec;
    fs::remove_all(options_.work_dir / served_name, ec);
    loaded_.erase(std::remove(loaded_.begin(), loaded_.end(), served_name), loaded_.end());
    return;
  }
  if (!proven_version_) return;
  // Merged weights: the proven ones loaded again. If that fails the server holds weights that
  // were never proven: nothing is taken as served until a version is proven again.
  if (!LoadMerged(*proven_version_).ok()) ForgetServerState();
}

void VllmFollower::ForgetServerState() {
  for (const auto& n : loaded_) {
    std::error_code ec;
    fs::remove_all(options_.work_dir / n, ec);
  }
  loaded_.clear();
  proven_.reset();
  proven_version_.reset();
  proven_reference_.reset();
}

Result<bool> VllmFollower::StillServesProven() {
  if (!proven_ || !proven_version_ || !proven_reference_) return false;
  const LogProbs& reference = *proven_reference_;
  auto answer = client_->PromptLogProbs(proven_->served_name, probe_);
  if (!answer.ok()) {
    if (answer.status().code() == StatusCode::kNotFound) return false;  // the adapter is gone
    return answer.status();
  }
  auto d = MaxAbsDiff(*answer, reference);
  if (!d.ok()) return d.status();
  return *d <= options_.tolerance;
}

}  // namespace ferry::engine
