// Helpers shared by the store commands (store, versions, verify, audit): opening the store
// named by --db, resolving version ids, times, and the JSON/text forms of version records.
// (A version's short id is store::ShortId, store/store.h.)
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "store/store.h"

namespace ferry::cli {

// Opens the store at `db` (read-only opens never block a writer). Prints the error and
// exits 1 (cli::Fail) when it cannot be opened; the message names the directory.
std::unique_ptr<store::Store> OpenStoreOrFail(const std::string& db, bool writable, bool create = false);

// The full id of the version `id_or_prefix` names; fails (exit 1) naming `flag` and the
// prefix when absent or ambiguous.
store::VersionRecord GetVersionOrFail(store::Store& s, const std::string& id_or_prefix, const std::string& flag);

// "2026-11-22T04:28:00Z" (UTC).
std::string FormatTime(int64_t time_ns);
// "2026-11-22T04:28:00.123Z" (UTC, milliseconds): the audit's times.
std::string FormatTimeMillis(int64_t time_ns);

// Parses "key=value" metric arguments; fails (exit 1) naming the bad argument.
std::map<std::string, double> ParseMetricsOrFail(const std::vector<std::string>& args);

// A version record as JSON. `with_tensors`: include the tensor rows and aux files.
nlohmann::ordered_json VersionJson(const store::VersionRecord& v, bool with_tensors);

// An event as JSON.
nlohmann::ordered_json EventJson(const store::Event& e);

}  // namespace ferry::cli
