#include "convert/converter.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "convert/engine_check.h"
#include "convert/merge_plan.h"
#include "convert/peft_config.h"
#include "core/checkpoint.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"
#include "kernels/lora_merge.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string Q(std::string_view s) { return "'" + std::string(s) + "'"; }

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::string TorchDTypeName(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
    case DType::kF64: return "float64";
    default: return std::string(DTypeName(d));
  }
}

bool IsWeightFile(const std::string& name) {
  return EndsWith(name, ".safetensors") || EndsWith(name, ".index.json") || EndsWith(name, ".bin") ||
         EndsWith(name, ".pt") || EndsWith(name, ".pth");
}


// Converts fp32 values to `dtype` in chunks and appends them to the writer.
Status AppendF32As(SafetensorsWriter& w, std::span<const float> values, DType dtype) {
  if (dtype == DType::kF32) return w.Append(std::as_bytes(values));
  const size_t esize = static_cast<size_t>(DTypeBits(dtype) / 8);
  constexpr size_t kChunk = 1 << 20;
  std::vector<std::byte> buf(std::min(values.size(), kChunk) * esize);
  for (size_t i = 0; i < values.size(); i += kChunk) {
    const size_t n = std::min(kChunk, values.size() - i);
    std::span<std::byte> out(buf.data(), n * esize);
    FERRY_RETURN_IF_ERROR(WriteFromF32(values.subspan(i, n), dtype, out));
    FERRY_RETURN_IF_ERROR(w.Append(out));
  }
  return Status::OK();
}

// Runs writer operations on a background thread, in submission order, so that writing
// tensor N (a copy into the page cache) overlaps computing tensor N+1. At most `kDepth`
// operations wait; Submit blocks beyond that. The first error sticks: later operations are
// skipped and Submit / Drain return it.
class WritePipeline {
 public:
  using Op = std::function<Status()>;
  WritePipeline() : worker_([this] { Loop(); }) {}
  ~WritePipeline() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  Status Submit(Op op) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return queue_.size() < kDepth || !error_.ok(); });
    if (!error_.ok()) return error_;
    queue_.push_back(std::move(op));
    cv_.notify_all();
    return Status::OK();
  }
  // Waits until every submitted operation ran; returns the first error.
  Status Drain() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return (queue_.empty() && !busy_) || !error_.ok(); });
    return error_;
  }

 private:
  static constexpr size_t kDepth = 2;
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Op op = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      const bool skip = !error_.ok();
      lock.unlock();
      Status s = skip ? Status::OK() : op();
      lock.lock();
      busy_ = false;
      if (!s.ok() && error_.ok()) error_ = s;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool busy_ = false;
  bool stop_ = false;
  Status error_;
  std::thread worker_;
};

// Output buffers of the fused path, recycled so each tensor does not fault in fresh pages.
class BufferPool {
 public:
  std::shared_ptr<std::vector<uint16_t>> Acquire(size_t n) {
    std::shared_ptr<std::vector<uint16_t>> b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        b = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!b) b = std::make_shared<std::vector<uint16_t>>();
    if (b->size() < n) b->resize(n);  // grows only; never re-zeroed
    return b;
  }
  void Return(std::shared_ptr<std::vector<uint16_t>> b) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(std::move(b));
  }

 private:
  std::mutex mu_;
  std::vector<std::shared_ptr<std::vector<uint16_t>>> free_;
};

struct OutputTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<std::string> parts;  // base-space tensors stacked on axis 0 (one unless fused)
  uint32_t shard = 0;
};

class MergeWriter {
 public:
  MergeWriter(const ConvertOptions& o, const Checkpoint& base, const Checkpoint& adapter, const MergePlan& plan)
      : opt_(o), base_(base), adapter_(adapter), plan_(plan) {
    threads_ = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }

