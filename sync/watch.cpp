#include "sync/watch.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <exception>
#include <nlohmann/json.hpp>
#include <system_error>

#include "convert/peft_config.h"
#include "core/checkpoint.h"

namespace ferry::sync {
namespace {

namespace fs = std::filesystem;

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// The fingerprint of `dir` (every regular file below it), or nullopt when it changed while
// being listed (a file vanished) or cannot be read.
std::optional<std::map<std::string, std::pair<uint64_t, int64_t>>> FingerprintOf(const fs::path& dir) {
  std::map<std::string, std::pair<uint64_t, int64_t>> fp;
  std::error_code ec;
  fs::recursive_directory_iterator it(dir, ec), end;
  if (ec) return std::nullopt;
  for (; it != end; it.increment(ec)) {
    if (ec) return std::nullopt;
    struct stat st {};
    if (::stat(it->path().c_str(), &st) != 0) return std::nullopt;
    if (!S_ISREG(st.st_mode)) continue;
    const int64_t mtime = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    fp[fs::relative(it->path(), dir, ec).string()] = {static_cast<uint64_t>(st.st_size), mtime};
    if (ec) return std::nullopt;
  }
  if (ec) return std::nullopt;
  return fp;
}

bool HasMarker(const std::map<std::string, std::pair<uint64_t, int64_t>>& fp) {
  return fp.count("adapter_config.json") != 0 || fp.count("config.json") != 0;
}

// Subdirectory names of `dir` (not starting with '.'), in natural order.
Result<std::vector<std::string>> ListSubdirs(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  if (ec) return Status::IOError("watched directory " + dir.string() + ": cannot list: " + ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) return Status::IOError("watched directory " + dir.string() + ": cannot list: " + ec.message());
    std::error_code type_ec;
    if (!it->is_directory(type_ec)) continue;
    std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    names.push_back(std::move(name));
  }
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) { return NaturalLess(a, b); });
  return names;
}

}  // namespace

bool NaturalLess(std::string_view a, std::string_view b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (IsDigit(a[i]) && IsDigit(b[j])) {
      size_t ie = i, je = j;
      while (ie < a.size() && IsDigit(a[ie])) ++ie;
      while (je < b.size() && IsDigit(b[je])) ++je;
      size_t is = i, js = j;  // skip leading zeros
      while (is + 1 < ie && a[is] == '0') ++is;
      while (js + 1 < je && b[js] == '0') ++js;
      const std::string_view na = a.substr(is, ie - is), nb = b.substr(js, je - js);
      if (na.size() != nb.size()) return na.size() < nb.size();
      if (na != nb) return na < nb;
      if (ie - i != je - j) return (ie - i) > (je - j);  // "01" before "1"
      i = ie;
      j = je;
      continue;
    }
    if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
    ++i;
    ++j;
  }
  return (a.size() - i) < (b.size() - j);
}

std::optional<int64_t> TrailingStep(std::string_view name) {
  size_t start = name.size();
  while (start > 0 && IsDigit(name[start - 1])) --start;
  if (start == name.size()) return std::nullopt;
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(name.data() + start, name.data() + name.size(), v);
  if (ec != std::errc() || ptr != name.data() + name.size()) return std::nullopt;
  return v;
}

Result<std::unique_ptr<CheckpointWatcher>> CheckpointWatcher::Create(store::Store* store, WatchOptions options) {
  if (store == nullptr) return Status::InvalidArgument("checkpoint watcher: no store");
  std::error_code ec;
  if (!fs::is_directory(options.dir, ec)) {
    return Status::NotFound("watched directory " + options.dir.string() + " is not a directory");
  }
  if (options.base.empty()) return Status::InvalidArgument("checkpoint watcher: no base (a version id or a directory)");
  std::unique_ptr<CheckpointWatcher> w(new CheckpointWatcher(store, std::move(options)));
  FERRY_RETURN_IF_ERROR(w->LoadBase());

  // The first observation: every present directory's fingerprint; of those with a marker,
  // all but the newest are skipped.
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListSubdirs(w->options_.dir));
  std::vector<std::string> with_marker;
  for (const auto& name : names) {
    auto fp = FingerprintOf(w->options_.dir / name);
    if (!fp) continue;
    if (HasMarker(*fp)) with_marker.push_back(name);
    w->pending_[name] = std::move(*fp);
  }
  for (size_t k = 0; k + 1 < with_marker.size(); ++k) {
    w->done_.insert(with_marker[k]);
    w->pending_.erase(with_marker[k]);
  }
  return w;
}

