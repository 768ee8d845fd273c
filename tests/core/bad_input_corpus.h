// A corpus of malformed checkpoints: every way a safetensors file, a sharded index or a
// checkpoint directory can be broken that Ferry must reject with a typed, named error.
//
// Each case is a set of files (relative path -> bytes) to lay out under a fresh root
// directory, the path to open (relative to that root; "" opens the root directory
// itself), the StatusCode that Checkpoint::Open must return, and substrings its message
// must contain. In those substrings "{root}" stands for the root directory, so a case
// can demand the full path of the file at fault.
//
// Used by tests/core/bad_input_test.cpp (the library) and tests/cli/bad_input_cli_test.cpp
// (the `ferry inspect` command); WriteCorpus() lays every case out for fuzzers or by hand.
#pragma once

#include <filesystem>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace ferry::corpus {

struct BadInputCase {
  // Unique, [a-z0-9_]: usable as a test name and a directory name.
  std::string name;
  // Relative path -> exact bytes. Parent directories are created as needed.
  std::map<std::string, std::string> files;
  // What to open, relative to the root; "" for the root directory itself.
  std::string open;
  // The code Checkpoint::Open must return.
  StatusCode code = StatusCode::kCorruption;
  // Substrings the error message must contain ("{root}" = the root directory).
  std::vector<std::string> message_contains;
  // The name of the file (or directory, "" = the root directory) at fault: what a user
  // must see in the CLI's error output.
  std::string culprit;
};

// Prints the case's name (for GoogleTest's parameter messages).
void PrintTo(const BadInputCase& c, std::ostream* os);

// Every case, in a fixed order. Each case's files are under 1 MB.
std::vector<BadInputCase> BadInputCases();

// Lays `c` out under `root` (which must exist). Errors name the file that failed.
[[nodiscard]] Status WriteCase(const BadInputCase& c, const std::filesystem::path& root);

// Lays every case out under `root`/<case name>/ (root is created if missing).
[[nodiscard]] Status WriteCorpus(const std::filesystem::path& root);

// `text` with every "{root}" replaced by `root`.
std::string ExpandRoot(const std::string& text, const std::filesystem::path& root);

// The path a case opens: `root` itself when c.open is empty, else root / c.open.
std::filesystem::path OpenPath(const BadInputCase& c, const std::filesystem::path& root);

// The bytes of a safetensors file with the given JSON header text (not padded) and data.
std::string SafetensorsBytes(const std::string& header_json, const std::string& data);

// 8 bytes of `v`, little-endian.
std::string Le64(uint64_t v);

}  // namespace ferry::corpus