  Result<ConvertSummary> Run(const fs::path& dir) {
    FERRY_ASSIGN_OR_RETURN(std::vector<OutputTensor> outputs, PlanOutputs());
    std::vector<TensorSpec> specs;
    WriterOptions wopt;
    wopt.sync = opt_.sync;
    uint64_t total = 0;
    for (const auto& t : outputs) {
      specs.push_back({t.name, t.dtype, t.shape});
      wopt.shard_of.push_back(t.shard);
      total += CheckedByteSize(t.dtype, t.shape).value();
    }
    if (opt_.max_shard_bytes > 0 || outputs.empty()) {
      wopt.shard_of.clear();
      wopt.max_shard_bytes = opt_.max_shard_bytes;
    }
    FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateInDirectory(dir, specs, wopt));
    uint64_t done = 0;
    {
      WritePipeline pipe;
      for (const auto& t : outputs) {
        for (const auto& part : t.parts) {
          Status s = WritePart(pipe, *writer, part, t.dtype);
          if (!s.ok()) {
            (void)pipe.Drain();
            return s;
          }
        }
        done += CheckedByteSize(t.dtype, t.shape).value();
        if (opt_.progress) opt_.progress(done, total);
      }
      FERRY_RETURN_IF_ERROR(pipe.Drain());
    }
    FERRY_RETURN_IF_ERROR(writer->Finish());
    summary_.bytes_written = writer->bytes_written();
    for (const auto& p : writer->OutputPaths()) summary_.files.push_back(p.filename().string());
    summary_.tensors_written = static_cast<int64_t>(outputs.size());
    summary_.lora_modules = static_cast<int64_t>(plan_.modules.size());
    summary_.untied_lm_head = plan_.untie;
    summary_.dequantized = static_cast<int64_t>(plan_.quantized.size());
    return summary_;
  }

 private:
  // The dtype a base-space tensor has before any --dtype override.
  DType NaturalDType(const std::string& name) const {
    auto q = plan_.quantized.find(name);
    if (q != plan_.quantized.end()) return q->second.dtype;
    return base_.Info(plan_.SourceOf(name))->dtype;
  }
  Shape NaturalShape(const std::string& name) const {
    auto q = plan_.quantized.find(name);
    if (q != plan_.quantized.end()) return q->second.shape;
    return base_.Info(plan_.SourceOf(name))->shape;
  }
  DType OutDType(const std::string& name) const {
    DType d = NaturalDType(name);
    if (opt_.dtype && CanWriteFromF32(d)) return *opt_.dtype;
    return d;
  }

  Result<std::vector<OutputTensor>> PlanOutputs() const {
    // Base tensors in storage order (file, then offset): reads stream through each file.
    std::map<fs::path, uint32_t> file_index;
    for (const auto& f : base_.files()) file_index.emplace(f, static_cast<uint32_t>(file_index.size()));
    struct Item {
      uint32_t file;
      uint64_t offset;
      std::string name;
    };
    std::vector<Item> items;
    for (const auto& n : base_.names()) {
      if (plan_.quant_aux.count(n)) continue;
      auto it = file_index.find(base_.FileOf(n));
      items.push_back({it == file_index.end() ? 0 : it->second, base_.Info(n)->begin, n});
    }
    std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
      return a.file != b.file ? a.file < b.file : a.offset < b.offset;
    });
    // Fused layout: find every q/k/v and gate/up group first (storage order need not put
    // the first member first), then emit each group where its first member is stored.
    std::map<std::string, OutputTensor> groups;  // by first member
    std::set<std::string> consumed;
    if (opt_.layout == Layout::kFused) {
      for (const auto& item : items) {
        auto fused = FuseGroup(item.name);
        if (!fused.ok()) return fused.status();
        if (fused->parts.empty()) continue;
        for (const auto& p : fused->parts) consumed.insert(p);
        groups.emplace(item.name, std::move(fused).value());
      }
    }
    std::vector<OutputTensor> out;
    for (const auto& item : items) {
      if (auto g = groups.find(item.name); g != groups.end()) {
        g->second.shard = item.file;
        out.push_back(std::move(g->second));
        continue;
      }
      if (consumed.count(item.name)) continue;
      out.push_back({item.name, OutDType(item.name), NaturalShape(item.name), {item.name}, item.file});
      if (plan_.untie && item.name == plan_.tied_source) {
        const std::string& lm = plan_.lm_head_key;
        out.push_back({lm, OutDType(lm), NaturalShape(lm), {lm}, item.file});
      }
    }
    // Renumber shards densely (a fused group may empty a shard).
    uint32_t next = 0, last = UINT32_MAX;
    for (auto& t : out) {
      if (t.shard != last) {
        last = t.shard;
        ++next;
      }
      t.shard = next - 1;
    }
    return out;
  }

  // For the fused layout: the q/k/v or gate/up group starting at `name`, or empty parts.
  Result<OutputTensor> FuseGroup(const std::string& name) const {
    static const std::vector<std::pair<std::vector<std::string>, std::string>> kGroups = {
        {{"q_proj", "k_proj", "v_proj"}, "qkv_proj"}, {{"gate_proj", "up_proj"}, "gate_up_proj"}};
    for (const auto& [members, fused] : kGroups) {
      for (const char* param : {".weight", ".bias"}) {
        const std::string first = "." + members[0] + param;
        if (!EndsWith(name, first)) continue;
        const std::string prefix = name.substr(0, name.size() - first.size() + 1);
        OutputTensor t;
        t.name = prefix + fused + param;
        int64_t rows = 0;
        for (const auto& m : members) {
          const std::string part = prefix + m + param;
          if (!base_.Contains(part) || plan_.quant_aux.count(part)) return OutputTensor{};
          const Shape s = NaturalShape(part);
          const Shape s0 = NaturalShape(name);
          if (s.empty() || s.size() != s0.size() || !std::equal(s.begin() + 1, s.end(), s0.begin() + 1) ||
              OutDType(part) != OutDType(name)) {
            return Status::InvalidArgument(base_.path().string() + ": cannot fuse " + Q(part) + " " + ShapeToString(s) +
                                           " with " + Q(name) + " " + ShapeToString(s0));
          }
          rows += s[0];
          t.parts.push_back(part);
        }
        if (base_.Contains(t.name)) {
          return Status::InvalidArgument(base_.path().string() + ": has both " + Q(t.name) + " and " + Q(name));
        }
        t.shape = NaturalShape(name);
        t.shape[0] = rows;
        t.dtype = OutDType(name);
        return t;
      }
    }
    return OutputTensor{};
  }

  // Computes one output part on this thread and hands its bytes to the write pipeline.
  Status WritePart(WritePipeline& pipe, SafetensorsWriter& w, const std::string& name, DType out_dtype) {
    const std::string source = plan_.SourceOf(name);
    std::vector<std::string> release = {source};
    if (auto q = plan_.quantized.find(name); q != plan_.quantized.end()) {
      release.insert(release.end(), q->second.aux_keys.begin(), q->second.aux_keys.end());
    }
    const Checkpoint* base = &base_;
    auto release_all = [base, release] {
      for (const auto& r : release) base->Release(r);
    };
    const bool quantized = plan_.quantized.count(name) != 0;
    if (!plan_.Changes(name) && !quantized && out_dtype == NaturalDType(name)) {
      const auto range = base_.RangeOf(source);
      if (range.fd >= 0) {  // copied inside the kernel, as cp does
        return pipe.Submit([&w, range] { return w.AppendFileRange(range.fd, range.offset, range.length); });
      }
      FERRY_ASSIGN_OR_RETURN(Tensor t, base_.Get(source));
      return pipe.Submit([&w, t, release_all] {
        Status s = w.Append(t.bytes());
        release_all();
        return s;
      });
    }
    ++summary_.tensors_changed;
    if (const LoraModule* m = FusableDelta(name, out_dtype)) {
      FERRY_ASSIGN_OR_RETURN(auto buf, FusedMerge(name, *m, out_dtype));
      const size_t n = static_cast<size_t>(m->out * m->in);
      BufferPool* pool = &pool_;
      return pipe.Submit([&w, buf, n, pool, release_all] {
        Status s = w.Append(std::as_bytes(std::span<const uint16_t>(buf->data(), n)));
        release_all();
        pool->Return(buf);
        return s;
      });
    }
    FERRY_ASSIGN_OR_RETURN(std::vector<float> v, Compute(name));
    auto values = std::make_shared<std::vector<float>>(std::move(v));
    return pipe.Submit([&w, values, out_dtype, release_all] {
      Status s = AppendF32As(w, *values, out_dtype);
      release_all();
      return s;
    });
  }

  // The common case — one plain LoRA delta on an unquantized 16-bit weight written in its own
  // dtype — runs through the fused kernel (decode, rank-r update, round in one pass per row
  // block). Bit-identical to Compute() + AppendF32As(); returns null when it does not apply.
  // The common case (one plain LoRA delta on a 16-bit weight kept in its dtype) runs through
  // the fused kernel, bit-identical to Compute() + AppendF32As().
  const LoraModule* FusableDelta(const std::string& name, DType out_dtype) const {
    const DType base = NaturalDType(name);
    return base == out_dtype ? plan_.FusableDelta(name, base, NaturalShape(name)) : nullptr;
  }

  Result<std::shared_ptr<std::vector<uint16_t>>> FusedMerge(const std::string& name, const LoraModule& m, DType dtype) {
    FERRY_ASSIGN_OR_RETURN(Tensor base, base_.Get(plan_.SourceOf(name)));
    FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter_, m.a_key));
    FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter_, m.b_key));
    auto out = pool_.Acquire(static_cast<size_t>(m.out * m.in));
    kernels::LoraMergeRows16(reinterpret_cast<const uint16_t*>(base.data()),
                             dtype == DType::kBF16 ? kernels::Float16Kind::kBF16 : kernels::Float16Kind::kF16, a.data(),
                             b.data(), m.out, m.in, m.rank, static_cast<float>(m.scaling), out->data(), threads_);
    adapter_.Release(m.a_key);
    adapter_.Release(m.b_key);
    return out;
  }

  // The merged fp32 values of a base-space tensor.
  Result<std::vector<float>> Compute(const std::string& name) {
    const Shape shape = NaturalShape(name);
    std::vector<float> w;
    if (auto r = plan_.replacements.find(name); r != plan_.replacements.end()) {
      FERRY_ASSIGN_OR_RETURN(w, ReadTensorAsF32(adapter_, r->second));
    } else if (auto q = plan_.quantized.find(name); q != plan_.quantized.end()) {
      FERRY_ASSIGN_OR_RETURN(w, Dequantize4bitAsLoaded(base_, q->second));
    } else {
      FERRY_ASSIGN_OR_RETURN(w, ReadTensorAsF32(base_, plan_.SourceOf(name)));
    }
    FERRY_RETURN_IF_ERROR(ApplyPlanEdits(plan_, adapter_, name, shape, w, threads_));
    return w;
  }

  const ConvertOptions& opt_;
  const Checkpoint& base_;
  const Checkpoint& adapter_;
  const MergePlan& plan_;
  int threads_ = 1;
  BufferPool pool_;  // output buffers of the fused path
  ConvertSummary summary_;
};

