#include "convert/converter.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "convert/fused_layout.h"
#include "convert/lora_layout.h"
#include "convert/merge_plan.h"
#include "convert/model_config.h"
#include "convert/peft_config.h"
#include "core/aux_files.h"
#include "core/checkpoint.h"
#include "core/file_util.h"
#include "core/mapped_file.h"
#include "core/safetensors.h"
#include "core/staging_dir.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

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
    std::sort(items.begin(), items.end(),
              [](const Item& a, const Item& b) { return a.file != b.file ? a.file < b.file : a.offset < b.offset; });
    // Output tensors in storage order (an untied lm_head right after its source), then the
    // fused layout's groups in place of their first member (convert/fused_layout.h).
    std::vector<TensorSpec> specs;
    std::map<std::string, uint32_t> shard_of;
    for (const auto& item : items) {
      specs.push_back({item.name, OutDType(item.name), NaturalShape(item.name)});
      shard_of.emplace(item.name, item.file);
      if (plan_.untie && item.name == plan_.tied_source) {
        const std::string& lm = plan_.lm_head_key;
        specs.push_back({lm, OutDType(lm), NaturalShape(lm)});
        shard_of.emplace(lm, item.file);
      }
    }
    std::vector<LaidOutTensor> laid_out;
    if (opt_.layout == Layout::kFused) {
      FERRY_ASSIGN_OR_RETURN(laid_out, FuseLayout(specs, base_.path().string()));
    } else {
      for (auto& spec : specs) laid_out.push_back(LaidOutTensor{spec, {spec.name}});
    }
    std::vector<OutputTensor> out;
    for (auto& t : laid_out) {
      const uint32_t shard = shard_of.at(t.parts.front());
      out.push_back({std::move(t.spec.name), t.spec.dtype, std::move(t.spec.shape), std::move(t.parts), shard});
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
      FERRY_ASSIGN_OR_RETURN(auto buf, FusedMerge(name, *m));
      const size_t n = static_cast<size_t>(m->out * m->in);
      BufferPool* pool = &pool_;
      return pipe.Submit([&w, buf, n, pool, release_all] {
        Status s = w.Append(std::as_bytes(std::span<const uint16_t>(buf->data(), n)));
        release_all();
        pool->Return(buf);
        return s;
      });
    }
    FERRY_ASSIGN_OR_RETURN(std::vector<float> v, MergedF32(plan_, base_, adapter_, name, NaturalShape(name), threads_));
    auto values = std::make_shared<std::vector<float>>(std::move(v));
    return pipe.Submit([&w, values, out_dtype, release_all] {
      Status s = AppendF32As(w, *values, out_dtype);
      release_all();
      return s;
    });
  }

  // The common case — one plain LoRA delta on an unquantized 16-bit weight written in its own
  // dtype — runs through the fused kernel (MergeFusable16: decode, rank-r update, round in one
  // pass per row block), bit-identical to MergedF32() + AppendF32As(); null when it does not
  // apply.
  const LoraModule* FusableDelta(const std::string& name, DType out_dtype) const {
    const DType base = NaturalDType(name);
    return base == out_dtype ? plan_.FusableDelta(name, base, NaturalShape(name)) : nullptr;
  }

  Result<std::shared_ptr<std::vector<uint16_t>>> FusedMerge(const std::string& name, const LoraModule& m) {
    FERRY_ASSIGN_OR_RETURN(Tensor base, base_.Get(plan_.SourceOf(name)));
    const size_t n = static_cast<size_t>(m.out * m.in);
    auto out = pool_.Acquire(n);
    FERRY_RETURN_IF_ERROR(MergeFusable16(base, adapter_, m, std::span<uint16_t>(out->data(), n), threads_));
    adapter_.Release(m.a_key);
    adapter_.Release(m.b_key);
    return out;
  }

  const ConvertOptions& opt_;
  const Checkpoint& base_;
  const Checkpoint& adapter_;
  const MergePlan& plan_;
  int threads_ = 1;
  BufferPool pool_;  // output buffers of the fused path
  ConvertSummary summary_;
};

