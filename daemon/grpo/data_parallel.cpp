#include "daemon/grpo/data_parallel.h"

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <mutex>

#include "daemon/dist/process_group.h"
#include "daemon/grpo/optimizer.h"
#include "daemon/runtime/torch_util.h"

namespace ferry::grpo {
namespace {

using json = nlohmann::json;

at::Tensor DigestTensor(const store::Digest& d) {
  at::Tensor t = at::empty({16}, at::kByte);
  std::memcpy(t.data_ptr<uint8_t>(), &d.hi, 8);
  std::memcpy(t.data_ptr<uint8_t>() + 8, &d.lo, 8);
  return t;
}

store::Digest DigestOf(const at::Tensor& t) {
  store::Digest d;
  const at::Tensor c = t.contiguous();
  std::memcpy(&d.hi, c.data_ptr<uint8_t>(), 8);
  std::memcpy(&d.lo, c.data_ptr<uint8_t>() + 8, 8);
  return d;
}

// A digest of the adapter's parameters: each tensor's store digest, by name.
Result<store::Digest> AdapterDigest(const Trainer::State& s) {
  std::string all;
  for (const auto& [name, p] : s.adapter->named_parameters()) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, runtime::ToCore(p.detach()));
    all += name;
    all.push_back('\0');
    all += store::TensorDigest(t).Hex();
  }
  return store::AuxDigest(all);
}

bool IsMin(const std::string& key) {
  const std::string last = key.substr(key.rfind('/') + 1);
  return last == "min" || last.starts_with("min_") || last.ends_with("_min");
}
bool IsMax(const std::string& key) {
  const std::string last = key.substr(key.rfind('/') + 1);
  return last == "max" || last.starts_with("max_") || last.ends_with("_max");
}

}  // namespace

Status ShareStartState(Trainer::State& s) {
  dist::ProcessGroup& g = *s.group;
  const std::string what = "sharing rank 0's start state";
  std::string header;
  if (g.rank() == 0) {
    json h;
    const run::DatasetPosition pos = s.sampler->position();
    h["step"] = s.step;
    h["micro_step"] = s.micro_step;
    h["num_tokens"] = s.num_tokens;
    h["epoch"] = pos.epoch;
    h["index"] = pos.index;
    h["dataset_digest"] = s.dataset->digest();
    json steps = json::object();
    for (const auto& [key, p] : s.adapter->named_parameters()) {
      auto it = s.optimizer->state().find(StateKey(p));
      if (it != s.optimizer->state().end()) {
        steps[key] = static_cast<torch::optim::AdamWParamState&>(*it->second).step();
      }
    }
    h["optimizer_steps"] = steps;
    header = h.dump();
  }
  FERRY_ASSIGN_OR_RETURN(std::string text, g.BroadcastBytes(header, 0, what));
  json h;
  std::map<std::string, int64_t> steps;
  try {
    h = json::parse(text);
    if (g.rank() != 0) {
      // The same prompts on every host: a dataset file that differs (a stale copy) would train
      // silently on other data, the weights still agreeing.
      const std::string theirs = h.at("dataset_digest").get<std::string>();
      if (theirs != s.dataset->digest()) {
        return Status::FailedPrecondition(what + ": the dataset " + s.config.dataset.string() + " of " +
                                          g.Describe(g.rank()) + " has digest " + s.dataset->digest() + ", that of " +
                                          g.Describe(0) + " " + theirs + "; every rank needs the same dataset");
      }
      s.step = h.at("step").get<int64_t>();
      s.micro_step = h.at("micro_step").get<int64_t>();
      s.num_tokens = h.at("num_tokens").get<double>();
      FERRY_RETURN_IF_ERROR(s.sampler->Seek({h.at("epoch").get<uint64_t>(), h.at("index").get<uint64_t>()}));
    }
    for (const auto& [key, v] : h.at("optimizer_steps").items()) steps[key] = v.get<int64_t>();
  } catch (const json::exception& e) {
    return Status::Corruption(what + ": " + e.what());
  }
  s.generator_step = s.step;
  const auto& params = s.adapter->named_parameters();
  for (const auto& [key, n] : steps) {
    if (!params.contains(key)) {
      return Status::FailedPrecondition(what + ": rank 0's adapter has '" + key + "', which this rank's has not");
    }
  }
  // The tensors, in name order on every rank.
  return runtime::GuardTorch(what, [&]() -> Status {
    at::NoGradGuard no_grad;
    if (g.rank() != 0) s.optimizer->state().clear();
    for (const auto& [key, p] : params) {
      at::Tensor data = p.detach();
      FERRY_RETURN_IF_ERROR(g.Broadcast(data, 0, what + " (" + key + ")"));
      auto n = steps.find(key);
      if (n == steps.end()) continue;
      if (g.rank() != 0) {
        auto ps = std::make_unique<torch::optim::AdamWParamState>();
        ps->step(n->second);
        ps->exp_avg(at::zeros_like(p));
        ps->exp_avg_sq(at::zeros_like(p));
        s.optimizer->state()[StateKey(p)] = std::move(ps);
      }
      auto& os = static_cast<torch::optim::AdamWParamState&>(*s.optimizer->state().at(StateKey(p)));
      at::Tensor m = os.exp_avg(), v = os.exp_avg_sq();
      FERRY_RETURN_IF_ERROR(g.Broadcast(m, 0, what + " (exp_avg of " + key + ")"));
      FERRY_RETURN_IF_ERROR(g.Broadcast(v, 0, what + " (exp_avg_sq of " + key + ")"));
    }
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    at::Tensor rng;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      rng = gen.get_state();
    }
    FERRY_RETURN_IF_ERROR(g.Broadcast(rng, 0, what + " (random state)"));
    if (g.rank() != 0) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
    return Status::OK();
  });
}

