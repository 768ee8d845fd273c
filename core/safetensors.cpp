#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "core/json_limits.h"
#include "core/text.h"

namespace ferry {
namespace {

using json = nlohmann::json;

uint64_t ReadLE64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint64_t>(p[i]);
  return v;
}

Result<TensorInfo> ParseEntry(const std::string& name, const json& v) {
  const std::string where = "tensor " + Quote(name);
  if (!v.is_object()) return Status::Corruption(where + ": entry is not a JSON object");
  auto dt = v.find("dtype");
  auto sh = v.find("shape");
  auto off = v.find("data_offsets");
  if (dt == v.end() || !dt->is_string()) return Status::Corruption(where + ": missing or non-string 'dtype'");
  if (sh == v.end() || !sh->is_array()) return Status::Corruption(where + ": missing or non-array 'shape'");
  if (off == v.end() || !off->is_array() || off->size() != 2) {
    return Status::Corruption(where + ": 'data_offsets' must be an array of two integers");
  }
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return Status::Corruption(where + ": unknown field " + Quote(it.key()));
    }
  }
  TensorInfo info;
  info.name = name;
  const std::string dname = dt->get<std::string>();
  auto parsed = ParseDType(dname);
  if (!parsed) return Status::Unsupported(where + ": unknown dtype " + Quote(dname));
  info.dtype = *parsed;
  if (sh->size() > 64) return Status::Corruption(where + ": shape has " + std::to_string(sh->size()) + " dimensions");
  for (const auto& d : *sh) {
    if (!d.is_number_unsigned()) return Status::Corruption(where + ": shape entries must be non-negative integers");
    uint64_t u = d.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Status::Corruption(where + ": dimension " + std::to_string(u) + " is too large");
    }
    info.shape.push_back(static_cast<int64_t>(u));
  }
  for (const auto& o : *off) {
    if (!o.is_number_unsigned()) return Status::Corruption(where + ": data_offsets must be non-negative integers");
  }
  info.begin = (*off)[0].get<uint64_t>();
  info.end = (*off)[1].get<uint64_t>();
  if (info.end < info.begin) {
    return Status::Corruption(where + ": data_offsets end " + std::to_string(info.end) + " is before begin " +
                              std::to_string(info.begin));
  }
  auto size = CheckedByteSize(info.dtype, info.shape);
  if (!size.ok()) return size.status().WithContext(where);
  if (*size != info.nbytes()) {
    return Status::Corruption(where + ": " + std::string(DTypeName(info.dtype)) + " " + ShapeToString(info.shape) +
                              " needs " + std::to_string(*size) + " bytes but data_offsets span " +
                              std::to_string(info.nbytes()));
  }
  return info;
}

}  // namespace

Result<SafetensorsHeader> ParseSafetensorsHeader(std::span<const std::byte> file, uint64_t file_size) {
  if (file_size < 8 || file.size() < 8) {
    return Status::Corruption("file is " + std::to_string(file_size) + " bytes, too short for a safetensors header");
  }
  const uint64_t n = ReadLE64(file.data());
  if (n > kMaxSafetensorsHeaderBytes) {
    return Status::Corruption("header length " + std::to_string(n) + " exceeds the limit of " +
                              std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  }
  if (n + 8 > file_size || n + 8 > file.size()) {
    return Status::Corruption("header length " + std::to_string(n) + " runs past the end of the file (" +
                              std::to_string(file_size) + " bytes)");
  }
  if (n == 0) return Status::Corruption("header is empty");
  const char* hdr = reinterpret_cast<const char*>(file.data() + 8);
  if (hdr[0] != '{') return Status::Corruption("header does not start with '{'");
  if (JsonNestsDeeperThan(std::string_view(hdr, n), 8)) return Status::Corruption("header JSON is nested too deeply");

  // Duplicate names: nlohmann keeps the last value silently, so watch keys at depth 1.
  std::set<std::string> seen;
  std::string duplicate;
  bool too_deep = false;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > 8) too_deep = true;
    if (event == json::parse_event_t::key && depth == 1) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return !too_deep;
  };
  json j = json::parse(hdr, hdr + n, cb, /*allow_exceptions=*/false);
  if (too_deep) return Status::Corruption("header JSON is nested too deeply");
  if (j.is_discarded()) return Status::Corruption("header is not valid UTF-8 JSON");
  if (!j.is_object()) return Status::Corruption("header is not a JSON object");
  if (!duplicate.empty()) return Status::Corruption("duplicate tensor name " + Quote(duplicate));

  SafetensorsHeader h;
  h.data_offset = 8 + n;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Status::Corruption("'__metadata__' is not an object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          return Status::Corruption("'__metadata__' value for " + Quote(m.key()) + " is not a string");
        h.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    FERRY_ASSIGN_OR_RETURN(TensorInfo info, ParseEntry(it.key(), *it));
    h.tensors.push_back(std::move(info));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expect = 0;
  for (const auto& t : h.tensors) {
    if (t.begin < expect) {
      return Status::Corruption("tensor " + Quote(t.name) + ": data_offsets [" + std::to_string(t.begin) + ", " +
                                std::to_string(t.end) + "] overlap the previous tensor (which ends at " +
                                std::to_string(expect) + ")");
    }
    if (t.begin > expect) {
      return Status::Corruption("tensor " + Quote(t.name) + ": gap in the data section before offset " +
                                std::to_string(t.begin) + " (previous tensor ends at " + std::to_string(expect) + ")");
    }
    expect = t.end;
  }
  const uint64_t data_size = file_size - h.data_offset;
  if (expect != data_size) {
    if (expect > data_size) {
      return Status::Corruption("tensors need " + std::to_string(expect) + " data bytes but the file has only " +
                                std::to_string(data_size) + " (truncated?)");
    }
    return Status::Corruption(std::to_string(data_size - expect) + " trailing bytes after the last tensor");
  }
  return h;
}

