// tokenizer.json and tokenizer_config.json -> TokenizerImpl. Every refusal names the file
// and the JSON path of the field at fault.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/json_limits.h"
#include "daemon/text/auto_tokenizer.h"
#include "daemon/text/tokenizer_impl.h"
#include "daemon/text/unicode.h"

namespace ferry::text {
namespace {

using json = nlohmann::json;

std::string Quote(std::string_view s) {
  // Short, printable quotations for messages: control characters escaped, long text cut.
  std::string out = "\"";
  size_t n = 0;
  for (char c : s) {
    if (++n > 80) {
      out += "...";
      break;
    }
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", u);
      out += buf;
    } else if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string TypeName(const json& j) { return j.type_name(); }

// model.vocab and model.merges, read straight from the SAX events (151k-entry objects and
// arrays are most of a tokenizer.json; a DOM of them costs more than all the rest).
struct StreamedModel {
  bool have_vocab = false;                              // model.vocab was an object
  bool have_merges = false;                             // model.merges was an array
  std::vector<std::pair<std::string, uint64_t>> vocab;  // file order
  std::vector<std::pair<std::string, std::string>> merges;
};

// Builds the DOM of a tokenizer.json except for model.vocab (an object) and model.merges (an
// array), which go to a StreamedModel; any other shape of those two stays in the DOM, where
// the parser refuses it. Refusals found while streaming stop the parse with `error` set.
class TokenizerJsonSax {
 public:
  TokenizerJsonSax(json* root, StreamedModel* model) : dom_(*root, /*allow_exceptions=*/false), model_(model) {}

  Status error;  // set when a streamed field is refused or the JSON is malformed

  bool null() {
    return Scalar("null", [&] { return dom_.null(); });
  }
  bool boolean(bool v) {
    return Scalar("boolean", [&] { return dom_.boolean(v); });
  }
  bool number_float(double v, const std::string& text) {
    return Scalar(text, [&] { return dom_.number_float(v, text); });
  }
  bool binary(json::binary_t& v) {
    return Scalar("binary", [&] { return dom_.binary(v); });
  }
  bool number_integer(int64_t v) {
    if (mode_ == Mode::kVocab && v >= 0) return AddVocab(static_cast<uint64_t>(v));
    return Scalar(std::to_string(v), [&] { return dom_.number_integer(v); });
  }
  bool number_unsigned(uint64_t v) {
    if (mode_ == Mode::kVocab) return AddVocab(v);
    return Scalar(std::to_string(v), [&] { return dom_.number_unsigned(v); });
  }
  bool string(std::string& v) {
    if (mode_ == Mode::kVocab) return Refuse(VocabAt(), "must be a non-negative integer, not string");
    if (mode_ == Mode::kMerges) {
      if (in_pair_) {
        pair_.push_back(std::move(v));
        return true;
      }
      const size_t sp = v.find(' ');
      if (sp == std::string::npos || v.find(' ', sp + 1) != std::string::npos) {
        return Refuse(MergeAt(), Quote(v) + " is not two tokens separated by one space");
      }
      return AddMerge(v.substr(0, sp), v.substr(sp + 1));
    }
    return dom_.string(v);
  }
  bool key(std::string& k) {
    if (mode_ == Mode::kVocab) {
      vocab_key_ = k;
      return true;
    }
    if (depth_ == 1) root_key_ = k;
    if (in_model_ && depth_ == 2) model_key_ = k;
    return dom_.key(k);
  }
  bool start_object(std::size_t n) {
    if (mode_ == Mode::kVocab) return Refuse(VocabAt(), "must be a non-negative integer, not object");
    if (mode_ == Mode::kMerges) return Refuse(MergeAt(), "must be \"a b\" or [\"a\", \"b\"]");
    if (depth_ == 1 && root_key_ == "model") {
      in_model_ = true;
      *model_ = StreamedModel();  // a repeated "model" key: the last one counts, as in the DOM
    } else if (in_model_ && depth_ == 2 && model_key_ == "vocab") {
      ++depth_;
      mode_ = Mode::kVocab;
      model_->have_vocab = true;
      model_->vocab.clear();
      return true;
    }
    ++depth_;
    return dom_.start_object(n);
  }
  bool end_object() {
    --depth_;
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kNone;
      return true;
    }
    if (in_model_ && depth_ == 1) in_model_ = false;
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    if (mode_ == Mode::kVocab) return Refuse(VocabAt(), "must be a non-negative integer, not array");
    if (mode_ == Mode::kMerges) {
      if (in_pair_) return Refuse(MergeAt(), "must be \"a b\" or [\"a\", \"b\"]");
      in_pair_ = true;
      pair_.clear();
      ++depth_;
      return true;
    }
    if (in_model_ && depth_ == 2 && model_key_ == "merges") {
      ++depth_;
      mode_ = Mode::kMerges;
      model_->have_merges = true;
      model_->merges.clear();
      return true;
    }
    ++depth_;
    return dom_.start_array(n);
  }
  bool end_array() {
    --depth_;
    if (mode_ == Mode::kMerges) {
      if (!in_pair_) {
        mode_ = Mode::kNone;
        return true;
      }
      in_pair_ = false;
      if (pair_.size() != 2) return Refuse(MergeAt(), "must be \"a b\" or [\"a\", \"b\"]");
      return AddMerge(std::move(pair_[0]), std::move(pair_[1]));
    }
    return dom_.end_array();
  }
  bool parse_error(std::size_t position, const std::string& last_token, const nlohmann::detail::exception& ex) {
    if (error.ok()) error = Status::Corruption(std::string("not valid JSON (") + ex.what() + ")");
    return false;
  }

 private:
  enum class Mode { kNone, kVocab, kMerges };

  // A scalar event: refused inside the streamed fields, else given to the DOM.
  template <typename F>
  bool Scalar(const std::string& shown, F forward) {
    if (mode_ == Mode::kVocab) {
      return Refuse(VocabAt(), "must be a non-negative integer, not " + shown);
    }
    if (mode_ == Mode::kMerges) return Refuse(MergeAt(), "must be \"a b\" or [\"a\", \"b\"]");
    return forward();
  }
  bool AddVocab(uint64_t id) {
    if (model_->vocab.size() >= kMaxVocabSize) {
      error = Status::Unsupported("model.vocab has more than " + std::to_string(kMaxVocabSize) + " entries");
      return false;
    }
    model_->vocab.emplace_back(std::move(vocab_key_), id);
    return true;
  }
  bool AddMerge(std::string a, std::string b) {
    if (model_->merges.size() >= kMaxMerges) {
      error = Status::Unsupported("model.merges has more than " + std::to_string(kMaxMerges) + " entries");
      return false;
    }
    model_->merges.emplace_back(std::move(a), std::move(b));
    return true;
  }
  bool Refuse(const std::string& path, const std::string& what) {
    error = Status::Corruption(path + " " + what);
    return false;
  }
  std::string VocabAt() const { return "model.vocab[" + Quote(vocab_key_) + "]"; }
  std::string MergeAt() const { return "model.merges[" + std::to_string(model_->merges.size()) + "]"; }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  StreamedModel* model_;
  int depth_ = 0;
  bool in_model_ = false;
  std::string root_key_, model_key_, vocab_key_;
  Mode mode_ = Mode::kNone;
  bool in_pair_ = false;
  std::vector<std::string> pair_;
};

class Parser {
 public:
  explicit Parser(std::string_view source) : src_(source) {}

