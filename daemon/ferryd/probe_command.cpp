// ferryd probe: the reference prompt log-probabilities of a model version (and adapter), computed
// in F32 by the runtime (daemon/runtime/prompt_logprobs.h), for comparison with what a vLLM server
// reports as prompt_logprobs for the same token ids. One-shot from flags, or as a long-lived
// prober answering JSON lines on stdin (docs/daemon.md, "ferryd probe").
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <limits>
#include <list>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/text.h"
#include "daemon/ferryd/commands.h"
#include "daemon/runtime/lora.h"
#include "daemon/runtime/model.h"
#include "daemon/runtime/prompt_logprobs.h"

namespace ferry::ferryd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Serve mode's bounds on one request: its line, and its number of sequences (each one's length is
// bounded by the line and by the model's max_position_embeddings).
constexpr size_t kMaxRequestBytes = size_t{1} << 20;
constexpr size_t kMaxSequences = 4096;
// Loaded (model, adapter) pairs kept by serve mode, most recently used first.
constexpr size_t kCachedModels = 2;

struct ProbeFlags {
  fs::path model;
  fs::path adapter;
  std::string ids;
  bool json = false;
  bool serve = false;
  int threads = 0;
};

// A model (computing in F32) and its optional adapter; the adapter's binding points into the
// adapter, which is destroyed first.
struct LoadedModel {
  std::string model_dir, adapter_dir;
  std::unique_ptr<runtime::CausalLM> model;
  std::unique_ptr<runtime::LoraAdapter> adapter;

  const runtime::LoraBinding* lora() const { return adapter ? &adapter->binding() : nullptr; }
};

// Errors are prefixed with `model_what` or `adapter_what`: what named the directory ("--model",
// "field 'model'").
Result<std::unique_ptr<LoadedModel>> LoadModel(const std::string& model_dir, const std::string& adapter_dir,
                                               std::string_view model_what, std::string_view adapter_what) {
  auto m = std::make_unique<LoadedModel>();
  m->model_dir = model_dir;
  m->adapter_dir = adapter_dir;
  runtime::ModelOptions options;
  options.dtype = at::kFloat;
  auto model = runtime::CausalLM::Load(model_dir, options);
  if (!model.ok()) return model.status().WithContext(model_what);
  m->model = std::move(*model);
  if (!adapter_dir.empty()) {
    auto adapter = runtime::LoraAdapter::Load(*m->model, adapter_dir);
    if (!adapter.ok()) return adapter.status().WithContext(adapter_what);
    m->adapter = std::move(*adapter);
  }
  return m;
}

// The values as a JSON array of arrays, each float as "%.9g" (round-trips an F32); a value that
// is not finite (a broken model) as null, which JSON has for it.
std::string LogProbsJson(const std::vector<std::vector<float>>& values) {
  std::string out = "[";
  char buf[32];
  for (size_t i = 0; i < values.size(); ++i) {
    out += i ? ", [" : "[";
    for (size_t t = 0; t < values[i].size(); ++t) {
      if (t) out += ", ";
      const float v = values[i][t];
      if (std::isfinite(v)) {
        std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
        out += buf;
      } else {
        out += "null";
      }
    }
    out += "]";
  }
  return out + "]";
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (size_t start = 0;;) {
    const size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) return out;
    start = end + 1;
  }
}

std::string_view TrimBlanks(std::string_view s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// "1,2,3;4,5,6,7": sequences split at ';', ids at ',', blanks around either allowed.
Result<std::vector<std::vector<int64_t>>> ParseIds(std::string_view text) {
  std::vector<std::vector<int64_t>> out;
  for (std::string_view seq : Split(text, ';')) {
    std::vector<int64_t> ids;
    for (std::string_view raw : Split(seq, ',')) {
      const std::string_view id = TrimBlanks(raw);
      // 18 digits: below 2^63, so stoll cannot overflow; the model refuses ids past its vocabulary.
      if (id.empty() || id.size() > 18 || id.find_first_not_of("0123456789") != std::string_view::npos) {
        return Status::InvalidArgument("--ids: sequence " + std::to_string(out.size()) + ", token " +
                                       std::to_string(ids.size()) + ": " + QuoteForMessage(id, 32) +
                                       " is not a token id (a decimal integer >= 0)");
      }
      ids.push_back(std::stoll(std::string(id)));
    }
    out.push_back(std::move(ids));
  }
  return out;
}

Status RunOnce(const ProbeFlags& f) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::vector<int64_t>> sequences, ParseIds(f.ids));
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<LoadedModel> m,
                         LoadModel(f.model.string(), f.adapter.string(), "--model", "--adapter"));
  const auto t0 = std::chrono::steady_clock::now();
  FERRY_ASSIGN_OR_RETURN(auto values, runtime::PromptLogProbs(*m->model, m->lora(), sequences));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (f.json) {
    const json adapter = f.adapter.empty() ? json(nullptr) : json(f.adapter.string());
    std::printf("{\"model\": %s, \"adapter\": %s, \"logprobs\": %s}\n",
                json(f.model.string()).dump(-1, ' ', false, json::error_handler_t::replace).c_str(),
                adapter.dump(-1, ' ', false, json::error_handler_t::replace).c_str(), LogProbsJson(values).c_str());
  } else {
    for (const auto& row : values) {
      for (size_t t = 0; t < row.size(); ++t) std::printf(t ? " %.9g" : "%.9g", static_cast<double>(row[t]));
      std::printf("\n");
    }
  }
  std::fflush(stdout);
  std::fprintf(stderr, "ferryd: prompt log-probabilities of %zu sequence%s in %.3f s\n", values.size(),
               values.size() == 1 ? "" : "s", seconds);
  return Status::OK();
}

