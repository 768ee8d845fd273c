#include "daemon/text/tokenizer.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <system_error>

#include "daemon/text/tokenizer_impl.h"
#include "daemon/text/unicode.h"

namespace ferry::text {
namespace {

// Reads a whole file of at most `max_bytes`.
Result<std::string> ReadFile(const std::filesystem::path& path, size_t max_bytes) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) return Status::NotFound(path.string() + ": no such file");
    return Status::IOError(path.string() + ": " + ec.message());
  }
  if (size > max_bytes) {
    return Status::Unsupported(path.string() + ": " + std::to_string(size) + " bytes is more than the " +
                               std::to_string(max_bytes) + " bytes allowed");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IOError(path.string() + ": cannot open: " + std::strerror(errno));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  if (in.gcount() != static_cast<std::streamsize>(size)) return Status::IOError(path.string() + ": short read");
  return text;
}

// A configuration file of at most kMaxTokenizerConfigBytes; nullopt when it does not exist.
Result<std::optional<std::string>> ReadOptionalFile(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (ec) return Status::IOError(path.string() + ": " + ec.message());
    return std::optional<std::string>();
  }
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadFile(path, kMaxTokenizerConfigBytes));
  return std::optional<std::string>(std::move(text));
}

Status OutOfRange(int32_t id, int32_t vocab_size) {
  return Status::InvalidArgument("token id " + std::to_string(id) + " is not in the vocabulary (ids 0.." +
                                 std::to_string(vocab_size - 1) + ")");
}

}  // namespace

std::optional<int32_t> TokenizerImpl::Find(std::string_view token) const {
  const auto it = added_index.find(token);
  if (it != added_index.end()) return it->second;
  return model->Find(token);
}

void TokenizerImpl::Index() {
  token_text.assign(static_cast<size_t>(vocab_size), std::string());
  special.assign(static_cast<size_t>(vocab_size), 0);
  added_index.clear();
  special_forms.clear();
  for (int32_t id = 0; id < model->size(); ++id) token_text[id] = model->token(id);
  for (const AddedToken& t : added.tokens()) {
    token_text[t.id] = t.form;
    added_index.emplace(t.content, t.id);
    if (t.special) {
      special[t.id] = 1;
      special_forms.insert(t.content);
    }
  }
  token_bytes.clear();
  token_bytes_offset.assign(1, 0);
  for (int32_t id = 0; id < vocab_size; ++id) {
    std::string bytes = token_text[id];
    bool fused = false;
    if (decoder != nullptr) decoder->TokenBytes(&bytes, &fused);
    token_bytes += bytes;
    token_bytes_offset.push_back(token_bytes.size());
  }
}

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::FromJson(std::string_view json, std::string_view source_name) {
  FERRY_ASSIGN_OR_RETURN(auto impl, ParseTokenizerJson(json, source_name));
  return Tokenizer(std::move(impl));
}

Result<Tokenizer> Tokenizer::FromFile(const std::filesystem::path& path) {
  FERRY_ASSIGN_OR_RETURN(const std::string text, ReadFile(path, kMaxTokenizerJsonBytes));
  return FromJson(text, path.string());
}

Result<Tokenizer> Tokenizer::FromDirectory(const std::filesystem::path& dir) {
  const auto json_path = dir / "tokenizer.json";
  FERRY_ASSIGN_OR_RETURN(const std::string text, ReadFile(json_path, kMaxTokenizerJsonBytes));
  const std::string json_source = json_path.string();
  const auto config_path = dir / "tokenizer_config.json";
  const auto model_config_path = dir / "config.json";
  const auto map_path = dir / "special_tokens_map.json";
  const std::string config_source = config_path.string(), model_config_source = model_config_path.string(),
                    map_source = map_path.string();
  FERRY_ASSIGN_OR_RETURN(const std::optional<std::string> config, ReadOptionalFile(config_path));
  FERRY_ASSIGN_OR_RETURN(const std::optional<std::string> model_config, ReadOptionalFile(model_config_path));
  FERRY_ASSIGN_OR_RETURN(const std::optional<std::string> special_tokens_map, ReadOptionalFile(map_path));
  std::optional<SourceText> config_text, model_config_text, map_text;
  if (config) config_text = SourceText{*config, config_source};
  if (model_config) model_config_text = SourceText{*model_config, model_config_source};
  if (special_tokens_map) map_text = SourceText{*special_tokens_map, map_source};
  FERRY_ASSIGN_OR_RETURN(auto impl, ParseDirectory({text, json_source}, config_text, model_config_text, map_text));
  return Tokenizer(std::move(impl));
}

Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, const EncodeOptions& options) const {
  const TokenizerImpl& m = *impl_;
  if (const auto bad = FirstInvalidUtf8(text)) {
    return Status::InvalidArgument("text is not valid UTF-8 at byte " + std::to_string(*bad));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<AddedVocabulary::Segment> raw, normalized;
  std::vector<Piece> pieces;
  m.added.Split(text, /*normalized=*/false, &raw);
  for (const auto& seg : raw) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    if (seg.end == seg.begin) continue;
    std::string piece(text.substr(seg.begin, seg.end - seg.begin));
    if (m.normalizer != nullptr) FERRY_RETURN_IF_ERROR(m.normalizer->Apply(&piece));
    normalized.clear();
    m.added.Split(piece, /*normalized=*/true, &normalized);
    for (const auto& sub : normalized) {
      if (sub.id >= 0) {
        ids.push_back(sub.id);
        continue;
      }
      if (sub.end == sub.begin) continue;
      pieces.clear();
      pieces.push_back({piece.substr(sub.begin, sub.end - sub.begin), seg.begin == 0 && sub.begin == 0});
      if (m.pre_tokenizer != nullptr) FERRY_RETURN_IF_ERROR(m.pre_tokenizer->Apply(&pieces));
      for (const Piece& p : pieces) m.model->Tokenize(p.text, &ids);
    }
  }
  if (m.post_processor != nullptr) m.post_processor->Apply(options.add_special_tokens, &ids);
  return ids;
}

Result<std::string> Tokenizer::Decode(std::span<const int32_t> ids, const DecodeOptions& options) const {
  const TokenizerImpl& m = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int32_t id : ids) {
    if (id < 0 || id >= m.vocab_size) return OutOfRange(id, m.vocab_size);
    const std::string& t = m.token_text[id];
    if (options.skip_special_tokens && m.special_forms.count(t) != 0) continue;
    tokens.push_back(t);
  }
  if (m.decoder == nullptr) {
    std::string out;
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (k > 0) out += ' ';
      out += tokens[k];
    }
    return out;
  }
  FERRY_RETURN_IF_ERROR(m.decoder->DecodeChain(&tokens));
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

Result<std::string_view> Tokenizer::TokenBytes(int32_t id) const {
  const TokenizerImpl& m = *impl_;
  if (id < 0 || id >= m.vocab_size) return OutOfRange(id, m.vocab_size);
  const size_t b = m.token_bytes_offset[id], e = m.token_bytes_offset[id + 1];
  return std::string_view(m.token_bytes).substr(b, e - b);
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::TokenId(std::string_view token) const { return impl_->Find(token); }

Result<std::string_view> Tokenizer::TokenText(int32_t id) const {
  if (id < 0 || id >= impl_->vocab_size) return OutOfRange(id, impl_->vocab_size);
  return std::string_view(impl_->token_text[id]);
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }

bool Tokenizer::IsSpecial(int32_t id) const { return id >= 0 && id < impl_->vocab_size && impl_->special[id] != 0; }

const std::string& Tokenizer::source() const { return impl_->source; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

}  // namespace ferry::text