  Status Corrupt(const std::string& path, const std::string& what) const {
    return Status::Corruption(src_ + ": " + path + " " + what);
  }
  Status Unsupported(const std::string& path, const std::string& what) const {
    return Status::Unsupported(src_ + ": " + path + " " + what);
  }

  static std::string Join(const std::string& path, std::string_view key) {
    return path.empty() ? std::string(key) : path + "." + std::string(key);
  }
  static std::string Index(const std::string& path, size_t i) { return path + "[" + std::to_string(i) + "]"; }

  // The value of `key` in object `obj`, or null when absent.
  static const json* Find(const json& obj, std::string_view key) {
    const auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
  }

  Status RequireObject(const json& j, const std::string& path) const {
    if (!j.is_object()) return Corrupt(path, "must be an object, not " + TypeName(j));
    return Status::OK();
  }
  Status RequireArray(const json& j, const std::string& path) const {
    if (!j.is_array()) return Corrupt(path, "must be an array, not " + TypeName(j));
    return Status::OK();
  }

  Result<bool> Bool(const json& obj, const std::string& path, std::string_view key, bool def) const {
    const json* v = Find(obj, key);
    if (v == nullptr || v->is_null()) return def;
    if (!v->is_boolean()) return Corrupt(Join(path, key), "must be true or false, not " + TypeName(*v));
    return v->get<bool>();
  }

  Result<std::string> String(const json& obj, const std::string& path, std::string_view key) const {
    const json* v = Find(obj, key);
    if (v == nullptr) return Corrupt(Join(path, key), "is missing");
    if (!v->is_string()) return Corrupt(Join(path, key), "must be a string, not " + TypeName(*v));
    return v->get<std::string>();
  }

  // An optional string: nullopt when absent or null.
  Result<std::optional<std::string>> OptString(const json& obj, const std::string& path, std::string_view key) const {
    const json* v = Find(obj, key);
    if (v == nullptr || v->is_null()) return std::optional<std::string>();
    if (!v->is_string()) return Corrupt(Join(path, key), "must be a string or null, not " + TypeName(*v));
    return std::optional<std::string>(v->get<std::string>());
  }

  Result<uint64_t> Unsigned(const json& v, const std::string& path, uint64_t max) const {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
      return Corrupt(path, "must be a non-negative integer, not " + (v.is_number() ? v.dump() : TypeName(v)));
    }
    const auto u = v.get<uint64_t>();
    if (u > max) return Corrupt(path, std::to_string(u) + " is larger than " + std::to_string(max));
    return u;
  }

  // One character of text (Metaspace replacement, Strip content).
  Result<char32_t> Char(const json& obj, const std::string& path, std::string_view key) const {
    FERRY_ASSIGN_OR_RETURN(std::string s, String(obj, path, key));
    size_t i = 0;
    const char32_t cp = s.empty() ? 0 : NextCodePoint(s, &i);
    if (s.empty() || i != s.size()) return Corrupt(Join(path, key), Quote(s) + " must be exactly one character");
    return cp;
  }

  Result<std::string> Type(const json& obj, const std::string& path) const {
    FERRY_RETURN_IF_ERROR(RequireObject(obj, path));
    return String(obj, path, "type");
  }

  Result<Pattern> ParsePattern(const json& obj, const std::string& path) const {
    const json* p = Find(obj, "pattern");
    const std::string at = Join(path, "pattern");
    if (p == nullptr) return Corrupt(at, "is missing");
    if (!p->is_object() || p->size() != 1) return Corrupt(at, "must be {\"String\": ...} or {\"Regex\": ...}");
    const auto first = p->begin();
    const std::string kind = first.key();
    const json& value = first.value();
    const std::string vat = Join(at, kind);
    if (kind != "String" && kind != "Regex") return Corrupt(at, "must be {\"String\": ...} or {\"Regex\": ...}");
    if (!value.is_string()) return Corrupt(vat, "must be a string, not " + TypeName(value));
    const auto text = value.get<std::string>();
    if (text.size() > kMaxPatternBytes) {
      return Unsupported(vat, "is longer than " + std::to_string(kMaxPatternBytes) + " bytes");
    }
    if (kind == "String") {
      if (text.empty()) return Unsupported(vat, "\"\" (an empty pattern) is not supported");
      return Pattern::Literal(text);
    }
    return Pattern::Regex(text, src_ + ": " + vat);
  }

  Result<PrependScheme> ParsePrependScheme(const json& obj, const std::string& path) const {
    FERRY_ASSIGN_OR_RETURN(auto scheme_text, OptString(obj, path, "prepend_scheme"));
    PrependScheme scheme = PrependScheme::kAlways;
    if (scheme_text) {
      if (*scheme_text == "first") {
        scheme = PrependScheme::kFirst;
      } else if (*scheme_text == "never") {
        scheme = PrependScheme::kNever;
      } else if (*scheme_text != "always") {
        return Corrupt(Join(path, "prepend_scheme"), Quote(*scheme_text) + " is not always, first or never");
      }
    }
    const json* aps = Find(obj, "add_prefix_space");
    if (aps != nullptr && !aps->is_null()) {
      if (!aps->is_boolean()) return Corrupt(Join(path, "add_prefix_space"), "must be true or false");
      if (!aps->get<bool>()) {
        // As upstream: false requires prepend_scheme "never" (the default is "always").
        if (scheme != PrependScheme::kNever) {
          return Corrupt(Join(path, "add_prefix_space"),
                         "false does not match prepend_scheme " + Quote(scheme_text ? *scheme_text : "always"));
        }
        scheme = PrependScheme::kNever;
      }
    }
    return scheme;
  }

  Result<std::unique_ptr<Normalizer>> ParseNormalizer(const json& j, const std::string& path) const {
    FERRY_ASSIGN_OR_RETURN(const std::string type, Type(j, path));
    if (type == "NFC") return MakeNfc();
    if (type == "Prepend") {
      FERRY_ASSIGN_OR_RETURN(std::string prepend, String(j, path, "prepend"));
      if (prepend.size() > kMaxPatternBytes) return Unsupported(Join(path, "prepend"), "is too long");
      return MakePrepend(std::move(prepend));
    }
    if (type == "Replace") {
      FERRY_ASSIGN_OR_RETURN(Pattern pattern, ParsePattern(j, path));
      FERRY_ASSIGN_OR_RETURN(std::string content, String(j, path, "content"));
      if (content.size() > kMaxPatternBytes) return Unsupported(Join(path, "content"), "is too long");
      return MakeReplace(std::move(pattern), std::move(content));
    }
    if (type == "Sequence") {
      const std::string at = Join(path, "normalizers");
      const json* list = Find(j, "normalizers");
      if (list == nullptr) return Corrupt(at, "is missing");
      FERRY_RETURN_IF_ERROR(RequireArray(*list, at));
      std::vector<std::unique_ptr<Normalizer>> steps;
      for (size_t i = 0; i < list->size(); ++i) {
        FERRY_ASSIGN_OR_RETURN(auto step, ParseNormalizer((*list)[i], Index(at, i)));
        steps.push_back(std::move(step));
      }
      return MakeNormalizerSequence(std::move(steps));
    }
    return Unsupported(Join(path, "type"), Quote(type) + " is not supported");
  }