Result<std::shared_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::filesystem::path& path) {
  auto mapped = MappedFile::Open(path);
  if (!mapped.ok()) return mapped.status();
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->file_ = std::move(mapped).value();
  auto hdr = ParseSafetensorsHeader(f->file_->bytes(), f->file_->size());
  if (!hdr.ok()) return hdr.status().WithContext(path.string());
  f->header_ = std::move(hdr).value();
  for (size_t i = 0; i < f->header_.tensors.size(); ++i) f->by_name_.emplace(f->header_.tensors[i].name, i);
  return f;
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &header_.tensors[it->second];
}

Tensor SafetensorsFile::View(const TensorInfo& info) const {
  auto bytes = file_->bytes().subspan(header_.data_offset + info.begin, info.nbytes());
  // Validated at Open: the size always matches.
  return Tensor::Wrap(info.dtype, info.shape, bytes, shared_from_this()).value();
}

Result<Tensor> SafetensorsFile::Get(std::string_view name) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) return Status::NotFound(path().string() + ": no tensor " + Quote(name));
  return View(*info);
}

void SafetensorsFile::Release(const TensorInfo& info) const {
  file_->Release(header_.data_offset + info.begin, info.nbytes());
}

void SafetensorsFile::AdviseSequential(const TensorInfo& info) const {
  file_->AdviseSequential(header_.data_offset + info.begin, info.nbytes());
}

// ---------------------------------------------------------------------------------
// Writer.

std::string ShardFileName(const std::string& basename, size_t index, size_t count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu.safetensors", index + 1, count);
  return basename + buf;
}

// The header is JSON: a name or metadata text that is not UTF-8 (nlohmann's dump would throw)
// or holds a control character is refused, naming it escaped.
static Status CheckHeaderText(const std::vector<TensorSpec>& specs,
                              const std::map<std::string, std::string>& metadata) {
  for (const auto& [k, v] : metadata) {
    FERRY_RETURN_IF_ERROR(CheckPrintableUtf8("metadata key", k));
    FERRY_RETURN_IF_ERROR(CheckPrintableUtf8("metadata value of '" + EscapeForMessage(k) + "'", v));
  }
  for (const auto& s : specs) FERRY_RETURN_IF_ERROR(CheckPrintableUtf8("tensor name", s.name));
  return Status::OK();
}

Result<std::string> SerializeSafetensorsHeader(const std::vector<TensorSpec>& specs,
                                               const std::map<std::string, std::string>& metadata) {
  FERRY_RETURN_IF_ERROR(CheckHeaderText(specs, metadata));
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const auto& s : specs) {
    if (s.name == "__metadata__") return Status::InvalidArgument("tensor name '__metadata__' is reserved");
    if (!names.insert(s.name).second) return Status::InvalidArgument("duplicate tensor name " + Quote(s.name));
    FERRY_ASSIGN_OR_RETURN(uint64_t size, CheckedByteSize(s.dtype, s.shape));
    if (size > std::numeric_limits<uint64_t>::max() - offset) {
      return Status::InvalidArgument("tensor " + Quote(s.name) + ": data offsets overflow 64 bits");
    }
    j[s.name] = {
        {"dtype", std::string(DTypeName(s.dtype))}, {"shape", s.shape}, {"data_offsets", {offset, offset + size}}};
    offset += size;
  }
  std::string body = j.dump();
  while ((body.size() + 8) % 8 != 0) body.push_back(' ');
  if (body.size() > kMaxSafetensorsHeaderBytes) return Status::InvalidArgument("header would exceed 100 MB");
  std::string out(8, '\0');
  uint64_t n = body.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + body;
}