// ---------------------------------------------------------------------------------
// lora layout

Status RefuseForEngine(const PeftConfig& cfg, const Checkpoint& base, const Checkpoint& adapter, const MergePlan& plan) {
  const std::vector<LoraLayoutRefusal> refusals = FindLoraLayoutRefusals(cfg, base, adapter, plan);
  if (refusals.empty()) return Status::OK();
  return Status::Unsupported(refusals.front().message + " Use --layout hf (or fused) to merge it instead.");
}

struct EngineModule {
  std::string name;  // module name as the base stores it
  bool embedding = false;
  int64_t in = 0, out = 0;
  std::vector<const LoraModule*> parts;  // several when separate adapters are fused
};

Result<ConvertSummary> WriteLora(const ConvertOptions& opt, const PeftConfig& cfg, const Checkpoint& base,
                                 const Checkpoint& adapter, const MergePlan& plan, const fs::path& dir) {
  FERRY_RETURN_IF_ERROR(RefuseForEngine(cfg, base, adapter, plan));
  std::map<std::string, EngineModule> mods;
  for (const auto& m : plan.modules) {
    const std::string name = m.target.substr(0, m.target.size() - std::string(".weight").size());
    EngineModule& e = mods[name];
    e.name = name;
    e.embedding = m.kind == LoraModule::Kind::kEmbedding;
    const TensorInfo* w = plan.quantized.count(m.target) ? nullptr : base.Info(plan.SourceOf(m.target));
    Shape ws = w ? w->shape : plan.quantized.at(m.target).shape;
    e.in = m.in;
    e.out = e.embedding ? m.out : (m.fan_in_fan_out ? ws[1] : ws[0]);
    e.parts.push_back(&m);
  }
  int64_t rank = 0;
  for (const auto& [n, e] : mods) {
    int64_t r = 0;
    for (const auto* p : e.parts) r += p->rank;
    rank = std::max(rank, r);
  }
  DType out_dtype = DType::kF32;
  if (!plan.modules.empty()) out_dtype = adapter.Info(plan.modules.front().a_key)->dtype;
  if (opt.dtype) out_dtype = *opt.dtype;
  if (!CanWriteFromF32(out_dtype)) out_dtype = DType::kF32;

  std::vector<TensorSpec> specs;
  for (const auto& [n, e] : mods) {
    const std::string a = e.embedding ? ".lora_embedding_A" : ".lora_A.weight";
    const std::string b = e.embedding ? ".lora_embedding_B" : ".lora_B.weight";
    specs.push_back({"base_model.model." + n + a, out_dtype, {rank, e.in}});
    specs.push_back({"base_model.model." + n + b, out_dtype, {e.out, rank}});
  }
  WriterOptions wopt;
  wopt.basename = "adapter_model";
  wopt.sync = opt.sync;
  FERRY_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::CreateInDirectory(dir, specs, wopt));
  std::set<std::string> leaves;
  for (const auto& [n, e] : mods) {
    leaves.insert(n.substr(n.rfind('.') + 1));
    // A' = [s_1 A_1; s_2 A_2; ...; 0], B' = block placement of B_i rows/cols, zero elsewhere.
    std::vector<float> a_out(static_cast<size_t>(rank * e.in), 0.0f);
    std::vector<float> b_out(static_cast<size_t>(e.out * rank), 0.0f);
    int64_t col = 0;
    for (const LoraModule* p : e.parts) {
      FERRY_ASSIGN_OR_RETURN(std::vector<float> a, ReadTensorAsF32(adapter, p->a_key));
      FERRY_ASSIGN_OR_RETURN(std::vector<float> b, ReadTensorAsF32(adapter, p->b_key));
      const float s = static_cast<float>(p->scaling);
      for (int64_t k = 0; k < p->rank; ++k) {
        for (int64_t i = 0; i < e.in; ++i) a_out[static_cast<size_t>((col + k) * e.in + i)] = s * a[static_cast<size_t>(k * e.in + i)];
      }
      const int64_t rows = p->out;
      for (int64_t o = 0; o < rows; ++o) {
        for (int64_t k = 0; k < p->rank; ++k) {
          b_out[static_cast<size_t>((p->row_offset + o) * rank + col + k)] =
              b[static_cast<size_t>((p->b_row_begin + o) * p->rank + k)];
        }
      }
      col += p->rank;
    }
    FERRY_RETURN_IF_ERROR(AppendF32As(*writer, a_out, out_dtype));
    FERRY_RETURN_IF_ERROR(AppendF32As(*writer, b_out, out_dtype));
  }
  FERRY_RETURN_IF_ERROR(writer->Finish());

  // A clean config: one global rank, scaling 1 (alpha = r), no patterns, no extras.
  ojson j = ojson::parse(cfg.raw_json, nullptr, false);
  if (!j.is_object()) j = ojson::object();
  j["peft_type"] = "LORA";
  j["r"] = rank;
  j["lora_alpha"] = rank;
  j["use_rslora"] = false;
  j["use_dora"] = false;
  j["rank_pattern"] = ojson::object();
  j["alpha_pattern"] = ojson::object();
  j["target_modules"] = std::vector<std::string>(leaves.begin(), leaves.end());
  j["modules_to_save"] = nullptr;
  j["lora_bias"] = false;
  j["bias"] = "none";
  j["trainable_token_indices"] = nullptr;
  j["exclude_modules"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["init_lora_weights"] = true;
  FERRY_RETURN_IF_ERROR(WriteFileAtomic(dir / "adapter_config.json", j.dump(2) + "\n"));

  ConvertSummary s;
  for (const auto& p : writer->OutputPaths()) s.files.push_back(p.filename().string());
  s.files.push_back("adapter_config.json");
  s.tensors_written = static_cast<int64_t>(specs.size());
  s.tensors_changed = s.tensors_written;
  s.lora_modules = static_cast<int64_t>(mods.size());
  s.global_rank = rank;
  s.global_alpha = static_cast<double>(rank);
  s.bytes_written = writer->bytes_written();
  return s;
}