Result<at::Tensor> GatherRows(Trainer::State& s, const at::Tensor& local, const std::string& what) {
  if (!s.group) return local;
  PhaseTimer timer(s, "communication");
  FERRY_ASSIGN_OR_RETURN(at::Tensor all, s.group->AllGather(local.contiguous(), what));
  std::vector<int64_t> shape = local.sizes().vec();
  shape[0] *= s.group->size();
  return all.reshape(shape);
}

Result<int64_t> SumOverRanks(Trainer::State& s, int64_t value, const std::string& what) {
  if (!s.group) return value;
  PhaseTimer timer(s, "communication");
  at::Tensor t = at::full({1}, value, at::kLong);
  FERRY_RETURN_IF_ERROR(s.group->AllReduceSum(t, what));
  return t.item<int64_t>();
}

Status AverageGradients(Trainer::State& s) {
  if (!s.group) return Status::OK();
  PhaseTimer timer(s, "communication");
  const std::string what = "averaging the LoRA gradients";
  return runtime::GuardTorch(what, [&]() -> Status {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> params = s.adapter->parameters();
    for (at::Tensor& p : params) {
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
    const double world = static_cast<double>(s.group->size());
    size_t i = 0;
    while (i < params.size()) {
      // One bucket: consecutive gradients of one dtype up to kGradientBucketBytes.
      std::vector<at::Tensor> bucket;
      int64_t bytes = 0;
      const at::ScalarType type = params[i].grad().scalar_type();
      while (i < params.size() && params[i].grad().scalar_type() == type &&
             (bucket.empty() || bytes + params[i].grad().nbytes() <= static_cast<size_t>(kGradientBucketBytes))) {
        bucket.push_back(params[i].grad());
        bytes += static_cast<int64_t>(params[i].grad().nbytes());
        ++i;
      }
      std::vector<at::Tensor> flat_views;
      for (const at::Tensor& gr : bucket) flat_views.push_back(gr.reshape({-1}));
      at::Tensor flat = at::cat(flat_views);
      FERRY_RETURN_IF_ERROR(s.group->AllReduceSum(flat, what));
      flat.div_(world);
      int64_t offset = 0;
      for (at::Tensor& gr : bucket) {
        gr.copy_(flat.narrow(0, offset, gr.numel()).view(gr.sizes()));
        offset += gr.numel();
      }
    }
    return Status::OK();
  });
}

bool AdapterCheckDue(const Trainer::State& s, int64_t step) {
  const int64_t every = s.config.distributed.check_every;
  return s.group && every > 0 && (step == 1 || step % every == 0);
}

// A digest as 4 doubles (32 bits each: exact), to travel in a gather of doubles.
void PutDigest(std::vector<double>& out, const store::Digest& d) {
  out.push_back(static_cast<double>(d.hi >> 32));
  out.push_back(static_cast<double>(d.hi & 0xffffffffULL));
  out.push_back(static_cast<double>(d.lo >> 32));
  out.push_back(static_cast<double>(d.lo & 0xffffffffULL));
}
store::Digest GetDigest(const at::Tensor& row, int64_t at) {
  auto v = [&](int64_t i) { return static_cast<uint64_t>(row[at + i].item<double>()); };
  return store::Digest{(v(0) << 32) | v(1), (v(2) << 32) | v(3)};
}

Status ShareStepEnd(Trainer::State& s, const store::Digest& acked, Metrics& metrics, bool check_adapter,
                    bool at_start) {
  if (!s.group) {
    s.rank_versions = {acked.Hex()};
    return Status::OK();
  }
  PhaseTimer timer(s, "communication");
  dist::ProcessGroup& g = *s.group;
  const std::string when = at_start ? "at the start: " : "";  // a step's errors: Trainer::Step names it
  // [acked id (4), the metrics' names (4), the rank's word (1), the metrics' values]
  std::vector<double> values;
  PutDigest(values, acked);
  std::string names;
  for (const auto& [k, v] : metrics) names += k + '\n';
  PutDigest(values, store::AuxDigest(names));
  values.push_back(s.ask_before_step && s.ask_before_step() ? 1.0 : 0.0);
  for (const auto& [k, v] : metrics) values.push_back(v);
  FERRY_ASSIGN_OR_RETURN(at::Tensor all, g.AllGather(at::tensor(values, at::kDouble),
                                                     when + "gathering the acknowledged ids and the metrics"));
  s.await_word = false;
  s.stop_asked_by = -1;
  for (int r = 0; r < g.size(); ++r) {
    if (all[r][8].item<double>() == 0) continue;
    s.await_word = true;
    if (r != 0 && s.stop_asked_by < 0) s.stop_asked_by = r;
  }
  s.rank_versions.clear();
  for (int r = 0; r < g.size(); ++r) s.rank_versions.push_back(GetDigest(all[r], 0).Hex());
  for (int r = 1; r < g.size(); ++r) {
    if (s.rank_versions[static_cast<size_t>(r)] != s.rank_versions[0]) {
      return Status::Corruption(when + "the generator of " + g.Describe(r) + " acknowledged " +
                                s.rank_versions[static_cast<size_t>(r)] + " but that of " + g.Describe(0) +
                                " acknowledged " + s.rank_versions[0] +
                                ": the ranks do not hold the same weights (a base that differs between hosts, or "
                                "corrupted memory); the run stops");
    }
  }
  for (int r = 0; r < g.size(); ++r) {
    if (GetDigest(all[r], 4) != GetDigest(all[g.rank()], 4)) {
      return Status::Internal(when + "the metrics of " + g.Describe(r) + " have other names than " +
                              g.Describe(g.rank()) + "'s");
    }
  }
  int64_t j = 9;
  for (auto& [k, v] : metrics) {
    const at::Tensor col = all.select(1, j++);
    // NaN (a metric TRL logs as NaN on a rank) stays NaN when every rank has it.
    const at::Tensor finite = col.isnan().logical_not();
    if (!finite.any().item<bool>()) continue;
    const at::Tensor vals = col.masked_select(finite);
    v = IsMin(k) ? vals.min().item<double>() : IsMax(k) ? vals.max().item<double>() : vals.mean().item<double>();
  }
  if (!check_adapter) return Status::OK();
  FERRY_ASSIGN_OR_RETURN(store::Digest mine, AdapterDigest(s));
  FERRY_ASSIGN_OR_RETURN(at::Tensor adapters, g.AllGather(DigestTensor(mine), when + "comparing the adapters"));
  for (int r = 1; r < g.size(); ++r) {
    if (!adapters[r].equal(adapters[0])) {
      return Status::Corruption(when + "the adapter parameters of " + g.Describe(r) + " (digest " +
                                DigestOf(adapters[r]).Hex() + ") differ from those of " + g.Describe(0) + " (digest " +
                                DigestOf(adapters[0]).Hex() + "); the run stops");
    }
  }
  return Status::OK();
}

}  // namespace ferry::grpo