Status CheckpointWatcher::LoadBase() {
  const std::string& base = options_.base;
  const fs::path base_path(base);
  std::error_code ec;
  store::VersionRecord rec;
  if (fs::is_directory(base_path, ec)) {
    if (fs::exists(base_path / "adapter_config.json", ec)) {
      return Status::InvalidArgument("base " + base +
                                     " is a PEFT adapter (it holds adapter_config.json), not a base model");
    }
    store::ImportOptions o;
    o.run = options_.run;
    o.kind = store::VersionKind::kBase;
    auto imported = store_->Import(base_path, o);
    if (!imported.ok()) return imported.status().WithContext("base " + base);
    rec = imported->record;
    if (rec.kind == store::VersionKind::kAdapter) {
      return Status::InvalidArgument("base " + base + " is stored as an adapter version, not a base model");
    }
    auto ckpt = Checkpoint::Open(base_path);
    if (!ckpt.ok()) return ckpt.status().WithContext("base " + base);
    for (const auto& name : ckpt->names()) {
      auto t = ckpt->Get(name);
      if (!t.ok()) return t.status().WithContext("base " + base);
      base_tensors_.emplace(name, *t);
    }
  } else {
    auto found = store_->GetVersion(base);
    if (!found.ok()) {
      if (found.status().code() == StatusCode::kNotFound) {
        return Status::NotFound("base '" + base + "' is neither a directory nor a stored version");
      }
      return found.status().WithContext("base " + base);
    }
    rec = *found;
    if (rec.kind == store::VersionKind::kAdapter) {
      return Status::InvalidArgument("base " + base + " is an adapter version, not a base model");
    }
    for (const auto& row : rec.tensors) {
      auto t = store_->ReadTensor(row, /*verify=*/true);
      if (!t.ok()) return t.status().WithContext("base " + base);
      base_tensors_.emplace(row.name, *t);
    }
  }
  for (const auto& aux : rec.aux) {
    auto contents = store_->ReadAux(aux);
    if (!contents.ok()) return contents.status().WithContext("base " + base + ": auxiliary file " + aux.name);
    base_aux_.push_back(AuxFileData{aux.name, std::move(*contents)});
  }
  base_version_ = rec.id;
  tie_word_embeddings_ = TiesWordEmbeddings(base_aux_);
  return Status::OK();
}

Result<std::vector<WatchedCheckpoint>> CheckpointWatcher::Poll() {
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, ListSubdirs(options_.dir));
  std::vector<std::string> settled;
  std::set<std::string> present;
  for (const auto& name : names) {
    present.insert(name);
    if (done_.count(name) != 0) continue;
    auto fp = FingerprintOf(options_.dir / name);
    if (!fp) {
      pending_.erase(name);  // changing under us: start over
      continue;
    }
    auto it = pending_.find(name);
    if (it != pending_.end() && it->second == *fp && HasMarker(*fp)) {
      settled.push_back(name);
    } else {
      pending_[name] = std::move(*fp);
    }
  }
  // Directories removed before they settled are forgotten.
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = present.count(it->first) != 0 ? std::next(it) : pending_.erase(it);
  }
  std::vector<WatchedCheckpoint> out;
  for (const auto& name : settled) {
    done_.insert(name);
    pending_.erase(name);
    out.push_back(Handle(options_.dir / name));
  }
  return out;
}

WatchedCheckpoint CheckpointWatcher::Handle(const fs::path& dir) {
  WatchedCheckpoint out;
  out.dir = dir;
  out.step = TrailingStep(dir.filename().string());
  std::error_code ec;
  out.adapter = fs::exists(dir / "adapter_config.json", ec);
  Status s;
  // One checkpoint's failure, even an exception from below (a bug there, or memory), ends
  // in that checkpoint's error: the watcher and the publisher driving it go on.
  try {
    s = out.adapter ? ImportAdapter(dir, out) : ImportFull(dir, out);
  } catch (const std::exception& e) {
    s = Status::Internal(std::string("unexpected exception: ") + e.what());
  }
  if (!s.ok()) {
    out.error = s.WithContext("checkpoint " + dir.string());
    out.version.reset();
  }
  return out;
}

Status CheckpointWatcher::ImportAdapter(const fs::path& dir, WatchedCheckpoint& out) {
  FERRY_ASSIGN_OR_RETURN(PeftConfig config, LoadPeftConfig(dir));
  FERRY_ASSIGN_OR_RETURN(Checkpoint adapter, Checkpoint::Open(dir));
  SnapshotSource source;
  source.tensors = base_tensors_;
  source.adapter_config = std::move(config);
  for (const auto& name : adapter.names()) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, adapter.Get(name));
    source.adapter_tensors.emplace(name, t);
  }
  source.aux_files = base_aux_;
  SnapshotOptions so;
  so.layout = options_.layout;
  so.threads = options_.threads;
  so.tie_word_embeddings = tie_word_embeddings_;
  // Plan first: an adapter that does not fit the base leaves nothing in the store. The
  // merged weights are then made and stored one tensor at a time (the model is never held
  // merged in memory).
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<const LazySnapshot> snapshot, LazySnapshot::Plan(source, so));

  store::ImportOptions ao;
  ao.run = options_.run;
  ao.kind = store::VersionKind::kAdapter;
  ao.layout = Layout::kLora;
  ao.step = out.step;
  ao.base_version = base_version_;
  FERRY_ASSIGN_OR_RETURN(store::ImportResult imported, store_->Import(dir, ao));
  out.adapter_version = imported.record.id;

  store::ImportOptions mo;
  mo.run = options_.run;
  mo.step = out.step;
  mo.base_version = base_version_;
  mo.adapter_version = imported.record.id;
  FERRY_ASSIGN_OR_RETURN(store::ImportResult merged, snapshot->Record(*store_, mo));
  out.version = merged.record.id;
  return Status::OK();
}

Status CheckpointWatcher::ImportFull(const fs::path& dir, WatchedCheckpoint& out) {
  store::ImportOptions o;
  o.run = options_.run;
  o.kind = store::VersionKind::kFull;
  o.step = out.step;
  FERRY_ASSIGN_OR_RETURN(store::ImportResult imported, store_->Import(dir, o));
  out.version = imported.record.id;
  return Status::OK();
}

}  // namespace ferry::sync