// Copies the non-weight files of `from` (config, tokenizer, README...) except `skip` into
// `to`, fsynced when `sync`; their names are appended to `copied`, sorted.
Status CopyAuxFiles(const fs::path& from, const fs::path& to, const std::set<std::string>& skip, bool sync,
                    std::vector<std::string>& copied) {
  std::error_code ec;
  if (!fs::is_directory(from, ec)) return Status::OK();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(from, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_regular_file() || n.empty() || n[0] == '.' || IsWeightFile(n) || skip.count(n)) continue;
    fs::copy_file(e.path(), to / n, fs::copy_options::overwrite_existing, ec);
    if (ec) return Status::IOError((to / n).string() + ": " + ec.message());
    if (sync) {
      const int fd = ::open((to / n).c_str(), O_RDONLY | O_CLOEXEC);
      const bool ok = fd >= 0 && ::fsync(fd) == 0;
      const int err = errno;
      if (fd >= 0) ::close(fd);
      if (!ok) return Status::IOError((to / n).string() + ": fsync failed: " + std::strerror(err));
    }
    names.push_back(n);
  }
  if (ec) return Status::IOError(from.string() + ": " + ec.message());
  std::sort(names.begin(), names.end());
  copied.insert(copied.end(), names.begin(), names.end());
  return Status::OK();
}

