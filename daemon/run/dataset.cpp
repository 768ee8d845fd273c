// Reading the JSONL dataset and the seeded epoch order (format and algorithm in dataset.h).
#include "daemon/run/dataset.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/mapped_file.h"
#include "kernels/hash.h"
#include "store/store.h"

namespace ferry::run {
namespace {

using Json = nlohmann::json;

std::string JsonTypeName(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::object: return "an object";
    case Json::value_t::array: return "an array";
    case Json::value_t::string: return "a string";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float: return "a number";
    default: return "something else";
  }
}

bool IsBlank(std::string_view line) {
  return std::all_of(line.begin(), line.end(), [](char c) { return c == ' ' || c == '\t'; });
}

class LineParser {
 public:
  LineParser(const std::string& source, uint64_t line, const DatasetOptions& options)
      : where_(source + ":" + std::to_string(line)), options_(options) {}

  Status Bad(const std::string& field, const std::string& what) const {
    return Status::Corruption(where_ + ": field '" + field + "': " + what);
  }

  Result<std::vector<ChatMessage>> Messages(const Json& list, const std::string& field) const {
    if (!options_.allow_messages) {
      return Bad(field,
                 "a list of chat messages, but chat_template is \"none\": set chat_template (\"auto\", "
                 "\"chatml\" or \"llama3\") or give plain-text prompts");
    }
    if (list.empty()) return Bad(field, "must not be an empty list of messages");
    std::vector<ChatMessage> out;
    out.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string at = field + "[" + std::to_string(i) + "]";
      const Json& m = list[i];
      if (!m.is_object())
        return Bad(at, "must be a message {\"role\": ..., \"content\": ...} (got " + JsonTypeName(m) + ")");
      auto role = m.find("role");
      if (role == m.end()) return Bad(at + ".role", "missing");
      if (!role->is_string()) return Bad(at + ".role", "must be a string (got " + JsonTypeName(*role) + ")");
      const std::string& r = role->get_ref<const std::string&>();
      if (r != "system" && r != "user" && r != "assistant") {
        return Bad(at + ".role", "must be \"system\", \"user\" or \"assistant\" (got \"" + r.substr(0, 40) + "\")");
      }
      auto content = m.find("content");
      if (content == m.end()) return Bad(at + ".content", "missing");
      if (!content->is_string()) {
        return Bad(at + ".content",
                   "must be a string (got " + JsonTypeName(*content) + "; multimodal content is not supported)");
      }
      out.push_back({r, content->get<std::string>()});
    }
    const std::string& last = out.back().role;
    if (last == "assistant") {
      return Bad(field,
                 "ends with an assistant message: ferryd generates the assistant turn, so a prompt must end "
                 "with a user message (put a reference answer in a field of its own)");
    }
    if (last != "user") return Bad(field, "must end with a user message (it ends with a " + last + " message)");
    return out;
  }

  Status Fill(const Json& obj, Example& ex) const {
    if (!obj.is_object()) return Status::Corruption(where_ + ": not a JSON object (got " + JsonTypeName(obj) + ")");
    auto prompt = obj.find("prompt");
    auto messages = obj.find("messages");
    if (prompt != obj.end() && messages != obj.end()) {
      return Bad("messages", "an example has either 'prompt' or 'messages', not both");
    }
    if (prompt == obj.end() && messages == obj.end()) {
      return Bad("prompt", "missing: an example needs 'prompt' (a string or a list of messages) or 'messages'");
    }
    if (prompt != obj.end()) {
      if (prompt->is_string()) {
        ex.prompt = prompt->get<std::string>();
        if (ex.prompt.empty()) return Bad("prompt", "must not be empty");
      } else if (prompt->is_array()) {
        FERRY_ASSIGN_OR_RETURN(ex.messages, Messages(*prompt, "prompt"));
      } else {
        return Bad("prompt", "must be a string or a list of messages (got " + JsonTypeName(*prompt) + ")");
      }
    } else {
      if (!messages->is_array())
        return Bad("messages", "must be a list of messages (got " + JsonTypeName(*messages) + ")");
      FERRY_ASSIGN_OR_RETURN(ex.messages, Messages(*messages, "messages"));
    }
    for (auto it = obj.begin(); it != obj.end(); ++it) {
      if (it->is_string()) {
        ex.fields.emplace_back(it.key(), it->get<std::string>());
      } else if (it->is_number()) {
        ex.fields.emplace_back(it.key(), it->dump());
      }
    }
    // nlohmann's objects are sorted by key already; keep the promise explicit.
    std::sort(ex.fields.begin(), ex.fields.end());
    for (const std::string& f : options_.required_fields) {
      if (ex.Field(f) != nullptr) continue;
      auto it = obj.find(f);
      if (it == obj.end()) return Bad(f, "missing (a reward reads it)");
      return Bad(f, "must be a string or a number for the reward that reads it (got " + JsonTypeName(*it) + ")");
    }
    return Status::OK();
  }