// Copies the auxiliary files of `from` (core/aux_files.h: config, tokenizer files...) except
// `skip` into `to`, fsynced when `sync`; their names are appended to `copied`, sorted. A
// directory that is not there (a base given as a file) has none.
Status CopyAuxFiles(const fs::path& from, const fs::path& to, const std::set<std::string>& skip, bool sync,
                    std::vector<std::string>& copied) {
  std::error_code ec;
  if (!fs::is_directory(from, ec)) return Status::OK();
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListAuxFiles(from));
  for (const std::string& n : names) {
    if (skip.count(n)) continue;
    fs::copy_file(from / n, to / n, fs::copy_options::overwrite_existing, ec);
    if (ec) return Status::IOError((to / n).string() + ": " + ec.message());
    if (sync) FERRY_RETURN_IF_ERROR(SyncFile(to / n));
    copied.push_back(n);
  }
  return Status::OK();
}

// The base's config.json, when there is one, and whether it ties the embeddings.
struct ModelConfigFile {
  std::optional<std::string> text;
  bool tied = false;
};

Result<ModelConfigFile> LoadModelConfig(const fs::path& base) {
  const fs::path p = base / "config.json";
  ModelConfigFile out;
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return out;
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(p));
  ojson j = ojson::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(p.string() + ": not a JSON object");
  if (j.contains("tie_word_embeddings")) {
    const auto& t = j["tie_word_embeddings"];
    if (!t.is_boolean() && !t.is_null()) {
      return Status::Corruption(p.string() + ": field 'tie_word_embeddings' must be true or false");
    }
    out.tied = t.is_boolean() && t.get<bool>();
  }
  out.text = std::move(text);
  return out;
}

// config.json beside merged weights (convert/model_config.h).
Status WriteModelConfig(const ModelConfigFile& config, const MergePlan& plan, const ConvertOptions& opt,
                        const fs::path& base_dir, const fs::path& dir) {
  if (!config.text) return Status::OK();
  ModelConfigEdits edits;
  edits.untie = plan.untie;
  edits.dtype = opt.dtype;
  if (!edits.dtype && !plan.quantized.empty()) edits.dtype = plan.quantized.begin()->second.dtype;
  FERRY_ASSIGN_OR_RETURN(std::string text,
                         RewriteModelConfig(*config.text, edits, (base_dir / "config.json").string()));
  return WriteFileAtomic(dir / "config.json", text, opt.sync);
}

}  // namespace