struct SafetensorsWriter::Shard {
  std::filesystem::path final_path;
  std::filesystem::path temp_path;
  size_t first = 0;  // tensor index range [first, last)
  size_t last = 0;
  bool created = false;
  bool renamed = false;
};

namespace {
constexpr size_t kWriteBuffer = 8u << 20;

// Where the data section of the safetensors file open as `fd` starts (8 + its header length
// prefix), or 0 when the first 8 bytes cannot be read.
uint64_t SafetensorsDataStart(int fd) {
  unsigned char b[8];
  if (::pread(fd, b, sizeof b, 0) != static_cast<ssize_t>(sizeof b)) return 0;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[i];
  return n <= kMaxSafetensorsHeaderBytes ? n + 8 : 0;
}

}  // namespace

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::CreateFile(const std::filesystem::path& path,
                                                                         std::vector<TensorSpec> specs,
                                                                         WriterOptions options) {
  if (options.max_shard_bytes != 0)
    return Status::InvalidArgument("CreateFile writes one file: max_shard_bytes must be 0");
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->specs_ = std::move(specs);
  w->options_ = std::move(options);
  FERRY_RETURN_IF_ERROR(w->Init(path.parent_path(), &path));
  return w;
}

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::CreateInDirectory(const std::filesystem::path& dir,
                                                                                std::vector<TensorSpec> specs,
                                                                                WriterOptions options) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return Status::NotFound(dir.string() + ": output directory does not exist");
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  w->specs_ = std::move(specs);
  w->options_ = std::move(options);
  FERRY_RETURN_IF_ERROR(w->Init(dir, nullptr));
  return w;
}

Status SafetensorsWriter::Init(const std::filesystem::path& dir, const std::filesystem::path* single_file) {
  // Checked before any file is created: every shard's header must be writable.
  if (Status s = CheckHeaderText(specs_, options_.metadata); !s.ok()) {
    return s.WithContext(single_file != nullptr ? single_file->string() : dir.string());
  }
  std::set<std::string_view> names;
  for (const auto& s : specs_) {
    if (s.name == "__metadata__") return Status::InvalidArgument("tensor name '__metadata__' is reserved");
    if (!names.insert(s.name).second) return Status::InvalidArgument("duplicate tensor name " + Quote(s.name));
    auto size = CheckedByteSize(s.dtype, s.shape);
    if (!size.ok()) return size.status().WithContext("tensor " + Quote(s.name));
    sizes_.push_back(*size);
  }
  // Assign tensors to shards in declared order, as transformers does.
  std::vector<std::pair<size_t, size_t>> ranges;
  const uint64_t limit = options_.max_shard_bytes;
  size_t start = 0;
  uint64_t acc = 0;
  const auto& shard_of = options_.shard_of;
  if (!shard_of.empty()) {
    if (shard_of.size() != specs_.size() || single_file != nullptr) {
      return Status::InvalidArgument("shard_of must give one shard per declared tensor (directory output only)");
    }
    if (shard_of.front() != 0) return Status::InvalidArgument("shard_of must start at shard 0");
    for (size_t i = 1; i < specs_.size(); ++i) {
      if (shard_of[i] != shard_of[i - 1] && shard_of[i] != shard_of[i - 1] + 1) {
        return Status::InvalidArgument("shard_of must be non-decreasing without skipping a shard");
      }
      if (shard_of[i] != shard_of[i - 1]) {
        ranges.emplace_back(start, i);
        start = i;
      }
    }
  } else {
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (limit != 0 && i > start && (sizes_[i] > limit || acc > limit - sizes_[i])) {
        ranges.emplace_back(start, i);
        start = i;
        acc = 0;
      }
      acc += sizes_[i];
    }
  }
  ranges.emplace_back(start, specs_.size());
  for (size_t k = 0; k < ranges.size(); ++k) {
    Shard s;
    s.first = ranges[k].first;
    s.last = ranges[k].second;
    if (single_file != nullptr) {
      s.final_path = *single_file;
    } else if (ranges.size() == 1) {
      s.final_path = dir / (options_.basename + ".safetensors");
    } else {
      s.final_path = dir / ShardFileName(options_.basename, k, ranges.size());
    }
    s.temp_path = TempNameFor(s.final_path);
    shards_.push_back(std::move(s));
  }
  if (shards_.size() > 1) index_path_ = dir / (options_.basename + ".safetensors.index.json");
  buffer_.resize(kWriteBuffer);
  // Open the first shard now so that an empty tensor list still produces a file.
  return OpenShard(0);
}

