// libFuzzer target for the sync wire protocol (sync/protocol.h): frames from the network
// are hostile, so any bytes must decode to a message / manifest or an error, never a
// crash, hang or unbounded allocation.
//
// Input layout: byte 0 selects the mode (mod 4), the rest is the body.
//   0  Decode(body, no payload frame)
//   1  u16 LE header length L, then L header bytes, then the payload frame (the rest)
//   2  DecodeManifest(body)
//   3  Decode(body, empty payload frame)
//
// Beyond "no sanitizer report", every accepted input must survive the project's own
// encoders: EncodeHeader / EncodeManifest of the decoded value decodes again to the same
// fields, and re-encoding is a fixed point. An accepted manifest is also laid out as the
// receiver lays it out (SerializeSafetensorsHeader), and that header must parse back to
// the manifest's tensors at contiguous offsets.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/safetensors.h"
#include "store/store.h"
#include "sync/protocol.h"

namespace {

using ferry::sync::ItemKind;
using ferry::sync::Manifest;
using ferry::sync::Message;
using ferry::sync::MsgType;

void Check(bool ok) {
  if (!ok) std::abort();
}

std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

bool SameBytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

// The fields EncodeHeader (and the payload frame) carry for `a.type`.
bool SameMessage(const Message& a, const Message& b) {
  if (a.type != b.type) return false;
  switch (a.type) {
    case MsgType::kHello: return a.payload == b.payload;
    case MsgType::kManifest: return a.sequence == b.sequence && a.epoch == b.epoch && a.payload == b.payload;
    case MsgType::kFetch:
      return a.version == b.version && a.kind == b.kind && a.index == b.index && a.offset == b.offset &&
             a.length == b.length;
    case MsgType::kChunk:
      return a.version == b.version && a.kind == b.kind && a.index == b.index && a.offset == b.offset &&
             a.sequence == b.sequence && a.epoch == b.epoch && SameBytes(a.bytes, b.bytes);
    case MsgType::kAck:
      return a.version == b.version && a.computed == b.computed && a.proven == b.proven && a.payload == b.payload;
    case MsgType::kAcked: return a.version == b.version;
    case MsgType::kAnnounce: return a.sequence == b.sequence && a.version == b.version && a.epoch == b.epoch;
    case MsgType::kError: return a.code == b.code && a.payload == b.payload;
    case MsgType::kEngine: return a.version == b.version && a.payload == b.payload;
  }
  return false;
}

bool SameManifest(const Manifest& a, const Manifest& b) {
  if (!(a.version == b.version) || a.sequence != b.sequence || a.epoch != b.epoch || a.kind != b.kind ||
      a.layout != b.layout || a.mode != b.mode || a.base_version != b.base_version ||
      a.merged_version != b.merged_version || a.tensors.size() != b.tensors.size() || a.aux.size() != b.aux.size()) {
    return false;
  }
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& x = a.tensors[i];
    const auto& y = b.tensors[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || !(x.digest == y.digest) ||
        x.nbytes != y.nbytes) {
      return false;
    }
  }
  for (size_t i = 0; i < a.aux.size(); ++i) {
    const auto& x = a.aux[i];
    const auto& y = b.aux[i];
    if (x.name != y.name || !(x.digest == y.digest) || x.size != y.size) return false;
  }
  return true;
}

// The receiver's layout of `man` (sync/receiver_transfer.cpp ReceiveInto): a safetensors header
// from the tensor specs, then each tensor's bytes in manifest order. The header must parse
// back to the same tensors at contiguous offsets.
void CheckLayout(const Manifest& man) {
  std::vector<ferry::TensorSpec> specs;
  for (const auto& t : man.tensors) specs.push_back({t.name, t.dtype, t.shape});
  auto header = ferry::SerializeSafetensorsHeader(specs, {{"format", "pt"}});
  if (!header.ok()) return;  // e.g. a tensor named __metadata__, or data offsets past 64 bits
  uint64_t data = 0;
  std::map<std::string, std::pair<uint64_t, uint64_t>> want;  // name -> [begin, end)
  for (const auto& t : man.tensors) {
    Check(t.nbytes <= std::numeric_limits<uint64_t>::max() - data);  // Serialize refuses an overflow
    want[t.name] = {data, data + t.nbytes};
    data += t.nbytes;
  }
  if (data > std::numeric_limits<uint64_t>::max() - header->size()) return;
  auto parsed = ferry::ParseSafetensorsHeader(AsBytes(*header), header->size() + data);
  Check(parsed.ok());
  Check(parsed->data_offset == header->size());
  Check(parsed->tensors.size() == man.tensors.size());
  for (const auto& t : parsed->tensors) {
    auto it = want.find(t.name);
    Check(it != want.end());
    Check(t.begin == it->second.first && t.end == it->second.second);
  }
  for (const auto& t : man.tensors) {
    bool found = false;
    for (const auto& p : parsed->tensors) {
      if (p.name == t.name) {
        Check(p.dtype == t.dtype && p.shape == t.shape);
        found = true;
        break;
      }
    }
    Check(found);
  }
}

