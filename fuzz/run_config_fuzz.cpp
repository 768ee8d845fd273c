// libFuzzer entry point for daemon/run's parsers: the TOML run config (config.h) and the
// JSONL dataset (dataset.h). The first byte chooses the parser (even: config, odd: dataset;
// for datasets its bits 1 and 2 also set DatasetOptions), the rest is the file. Any bytes
// must give a value or an error, never a crash, hang or unbounded allocation; what is
// accepted must keep the promises of the headers (checked below, trapping otherwise).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "daemon/run/config.h"
#include "daemon/run/dataset.h"
#include "daemon/run/rewards.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

void FuzzConfig(std::string_view text) {
  auto c = ferry::run::ParseRunConfig(text, "/fuzz/run.toml");
  if (!c.ok()) return;
  Check(c->num_generations >= 2);
  Check(c->generation_batch_size > 0 && c->generation_batch_size % c->num_generations == 0);
  Check(c->generation_batch_size == c->per_device_train_batch_size * c->steps_per_generation);
  Check(!c->rewards.empty());
  Check(!c->lora.target_modules.empty());
  const std::string json = c->ToJson();
  Check(nlohmann::json::accept(json));
  Check(c->Fingerprint().size() == 32);
  Check(ferry::run::LoraPeftConfig(*c).ok());
  (void)ferry::run::TotalSteps(*c, 1000);
  (void)ferry::run::WarmupSteps(*c, 1000);
  (void)ferry::run::DatasetOptionsFor(*c);
  bool commands = false;
  for (const auto& r : c->rewards) commands |= r.type == ferry::run::RewardType::kCommand;
  if (!commands) Check(ferry::run::RewardScorer::Create(*c).ok());  // never start processes here
}

void FuzzDataset(uint8_t flags, std::string_view text) {
  ferry::run::DatasetOptions o;
  o.max_examples = 4096;
  if (flags & 2) o.required_fields = {"answer"};
  o.allow_messages = (flags & 4) == 0;
  auto ds = ferry::run::Dataset::Parse(text, "/fuzz/train.jsonl", o);
  if (!ds.ok()) return;
  Check((*ds)->size() > 0);
  for (const auto& ex : (*ds)->examples()) {
    Check(ex.prompt.empty() != ex.messages.empty());
    Check(ex.messages.empty() || (o.allow_messages && ex.messages.back().role == "user"));
    Check(!ex.json.empty());
    for (const auto& f : o.required_fields) Check(ex.Field(f) != nullptr);
  }
  ferry::run::DatasetSampler s(*ds, flags, true);
  const auto first = s.NextIndices((*ds)->size() + 3);
  Check(first.size() == (*ds)->size() + 3);
  const auto pos = s.position();
  ferry::run::DatasetSampler t(*ds, flags, true);
  Check(t.Seek(pos).ok());
  Check(s.NextIndices(2) == t.NextIndices(2));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    FuzzConfig(text);
  } else {
    FuzzDataset(data[0], text);
  }
  return 0;
}