// --- serve mode ---

// One parsed request line.
struct ProbeRequest {
  std::string model, adapter;
  std::vector<std::vector<int64_t>> sequences;
};

// `v` as JSON for a message (control characters escaped by the dump), cut after 40 bytes.
std::string JsonSnippet(const json& v) {
  const std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.size() <= 40 ? text : text.substr(0, 40) + "...";
}

Result<ProbeRequest> ParseRequest(const std::string& line) {
  const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status::InvalidArgument("request is not a JSON object: " + QuoteForMessage(line, 80));
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "model" && key != "adapter" && key != "sequences") {
      return Status::InvalidArgument("unknown field " + QuoteForMessage(key, 64) +
                                     " (a request has 'model', 'adapter' and 'sequences')");
    }
  }
  ProbeRequest r;
  if (!j.contains("model") || !j["model"].is_string() || j["model"].get_ref<const std::string&>().empty()) {
    return Status::InvalidArgument("field 'model' must be a model directory (a non-empty string)");
  }
  r.model = j["model"].get<std::string>();
  if (j.contains("adapter") && !j["adapter"].is_null()) {
    if (!j["adapter"].is_string() || j["adapter"].get_ref<const std::string&>().empty()) {
      return Status::InvalidArgument("field 'adapter' must be an adapter directory (a non-empty string) or null");
    }
    r.adapter = j["adapter"].get<std::string>();
  }
  if (!j.contains("sequences") || !j["sequences"].is_array() || j["sequences"].empty()) {
    return Status::InvalidArgument("field 'sequences' must be a non-empty list of lists of token ids");
  }
  const json& seqs = j["sequences"];
  if (seqs.size() > kMaxSequences) {
    return Status::InvalidArgument("field 'sequences' holds " + std::to_string(seqs.size()) +
                                   " sequences, more than the " + std::to_string(kMaxSequences) +
                                   " a request may hold");
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::string where = "field 'sequences'[" + std::to_string(i) + "]";
    if (!seqs[i].is_array()) return Status::InvalidArgument(where + " must be a list of token ids");
    std::vector<int64_t> ids;
    ids.reserve(seqs[i].size());
    for (size_t t = 0; t < seqs[i].size(); ++t) {
      const json& id = seqs[i][t];
      const bool fits =
          id.is_number_integer() && (!id.is_number_unsigned() ||
                                     id.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
      if (!fits) {
        return Status::InvalidArgument(where + "[" + std::to_string(t) + "] is not a token id: " + JsonSnippet(id));
      }
      ids.push_back(id.get<int64_t>());
    }
    r.sequences.push_back(std::move(ids));
  }
  return r;
}

// The most recently used loaded models by (model dir, adapter dir) as given: version directories
// are immutable, so a path names one set of weights for the prober's life.
class ModelCache {
 public:
  Result<const LoadedModel*> Get(const std::string& model_dir, const std::string& adapter_dir) {
    for (auto it = models_.begin(); it != models_.end(); ++it) {
      if ((*it)->model_dir == model_dir && (*it)->adapter_dir == adapter_dir) {
        models_.splice(models_.begin(), models_, it);
        return models_.front().get();
      }
    }
    // Evict first, so no more than kCachedModels are ever held at once.
    while (models_.size() >= kCachedModels) models_.pop_back();
    auto loaded = LoadModel(model_dir, adapter_dir, "field 'model'", "field 'adapter'");
    if (!loaded.ok()) return loaded.status();
    models_.push_front(std::move(*loaded));
    return models_.front().get();
  }

 private:
  std::list<std::unique_ptr<LoadedModel>> models_;
};