Status SafetensorsWriter::OpenShard(size_t i) {
  Shard& s = shards_[i];
  fd_ = ::open(s.temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) return ErrnoStatus(s.temp_path.string(), errno);
  s.created = true;
  cur_shard_ = i;
  std::vector<TensorSpec> subset(specs_.begin() + static_cast<ptrdiff_t>(s.first),
                                 specs_.begin() + static_cast<ptrdiff_t>(s.last));
  FERRY_ASSIGN_OR_RETURN(header_, SerializeSafetensorsHeader(subset, options_.metadata));
  buffered_ = 0;
  header_pending_ = true;
  header_over_copy_ = false;
  return Status::OK();
}

Status SafetensorsWriter::WriteHeader() {
  if (!header_pending_) return Status::OK();
  header_pending_ = false;
  return AppendRaw(header_);
}

Status SafetensorsWriter::FlushBuffer() {
  if (buffered_ == 0) return Status::OK();
  FERRY_RETURN_IF_ERROR(WriteAll(fd_, {buffer_.data(), buffered_}, shards_[cur_shard_].temp_path));
  bytes_written_ += buffered_;
  buffered_ = 0;
  return Status::OK();
}

Status SafetensorsWriter::CloseShard() {
  FERRY_RETURN_IF_ERROR(WriteHeader());  // a shard of empty tensors still has its header
  FERRY_RETURN_IF_ERROR(FlushPendingRange());
  FERRY_RETURN_IF_ERROR(FlushBuffer());
  const auto& path = shards_[cur_shard_].temp_path;
  if (options_.sync && ::fdatasync(fd_) != 0) return ErrnoStatus(path.string() + ": fsync", errno);
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) return ErrnoStatus(path.string(), errno);
  return Status::OK();
}

Status SafetensorsWriter::Append(std::span<const std::byte> bytes) {
  if (finished_) return Status::FailedPrecondition("writer already finished");
  FERRY_RETURN_IF_ERROR(Advance());  // skip empty tensors the caller did not Write()
  while (!bytes.empty()) {
    if (cur_tensor_ >= specs_.size()) {
      return Status::InvalidArgument("more bytes appended than the declared tensors hold");
    }
    const uint64_t left = sizes_[cur_tensor_] - cur_offset_;
    if (bytes.size() > left) {
      return Status::InvalidArgument("tensor " + Quote(specs_[cur_tensor_].name) + ": appended piece of " +
                                     std::to_string(bytes.size()) + " bytes exceeds the " + std::to_string(left) +
                                     " bytes left");
    }
    FERRY_RETURN_IF_ERROR(AppendRaw(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())));
    cur_offset_ += bytes.size();
    bytes = {};
    FERRY_RETURN_IF_ERROR(Advance());
  }
  return Status::OK();
}

Status SafetensorsWriter::Advance() {
  // Move past completed (and empty) tensors, on to the next shard as needed.
  while (cur_tensor_ < specs_.size() && cur_offset_ == sizes_[cur_tensor_]) {
    ++cur_tensor_;
    cur_offset_ = 0;
    if (cur_tensor_ < specs_.size() && cur_tensor_ >= shards_[cur_shard_].last) {
      FERRY_RETURN_IF_ERROR(CloseShard());
      FERRY_RETURN_IF_ERROR(OpenShard(cur_shard_ + 1));
    }
  }
  return Status::OK();
}