Result<ojson> LoadModelConfig(const fs::path& base) {
  const fs::path p = base / "config.json";
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return ojson();
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(p));
  ojson j = ojson::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(p.string() + ": not a JSON object");
  return j;
}

// What a merge does to config.json (MergedModelConfig).
std::string EditModelConfig(ojson j, bool untie, std::optional<DType> dtype) {
  j.erase("quantization_config");
  if (untie) j["tie_word_embeddings"] = false;
  if (dtype) {
    for (const char* k : {"torch_dtype", "dtype"}) {
      if (j.contains(k)) j[k] = TorchDTypeName(*dtype);
    }
  }
  return j.dump(2) + "\n";
}

Status WriteModelConfig(ojson j, const MergePlan& plan, const ConvertOptions& opt, const fs::path& dir) {
  if (j.is_null()) return Status::OK();
  std::optional<DType> dtype = opt.dtype;
  if (!dtype && !plan.quantized.empty()) dtype = plan.quantized.begin()->second.dtype;
  return WriteFileAtomic(dir / "config.json", EditModelConfig(std::move(j), plan.untie, dtype), opt.sync);
}

}  // namespace

std::string_view LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kHf: return "hf";
    case Layout::kFused: return "fused";
    case Layout::kLora: return "lora";
  }
  return "?";
}