Result<uint64_t> ParseByteSize(std::string_view text) {
  std::string t(text);
  size_t i = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.')) ++i;
  if (i == 0) return Status::InvalidArgument("size '" + t + "' does not start with a number");
  double v = std::strtod(t.substr(0, i).c_str(), nullptr);
  std::string unit = t.substr(i);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> kUnits = {
      {"", 1},      {"B", 1},        {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto u = kUnits.find(unit);
  if (u == kUnits.end())
    return Status::InvalidArgument("size '" + t + "' has an unknown unit (use B, KB, MB, GB, KiB, MiB, GiB)");
  const double bytes = v * u->second;
  if (!(bytes >= 1) || bytes > 1e18) return Status::InvalidArgument("size '" + t + "' is out of range");
  return static_cast<uint64_t>(bytes);
}

Result<ConvertSummary> Convert(const ConvertOptions& opt, ConvertRemedy* remedy) {
  const auto start = std::chrono::steady_clock::now();
  if (remedy != nullptr) *remedy = ConvertRemedy::kNone;
  std::error_code ec;
  if (!fs::exists(opt.base, ec)) return Status::NotFound(opt.base.string() + ": base model does not exist");
  // No adapter: the base alone, in the layout asked for (a 4-bit base dequantized: what an
  // engine that cannot read bitsandbytes' format serves a QLoRA run's adapters on).
  const bool base_alone = opt.adapter.empty();
  if (base_alone && opt.layout == Layout::kLora) {
    return Status::InvalidArgument("the lora layout is an adapter's: it needs an adapter directory");
  }
  if (!base_alone && !fs::exists(opt.adapter, ec)) {
    return Status::NotFound(opt.adapter.string() + ": adapter does not exist");
  }
  PeftConfig cfg;
  Checkpoint adapter = Checkpoint::FromTensors("no adapter", {});
  if (!base_alone) {
    FERRY_ASSIGN_OR_RETURN(cfg, LoadPeftConfig(opt.adapter));
    FERRY_RETURN_IF_ERROR(cfg.CheckMergeable());
    FERRY_ASSIGN_OR_RETURN(adapter, Checkpoint::Open(opt.adapter));
  }
  FERRY_ASSIGN_OR_RETURN(Checkpoint base, Checkpoint::Open(opt.base));
  const fs::path base_dir = fs::is_directory(opt.base, ec) ? opt.base : opt.base.parent_path();
  FERRY_ASSIGN_OR_RETURN(ModelConfigFile model_config, LoadModelConfig(base_dir));
  FERRY_ASSIGN_OR_RETURN(MergePlan plan, PlanMerge(cfg, adapter, base, model_config.tied));
  // Everything is checked: only now create the staging directory.
  auto created = StagingDir::Create(opt.out, opt.force);
  if (!created.ok()) {
    if (remedy != nullptr && created.status().code() == StatusCode::kAlreadyExists)
      *remedy = ConvertRemedy::kReplaceOutput;
    return created.status();
  }
  StagingDir staging = std::move(created).value();
  ConvertSummary summary;
  std::vector<std::string> lora_warnings;
  if (opt.layout == Layout::kLora) {
    LoraLayoutOptions lopt;
    lopt.dtype = opt.dtype;
    lopt.sync = opt.sync;
    auto written = WriteLoraLayout(cfg, base, adapter, plan, lopt, staging.path());
    if (!written.ok()) {
      // kUnsupported there is always a refusal (lora_layout.h): merging applies what it cannot.
      if (remedy != nullptr && written.status().code() == StatusCode::kUnsupported)
        *remedy = ConvertRemedy::kMergedLayout;
      return written.status();
    }
    LoraLayoutSummary lora = std::move(written).value();
    summary.files = std::move(lora.files);
    summary.tensors_written = lora.tensors_written;
    summary.tensors_changed = lora.tensors_written;
    summary.lora_modules = lora.modules;
    summary.global_rank = lora.global_rank;
    summary.global_alpha = lora.global_alpha;
    summary.global_scaling = lora.global_scaling;
    summary.lora_factor_dtype = lora.factor_dtype;
    summary.lora_inexact_modules = lora.inexact_modules;
    summary.bytes_written = lora.bytes_written;
    lora_warnings = std::move(lora.warnings);
    FERRY_RETURN_IF_ERROR(CopyAuxFiles(opt.adapter, staging.path(), {"adapter_config.json"}, opt.sync, summary.files));
  } else {
    FERRY_ASSIGN_OR_RETURN(summary, MergeWriter(opt, base, adapter, plan).Run(staging.path()));
    FERRY_RETURN_IF_ERROR(WriteModelConfig(model_config, plan, opt, base_dir, staging.path()));
    if (model_config.text) summary.files.push_back("config.json");
    FERRY_RETURN_IF_ERROR(CopyAuxFiles(base_dir, staging.path(), {"config.json"}, opt.sync, summary.files));
  }
  summary.layout = opt.layout;
  summary.out = opt.out;
  summary.warnings = plan.warnings;
  summary.warnings.insert(summary.warnings.end(), lora_warnings.begin(), lora_warnings.end());
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
    j["global_scaling"] = s.global_scaling;
    j["factor_dtype"] = std::string(DTypeName(s.lora_factor_dtype));
    j["inexact_modules"] = s.lora_inexact_modules;
  }
  j["bytes_written"] = s.bytes_written;
  j["seconds"] = s.seconds;
  j["warnings"] = s.warnings;
  return j.dump(2);
}

}  // namespace ferry
