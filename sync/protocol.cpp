#include "sync/protocol.h"

#include <cstring>
#include <initializer_list>
#include <set>

#include <nlohmann/json.hpp>

#include "core/aux_files.h"
#include "core/json_limits.h"

namespace ferry::sync {
namespace {

void PutLe(std::string& out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutDigest(std::string& out, const store::Digest& d) {
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((d.hi >> (8 * i)) & 0xff));
  for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((d.lo >> (8 * i)) & 0xff));
}

// A bounds-checked reader over a header frame.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> b) : b_(b) {}
  bool Le(uint64_t* v, int n) {
    if (pos_ + n > b_.size()) return false;
    *v = 0;
    for (int i = 0; i < n; ++i) *v |= static_cast<uint64_t>(b_[pos_ + i]) << (8 * i);
    pos_ += n;
    return true;
  }
  bool Dig(store::Digest* d) {
    if (pos_ + 16 > b_.size()) return false;
    d->hi = d->lo = 0;
    for (int i = 0; i < 8; ++i) d->hi = (d->hi << 8) | static_cast<uint64_t>(b_[pos_ + i]);
    for (int i = 8; i < 16; ++i) d->lo = (d->lo << 8) | static_cast<uint64_t>(b_[pos_ + i]);
    pos_ += 16;
    return true;
  }
  bool AtEnd() const { return pos_ == b_.size(); }

 private:
  std::span<const std::byte> b_;
  size_t pos_ = 0;
};

std::string_view TypeName(MsgType t) {
  switch (t) {
    case MsgType::kHello: return "HELLO";
    case MsgType::kManifest: return "MANIFEST";
    case MsgType::kFetch: return "FETCH";
    case MsgType::kChunk: return "CHUNK";
    case MsgType::kAck: return "ACK";
    case MsgType::kAcked: return "ACKED";
    case MsgType::kAnnounce: return "ANNOUNCE";
    case MsgType::kError: return "ERROR";
    case MsgType::kEngine: return "ENGINE";
  }
  return "?";
}

}  // namespace

bool HasPayload(MsgType type) {
  return type == MsgType::kHello || type == MsgType::kManifest || type == MsgType::kChunk || type == MsgType::kAck ||
         type == MsgType::kError || type == MsgType::kEngine;
}

std::string EncodeHeader(const Message& m) {
  std::string out(kMagic);
  out.push_back(static_cast<char>(m.type));
  switch (m.type) {
    case MsgType::kHello:
      if (m.wanted) PutDigest(out, *m.wanted);
      break;
    case MsgType::kManifest:
      PutLe(out, m.sequence, 8);
      PutLe(out, m.epoch, 8);
      break;
    case MsgType::kFetch:
      PutDigest(out, m.version);
      out.push_back(static_cast<char>(m.kind));
      PutLe(out, m.index, 4);
      PutLe(out, m.offset, 8);
      PutLe(out, m.length, 4);
      break;
    case MsgType::kChunk:
      PutDigest(out, m.version);
      out.push_back(static_cast<char>(m.kind));
      PutLe(out, m.index, 4);
      PutLe(out, m.offset, 8);
      PutLe(out, m.sequence, 8);
      PutLe(out, m.epoch, 8);
      break;
    case MsgType::kAck:
      PutDigest(out, m.version);
      PutDigest(out, m.computed);
      out.push_back(m.proven ? '\x01' : '\x00');
      PutDigest(out, m.proven.value_or(store::Digest{}));
      break;
    case MsgType::kAcked:
    case MsgType::kEngine: PutDigest(out, m.version); break;
    case MsgType::kAnnounce:
      PutLe(out, m.sequence, 8);
      PutDigest(out, m.version);
      PutLe(out, m.epoch, 8);
      break;
    case MsgType::kError: PutLe(out, m.code, 4); break;
  }
  return out;
}