Result<Layout> ParseLayout(std::string_view name) {
  if (name == "hf") return Layout::kHf;
  if (name == "fused") return Layout::kFused;
  if (name == "lora") return Layout::kLora;
  return Status::InvalidArgument("unknown layout '" + std::string(name) + "' (expected hf, fused or lora)");
}

Result<std::string> MergedModelConfig(std::string_view text, bool untie, std::optional<DType> dtype) {
  ojson j = ojson::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption("config.json: not a JSON object");
  return EditModelConfig(std::move(j), untie, dtype);
}

Result<uint64_t> ParseByteSize(std::string_view text) {
  std::string t(text);
  size_t i = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  if (i == 0) return Status::InvalidArgument("size '" + t + "' does not start with a number");
  double v = std::strtod(t.substr(0, i).c_str(), nullptr);
  std::string unit = t.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> kUnits = {
      {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto u = kUnits.find(unit);
  if (u == kUnits.end()) return Status::InvalidArgument("size '" + t + "' has an unknown unit (use B, KB, MB, GB, KiB, MiB, GiB)");
  const double bytes = v * u->second;
  if (!(bytes >= 1) || bytes > 1e18) return Status::InvalidArgument("size '" + t + "' is out of range");
  return static_cast<uint64_t>(bytes);
}

Result<ConvertSummary> Convert(const ConvertOptions& opt) {
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  if (!fs::exists(opt.base, ec)) return Status::NotFound(opt.base.string() + ": base model does not exist");
  if (!fs::exists(opt.adapter, ec)) return Status::NotFound(opt.adapter.string() + ": adapter does not exist");
  FERRY_ASSIGN_OR_RETURN(PeftConfig cfg, LoadPeftConfig(opt.adapter));
  FERRY_RETURN_IF_ERROR(cfg.CheckMergeable());
  FERRY_ASSIGN_OR_RETURN(Checkpoint adapter, Checkpoint::Open(opt.adapter));
  FERRY_ASSIGN_OR_RETURN(Checkpoint base, Checkpoint::Open(opt.base));
  FERRY_ASSIGN_OR_RETURN(ojson model_config, LoadModelConfig(fs::is_directory(opt.base) ? opt.base : opt.base.parent_path()));
  bool tied = false;
  if (model_config.is_object() && model_config.contains("tie_word_embeddings")) {
    const auto& t = model_config["tie_word_embeddings"];
    if (!t.is_boolean() && !t.is_null()) {
      return Status::Corruption((fs::is_directory(opt.base) ? opt.base : opt.base.parent_path()).string() +
                                "/config.json: field 'tie_word_embeddings' must be true or false");
    }
    tied = t.is_boolean() && t.get<bool>();
  }
  FERRY_ASSIGN_OR_RETURN(MergePlan plan, PlanMerge(cfg, adapter, base, tied));
  // Everything is checked: only now create the staging directory.
  FERRY_ASSIGN_OR_RETURN(StagingDir staging, StagingDir::Create(opt.out, opt.force));
  ConvertSummary summary;
  const fs::path base_dir = fs::is_directory(opt.base) ? opt.base : opt.base.parent_path();
  if (opt.layout == Layout::kLora) {
    FERRY_ASSIGN_OR_RETURN(summary, WriteLora(opt, cfg, base, adapter, plan, staging.path()));
    FERRY_RETURN_IF_ERROR(
        CopyAuxFiles(opt.adapter, staging.path(), {"adapter_config.json", "README.md"}, opt.sync, summary.files));
  } else {
    FERRY_ASSIGN_OR_RETURN(summary, MergeWriter(opt, base, adapter, plan).Run(staging.path()));
    FERRY_RETURN_IF_ERROR(WriteModelConfig(model_config, plan, opt, staging.path()));
    if (model_config.is_object()) summary.files.push_back("config.json");
    FERRY_RETURN_IF_ERROR(CopyAuxFiles(base_dir, staging.path(), {"config.json"}, opt.sync, summary.files));
  }
  summary.layout = opt.layout;
  summary.out = opt.out;
  summary.warnings = plan.warnings;
  FERRY_RETURN_IF_ERROR(staging.Commit());
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return summary;
}

std::string ConvertSummaryToJson(const ConvertSummary& s) {
  ojson j;
  j["layout"] = std::string(LayoutName(s.layout));
  j["out"] = s.out.string();
  j["files"] = s.files;
  j["tensors_written"] = s.tensors_written;
  j["tensors_changed"] = s.tensors_changed;
  j["lora_modules"] = s.lora_modules;
  j["dequantized_4bit"] = s.dequantized;
  j["untied_lm_head"] = s.untied_lm_head;
  if (s.layout == Layout::kLora) {
    j["global_rank"] = s.global_rank;
    j["global_alpha"] = s.global_alpha;
  }
  j["bytes_written"] = s.bytes_written;
  j["seconds"] = s.seconds;
  j["warnings"] = s.warnings;
  return j.dump(2);
}

}  // namespace ferry
