// Prometheus text and file following (daemon/control/metrics.h).
#include "daemon/control/metrics.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <set>

#include <nlohmann/json.hpp>

namespace ferry::control {
namespace {

using OrderedJson = nlohmann::ordered_json;

// Length of the valid UTF-8 sequence starting at s[i], or 0 when it is not one.
size_t Utf8Length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n = 0;
  uint32_t cp = 0;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(i + k) & 0x3F);
  }
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return n;
}

std::string FormatNumber(const OrderedJson& v) {
  if (v.is_number_unsigned()) return std::to_string(v.get<uint64_t>());
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  const double d = v.get<double>();
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  return ec == std::errc() ? std::string(buf, ptr) : std::to_string(d);
}

uint64_t HashLine(std::string_view line) { return std::hash<std::string_view>{}(line); }

}  // namespace

std::string PrometheusMetricName(std::string_view field) {
  std::string out = "ferry_";
  for (char c : field) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
    out += ok ? c : '_';
  }
  return out;
}

std::string EscapeLabelValue(std::string_view value) {
  std::string out;
  for (size_t i = 0; i < value.size();) {
    const size_t n = Utf8Length(value, i);
    if (n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
      ++i;
      continue;
    }
    const char c = value[i];
    if (n == 1 && c == '\\') {
      out += "\\\\";
    } else if (n == 1 && c == '"') {
      out += "\\\"";
    } else if (n == 1 && c == '\n') {
      out += "\\n";
    } else {
      out.append(value.substr(i, n));
    }
    i += n;
  }
  return out;
}

Result<OrderedJson> ParseMetricsLine(std::string_view line) {
  const OrderedJson::parser_callback_t shallow = [](int depth, OrderedJson::parse_event_t event, OrderedJson&) {
    return !(depth >= 1 &&
             (event == OrderedJson::parse_event_t::object_start || event == OrderedJson::parse_event_t::array_start));
  };
  OrderedJson j = OrderedJson::parse(line.begin(), line.end(), shallow, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::Corruption("not JSON");
  if (!j.is_object()) return Status::Corruption(std::string("a JSON ") + j.type_name() + ", not an object");
  // The parser leaves some discarded values in place (an object's, with ordered_json).
  for (auto it = j.begin(); it != j.end();) it = it->is_discarded() ? j.erase(it) : std::next(it);
  return j;
}

Result<std::string> MetricsToPrometheus(std::string_view line, std::string_view run) {
  FERRY_ASSIGN_OR_RETURN(const OrderedJson j, ParseMetricsLine(line));
  const std::string run_label = "run=\"" + EscapeLabelValue(run) + "\"";
  std::set<std::string> names;
  std::string out;
  for (const auto& [key, value] : j.items()) {
    if (key == "generator_version") {
      if (!value.is_string() || !names.insert("ferry_generator_info").second) continue;
      out += "# TYPE ferry_generator_info gauge\n";
      out += "ferry_generator_info{" + run_label + ",version=\"" +
             EscapeLabelValue(value.get_ref<const std::string&>()) + "\"} 1\n";
      continue;
    }
    if (!value.is_number()) continue;
    const std::string name = PrometheusMetricName(key);
    if (!names.insert(name).second) continue;
    out += "# TYPE " + name + " gauge\n";
    out += name + "{" + run_label + "} " + FormatNumber(value) + "\n";
  }
  return out;
}

Result<FileTail::Update> FileTail::Poll() {
  Update u;
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return u;
    return Status::IOError(path_.string() + ": cannot open: " + std::strerror(errno));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::IOError(path_.string() + ": cannot stat: " + std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  bool rewritten = inode_ != 0 && (static_cast<uint64_t>(st.st_ino) != inode_ || size < offset_);
  if (!rewritten && !last_line_.empty()) {
    std::string check(last_line_.size(), '\0');
    const ssize_t n = ::pread(fd, check.data(), check.size(), static_cast<off_t>(offset_ - last_line_.size()));
    rewritten = n != static_cast<ssize_t>(check.size()) || check != last_line_;
  }
  inode_ = static_cast<uint64_t>(st.st_ino);
  if (rewritten) {
    u.rewritten = true;
    offset_ = 0;
    last_line_.clear();
    replaying_ = remember_ ? std::move(hashes_) : std::vector<uint64_t>();
    hashes_.clear();
    replay_index_ = 0;
  }
  if (size <= offset_) return u;
  std::string buf(std::min<uint64_t>(size - offset_, kMaxPollBytes), '\0');
  size_t got = 0;
  while (got < buf.size()) {
    const ssize_t n = ::pread(fd, buf.data() + got, buf.size() - got, static_cast<off_t>(offset_ + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IOError(path_.string() + ": cannot read: " + std::strerror(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  buf.resize(got);
  size_t pos = 0;
  const auto take = [&](size_t end, bool newline) {
    const std::string_view line(buf.data() + pos, end - pos);
    const uint64_t h = HashLine(line);
    const bool replayed = replay_index_ < replaying_.size() && replaying_[replay_index_] == h;
    if (replayed) {
      ++replay_index_;
    } else {
      replaying_.clear();
      replay_index_ = 0;
      u.lines.emplace_back(line);
    }
    if (remember_) hashes_.push_back(h);
    const size_t next = end + (newline ? 1 : 0);
    last_line_.assign(buf.data() + pos, next - pos);
    offset_ += next - pos;
    pos = next;
  };
  for (;;) {
    const size_t nl = buf.find('\n', pos);
    if (nl == std::string::npos) break;
    take(nl, true);
  }
  if (buf.size() - pos > kMaxPendingBytes) take(buf.size(), false);
  return u;
}

}  // namespace ferry::control