Result<Message> Decode(std::span<const std::byte> header, const std::span<const std::byte>* payload) {
  if (header.size() < kMagic.size() + 1 || std::memcmp(header.data(), kMagic.data(), kMagic.size()) != 0) {
    return Status::Corruption("sync message: header frame does not start with magic \"" + std::string(kMagic) + "\"");
  }
  Message m;
  const auto t = static_cast<uint8_t>(header[kMagic.size()]);
  if (t < 1 || t > 9) return Status::Corruption("sync message: unknown type byte " + std::to_string(t));
  m.type = static_cast<MsgType>(t);
  const std::string name(TypeName(m.type));
  Reader r(header.subspan(kMagic.size() + 1));
  uint64_t v = 0;
  bool ok = true;
  switch (m.type) {
    case MsgType::kHello:
      if (!r.AtEnd()) {
        store::Digest wanted;
        ok = r.Dig(&wanted);
        m.wanted = wanted;
      }
      break;
    case MsgType::kManifest: ok = r.Le(&m.sequence, 8) && r.Le(&m.epoch, 8); break;
    case MsgType::kFetch:
    case MsgType::kChunk:
      ok = r.Dig(&m.version) && r.Le(&v, 1);
      if (ok && v > 1)
        return Status::Corruption("sync " + name + ": field kind has unknown value " + std::to_string(v));
      m.kind = static_cast<ItemKind>(v);
      ok = ok && r.Le(&v, 4);
      m.index = static_cast<uint32_t>(v);
      ok = ok && r.Le(&m.offset, 8);
      if (m.type == MsgType::kFetch) {
        ok = ok && r.Le(&v, 4);
        m.length = static_cast<uint32_t>(v);
        if (ok && (m.length == 0 || m.length > kMaxChunkBytes)) {
          return Status::Corruption("sync FETCH: field length " + std::to_string(m.length) + " outside 1.." +
                                    std::to_string(kMaxChunkBytes));
        }
      } else {
        ok = ok && r.Le(&m.sequence, 8) && r.Le(&m.epoch, 8);
      }
      break;
    case MsgType::kAck: {
      store::Digest proven;
      ok = r.Dig(&m.version) && r.Dig(&m.computed) && r.Le(&v, 1) && r.Dig(&proven);
      if (ok && v > 1) return Status::Corruption("sync ACK: field has_proven has value " + std::to_string(v));
      if (ok && v == 1) m.proven = proven;
      break;
    }
    case MsgType::kAcked:
    case MsgType::kEngine: ok = r.Dig(&m.version); break;
    case MsgType::kAnnounce: ok = r.Le(&m.sequence, 8) && r.Dig(&m.version) && r.Le(&m.epoch, 8); break;
    case MsgType::kError:
      ok = r.Le(&v, 4);
      m.code = static_cast<uint32_t>(v);
      break;
  }
  if (!ok)
    return Status::Corruption("sync " + name + ": header frame truncated (" + std::to_string(header.size()) +
                              " bytes)");
  if (!r.AtEnd()) return Status::Corruption("sync " + name + ": header frame has trailing bytes");
  if (HasPayload(m.type) != (payload != nullptr)) {
    return Status::Corruption("sync " + name + (payload ? ": unexpected payload frame" : ": payload frame missing"));
  }
  if (payload == nullptr) return m;
  if (m.type == MsgType::kChunk) {
    if (payload->size() > kMaxChunkBytes) return Status::Corruption("sync CHUNK: payload larger than the chunk limit");
    m.bytes = *payload;
    return m;
  }
  if (m.type == MsgType::kEngine && payload->size() > kMaxEngineReportBytes) {
    return Status::Corruption("sync ENGINE: payload larger than " + std::to_string(kMaxEngineReportBytes) + " bytes");
  }
  m.payload.assign(reinterpret_cast<const char*>(payload->data()), payload->size());
  if ((m.type == MsgType::kHello || m.type == MsgType::kAck) && !IsValidReceiverId(m.payload)) {
    return Status::Corruption("sync " + name + ": field receiver id is not [A-Za-z0-9._-]{1,64}");
  }
  return m;
}

bool IsValidReceiverId(std::string_view id) {
  if (id.empty() || id.size() > kMaxReceiverIdBytes) return false;
  for (char c : id) {
    const bool good =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!good) return false;
  }
  return true;
}

bool IsSafeFileName(std::string_view name) { return name.size() <= kMaxNameBytes && CheckAuxFileName(name).ok(); }

