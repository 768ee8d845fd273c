// Auxiliary files: the small non-weight files that belong to a set of weights and travel
// with them. The one rule for which files those are, used by every part that moves them:
// the store records them in a version (and hashes them into its id, store/store.h), the
// converter copies them beside its output, sync sends them and the receiver writes them,
// the watcher and the daemon take them from a base directory.
//
// An auxiliary file is a regular file directly in the weights' directory whose name is one of
//   config.json, generation_config.json, tokenizer*.json, special_tokens_map.json,
//   tokenizer.model, vocab.*, merges.txt, chat_template.*, adapter_config.json
// and is not a weight file name (core/file_util.h IsWeightFileName: a "vocab.safetensors" is
// weights, not vocabulary). Anything else in the directory (README.md, LICENSE, dot files,
// the weights) is not. Every recorded name must also be a plain file name in well-formed
// UTF-8 without control characters (ValidateAuxFileName): names go into JSON and into the
// version id.
#pragma once

#include <compare>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace ferry {

// One auxiliary file: its name (a plain file name) and its whole contents.
struct AuxFileData {
  std::string name;
  std::string contents;
  auto operator<=>(const AuxFileData&) const = default;
};
// A set of auxiliary files; sorted by name, each name once, wherever a function says so.
using AuxFiles = std::vector<AuxFileData>;

// True when `name` is an auxiliary file name of the list above (and not a weight file name).
bool IsAuxFileName(std::string_view name);

// kInvalidArgument ("auxiliary file name '<escaped>' ...") unless `name` is a plain file
// name (not empty, ".", "..", no '/'), well-formed UTF-8, without control characters
// (< 0x20, 0x7F). Says nothing about the list: see IsAuxFileName.
Status ValidateAuxFileName(std::string_view name);

// ValidateAuxFileName, then kInvalidArgument "auxiliary file name '<escaped>' is not one of
// the auxiliary file names (config.json, tokenizer*.json, ...)" unless IsAuxFileName: what a
// name received from elsewhere (a sync manifest) must satisfy before a file is written.
Status CheckAuxFileName(std::string_view name);

// The names of the auxiliary files in `dir`, sorted, with CollectAuxFiles' errors (without
// reading any file): for callers that copy the files rather than hold them.
Result<std::vector<std::string>> ListAuxFiles(const std::filesystem::path& dir);

// The auxiliary files in `dir` (name, contents), sorted by name. kIOError naming the
// directory when it cannot be listed; files over 256 MiB are an error naming the file.
// A regular file whose name matches the list but fails ValidateAuxFileName is
// kInvalidArgument naming the directory and the name escaped ("DIR: auxiliary file name
// 'vocab.\xff' is not valid UTF-8", "... contains a control character"): such a name cannot
// be recorded exactly, so the directory is refused rather than recorded without it. Files
// whose names do not match the list are ignored.
Result<AuxFiles> CollectAuxFiles(const std::filesystem::path& dir);

// config.json's tie_word_embeddings among `aux`: false when there is no config.json, it is not
// a JSON object or the key is absent or not a boolean (transformers' default).
bool TiesWordEmbeddings(const AuxFiles& aux);

}  // namespace ferry