Status SafetensorsWriter::AppendFileRange(int src, uint64_t offset, uint64_t length) {
  if (finished_) return Status::FailedPrecondition("writer already finished");
  FERRY_RETURN_IF_ERROR(Advance());
  if (length == 0) return Status::OK();
  if (cur_tensor_ >= specs_.size() || length > sizes_[cur_tensor_] - cur_offset_) {
    return Status::InvalidArgument("file range of " + std::to_string(length) + " bytes exceeds the current tensor");
  }
  if (header_pending_ && offset % 8 == 0 && offset >= header_.size() && offset - 8 <= kMaxSafetensorsHeaderBytes &&
      SafetensorsDataStart(src) == offset) {
    // The shard's first data starts the data section of a safetensors source file: copy from
    // byte 0 of both files (the source's header bytes included) and write the header,
    // padded with spaces to exactly `offset` bytes, over the source's header afterwards.
    // Copies that start at a file's first byte are measurably cheaper (Linux 6.18, ext4:
    // 0.26 s instead of 0.31 s per GB; bench/README.md), and this is what `cp` does.
    std::string body = header_.substr(8);
    while (!body.empty() && body.back() == ' ') body.pop_back();
    body.resize(offset - 8, ' ');
    header_.assign(8, '\0');
    const uint64_t n = body.size();
    for (int i = 0; i < 8; ++i) header_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    header_ += body;
    header_pending_ = false;
    header_over_copy_ = true;
    pending_src_ = src;
    pending_off_ = 0;
    pending_len_ = offset + length;
    bytes_written_ += offset + length;
    cur_offset_ += length;
    return Advance();
  }
  FERRY_RETURN_IF_ERROR(WriteHeader());
  FERRY_RETURN_IF_ERROR(FlushBuffer());
  // Ranges that continue the pending one (consecutive tensors of the same source file) are
  // coalesced, so a run of unchanged tensors costs one in-kernel copy, as cp's does.
  if (pending_src_ == src && pending_off_ + pending_len_ == offset) {
    pending_len_ += length;
  } else {
    FERRY_RETURN_IF_ERROR(FlushPendingRange());
    pending_src_ = src;
    pending_off_ = offset;
    pending_len_ = length;
  }
  bytes_written_ += length;
  cur_offset_ += length;
  return Advance();
}

