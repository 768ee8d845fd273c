#include "core/checkpoint.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/json_limits.h"
#include "core/text.h"

namespace ferry {
namespace {

// Finds and loads libferry_torchio.so. Returns a loader or a status saying what was tried.
Result<LegacyLoader> LoadTorchioPlugin() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("FERRY_TORCHIO"); env != nullptr && *env != '\0') candidates.push_back(env);
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) candidates.push_back((exe.parent_path() / "libferry_torchio.so").string());
  candidates.push_back("libferry_torchio.so");
  std::string tried;
  for (const auto& c : candidates) {
    void* handle = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      tried += "\n  " + c + ": " + ::dlerror();
      continue;
    }
    using Entry = const LegacyLoader* (*)();
    auto entry = reinterpret_cast<Entry>(::dlsym(handle, kTorchioEntryPoint));
    if (entry == nullptr || entry() == nullptr) {
      tried += "\n  " + c + ": no entry point " + kTorchioEntryPoint;
      continue;
    }
    return *entry();  // the plugin stays loaded: tensors it returns reference its code
  }
  return Status::Unsupported(
      "reading torch pickles needs Ferry's LibTorch plugin libferry_torchio.so "
      "(build Ferry with LibTorch, or set FERRY_TORCHIO); tried:" +
      tried);
}

struct LoaderState {
  std::mutex mu;
  bool explicitly_set = false;
  LegacyLoader loader;
  Status plugin_error;
};

LoaderState& State() {
  static LoaderState s;
  return s;
}

Result<LegacyLoader> Loader() {
  LoaderState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.explicitly_set && !s.loader && s.plugin_error.ok()) {
    auto plugin = LoadTorchioPlugin();
    if (plugin.ok()) s.loader = *plugin;
    else s.plugin_error = plugin.status();
  }
  if (s.loader) return s.loader;
  if (s.explicitly_set) return Status::Unsupported("reading torch pickles is disabled in this program");
  return s.plugin_error;
}

}  // namespace

void SetLegacyLoader(LegacyLoader loader) {
  LoaderState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  s.explicitly_set = true;
  s.loader = std::move(loader);
}

Result<std::filesystem::path> FindWeights(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const char* name : {"model.safetensors.index.json", "model.safetensors", "adapter_model.safetensors",
                           "adapter_model.bin", "pytorch_model.bin"}) {
    if (fs::is_regular_file(dir / name, ec)) return dir / name;
  }
  std::vector<fs::path> found;
  std::vector<fs::path> indexes;
  // The error_code forms throughout: a directory changing under us must not throw.
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string n = it->path().filename().string();
    std::error_code type_ec;
    if (n.empty() || n[0] == '.' || !it->is_regular_file(type_ec)) continue;  // ".x.tmp-*": unfinished writes
    if (n.ends_with(".safetensors.index.json")) indexes.push_back(it->path());
    if (n.ends_with(".safetensors")) found.push_back(it->path());
  }
  if (ec) return Status::IOError(dir.string() + ": " + ec.message());
  if (indexes.size() == 1) return indexes[0];
  if (found.size() == 1) return found[0];
  if (found.empty())
    return Status::NotFound(dir.string() + ": no safetensors weights (or adapter_model.bin) in directory");
  return Status::InvalidArgument(dir.string() + ": " + std::to_string(found.size()) +
                                 " .safetensors files but no index to say how they fit together");
}

Result<Checkpoint> Checkpoint::Open(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::NotFound(path.string() + ": no such file or directory");
  fs::path file = path;
  if (fs::is_directory(path, ec)) {
    FERRY_ASSIGN_OR_RETURN(file, FindWeights(path));
  }
  const std::string name = file.filename().string();
  if (name.ends_with(".index.json")) {
    auto c = OpenIndex(file);
    if (c.ok()) c->path_ = path;
    return c;
  }
  if (name.ends_with(".bin") || name.ends_with(".pt") || name.ends_with(".pth")) {
    auto loader = Loader();
    if (!loader.ok()) return loader.status().WithContext(file.string());
    FERRY_ASSIGN_OR_RETURN(auto tensors, (*loader)(file));
    Checkpoint c = FromTensors(path, std::move(tensors));
    c.format_ = CheckpointFormat::kTorchPickle;
    return c;
  }
  FERRY_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(file));
  Checkpoint c;
  c.path_ = path;
  c.format_ = CheckpointFormat::kSafetensorsFile;
  FERRY_RETURN_IF_ERROR(c.AddFile(std::move(f)));
  c.Finalize();
  return c;
}

Result<Checkpoint> Checkpoint::OpenIndex(const std::filesystem::path& index_path) {
  FERRY_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
  if (JsonNestsDeeperThan(text, 16)) return Status::Corruption(index_path.string() + ": JSON is nested too deeply");
  // nlohmann keeps the last of duplicate keys silently: watch the keys of weight_map.
  std::string top_key;
  std::string duplicate;
  std::set<std::string> seen;
  nlohmann::json::parser_callback_t cb = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& v) {
    if (event != nlohmann::json::parse_event_t::key) return true;
    const std::string& k = v.get_ref<const std::string&>();
    if (depth == 1) top_key = k;
    if (depth == 2 && top_key == "weight_map" && !seen.insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  };
  nlohmann::json j = nlohmann::json::parse(text, cb, /*allow_exceptions=*/false);
  const std::string where = index_path.string();
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(where + ": not a JSON object");
  if (!duplicate.empty()) return Status::Corruption(where + ": weight_map lists tensor " + Quote(duplicate) + " twice");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) return Status::Corruption(where + ": missing 'weight_map' object");
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string())
      return Status::Corruption(where + ": weight_map entry for " + Quote(it.key()) + " is not a string");
    const std::string shard = it->get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard.find('\0') != std::string::npos ||
        shard == "." || shard == "..") {
      return Status::Corruption(where + ": weight_map names an invalid shard file " + Quote(shard));
    }
    by_file[shard].push_back(it.key());
  }
  return OpenShards(index_path, by_file);
}