  // `has_normalizer`: Metaspace's "first" scheme is refused with a normalizer (see below).
  Result<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const json& j, const std::string& path,
                                                          bool has_normalizer) const {
    FERRY_ASSIGN_OR_RETURN(const std::string type, Type(j, path));
    if (type == "ByteLevel") {
      FERRY_ASSIGN_OR_RETURN(const bool add_prefix_space, Bool(j, path, "add_prefix_space", true));
      FERRY_ASSIGN_OR_RETURN(const bool use_regex, Bool(j, path, "use_regex", true));
      std::shared_ptr<const Pattern> regex;
      if (use_regex) {
        FERRY_ASSIGN_OR_RETURN(Pattern p, Pattern::Regex(kGpt2Pattern, "the GPT-2 pattern"));
        regex = std::make_shared<const Pattern>(std::move(p));
      }
      return MakeByteLevelPreTokenizer(add_prefix_space, std::move(regex));
    }
    if (type == "Split") {
      FERRY_ASSIGN_OR_RETURN(Pattern pattern, ParsePattern(j, path));
      FERRY_ASSIGN_OR_RETURN(const std::string behavior_text, String(j, path, "behavior"));
      SplitBehavior behavior;
      if (behavior_text == "Removed") {
        behavior = SplitBehavior::kRemoved;
      } else if (behavior_text == "Isolated") {
        behavior = SplitBehavior::kIsolated;
      } else if (behavior_text == "MergedWithPrevious") {
        behavior = SplitBehavior::kMergedWithPrevious;
      } else if (behavior_text == "MergedWithNext") {
        behavior = SplitBehavior::kMergedWithNext;
      } else if (behavior_text == "Contiguous") {
        behavior = SplitBehavior::kContiguous;
      } else {
        return Corrupt(Join(path, "behavior"), Quote(behavior_text) + " is not a split behavior");
      }
      FERRY_ASSIGN_OR_RETURN(const bool invert, Bool(j, path, "invert", false));
      return MakeSplit(std::move(pattern), behavior, invert);
    }
    if (type == "Metaspace") {
      FERRY_ASSIGN_OR_RETURN(const char32_t replacement, Char(j, path, "replacement"));
      FERRY_ASSIGN_OR_RETURN(const PrependScheme scheme, ParsePrependScheme(j, path));
      FERRY_ASSIGN_OR_RETURN(const bool split, Bool(j, path, "split", true));
      if (scheme == PrependScheme::kFirst && has_normalizer) {
        // "first" asks whether a piece starts at offset 0 of the original text, which a
        // normalizer's alignment decides; real tokenizers never combine the two.
        return Unsupported(Join(path, "prepend_scheme"), "\"first\" together with a normalizer is not supported");
      }
      return MakeMetaspace(replacement, scheme, split);
    }
    if (type == "Sequence") {
      const std::string at = Join(path, "pretokenizers");
      const json* list = Find(j, "pretokenizers");
      if (list == nullptr) return Corrupt(at, "is missing");
      FERRY_RETURN_IF_ERROR(RequireArray(*list, at));
      std::vector<std::unique_ptr<PreTokenizer>> steps;
      for (size_t i = 0; i < list->size(); ++i) {
        FERRY_ASSIGN_OR_RETURN(auto step, ParsePreTokenizer((*list)[i], Index(at, i), has_normalizer));
        steps.push_back(std::move(step));
      }
      return MakePreTokenizerSequence(std::move(steps));
    }
    return Unsupported(Join(path, "type"), Quote(type) + " is not supported");
  }