Status SafetensorsWriter::FlushPendingRange() {
  if (pending_src_ < 0 || pending_len_ == 0) {
    pending_src_ = -1;
    return Status::OK();
  }
  const int src = pending_src_;
  loff_t in_off = static_cast<loff_t>(pending_off_);
  uint64_t left = pending_len_;
  pending_src_ = -1;
  pending_len_ = 0;
  const auto& path = shards_[cur_shard_].temp_path;
  bool fallback = false;
  while (left > 0 && !fallback) {
    ssize_t n = ::copy_file_range(src, &in_off, fd_, nullptr, std::min<uint64_t>(left, 1u << 30), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
      fallback = true;
      break;
    }
    if (n < 0) return ErrnoStatus(path.string() + ": copy_file_range", errno);
    if (n == 0) return Status::IOError(path.string() + ": source ended " + std::to_string(left) + " bytes early");
    left -= static_cast<uint64_t>(n);
  }
  if (fallback) {
    std::vector<std::byte> buf(std::min<uint64_t>(left, 4u << 20));
    while (left > 0) {
      ssize_t n = ::pread(src, buf.data(), std::min<uint64_t>(left, buf.size()), in_off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Status::IOError(path.string() + ": short read from source");
      FERRY_RETURN_IF_ERROR(WriteAll(fd_, {buf.data(), static_cast<size_t>(n)}, path));
      in_off += n;
      left -= static_cast<uint64_t>(n);
    }
  }
  if (header_over_copy_) {
    header_over_copy_ = false;
    FERRY_RETURN_IF_ERROR(
        PwriteAll(fd_, {reinterpret_cast<const std::byte*>(header_.data()), header_.size()}, 0, path));
  }
  return Status::OK();
}

Status SafetensorsWriter::Write(std::string_view name, const Tensor& t) {
  if (finished_) return Status::FailedPrecondition("writer already finished");
  auto check_spec = [&](const TensorSpec& s) -> Status {
    if (s.dtype != t.dtype() || s.shape != t.shape()) {
      return Status::InvalidArgument("tensor " + Quote(name) + ": declared " + std::string(DTypeName(s.dtype)) + " " +
                                     ShapeToString(s.shape) + " but got " + std::string(DTypeName(t.dtype())) + " " +
                                     ShapeToString(t.shape()));
    }
    return Status::OK();
  };
  FERRY_RETURN_IF_ERROR(Advance());
  // Empty tensors need no bytes and Advance() steps over them, so an empty tensor written
  // in its declared place may already lie just behind cur_tensor_.
  if (cur_offset_ == 0) {
    for (size_t i = cur_tensor_; i > 0 && sizes_[i - 1] == 0; --i) {
      if (specs_[i - 1].name == name) return check_spec(specs_[i - 1]);
    }
  }
  if (cur_tensor_ >= specs_.size() || specs_[cur_tensor_].name != name || cur_offset_ != 0) {
    return Status::InvalidArgument("tensor " + Quote(name) + " written out of the declared order");
  }
  FERRY_RETURN_IF_ERROR(check_spec(specs_[cur_tensor_]));
  if (t.nbytes() != sizes_[cur_tensor_]) {
    return Status::InvalidArgument("tensor " + Quote(name) + ": holds " + std::to_string(t.nbytes()) + " bytes, " +
                                   std::to_string(sizes_[cur_tensor_]) + " expected");
  }
  return Append(t.bytes());
}

Status SafetensorsWriter::AppendRaw(std::string_view data) {
  FERRY_RETURN_IF_ERROR(WriteHeader());        // the header precedes the shard's data
  FERRY_RETURN_IF_ERROR(FlushPendingRange());  // keep the byte order
  // Small pieces go through the buffer; large ones are written straight from the source.
  if (data.size() >= kWriteBuffer / 2) {
    FERRY_RETURN_IF_ERROR(FlushBuffer());
    FERRY_RETURN_IF_ERROR(
        WriteAll(fd_, std::as_bytes(std::span<const char>(data.data(), data.size())), shards_[cur_shard_].temp_path));
    bytes_written_ += data.size();
    return Status::OK();
  }
  if (buffered_ + data.size() > buffer_.size()) FERRY_RETURN_IF_ERROR(FlushBuffer());
  std::memcpy(buffer_.data() + buffered_, data.data(), data.size());
  buffered_ += data.size();
  return Status::OK();
}

Status SafetensorsWriter::Finish() {
  if (finished_) return Status::FailedPrecondition("writer already finished");
  Status adv = Advance();  // empty tensors at the end need no bytes
  if (!adv.ok()) {
    Abort();
    return adv;
  }
  if (cur_tensor_ < specs_.size()) {
    Status s = Status::FailedPrecondition("tensor " + Quote(specs_[cur_tensor_].name) +
                                          " was declared but not written (" + std::to_string(cur_offset_) + " of " +
                                          std::to_string(sizes_[cur_tensor_]) + " bytes)");
    Abort();
    return s;
  }
  Status st = CloseShard();
  if (!st.ok()) {
    Abort();
    return st;
  }
  for (auto& s : shards_) {
    if (::rename(s.temp_path.c_str(), s.final_path.c_str()) != 0) {
      Status e = ErrnoStatus(s.final_path.string(), errno);
      Abort();
      return e;
    }
    s.renamed = true;
  }
  if (!index_path_.empty()) {
    // The index is the file that makes a sharded checkpoint "whole": it goes last.
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    std::vector<std::pair<std::string, std::string>> entries;
    uint64_t total = 0;
    for (const auto& s : shards_) {
      for (size_t i = s.first; i < s.last; ++i) {
        entries.emplace_back(specs_[i].name, s.final_path.filename().string());
        total += sizes_[i];
      }
    }
    std::sort(entries.begin(), entries.end());
    for (auto& [k, v] : entries) weight_map[k] = v;
    nlohmann::ordered_json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    st = WriteFileAtomic(index_path_, idx.dump(2) + "\n", options_.sync);
    if (!st.ok()) {
      Abort();
      return st;
    }
  }
  if (options_.sync) {
    st = SyncDirectory(shards_.front().final_path.parent_path());
    if (!st.ok()) {
      if (!index_path_.empty()) ::unlink(index_path_.c_str());
      Abort();
      return st;
    }
  }
  finished_ = true;
  return Status::OK();
}

void SafetensorsWriter::Abort() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  for (auto& s : shards_) {
    if (s.renamed) {
      ::unlink(s.final_path.c_str());
      s.renamed = false;
    } else if (s.created) {
      ::unlink(s.temp_path.c_str());
    }
    s.created = false;
  }
  finished_ = true;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (!finished_) Abort();
}

std::vector<std::filesystem::path> SafetensorsWriter::OutputPaths() const {
  std::vector<std::filesystem::path> out;
  for (const auto& s : shards_) out.push_back(s.final_path);
  if (!index_path_.empty()) out.push_back(index_path_);
  return out;
}

}  // namespace ferry