std::string_view PublishModeName(PublishMode mode) {
  switch (mode) {
    case PublishMode::kMerged: return "merged";
    case PublishMode::kAdapter: return "adapter";
    case PublishMode::kDelta: return "delta";
  }
  return "unknown";
}

Result<PublishMode> ParsePublishMode(std::string_view name) {
  for (PublishMode m : {PublishMode::kMerged, PublishMode::kAdapter, PublishMode::kDelta}) {
    if (PublishModeName(m) == name) return m;
  }
  return Status::InvalidArgument("publish mode \"" + std::string(name) + "\": expected merged, adapter or delta");
}

Manifest ManifestFor(const store::VersionRecord& r) {
  Manifest m;
  m.version = r.id;
  m.kind = r.kind;
  m.layout = r.layout;
  m.base_version = r.base_version;
  m.tensors = r.tensors;
  m.aux = r.aux;
  return m;
}

std::string EncodeManifest(const Manifest& m) {
  nlohmann::json j;
  j["version"] = m.version.Hex();
  j["sequence"] = m.sequence;
  j["epoch"] = m.epoch;
  j["kind"] = std::string(store::KindName(m.kind));
  j["layout"] = std::string(LayoutName(m.layout));
  j["mode"] = std::string(PublishModeName(m.mode));
  if (m.mode == PublishMode::kAdapter) {
    if (m.base_version) j["base_version"] = m.base_version->Hex();
    if (m.merged_version) j["merged_version"] = m.merged_version->Hex();
  }
  j["tensors"] = nlohmann::json::array();
  for (const auto& t : m.tensors) {
    j["tensors"].push_back({{"name", t.name},
                            {"dtype", std::string(DTypeName(t.dtype))},
                            {"shape", t.shape},
                            {"digest", t.digest.Hex()},
                            {"nbytes", t.nbytes}});
  }
  j["aux"] = nlohmann::json::array();
  for (const auto& a : m.aux) j["aux"].push_back({{"name", a.name}, {"digest", a.digest.Hex()}, {"size", a.size}});
  return j.dump();
}

