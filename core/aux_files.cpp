#include "core/aux_files.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "core/text.h"

namespace ferry {

bool IsAuxFileName(std::string_view n) {
  auto starts = [&](std::string_view p) { return n.size() > p.size() && n.starts_with(p); };
  const bool listed = n == "config.json" || n == "generation_config.json" ||
                      (starts("tokenizer") && n.ends_with(".json")) || n == "special_tokens_map.json" ||
                      n == "tokenizer.model" || starts("vocab.") || n == "merges.txt" || starts("chat_template.") ||
                      n == "adapter_config.json";
  return listed && !IsWeightFileName(n);
}

Status ValidateAuxFileName(std::string_view name) {
  if (name.empty() || name.find('/') != std::string_view::npos || name == "." || name == "..") {
    return Status::InvalidArgument("auxiliary file name '" + EscapeForMessage(name) + "' is not a plain file name");
  }
  return CheckPrintableUtf8("auxiliary file name", name);
}

Status CheckAuxFileName(std::string_view name) {
  FERRY_RETURN_IF_ERROR(ValidateAuxFileName(name));
  if (!IsAuxFileName(name)) {
    return Status::InvalidArgument("auxiliary file name '" + EscapeForMessage(name) +
                                   "' is not one of the auxiliary file names (config.json, generation_config.json, "
                                   "tokenizer*.json, special_tokens_map.json, tokenizer.model, vocab.*, merges.txt, "
                                   "chat_template.*, adapter_config.json)");
  }
  return Status::OK();
}

Result<std::vector<std::string>> ListAuxFiles(const std::filesystem::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return Status::IOError(dir.string() + ": cannot list directory: " + ec.message());
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) return Status::IOError(dir.string() + ": cannot list directory: " + ec.message());
    const std::string name = it->path().filename().string();
    if (!IsAuxFileName(name)) continue;
    std::error_code sec;
    if (!it->is_regular_file(sec)) continue;
    // The name goes into version records (JSON) and version ids: a name that cannot be
    // recorded exactly refuses the whole directory rather than being dropped or mangled.
    if (Status s = ValidateAuxFileName(name); !s.ok()) {
      return Status::InvalidArgument(dir.string() + ": " + s.message());
    }
    out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<AuxFiles> CollectAuxFiles(const std::filesystem::path& dir) {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListAuxFiles(dir));
  AuxFiles out;
  for (std::string& name : names) {
    FERRY_ASSIGN_OR_RETURN(std::string contents, ReadSmallFile(dir / name, size_t{256} << 20));
    out.push_back(AuxFileData{std::move(name), std::move(contents)});
  }
  return out;
}

bool TiesWordEmbeddings(const AuxFiles& aux) {
  for (const auto& [name, contents] : aux) {
    if (name != "config.json") continue;
    const auto j = nlohmann::json::parse(contents, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return false;
    const auto it = j.find("tie_word_embeddings");
    return it != j.end() && it->is_boolean() && it->get<bool>();
  }
  return false;
}

}  // namespace ferry