void FuzzManifest(std::string_view json) {
  auto man = ferry::sync::DecodeManifest(json);
  if (!man.ok()) {
    Check(!man.status().message().empty());
    return;
  }
  // Invariants DecodeManifest promises.
  Check(man->tensors.size() <= ferry::sync::kMaxTensors && man->aux.size() <= ferry::sync::kMaxAuxFiles);
  for (size_t i = 0; i < man->tensors.size(); ++i) {
    const auto& t = man->tensors[i];
    Check(!t.name.empty() && t.name.size() <= ferry::sync::kMaxNameBytes);
    if (i > 0) Check(man->tensors[i - 1].name < t.name);
    auto need = ferry::CheckedByteSize(t.dtype, t.shape);
    Check(need.ok() && *need == t.nbytes);
  }
  for (const auto& a : man->aux) {
    Check(ferry::sync::IsSafeFileName(a.name) && a.size <= ferry::sync::kMaxAuxBytes);
  }
  const bool adapter_mode = man->mode == ferry::sync::PublishMode::kAdapter;
  Check(adapter_mode == (man->kind == ferry::store::VersionKind::kAdapter));
  Check(man->base_version.has_value() == adapter_mode);
  Check(man->merged_version.has_value() == adapter_mode);

  const std::string again = ferry::sync::EncodeManifest(*man);
  auto back = ferry::sync::DecodeManifest(again);
  Check(back.ok());
  Check(SameManifest(*man, *back));
  Check(ferry::sync::EncodeManifest(*back) == again);

  (void)ferry::store::ManifestDigest(man->tensors, man->aux);
  CheckLayout(*man);
}

void FuzzMessage(std::span<const std::byte> header, const std::span<const std::byte>* payload) {
  auto m = ferry::sync::Decode(header, payload);
  if (!m.ok()) {
    Check(!m.status().message().empty());
    return;
  }
  Check(ferry::sync::HasPayload(m->type) == (payload != nullptr));
  if (m->type == MsgType::kChunk) {
    // m.bytes views the payload frame.
    Check(m->bytes.data() == payload->data() && m->bytes.size() == payload->size());
    Check(m->bytes.size() <= ferry::sync::kMaxChunkBytes);
  }
  if (m->type == MsgType::kFetch) Check(m->length >= 1 && m->length <= ferry::sync::kMaxChunkBytes);
  if (m->type == MsgType::kFetch || m->type == MsgType::kChunk) {
    Check(m->kind == ItemKind::kTensor || m->kind == ItemKind::kAux);
  }
  if (m->type == MsgType::kHello || m->type == MsgType::kAck) Check(ferry::sync::IsValidReceiverId(m->payload));

  // Re-encode with the project's encoder and decode again.
  const std::string h2 = ferry::sync::EncodeHeader(*m);
  // The header format is fixed-width and strict, so the re-encoding is the input header,
  // except that ACK's proven digest is written as zeros when has_proven is 0 (the decoder
  // does not insist on zeros there).
  const auto orig = std::string_view(reinterpret_cast<const char*>(header.data()), header.size());
  if (m->type == MsgType::kAck && !m->proven) {
    Check(h2.size() == orig.size() && h2.size() >= 16);
    Check(h2.compare(0, h2.size() - 16, orig, 0, orig.size() - 16) == 0);
    Check(h2.substr(h2.size() - 16) == std::string(16, '\0'));
  } else {
    Check(h2 == orig);
  }
  const std::span<const std::byte> p2 = m->type == MsgType::kChunk ? m->bytes : AsBytes(m->payload);
  const bool has = ferry::sync::HasPayload(m->type);
  auto back = ferry::sync::Decode(AsBytes(h2), has ? &p2 : nullptr);
  Check(back.ok());
  Check(SameMessage(*m, *back));
  Check(ferry::sync::EncodeHeader(*back) == h2);

  // The payload frame's presence is part of the format: the other choice must fail.
  const std::span<const std::byte> empty;
  Check(!ferry::sync::Decode(header, has ? nullptr : &empty).ok());

  if (m->type == MsgType::kManifest) FuzzManifest(m->payload);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const std::byte> body(reinterpret_cast<const std::byte*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: FuzzMessage(body, nullptr); break;
    case 1: {
      if (body.size() < 2) return 0;
      const size_t n = static_cast<size_t>(data[1]) | (static_cast<size_t>(data[2]) << 8);
      const auto rest = body.subspan(2);
      const auto header = rest.first(std::min(n, rest.size()));
      const auto payload = rest.subspan(header.size());
      FuzzMessage(header, &payload);
      break;
    }
    case 2: FuzzManifest({reinterpret_cast<const char*>(body.data()), body.size()}); break;
    case 3: {
      const std::span<const std::byte> empty;
      FuzzMessage(body, &empty);
      break;
    }
  }
  const std::string_view text(reinterpret_cast<const char*>(body.data()), body.size());
  if (ferry::sync::IsValidReceiverId(text)) Check(!text.empty() && text.size() <= ferry::sync::kMaxReceiverIdBytes);
  if (ferry::sync::IsSafeFileName(text)) Check(text[0] != '.' && text.find('/') == std::string_view::npos);
  return 0;
}
