#include "core/checkpoint.h"

#include <set>

#include <nlohmann/json.hpp>

namespace ferry {
namespace {

LegacyLoader& Loader() {
  static LegacyLoader loader;
  return loader;
}

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void SetLegacyLoader(LegacyLoader loader) { Loader() = std::move(loader); }

Result<std::filesystem::path> FindWeights(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const char* name : {"model.safetensors.index.json", "model.safetensors", "adapter_model.safetensors",
                           "adapter_model.bin", "pytorch_model.bin"}) {
    if (fs::is_regular_file(dir / name, ec)) return dir / name;
  }
  std::vector<fs::path> found;
  std::vector<fs::path> indexes;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (!e.is_regular_file() || n.empty() || n[0] == '.') continue;
    if (EndsWith(n, ".safetensors.index.json")) indexes.push_back(e.path());
    if (EndsWith(n, ".safetensors")) found.push_back(e.path());
  }
  if (ec) return Status::IOError(dir.string() + ": " + ec.message());
  if (indexes.size() == 1) return indexes[0];
  if (found.size() == 1) return found[0];
  if (found.empty()) return Status::NotFound(dir.string() + ": no safetensors weights (or adapter_model.bin) in directory");
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
  if (EndsWith(name, ".index.json")) {
    auto c = OpenIndex(file);
    if (c.ok()) c->path_ = path;
    return c;
  }
  if (EndsWith(name, ".bin") || EndsWith(name, ".pt") || EndsWith(name, ".pth")) {
    if (!Loader()) {
      return Status::Unsupported(file.string() + ": reading torch pickles needs the LibTorch build of Ferry");
    }
    FERRY_ASSIGN_OR_RETURN(auto tensors, Loader()(file));
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
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const std::string where = index_path.string();
  if (j.is_discarded() || !j.is_object()) return Status::Corruption(where + ": not a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) return Status::Corruption(where + ": missing 'weight_map' object");
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string()) return Status::Corruption(where + ": weight_map entry for " + Quote(it.key()) + " is not a string");
    const std::string shard = it->get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
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
        return Status::Corruption((dir / shard).string() + ": tensor " + Quote(t.name) + " is not listed in the index " +
                                  index_path.filename().string());
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

Result<Tensor> Checkpoint::Get(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) return Status::NotFound(path_.string() + ": no tensor " + Quote(name));
  if (it->second.file < 0) return memory_.at(name);
  return files_[static_cast<size_t>(it->second.file)]->View(it->second.info);
}

const TensorInfo* Checkpoint::Info(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second.info;
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