Result<Manifest> DecodeManifest(std::string_view text) {
  auto bad = [](const std::string& what) { return Status::Corruption("sync MANIFEST: " + what); };
  if (JsonNestsDeeperThan(text, kMaxManifestDepth)) {
    return bad("JSON nests deeper than " + std::to_string(kMaxManifestDepth) + " levels");
  }
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("payload is not a JSON object");
  auto get_digest = [&](const nlohmann::json& o, const std::string& field) -> Result<store::Digest> {
    if (!o.contains(field) || !o[field].is_string()) return bad("field " + field + " missing or not a string");
    auto d = store::Digest::FromHex(o[field].get<std::string>());
    if (!d.ok()) return bad("field " + field + " is not a 32-hex-digit digest");
    return *d;
  };
  auto get_u64 = [&](const nlohmann::json& o, const std::string& field) -> Result<uint64_t> {
    if (!o.contains(field) || !o[field].is_number_unsigned())
      return bad("field " + field + " missing or not an unsigned integer");
    return o[field].get<uint64_t>();
  };
  Manifest m;
  FERRY_ASSIGN_OR_RETURN(m.version, get_digest(j, "version"));
  FERRY_ASSIGN_OR_RETURN(m.sequence, get_u64(j, "sequence"));
  FERRY_ASSIGN_OR_RETURN(m.epoch, get_u64(j, "epoch"));
  auto get_enum = [&](const std::string& field,
                      std::initializer_list<std::string_view> allowed) -> Result<std::string> {
    if (!j.contains(field) || !j[field].is_string()) return bad("field " + field + " missing or not a string");
    std::string v = j[field].get<std::string>();
    for (std::string_view a : allowed) {
      if (v == a) return v;
    }
    return bad("field " + field + " has unknown value \"" + v.substr(0, 32) + "\"");
  };
  // The names are the wire's; the Manifest holds the enums they name.
  FERRY_ASSIGN_OR_RETURN(const std::string kind, get_enum("kind", {"full", "base", "merged", "adapter"}));
  FERRY_ASSIGN_OR_RETURN(const std::string layout, get_enum("layout", {"hf", "fused", "lora"}));
  FERRY_ASSIGN_OR_RETURN(const std::string mode, get_enum("mode", {"merged", "adapter", "delta"}));
  m.kind = *store::ParseKind(kind);
  m.layout = *ParseLayout(layout);
  m.mode = *ParsePublishMode(mode);
  if (m.mode == PublishMode::kAdapter) {
    FERRY_ASSIGN_OR_RETURN(m.base_version, get_digest(j, "base_version"));
    if (m.kind == store::VersionKind::kAdapter) {
      FERRY_ASSIGN_OR_RETURN(m.merged_version, get_digest(j, "merged_version"));
    } else if (m.kind == store::VersionKind::kMerged || !(*m.base_version == m.version) ||
               j.contains("merged_version")) {
      // The only other version adapter mode serves is the base the adapters apply to.
      return bad("field kind is \"" + kind +
                 "\" in adapter mode (must be adapter, or base/full with base_version = version and no "
                 "merged_version: the base itself)");
    }
  } else if (m.kind == store::VersionKind::kAdapter) {
    return bad("field kind is \"adapter\" outside adapter mode (mode " + mode + ")");
  }
  if (!j.contains("tensors") || !j["tensors"].is_array()) return bad("field tensors missing or not an array");
  if (!j.contains("aux") || !j["aux"].is_array()) return bad("field aux missing or not an array");
  if (j["tensors"].size() > kMaxTensors) return bad("more than " + std::to_string(kMaxTensors) + " tensors");
  if (j["aux"].size() > kMaxAuxFiles) return bad("more than " + std::to_string(kMaxAuxFiles) + " aux files");
  for (const auto& t : j["tensors"]) {
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string())
      return bad("a tensor has no string field name");
    store::TensorRow row;
    row.name = t["name"].get<std::string>();
    if (row.name.empty() || row.name.size() > kMaxNameBytes) return bad("tensor name empty or longer than the limit");
    const std::string where = "tensor " + row.name + ": ";
    if (!m.tensors.empty() && !(m.tensors.back().name < row.name)) return bad(where + "names not sorted and unique");
    if (!t.contains("dtype") || !t["dtype"].is_string()) return bad(where + "field dtype missing");
    auto dt = ParseDType(t["dtype"].get<std::string>());
    if (!dt) return bad(where + "field dtype unknown");
    row.dtype = *dt;
    if (!t.contains("shape") || !t["shape"].is_array() || t["shape"].size() > 16)
      return bad(where + "field shape invalid");
    for (const auto& d : t["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad(where + "field shape has a bad dimension");
      row.shape.push_back(d.get<int64_t>());
    }
    auto digest = get_digest(t, "digest");
    if (!digest.ok()) return bad(where + digest.status().message());
    row.digest = *digest;
    auto nbytes = get_u64(t, "nbytes");
    if (!nbytes.ok()) return bad(where + "field nbytes missing");
    row.nbytes = *nbytes;
    auto expect = CheckedByteSize(row.dtype, row.shape);
    if (!expect.ok() || *expect != row.nbytes) return bad(where + "field nbytes does not match dtype and shape");
    m.tensors.push_back(std::move(row));
  }
  std::set<std::string> aux_names;
  for (const auto& a : j["aux"]) {
    if (!a.is_object() || !a.contains("name") || !a["name"].is_string())
      return bad("an aux file has no string field name");
    store::AuxFile f;
    f.name = a["name"].get<std::string>();
    if (f.name.size() > kMaxNameBytes) return bad("aux file name longer than the limit");
    if (Status s = CheckAuxFileName(f.name); !s.ok()) return bad(s.message());
    if (!aux_names.insert(f.name).second) return bad("aux file " + f.name + " listed twice");
    auto digest = get_digest(a, "digest");
    if (!digest.ok()) return bad("aux " + f.name + ": " + digest.status().message());
    f.digest = *digest;
    auto size = get_u64(a, "size");
    if (!size.ok() || *size > kMaxAuxBytes) return bad("aux " + f.name + ": field size missing or above the limit");
    f.size = *size;
    m.aux.push_back(std::move(f));
  }
  return m;
}

}  // namespace ferry::sync