std::string ErrorLine(const Status& s) {
  nlohmann::ordered_json j;
  j["ok"] = false;
  j["error"] = s.message();
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

// The answer line (without its newline) to one request line.
std::string Answer(ModelCache& cache, const std::string& line) {
  const auto t0 = std::chrono::steady_clock::now();
  Result<ProbeRequest> r = ParseRequest(line);
  if (!r.ok()) return ErrorLine(r.status());
  Result<const LoadedModel*> m = cache.Get(r->model, r->adapter);
  if (!m.ok()) return ErrorLine(m.status());
  auto values = runtime::PromptLogProbs(*(*m)->model, (*m)->lora(), r->sequences);
  if (!values.ok()) return ErrorLine(values.status().WithContext("field 'sequences'"));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char secs[32];
  std::snprintf(secs, sizeof(secs), "%.6f", seconds);
  return "{\"ok\": true, \"logprobs\": " + LogProbsJson(*values) + ", \"seconds\": " + secs + "}";
}

enum class LineRead { kLine, kTooLong, kEof };

// One line of `in` without its '\n' (a last line without one counts). A line longer than `max`
// bytes is read to its end and dropped: kTooLong.
LineRead ReadBoundedLine(std::FILE* in, size_t max, std::string& line) {
  line.clear();
  bool too_long = false, any = false;
  for (int c; (c = getc_unlocked(in)) != EOF;) {
    any = true;
    if (c == '\n') return too_long ? LineRead::kTooLong : LineRead::kLine;
    if (line.size() < max) {
      line.push_back(static_cast<char>(c));
    } else {
      too_long = true;
    }
  }
  if (!any) return LineRead::kEof;
  return too_long ? LineRead::kTooLong : LineRead::kLine;
}

Status Serve() {
  ModelCache cache;
  std::string line;
  for (;;) {
    const LineRead got = ReadBoundedLine(stdin, kMaxRequestBytes, line);
    if (got == LineRead::kEof) break;
    std::string answer;
    if (got == LineRead::kTooLong) {
      answer =
          ErrorLine(Status::InvalidArgument("request line longer than " + std::to_string(kMaxRequestBytes) + " bytes"));
    } else if (line.find_first_not_of(" \t\r") == std::string::npos) {
      continue;  // a blank line is no request
    } else {
      try {
        answer = Answer(cache, line);
      } catch (const std::exception& e) {  // e.g. std::bad_alloc: an error answer, not an exit
        answer = ErrorLine(Status::Internal(std::string("probe: ") + e.what()));
      }
    }
    std::fputs(answer.c_str(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
  }
  if (std::ferror(stdin)) return Status::IOError("probe: reading stdin failed");
  return Status::OK();
}

Status RunProbe(const ProbeFlags& f) {
  const int threads = SetUpTorch(f.threads);
  if (!f.serve) return RunOnce(f);
  std::fprintf(stderr, "ferryd: probe serving requests from stdin (%d threads)\n", threads);
  return Serve();
}

}  // namespace

void SetProbeCommand(CLI::App& app) {
  auto f = std::make_shared<ProbeFlags>();
  CLI::App* cmd = app.add_subcommand(
      "probe",
      "Reference prompt log-probabilities (vLLM's prompt_logprobs) of token-id sequences under a model (and "
      "adapter), in F32");
  auto* model = cmd->add_option("--model", f->model, "Hugging Face model directory (config.json, safetensors)");
  auto* adapter = cmd->add_option("--adapter", f->adapter, "PEFT LoRA adapter directory to apply");
  auto* ids =
      cmd->add_option("--ids", f->ids, "token-id sequences, ids split by ',' and sequences by ';': \"1,2,3;4,5\"");
  auto* as_json = cmd->add_flag("--json", f->json,
                                "print {\"model\", \"adapter\", \"logprobs\": [[...], ...]} instead of one line of "
                                "log-probabilities per sequence");
  auto* serve = cmd->add_flag(
      "--serve", f->serve,
      "answer requests on stdin, one JSON line each: {\"model\": DIR, \"adapter\": DIR (optional), \"sequences\": "
      "[[ids], ...]} -> {\"ok\": true, \"logprobs\": [[...]], \"seconds\": S} or {\"ok\": false, \"error\": MESSAGE}; "
      "the 2 most recently used models stay loaded");
  serve->excludes(model)->excludes(adapter)->excludes(ids)->excludes(as_json);
  cmd->add_option("--threads", f->threads, "LibTorch threads (default: all hardware threads)");
  cmd->callback([f, model, ids] {
    if (!f->serve && (model->count() == 0 || ids->count() == 0)) {
      Fail(Status::InvalidArgument("give --model DIR and --ids \"1,2,3;4,5\", or --serve"));
    }
    Status s = RunProbe(*f);
    if (!s.ok()) Fail(s);
  });
}

}  // namespace ferry::ferryd