  Result<std::unique_ptr<PostProcessor>> ParsePostProcessor(const json& j, const std::string& path,
                                                            int32_t vocab_size) const {
    FERRY_ASSIGN_OR_RETURN(const std::string type, Type(j, path));
    if (type == "ByteLevel") return MakeNoOpProcessor();  // it trims offsets only
    if (type == "TemplateProcessing") {
      const std::string st_at = Join(path, "special_tokens");
      const json* specials = Find(j, "special_tokens");
      if (specials == nullptr) return Corrupt(st_at, "is missing");
      FERRY_RETURN_IF_ERROR(RequireObject(*specials, st_at));
      std::unordered_map<std::string, std::vector<int32_t>> special_ids;
      for (const auto& [name, entry] : specials->items()) {
        const std::string at = Join(st_at, name);
        FERRY_RETURN_IF_ERROR(RequireObject(entry, at));
        const json* ids = Find(entry, "ids");
        const json* tokens = Find(entry, "tokens");
        if (ids == nullptr) return Corrupt(Join(at, "ids"), "is missing");
        FERRY_RETURN_IF_ERROR(RequireArray(*ids, Join(at, "ids")));
        if (tokens != nullptr && tokens->is_array() && tokens->size() != ids->size()) {
          return Corrupt(
              at, "has " + std::to_string(ids->size()) + " ids but " + std::to_string(tokens->size()) + " tokens");
        }
        std::vector<int32_t> list;
        for (size_t i = 0; i < ids->size(); ++i) {
          FERRY_ASSIGN_OR_RETURN(const uint64_t id, Unsigned((*ids)[i], Index(Join(at, "ids"), i), UINT32_MAX));
          if (id >= static_cast<uint64_t>(vocab_size)) {
            return Corrupt(Index(Join(at, "ids"), i), std::to_string(id) + " is not a token id (vocabulary size " +
                                                          std::to_string(vocab_size) + ")");
          }
          list.push_back(static_cast<int32_t>(id));
        }
        special_ids.emplace(name, std::move(list));
      }
      const std::string single_at = Join(path, "single");
      const json* single = Find(j, "single");
      if (single == nullptr) return Corrupt(single_at, "is missing");
      FERRY_RETURN_IF_ERROR(RequireArray(*single, single_at));
      std::vector<TemplatePiece> pieces;
      for (size_t i = 0; i < single->size(); ++i) {
        const json& p = (*single)[i];
        const std::string at = Index(single_at, i);
        if (!p.is_object() || p.size() != 1)
          return Corrupt(at, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
        const auto first = p.begin();
        const std::string kind = first.key();
        const json& body = first.value();
        FERRY_RETURN_IF_ERROR(RequireObject(body, Join(at, kind)));
        FERRY_ASSIGN_OR_RETURN(const std::string id, String(body, Join(at, kind), "id"));
        if (kind == "Sequence") {
          if (id != "A")
            return Unsupported(Join(Join(at, kind), "id"), Quote(id) + " in the single template is not supported");
          pieces.push_back({true, {}});
        } else if (kind == "SpecialToken") {
          const auto it = special_ids.find(id);
          if (it == special_ids.end())
            return Corrupt(Join(Join(at, kind), "id"), Quote(id) + " is not in special_tokens");
          pieces.push_back({false, it->second});
        } else {
          return Corrupt(at, "must be {\"SpecialToken\": ...} or {\"Sequence\": ...}");
        }
      }
      return MakeTemplateProcessing(std::move(pieces));
    }
    if (type == "Sequence") {
      const std::string at = Join(path, "processors");
      const json* list = Find(j, "processors");
      if (list == nullptr) return Corrupt(at, "is missing");
      FERRY_RETURN_IF_ERROR(RequireArray(*list, at));
      std::vector<std::unique_ptr<PostProcessor>> steps;
      for (size_t i = 0; i < list->size(); ++i) {
        FERRY_ASSIGN_OR_RETURN(auto step, ParsePostProcessor((*list)[i], Index(at, i), vocab_size));
        steps.push_back(std::move(step));
      }
      return MakeProcessorSequence(std::move(steps));
    }
    return Unsupported(Join(path, "type"), Quote(type) + " is not supported");
  }

  Result<std::unique_ptr<Decoder>> ParseDecoder(const json& j, const std::string& path) const {
    FERRY_ASSIGN_OR_RETURN(const std::string type, Type(j, path));
    if (type == "ByteLevel") return MakeByteLevelDecoder();
    if (type == "ByteFallback") return MakeByteFallbackDecoder();
    if (type == "Fuse") return MakeFuseDecoder();
    if (type == "Metaspace") {
      FERRY_ASSIGN_OR_RETURN(const char32_t replacement, Char(j, path, "replacement"));
      FERRY_ASSIGN_OR_RETURN(const PrependScheme scheme, ParsePrependScheme(j, path));
      return MakeMetaspaceDecoder(replacement, scheme);
    }
    if (type == "Replace") {
      FERRY_ASSIGN_OR_RETURN(Pattern pattern, ParsePattern(j, path));
      FERRY_ASSIGN_OR_RETURN(std::string content, String(j, path, "content"));
      if (content.size() > kMaxPatternBytes) return Unsupported(Join(path, "content"), "is too long");
      return MakeReplaceDecoder(std::move(pattern), std::move(content));
    }
    if (type == "Strip") {
      FERRY_ASSIGN_OR_RETURN(const char32_t content, Char(j, path, "content"));
      const json* start = Find(j, "start");
      const json* stop = Find(j, "stop");
      if (start == nullptr) return Corrupt(Join(path, "start"), "is missing");
      if (stop == nullptr) return Corrupt(Join(path, "stop"), "is missing");
      FERRY_ASSIGN_OR_RETURN(const uint64_t start_n, Unsigned(*start, Join(path, "start"), kMaxTokenBytes));
      FERRY_ASSIGN_OR_RETURN(const uint64_t stop_n, Unsigned(*stop, Join(path, "stop"), kMaxTokenBytes));
      return MakeStripDecoder(content, start_n, stop_n);
    }
    if (type == "Sequence") {
      const std::string at = Join(path, "decoders");
      const json* list = Find(j, "decoders");
      if (list == nullptr) return Corrupt(at, "is missing");
      FERRY_RETURN_IF_ERROR(RequireArray(*list, at));
      std::vector<std::unique_ptr<Decoder>> steps;
      for (size_t i = 0; i < list->size(); ++i) {
        FERRY_ASSIGN_OR_RETURN(auto step, ParseDecoder((*list)[i], Index(at, i)));
        steps.push_back(std::move(step));
      }
      return MakeDecoderSequence(std::move(steps));
    }
    return Unsupported(Join(path, "type"), Quote(type) + " is not supported");
  }

  // The model options of the file: fuse_unk, byte_fallback, ignore_merges; dropout and the
  // affixes are checked (only "no dropout" and empty affixes are supported).
  Result<BpeOptions> ParseModelOptions(const json& j, const std::string& path) const {
    if (const json* d = Find(j, "dropout"); d != nullptr && !d->is_null()) {
      if (!d->is_number()) return Corrupt("model.dropout", "must be a number or null");
      const double p = d->get<double>();
      if (!(p >= 0.0 && p <= 1.0)) return Corrupt("model.dropout", d->dump() + " is not in [0, 1]");
      if (p != 0.0)
        return Unsupported("model.dropout", d->dump() + " is not supported (BPE dropout is random; null or 0 only)");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      FERRY_ASSIGN_OR_RETURN(auto v, OptString(j, path, key));
      if (v && !v->empty()) return Unsupported(Join(path, key), Quote(*v) + " is not supported (null or \"\" only)");
    }
    BpeOptions options;
    FERRY_ASSIGN_OR_RETURN(options.fuse_unk, Bool(j, path, "fuse_unk", false));
    FERRY_ASSIGN_OR_RETURN(options.byte_fallback, Bool(j, path, "byte_fallback", false));
    FERRY_ASSIGN_OR_RETURN(options.ignore_merges, Bool(j, path, "ignore_merges", false));
    return options;
  }

  // `llama`: the model as LlamaTokenizer builds it, BPE(vocab, merges, fuse_unk=True,
  // byte_fallback=True), whatever the file's other model fields say (they are not read).
  Result<std::unique_ptr<BpeModel>> ParseModel(const json& j, StreamedModel& streamed,
                                               const LlamaTokenizerPipeline* llama) const {
    const std::string path = "model";
    FERRY_RETURN_IF_ERROR(RequireObject(j, path));
    FERRY_ASSIGN_OR_RETURN(auto type, OptString(j, path, "type"));
    if (type && *type != "BPE") return Unsupported("model.type", Quote(*type) + " is not supported (only BPE)");
    BpeOptions options;
    std::optional<std::string> unk_token;
    if (llama != nullptr) {
      options.fuse_unk = true;
      options.byte_fallback = true;
    } else {
      FERRY_ASSIGN_OR_RETURN(options, ParseModelOptions(j, path));
      FERRY_ASSIGN_OR_RETURN(unk_token, OptString(j, path, "unk_token"));
    }

    // Objects and arrays here were streamed (StreamedModel), leaving a null behind in the DOM;
    // anything else stayed in the DOM.
    if (const json* vocab = Find(j, "vocab"); vocab != nullptr && !(streamed.have_vocab && vocab->is_null())) {
      FERRY_RETURN_IF_ERROR(RequireObject(*vocab, "model.vocab"));
    }
    if (!streamed.have_vocab) return Corrupt("model.vocab", "is missing");
    const size_t n = streamed.vocab.size();
    std::vector<std::string> tokens(n);
    std::vector<uint8_t> seen(n, 0);
    for (auto& [token, id] : streamed.vocab) {
      const std::string at = "model.vocab[" + Quote(token) + "]";
      if (token.size() > kMaxTokenBytes)
        return Unsupported(at, "is longer than " + std::to_string(kMaxTokenBytes) + " bytes");
      if (id >= n) {
        return Corrupt(at,
                       "id " + std::to_string(id) + " is outside 0.." + std::to_string(n - 1) + " (ids must be dense)");
      }
      if (seen[id]) return Corrupt(at, "id " + std::to_string(id) + " is given to two tokens");
      seen[id] = 1;
      tokens[id] = std::move(token);
    }
    if (const json* merges = Find(j, "merges"); merges != nullptr && !(streamed.have_merges && merges->is_null())) {
      FERRY_RETURN_IF_ERROR(RequireArray(*merges, "model.merges"));
    }
    if (!streamed.have_merges) return Corrupt("model.merges", "is missing");
    const auto& merges = streamed.merges;
    if (unk_token) {
      bool found = false;
      for (size_t id = 0; id < n && !found; ++id) {
        if (tokens[id] == *unk_token) {
          options.unk_id = static_cast<int32_t>(id);
          found = true;
        }
      }
      if (!found) return Corrupt("model.unk_token", Quote(*unk_token) + " is not in model.vocab");
    }
    return BpeModel::Create(std::move(tokens), merges, options, src_ + ": model");
  }

  Result<AddedVocabulary> ParseAddedTokens(const json* list, const BpeModel& model, const Normalizer* normalizer,
                                           int32_t* vocab_size) const {
    *vocab_size = model.size();
    if (list == nullptr || list->is_null()) return AddedVocabulary();
    FERRY_RETURN_IF_ERROR(RequireArray(*list, "added_tokens"));
    if (list->size() > kMaxAddedTokens) {
      return Unsupported("added_tokens", "has " + std::to_string(list->size()) + " entries (at most " +
                                             std::to_string(kMaxAddedTokens) + ")");
    }
    std::vector<AddedToken> tokens;
    std::unordered_map<std::string, size_t> by_content;
    int64_t next_id = model.size();
    for (size_t i = 0; i < list->size(); ++i) {
      const json& e = (*list)[i];
      const std::string at = Index("added_tokens", i);
      FERRY_ASSIGN_OR_RETURN(AddedToken t, AddedTokenAt(e, at));
      const json* id_json = Find(e, "id");
      if (id_json == nullptr) return Corrupt(Join(at, "id"), "is missing");
      FERRY_ASSIGN_OR_RETURN(const uint64_t id, Unsigned(*id_json, Join(at, "id"), UINT32_MAX));
      if (by_content.count(t.content) != 0) {
        return Corrupt(at, Quote(t.content) + " is listed twice (also added_tokens[" +
                               std::to_string(by_content[t.content]) + "])");
      }
      by_content.emplace(t.content, i);
      // Upstream ignores the id written in the file: a token that is in the model keeps the
      // model's id, any other gets the next id after the model's. Refuse files where the two
      // disagree rather than guess.
      const auto model_id = model.Find(t.content);
      const int64_t expected = model_id ? *model_id : next_id;
      if (static_cast<int64_t>(id) != expected) {
        return Corrupt(Join(at, "id"), std::to_string(id) + " for " + Quote(t.content) + " is not the id " +
                                           std::to_string(expected) + " that tokenizers assigns");
      }
      if (!model_id) ++next_id;
      t.id = static_cast<int32_t>(id);
      FERRY_RETURN_IF_ERROR(SetForm(normalizer, at, &t));
      tokens.push_back(std::move(t));
    }
    *vocab_size = static_cast<int32_t>(next_id);
    return AddedVocabulary(std::move(tokens));
  }

  // An added token's object (tokenizers' AddedToken fields; the id, where there is one, is the
  // caller's): content, special (default false), normalized (default: not special),
  // single_word, lstrip, rstrip (default false).
  // `force_special`: special whatever the object says (normalized then defaults to false, as
  // tokenizers resolves an unset normalized from the final special flag).
  Result<AddedToken> AddedTokenAt(const json& e, const std::string& at, bool force_special = false) const {
    FERRY_RETURN_IF_ERROR(RequireObject(e, at));
    AddedToken t;
    FERRY_ASSIGN_OR_RETURN(t.content, String(e, at, "content"));
    FERRY_RETURN_IF_ERROR(CheckTokenContent(t.content, Join(at, "content")));
    FERRY_ASSIGN_OR_RETURN(t.special, Bool(e, at, "special", false));
    t.special = t.special || force_special;
    FERRY_ASSIGN_OR_RETURN(t.normalized, Bool(e, at, "normalized", !t.special));
    FERRY_ASSIGN_OR_RETURN(t.single_word, Bool(e, at, "single_word", false));
    FERRY_ASSIGN_OR_RETURN(t.lstrip, Bool(e, at, "lstrip", false));
    FERRY_ASSIGN_OR_RETURN(t.rstrip, Bool(e, at, "rstrip", false));
    return t;
  }

  // An added token's text at `at`: not empty, at most kMaxTokenBytes.
  Status CheckTokenContent(const std::string& content, const std::string& at) const {
    if (content.empty()) return Corrupt(at, "is empty");
    if (content.size() > kMaxTokenBytes) {
      return Unsupported(at, "is longer than " + std::to_string(kMaxTokenBytes) + " bytes");
    }
    return Status::OK();
  }

  // What an added token matches and decodes from: its content, normalized when it says so.
  Status SetForm(const Normalizer* normalizer, const std::string& at, AddedToken* t) const {
    t->form = t->content;
    if (t->normalized && normalizer != nullptr) {
      FERRY_RETURN_IF_ERROR(normalizer->Apply(&t->form).WithContext(src_ + ": " + at));
    }
    return Status::OK();
  }

  const std::string& source() const { return src_; }

 private:
  std::string src_;
};

Result<json> ParseJsonText(std::string_view text, std::string_view source, size_t max_bytes) {
  if (text.size() > max_bytes) {
    return Status::Unsupported(std::string(source) + ": " + std::to_string(text.size()) + " bytes is more than the " +
                               std::to_string(max_bytes) + " bytes allowed");
  }
  if (JsonNestsDeeperThan(text, kMaxTokenizerJsonDepth)) {
    return Status::Corruption(std::string(source) + ": JSON nests deeper than " +
                              std::to_string(kMaxTokenizerJsonDepth));
  }
  try {
    json j = json::parse(text.begin(), text.end());
    if (!j.is_object()) return Status::Corruption(std::string(source) + ": must be a JSON object");
    return j;
  } catch (const json::exception& e) {
    return Status::Corruption(std::string(source) + ": not valid JSON (" + e.what() + ")");
  }
}

// The pipeline LlamaTokenizer builds (auto_tokenizer.h): Metaspace and its decoder.
std::unique_ptr<PreTokenizer> LlamaPreTokenizer(const LlamaTokenizerPipeline& llama) {
  return MakeMetaspace(U'\u2581', llama.prepend_scheme, /*split=*/false);
}

std::unique_ptr<Decoder> LlamaDecoder(const LlamaTokenizerPipeline& llama) {
  std::vector<std::unique_ptr<Decoder>> steps;
  steps.push_back(MakeReplaceDecoder(Pattern::Literal("\u2581"), " "));
  steps.push_back(MakeByteFallbackDecoder());
  steps.push_back(MakeFuseDecoder());
  if (llama.add_prefix_space) steps.push_back(MakeStripDecoder(U' ', 1, 0));
  return MakeDecoderSequence(std::move(steps));
}

// tokenizer.json as the package reads it, or with `llama` as LlamaTokenizer rebuilds it: the
// file's normalizer, pre-tokenizer and decoder are then not read.
Result<std::unique_ptr<TokenizerImpl>> Parse(std::string_view text, std::string_view source,
                                             const LlamaTokenizerPipeline* llama) {
  if (text.size() > kMaxTokenizerJsonBytes) {
    return Status::Unsupported(std::string(source) + ": " + std::to_string(text.size()) + " bytes is more than the " +
                               std::to_string(kMaxTokenizerJsonBytes) + " bytes allowed");
  }
  if (JsonNestsDeeperThan(text, kMaxTokenizerJsonDepth)) {
    return Status::Corruption(std::string(source) + ": JSON nests deeper than " +
                              std::to_string(kMaxTokenizerJsonDepth));
  }
  json j;
  StreamedModel streamed;
  {
    TokenizerJsonSax sax(&j, &streamed);
    const bool parsed = json::sax_parse(text.begin(), text.end(), &sax);
    if (!sax.error.ok()) return sax.error.WithContext(source);
    if (!parsed) return Status::Corruption(std::string(source) + ": not valid JSON");
  }
  if (!j.is_object()) return Status::Corruption(std::string(source) + ": must be a JSON object");
  Parser p(source);
  auto impl = std::make_unique<TokenizerImpl>();
  impl->source = std::string(source);

  if (const json* v = Parser::Find(j, "version"); v != nullptr && !v->is_null()) {
    if (!v->is_string() || v->get<std::string>() != "1.0") {
      return p.Unsupported("version", v->dump() + " is not supported (only \"1.0\")");
    }
  }
  for (const char* key : {"truncation", "padding"}) {
    if (const json* v = Parser::Find(j, key); v != nullptr && !v->is_null()) {
      return p.Unsupported(key, "must be null (it changes what encode returns; apply it to the ids instead)");
    }
  }
  const json* model = Parser::Find(j, "model");
  if (model == nullptr) return p.Corrupt("model", "is missing");
  FERRY_ASSIGN_OR_RETURN(impl->model, p.ParseModel(*model, streamed, llama));

  if (llama != nullptr) {
    impl->pre_tokenizer = LlamaPreTokenizer(*llama);
  } else {
    if (const json* n = Parser::Find(j, "normalizer"); n != nullptr && !n->is_null()) {
      FERRY_ASSIGN_OR_RETURN(impl->normalizer, p.ParseNormalizer(*n, "normalizer"));
    }
    if (const json* n = Parser::Find(j, "pre_tokenizer"); n != nullptr && !n->is_null()) {
      FERRY_ASSIGN_OR_RETURN(impl->pre_tokenizer,
                             p.ParsePreTokenizer(*n, "pre_tokenizer", impl->normalizer != nullptr));
    }
  }
  FERRY_ASSIGN_OR_RETURN(impl->added, p.ParseAddedTokens(Parser::Find(j, "added_tokens"), *impl->model,
                                                         impl->normalizer.get(), &impl->vocab_size));
  if (const json* n = Parser::Find(j, "post_processor"); n != nullptr && !n->is_null()) {
    FERRY_ASSIGN_OR_RETURN(impl->post_processor, p.ParsePostProcessor(*n, "post_processor", impl->vocab_size));
  }
  if (llama != nullptr) {
    impl->decoder = LlamaDecoder(*llama);
  } else if (const json* n = Parser::Find(j, "decoder"); n != nullptr && !n->is_null()) {
    FERRY_ASSIGN_OR_RETURN(impl->decoder, p.ParseDecoder(*n, "decoder"));
  }
  impl->Index();
  return impl;
}

// A special token of tokenizer_config.json (a named one, or one of extra_special_tokens): a
// string (special, not normalized, as transformers' AddedToken(token, special=True)) or an
// added token's object. `named`: special whatever the object says (transformers makes every
// named token special), and not normalized unless the object says so.
Result<AddedToken> ConfigSpecialToken(const Parser& p, const json& v, const std::string& at, bool named) {
  if (v.is_string()) {
    AddedToken t;
    t.content = v.get<std::string>();
    FERRY_RETURN_IF_ERROR(p.CheckTokenContent(t.content, at));
    t.special = true;
    t.normalized = false;
    return t;
  }
  if (!v.is_object()) return p.Corrupt(at, "must be a string, {\"content\": ...} or null, not " + TypeName(v));
  return p.AddedTokenAt(v, at, /*force_special=*/named);
}

// The tokens tokenizer_config.json declares that tokenizer.json lacks or declares otherwise,
// added as transformers 5 adds them when it loads a directory (from_pretrained, the base
// class's __init__, TokenizersBackend.__init__, then tokenizers' add_tokens):
//   1. added_tokens_decoder's entries in id order (the last of a file's keys for one id), each
//      unless an added token equal to it in content and every flag exists; one whose content
//      is a named token's is special (without added_tokens_decoder, tokenizer.json's added
//      tokens stand for it);
//   2. the named tokens: bos_token, eos_token, unk_token, sep_token, pad_token, cls_token,
//      mask_token (`defaults` stands in for those the file does not have: the tokenizer
//      class's own), then the file's other "*_token" keys with a string or an
//      {"__type": "AddedToken"} value, in the file's order, then the names of an
//      extra_special_tokens object (one of the above replaces its value in place); each
//      special, unless an added token has its content;
//   3. an extra_special_tokens list (additional_special_tokens where extra_special_tokens is
//      missing, empty or an object), each unless an added token has its content.
// A token whose content is an added token's replaces it in place (same id; a special one stays
// special, as in tokenizers' special set); one in the model's vocabulary takes its id there; any
// other the next id after the vocabulary's. The ids written in added_tokens_decoder are not used,
// as upstream. Returns the named tokens' contents by name (bos_token ...).
Result<std::map<std::string, std::string>> AddConfigTokens(const json& j, std::string_view text, const Parser& p,
                                                           const std::map<std::string, std::string>& defaults,
                                                           TokenizerImpl* impl) {
  // The keys of the top-level object (key "") or of one of its objects, in the file's order
  // (json keeps them sorted; transformers reads them in order).
  std::optional<nlohmann::ordered_json> ordered;
  const auto key_order = [&](const std::string& key) -> Result<std::vector<std::string>> {
    std::vector<std::string> keys;
    try {
      if (!ordered) ordered = nlohmann::ordered_json::parse(text.begin(), text.end());
      const nlohmann::ordered_json& o = key.empty() ? *ordered : ordered->at(key);
      for (const auto& [k, v] : o.items()) keys.push_back(k);
    } catch (const nlohmann::ordered_json::exception& e) {  // the text parsed as json already
      return p.Corrupt(key.empty() ? "the top-level object" : key, std::string("cannot be read in order: ") + e.what());
    }
    return keys;
  };

  // The named tokens, in transformers' order, with where each value is.
  struct Named {
    std::string name, path;
    const json* value;
  };
  static constexpr const char* kNamed[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                           "pad_token", "cls_token", "mask_token"};
  std::vector<Named> named;
  std::unordered_map<std::string, size_t> named_at;
  std::vector<json> default_values;  // stable storage for `defaults`
  default_values.reserve(std::size(kNamed));
  for (const char* key : kNamed) {  // each has its place, set or not (an extra may set it)
    const json* v = Parser::Find(j, key);
    if (v == nullptr) {
      auto d = defaults.find(key);
      if (d != defaults.end()) v = &default_values.emplace_back(d->second);
    }
    named_at.emplace(key, named.size());
    named.push_back({key, key, v});
  }
  FERRY_ASSIGN_OR_RETURN(const std::vector<std::string> top_keys, key_order(""));
  for (const std::string& key : top_keys) {
    const json& v = j.at(key);
    const bool tagged = v.is_object() && v.contains("__type") && v["__type"] == "AddedToken";
    if (key.ends_with("_token") && (v.is_string() || tagged) && !named_at.contains(key)) {
      named_at.emplace(key, named.size());
      named.push_back({key, key, &v});
    }
  }
  // extra_special_tokens as transformers 5 reads it: an object is named tokens, a list unnamed
  // ones, and additional_special_tokens stands in for a list that is missing or empty.
  const auto falsy = [](const json* v) {
    return v == nullptr || v->is_null() || ((v->is_array() || v->is_object()) && v->empty()) ||
           (v->is_string() && v->get_ref<const std::string&>().empty()) || (v->is_boolean() && !v->get<bool>()) ||
           (v->is_number() && v->get<double>() == 0);
  };
  std::string list_key = "extra_special_tokens";
  const json* list = Parser::Find(j, list_key);
  if (list != nullptr && list->is_object() && !list->empty()) {
    FERRY_ASSIGN_OR_RETURN(const std::vector<std::string> names, key_order(list_key));
    for (const std::string& name : names) {
      Named e{name, Parser::Join(list_key, name), &list->at(name)};
      if (auto it = named_at.find(name); it != named_at.end()) {
        named[it->second] = std::move(e);
      } else {
        named_at.emplace(name, named.size());
        named.push_back(std::move(e));
      }
    }
    list = nullptr;
  }
  if (falsy(list) && Parser::Find(j, "additional_special_tokens") != nullptr) {
    list_key = "additional_special_tokens";
    list = Parser::Find(j, list_key);
  }
  if (!falsy(list) && !list->is_array()) return p.Corrupt(list_key, "must be a list, not " + TypeName(*list));

  std::vector<AddedToken> named_tokens;
  std::map<std::string, std::string> contents;  // name -> content
  std::unordered_set<std::string> named_contents;
  for (const Named& m : named) {
    if (m.value == nullptr || m.value->is_null()) continue;
    FERRY_ASSIGN_OR_RETURN(AddedToken t, ConfigSpecialToken(p, *m.value, m.path, /*named=*/true));
    contents[m.name] = t.content;
    named_contents.insert(t.content);
    named_tokens.push_back(std::move(t));
  }

  // 1. added_tokens_decoder.
  std::vector<AddedToken> to_add;
  if (const json* d = Parser::Find(j, "added_tokens_decoder"); d != nullptr && !d->is_null()) {
    FERRY_RETURN_IF_ERROR(p.RequireObject(*d, "added_tokens_decoder"));
    if (d->size() > kMaxAddedTokens) {
      return p.Unsupported("added_tokens_decoder", "has " + std::to_string(d->size()) + " entries (at most " +
                                                       std::to_string(kMaxAddedTokens) + ")");
    }
    std::map<uint64_t, AddedToken> by_id;  // the file's last entry for an id ("7" and "07")
    FERRY_ASSIGN_OR_RETURN(const std::vector<std::string> keys, key_order("added_tokens_decoder"));
    for (const std::string& key : keys) {
      const std::string at = "added_tokens_decoder." + Quote(key);
      char* end = nullptr;
      errno = 0;
      const unsigned long long id = std::strtoull(key.c_str(), &end, 10);
      if (key.empty() || !std::isdigit(static_cast<unsigned char>(key[0])) || *end != '\0' || errno != 0 ||
          id > INT32_MAX) {
        return p.Corrupt(at, "is not a token id");
      }
      const json& value = d->at(key);
      bool is_named = false;
      if (value.is_object()) {
        const json* c = Parser::Find(value, "content");
        is_named = c != nullptr && c->is_string() && named_contents.contains(c->get<std::string>());
      }
      FERRY_ASSIGN_OR_RETURN(by_id[id], p.AddedTokenAt(value, at, /*force_special=*/is_named));
    }
    std::unordered_map<std::string_view, const AddedToken*> file;
    for (const AddedToken& a : impl->added.tokens()) file.emplace(a.content, &a);
    for (auto& [id, t] : by_id) {
      const auto it = file.find(t.content);
      const bool declared = it != file.end() && it->second->special == t.special &&
                            it->second->normalized == t.normalized && it->second->single_word == t.single_word &&
                            it->second->lstrip == t.lstrip && it->second->rstrip == t.rstrip;
      if (!declared) to_add.push_back(std::move(t));
    }
  } else {
    // Without it transformers takes tokenizer.json's added tokens for it (the legacy loading):
    // those named by a named token become special.
    for (const AddedToken& a : impl->added.tokens()) {
      if (a.special || !named_contents.contains(a.content)) continue;
      AddedToken t = a;
      t.special = true;
      to_add.push_back(std::move(t));
    }
  }
  // 2. and 3., each unless an added token (of the file or of the above) has its content.
  std::unordered_set<std::string> known;
  for (const AddedToken& t : impl->added.tokens()) known.insert(t.content);
  for (const AddedToken& t : to_add) known.insert(t.content);
  for (AddedToken& t : named_tokens) {
    if (known.insert(t.content).second) to_add.push_back(std::move(t));
  }
  if (!falsy(list)) {
    for (size_t i = 0; i < list->size(); ++i) {
      FERRY_ASSIGN_OR_RETURN(AddedToken t,
                             ConfigSpecialToken(p, (*list)[i], Parser::Index(list_key, i), /*named=*/false));
      if (known.insert(t.content).second) to_add.push_back(std::move(t));
    }
  }
  if (to_add.empty()) return contents;

  const std::string what = "the added and special tokens";
  std::vector<AddedToken> tokens = impl->added.tokens();
  if (tokens.size() + to_add.size() > kMaxAddedTokens) {
    return p.Unsupported(what, "are more than " + std::to_string(kMaxAddedTokens));
  }
  std::unordered_map<std::string, size_t> index;
  int64_t max_added = -1;
  for (size_t i = 0; i < tokens.size(); ++i) {
    index.emplace(tokens[i].content, i);
    max_added = std::max<int64_t>(max_added, tokens[i].id);
  }
  const int64_t model_size = impl->model->size();
  for (AddedToken& t : to_add) {
    FERRY_RETURN_IF_ERROR(p.SetForm(impl->normalizer.get(), "the added token " + Quote(t.content), &t));
    if (auto it = index.find(t.content); it != index.end()) {
      AddedToken& old = tokens[it->second];
      t.id = old.id;
      t.special = t.special || old.special;
      old = std::move(t);
      continue;
    }
    const std::optional<int32_t> model_id = impl->model->Find(t.content);
    const int64_t id = model_id ? *model_id : max_added >= model_size ? max_added + 1 : model_size;
    if (id > INT32_MAX) return p.Unsupported(what, "make an id past 2^31 - 1");
    t.id = static_cast<int32_t>(id);
    max_added = std::max(max_added, id);
    index.emplace(t.content, tokens.size());
    tokens.push_back(std::move(t));
  }
  impl->vocab_size = static_cast<int32_t>(std::max<int64_t>(impl->vocab_size, max_added + 1));
  impl->added = AddedVocabulary(std::move(tokens));
  impl->Index();
  return contents;
}

// tokenizer_config.json's added and special tokens and chat template.
// `defaults`: the tokenizer class's own named tokens, for those the file does not name.
Status ApplyTokenizerConfig(const json& j, std::string_view text, std::string_view source,
                            const std::map<std::string, std::string>& defaults, TokenizerImpl* impl) {
  Parser p(source);
  FERRY_ASSIGN_OR_RETURN(const auto named, AddConfigTokens(j, text, p, defaults, impl));
  const auto token_of = [&](const char* key) -> Result<std::optional<int32_t>> {
    auto it = named.find(key);
    if (it == named.end()) return std::optional<int32_t>();
    const std::optional<int32_t> id = impl->Find(it->second);
    if (!id) return p.Corrupt(key, Quote(it->second) + " is not a token of " + impl->source);  // added above
    return id;
  };
  FERRY_ASSIGN_OR_RETURN(impl->bos, token_of("bos_token"));
  FERRY_ASSIGN_OR_RETURN(impl->eos, token_of("eos_token"));
  FERRY_ASSIGN_OR_RETURN(impl->pad, token_of("pad_token"));

  // transformers 5 drops add_bos_token / add_eos_token when a tokenizer.json exists
  // (tokenization_utils_base.py, _from_pretrained): the post-processor of tokenizer.json alone
  // decides. They are only checked for type here.
  FERRY_RETURN_IF_ERROR(p.Bool(j, "", "add_bos_token", false).status());
  FERRY_RETURN_IF_ERROR(p.Bool(j, "", "add_eos_token", false).status());

  if (const json* t = Parser::Find(j, "chat_template"); t != nullptr && !t->is_null()) {
    if (t->is_string()) {
      impl->chat_template = t->get<std::string>();
    } else if (t->is_array()) {
      for (size_t i = 0; i < t->size(); ++i) {
        const json& e = (*t)[i];
        const std::string at = Parser::Index("chat_template", i);
        FERRY_RETURN_IF_ERROR(p.RequireObject(e, at));
        FERRY_ASSIGN_OR_RETURN(const std::string name, p.String(e, at, "name"));
        FERRY_ASSIGN_OR_RETURN(std::string tmpl, p.String(e, at, "template"));
        if (name == "default") impl->chat_template = std::move(tmpl);
      }
    } else {
      return p.Corrupt("chat_template", "must be a string or a list of {name, template}, not " + TypeName(*t));
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<TokenizerImpl>> ParseTokenizerJson(std::string_view text, std::string_view source) {
  return Parse(text, source, /*llama=*/nullptr);
}

// transformers' loading of a directory whose tokenizer_config.json has no added_tokens_decoder
// (transformers 5 saves none for a tokenizers-backed tokenizer, nor did transformers before
// 4.34 for any) or that has none:
// special_tokens_map.json's values are set over tokenizer_config.json's, an object as a special
// AddedToken, an extra_special_tokens list merged into the config's (tokenization_utils_base.py,
// _from_pretrained). The merged configuration's text.
Result<std::string> MergeSpecialTokensMap(std::optional<SourceText> tokenizer_config, SourceText special_tokens_map) {
  FERRY_ASSIGN_OR_RETURN(const json checked,
                         ParseJsonText(special_tokens_map.text, special_tokens_map.source, kMaxTokenizerConfigBytes));
  Parser p(special_tokens_map.source);
  for (const auto& [key, value] : checked.items()) {
    if (!value.is_string() && !value.is_object() && !value.is_array() && !value.is_null()) {
      return p.Corrupt(key, "must be a string, an object, a list or null, not " + TypeName(value));
    }
  }
  try {
    nlohmann::ordered_json doc =
        tokenizer_config ? nlohmann::ordered_json::parse(tokenizer_config->text.begin(), tokenizer_config->text.end())
                         : nlohmann::ordered_json::object();
    const auto special = [](nlohmann::ordered_json token) {
      if (token.is_object()) {
        token.erase("special");
        token["special"] = true;
        token["__type"] = "AddedToken";
      }
      return token;
    };
    const nlohmann::ordered_json map =
        nlohmann::ordered_json::parse(special_tokens_map.text.begin(), special_tokens_map.text.end());
    for (const auto& [key, value] : map.items()) {
      if (key == "extra_special_tokens" && value.is_array()) {
        nlohmann::ordered_json merged =
            doc.contains(key) && doc[key].is_array() ? doc[key] : nlohmann::ordered_json::array();
        for (const auto& token : value) {
          nlohmann::ordered_json t = special(token);
          if (std::find(merged.begin(), merged.end(), t) == merged.end()) merged.push_back(std::move(t));
        }
        doc[key] = std::move(merged);
      } else {
        doc[key] = key == "extra_special_tokens" ? value : special(value);
      }
    }
    return doc.dump();
  } catch (const nlohmann::ordered_json::exception& e) {  // both parsed as json already
    return p.Corrupt("the file", std::string("cannot be merged: ") + e.what());
  }
}

Result<std::unique_ptr<TokenizerImpl>> ParseDirectory(SourceText tokenizer_json,
                                                      std::optional<SourceText> tokenizer_config,
                                                      std::optional<SourceText> model_config,
                                                      std::optional<SourceText> special_tokens_map) {
  std::optional<json> config, model;
  if (tokenizer_config) {
    FERRY_ASSIGN_OR_RETURN(config,
                           ParseJsonText(tokenizer_config->text, tokenizer_config->source, kMaxTokenizerConfigBytes));
  }
  std::string merged_text, merged_source;
  if (special_tokens_map && !(config && config->contains("added_tokens_decoder"))) {
    FERRY_ASSIGN_OR_RETURN(merged_text, MergeSpecialTokensMap(tokenizer_config, *special_tokens_map));
    merged_source = (tokenizer_config ? std::string(tokenizer_config->source) + " with " : std::string()) +
                    std::string(special_tokens_map->source);
    FERRY_ASSIGN_OR_RETURN(config, ParseJsonText(merged_text, merged_source, 2 * kMaxTokenizerConfigBytes));
    tokenizer_config = SourceText{merged_text, merged_source};
  }
  if (model_config) {
    FERRY_ASSIGN_OR_RETURN(model, ParseJsonText(model_config->text, model_config->source, kMaxTokenizerConfigBytes));
  }
  FERRY_ASSIGN_OR_RETURN(const std::optional<LlamaTokenizerPipeline> llama,
                         AutoTokenizerLlamaPipeline(
                             config ? &*config : nullptr, tokenizer_config ? tokenizer_config->source : "",
                             model ? &*model : nullptr, model_config ? model_config->source : "", tokenizer_json.text));
  FERRY_ASSIGN_OR_RETURN(auto impl, Parse(tokenizer_json.text, tokenizer_json.source, llama ? &*llama : nullptr));
  if (config) {
    // LlamaTokenizer's own unk_token, bos_token and eos_token stand in for those the file lacks.
    std::map<std::string, std::string> defaults;
    if (llama) defaults = {{"unk_token", "<unk>"}, {"bos_token", "<s>"}, {"eos_token", "</s>"}};
    FERRY_RETURN_IF_ERROR(
        ApplyTokenizerConfig(*config, tokenizer_config->text, tokenizer_config->source, defaults, impl.get()));
  }
  return impl;
}

}  // namespace ferry::text