Result<Checkpoint> Checkpoint::OpenShards(const std::filesystem::path& index_path,
                                          const std::map<std::string, std::vector<std::string>>& by_file) {
  Checkpoint c;
  c.format_ = CheckpointFormat::kSafetensorsSharded;
  const auto dir = index_path.parent_path();
  for (const auto& [shard, names] : by_file) {
    auto f = SafetensorsFile::Open(dir / shard);
    if (!f.ok()) {
      if (f.status().code() == StatusCode::kNotFound) {
        return Status::NotFound(index_path.string() + ": names shard " + Quote(shard) + " which does not exist");
      }
      return f.status();
    }
    for (const auto& n : names) {
      if ((*f)->Find(n) == nullptr) {
        return Status::NotFound(index_path.string() + ": tensor " + Quote(n) + " is indexed in " + Quote(shard) +
                                " but that shard does not contain it");
      }
    }
    const std::set<std::string> listed(names.begin(), names.end());
    for (const auto& t : (*f)->tensors()) {
      if (!listed.count(t.name)) {
        return Status::Corruption((dir / shard).string() + ": tensor " + Quote(t.name) +
                                  " is not listed in the index " + index_path.filename().string());
      }
    }
    FERRY_RETURN_IF_ERROR(c.AddFile(std::move(f).value()));
  }
  c.Finalize();
  return c;
}

Status Checkpoint::AddFile(std::shared_ptr<SafetensorsFile> f) {
  const int idx = static_cast<int>(files_.size());
  for (const auto& t : f->tensors()) {
    auto [it, inserted] = entries_.emplace(t.name, Entry{idx, t});
    if (!inserted) {
      return Status::Corruption(f->path().string() + ": tensor " + Quote(t.name) + " also appears in " +
                                files_[static_cast<size_t>(it->second.file)]->path().string());
    }
  }
  files_.push_back(std::move(f));
  return Status::OK();
}

void Checkpoint::Finalize() {
  names_.clear();
  for (const auto& [n, e] : entries_) names_.push_back(n);
}

Checkpoint Checkpoint::FromTensors(std::filesystem::path origin, std::map<std::string, Tensor> tensors) {
  Checkpoint c;
  c.path_ = std::move(origin);
  for (auto& [name, t] : tensors) {
    TensorInfo info;
    info.name = name;
    info.dtype = t.dtype();
    info.shape = t.shape();
    info.begin = 0;
    info.end = t.nbytes();
    c.entries_.emplace(name, Entry{-1, std::move(info)});
  }
  c.memory_ = std::move(tensors);
  c.Finalize();
  return c;
}

Checkpoint Checkpoint::FromProducer(std::filesystem::path origin, std::vector<TensorInfo> infos,
                                    TensorProducer produce) {
  Checkpoint c;
  c.path_ = std::move(origin);
  for (auto& info : infos) {
    Result<uint64_t> n = CheckedByteSize(info.dtype, info.shape);
    info.begin = 0;
    info.end = n.ok() ? *n : 0;
    std::string name = info.name;
    c.entries_.insert_or_assign(std::move(name), Entry{kProduced, std::move(info)});
  }
  c.producer_ = std::make_shared<const TensorProducer>(std::move(produce));
  c.Finalize();
  return c;
}

Result<Tensor> Checkpoint::Get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return Status::NotFound(path_.string() + ": no tensor " + Quote(name));
  if (it->second.file == kProduced) {
    FERRY_ASSIGN_OR_RETURN(Tensor t, (*producer_)(name));
    const TensorInfo& want = it->second.info;
    if (t.dtype() != want.dtype || t.shape() != want.shape) {
      return Status::Internal(path_.string() + ": tensor " + Quote(name) + " was made as " +
                              std::string(DTypeName(t.dtype())) + " " + ShapeToString(t.shape()) + ", announced as " +
                              std::string(DTypeName(want.dtype)) + " " + ShapeToString(want.shape));
    }
    return t;
  }
  if (it->second.file < 0) return memory_.at(name);
  return files_[static_cast<size_t>(it->second.file)]->View(it->second.info);
}

const TensorInfo* Checkpoint::Info(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second.info;
}

SafetensorsFile::FileRange Checkpoint::RangeOf(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.file < 0) return {};
  return files_[static_cast<size_t>(it->second.file)]->RangeOf(it->second.info);
}

void Checkpoint::Release(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.file < 0) return;
  files_[static_cast<size_t>(it->second.file)]->Release(it->second.info);
}

std::filesystem::path Checkpoint::FileOf(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end() || it->second.file < 0) return {};
  return files_[static_cast<size_t>(it->second.file)]->path();
}

std::vector<std::filesystem::path> Checkpoint::files() const {
  std::vector<std::filesystem::path> out;
  for (const auto& f : files_) out.push_back(f->path());
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t t = 0;
  for (const auto& [n, e] : entries_) t += e.info.nbytes();
  return t;
}

std::map<std::string, std::string> Checkpoint::metadata() const {
  return files_.empty() ? std::map<std::string, std::string>{} : files_.front()->metadata();
}

}  // namespace ferry