  const std::string& where() const { return where_; }

 private:
  std::string where_;
  const DatasetOptions& options_;
};

// SplitMix64 and xoshiro256** (dataset.h spells them out).
struct SplitMix64 {
  uint64_t x;
  uint64_t Next() {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

struct Xoshiro256StarStar {
  uint64_t s[4];
  static uint64_t Rotl(uint64_t v, int k) { return (v << k) | (v >> (64 - k)); }
  uint64_t Next() {
    const uint64_t result = Rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = Rotl(s[3], 45);
    return result;
  }
  // Uniform in [0, m), m >= 1, by rejection.
  uint64_t Uniform(uint64_t m) {
    const uint64_t threshold = (0 - m) % m;  // (2^64 - m) mod m
    while (true) {
      const uint64_t r = Next();
      if (r >= threshold) return r % m;
    }
  }
};

}  // namespace

const std::string* Example::Field(std::string_view name) const {
  auto it =
      std::lower_bound(fields.begin(), fields.end(), name,
                       [](const std::pair<std::string, std::string>& f, std::string_view n) { return f.first < n; });
  if (it == fields.end() || it->first != name) return nullptr;
  return &it->second;
}

DatasetOptions DatasetOptionsFor(const RunConfig& config) {
  DatasetOptions o;
  for (const RewardSpec& r : config.rewards) {
    if ((r.type == RewardType::kAnswerMatch || r.type == RewardType::kDigitMatch) &&
        std::find(o.required_fields.begin(), o.required_fields.end(), r.field) == o.required_fields.end()) {
      o.required_fields.push_back(r.field);
    }
  }
  o.allow_messages = config.chat_template != ChatTemplate::kNone;
  return o;
}

Result<std::shared_ptr<const Dataset>> Dataset::Parse(std::string_view text, std::string source,
                                                      const DatasetOptions& options) {
  if (text.size() > options.max_file_bytes) {
    return Status::Unsupported(source + ": " + std::to_string(text.size()) + " bytes; a dataset has at most " +
                               std::to_string(options.max_file_bytes) + " (DatasetOptions::max_file_bytes)");
  }
  std::shared_ptr<Dataset> ds(new Dataset());
  ds->source_ = source;
  const kernels::Hash128 h = kernels::Xxh3_128(text.data(), text.size());
  ds->digest_ = store::Digest{h.hi, h.lo}.Hex();
  size_t pos = 0;
  uint64_t line_no = 0;
  if (text.substr(0, 3) == "\xEF\xBB\xBF") pos = 3;
  while (pos < text.size()) {
    ++line_no;
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.size() > options.max_line_bytes) {
      return Status::Unsupported(source + ":" + std::to_string(line_no) + ": a line of " + std::to_string(line.size()) +
                                 " bytes; at most " + std::to_string(options.max_line_bytes) +
                                 " (DatasetOptions::max_line_bytes)");
    }
    if (IsBlank(line)) continue;
    if (ds->examples_.size() >= options.max_examples || ds->examples_.size() >= (size_t{1} << 32)) {
      return Status::Unsupported(source + ":" + std::to_string(line_no) + ": more than " +
                                 std::to_string(std::min(options.max_examples, size_t{1} << 32)) +
                                 " examples (DatasetOptions::max_examples)");
    }
    LineParser lp(source, line_no, options);
    if (JsonNestsDeeperThan(line, options.max_json_depth)) {
      return Status::Corruption(lp.where() + ": JSON nested deeper than " + std::to_string(options.max_json_depth));
    }
    Json obj;
    try {
      obj = Json::parse(line);
    } catch (const Json::exception& e) {
      std::string what = e.what();
      if (auto at = what.find("parse error"); at != std::string::npos) what = what.substr(at);
      return Status::Corruption(lp.where() + ": not valid JSON: " + what);
    }
    Example ex;
    ex.index = ds->examples_.size();
    ex.line = line_no;
    FERRY_RETURN_IF_ERROR(lp.Fill(obj, ex));
    ex.json = std::string(line);
    ds->examples_.push_back(std::move(ex));
  }
  if (ds->examples_.empty()) return Status::InvalidArgument(source + ": no examples (the dataset is empty)");
  return std::shared_ptr<const Dataset>(std::move(ds));
}

Result<std::shared_ptr<const Dataset>> Dataset::Load(const std::filesystem::path& path, const DatasetOptions& options) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return Status::NotFound(path.string() + ": no such dataset file");
  if (!std::filesystem::is_regular_file(path, ec))
    return Status::InvalidArgument(path.string() + ": not a regular file");
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<MappedFile> file, MappedFile::Open(path));
  if (file->size() > options.max_file_bytes) {
    return Status::Unsupported(path.string() + ": " + std::to_string(file->size()) + " bytes; a dataset has at most " +
                               std::to_string(options.max_file_bytes) + " (DatasetOptions::max_file_bytes)");
  }
  file->AdviseSequential(0, file->size());
  const auto bytes = file->bytes();
  return Parse(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path.string(), options);
}

std::vector<uint32_t> EpochOrder(uint64_t n, uint64_t seed, uint64_t epoch, bool shuffle) {
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  if (!shuffle || n < 2) return order;
  SplitMix64 sm{seed ^ (epoch * 0x9E3779B97F4A7C15ull)};
  Xoshiro256StarStar rng{{sm.Next(), sm.Next(), sm.Next(), sm.Next()}};
  for (uint64_t i = n - 1; i >= 1; --i) {
    const uint64_t j = rng.Uniform(i + 1);
    std::swap(order[i], order[j]);
  }
  return order;
}

DatasetSampler::DatasetSampler(std::shared_ptr<const Dataset> dataset, uint64_t seed, bool shuffle)
    : dataset_(std::move(dataset)), seed_(seed), shuffle_(shuffle) {
  EnterEpoch(0);
}

DatasetSampler::DatasetSampler(std::shared_ptr<const Dataset> dataset, const RunConfig& config)
    : DatasetSampler(std::move(dataset), static_cast<uint64_t>(config.seed), config.shuffle_dataset) {}

void DatasetSampler::EnterEpoch(uint64_t epoch) {
  epoch_ = epoch;
  index_ = 0;
  order_ = EpochOrder(dataset_->size(), seed_, epoch_, shuffle_);
}

std::vector<size_t> DatasetSampler::NextIndices(size_t k) {
  std::vector<size_t> out;
  out.reserve(k);
  while (out.size() < k) {
    if (index_ == order_.size()) EnterEpoch(epoch_ + 1);
    out.push_back(order_[index_++]);
  }
  return out;
}

std::vector<const Example*> DatasetSampler::Next(size_t k) {
  std::vector<const Example*> out;
  out.reserve(k);
  for (size_t i : NextIndices(k)) out.push_back(&(*dataset_)[i]);
  return out;
}

DatasetPosition DatasetSampler::position() const {
  if (index_ == order_.size()) return {epoch_ + 1, 0};
  return {epoch_, index_};
}

Status DatasetSampler::Seek(DatasetPosition p) {
  if (p.index >= dataset_->size()) {
    return Status::InvalidArgument(dataset_->source() + ": dataset position index " + std::to_string(p.index) +
                                   " is not below its " + std::to_string(dataset_->size()) +
                                   " examples (a position saved for another dataset?)");
  }
  if (p.epoch != epoch_ || order_.size() != dataset_->size()) EnterEpoch(p.epoch);
  index_ = p.index;
  return Status::OK();
}

}  // namespace ferry::run
