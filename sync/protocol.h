// The weight-sync wire protocol between a publisher (serving store versions) and
// receivers (which verify and atomically activate them). Defined here, once; docs/sync.md
// repeats it.
//
// ---------------------------------------------------------------------------------------
// Sockets.
//   requests   publisher ROUTER  <->  receiver DEALER   (HELLO, FETCH, ACK and their replies)
//   updates    publisher PUB      ->  receiver SUB      (ANNOUNCE, sequence-numbered)
//   A receiver subscribes first, then sends HELLO and gets the latest MANIFEST at once
//   (zguide clone pattern): a late joiner never waits for the next announcement.
//   A receiver's DEALER routing id is "<receiver id>/<16 hex digits>" (new digits for each
//   socket), so the publisher can attribute FETCHes and connections to a receiver.
//
// Every message is 1 or 2 ZeroMQ frames (after the ROUTER routing id):
//   frame 0  header:  "FSY2" (4 bytes) || u8 type || type-specific fixed fields
//   frame 1  payload: only where listed below
//   Integers are little-endian; a digest is 16 bytes, hi then lo, each u64 big-endian
//   (the byte order of Digest::Hex()).
//
//   type  name      header fields after the type byte          payload frame
//   1     HELLO     (none), or digest version                   receiver id
//   2     MANIFEST  u64 sequence || u64 epoch                   manifest JSON (below)
//   3     FETCH     digest version || u8 kind || u32 index ||   (none)
//                   u64 offset || u32 length
//   4     CHUNK     digest version || u8 kind || u32 index ||   the bytes
//                   u64 offset || u64 latest sequence ||
//                   u64 epoch
//   5     ACK       digest version || digest computed ||        receiver id
//                   u8 has_proven || digest proven (zeros
//                   when has_proven is 0)
//   6     ACKED     digest version                              (none)
//   7     ANNOUNCE  u64 sequence || digest version || u64 epoch (none)       (PUB only)
//   8     ERROR     u32 StatusCode                              message text
//   9     ENGINE    digest version                              report JSON (below)
//
//   kind: 0 = tensor (index into the manifest's tensors), 1 = auxiliary file.
//   MANIFEST JSON: {"version": hex, "sequence": n, "epoch": n, "kind": "full"|"base"|
//   "merged"|"adapter", "layout": "hf"|"fused"|"lora", "mode": "merged"|"adapter"|"delta",
//   "base_version": hex, "merged_version": hex (both only in adapter mode; the base the
//   adapters apply to is served in adapter mode too, as kind base or full with
//   base_version = its own version and no merged_version), "tensors":
//   [{"name", "dtype", "shape", "digest", "nbytes"}...] sorted by name, "aux": [{"name",
//   "digest", "size"}...]}. Unknown fields are ignored.
//   ACK: version = the served version, computed = the manifest digest the receiver computed
//   over the files it received; in adapter mode proven = the manifest id of its local
//   merge (checked equal to merged_version before activating).
//   ENGINE: an inference engine the receiver drives answered (or did not) as `version` (the
//   merged hf id it was given, as ACK's proven): JSON {"receiver", "engine", "url", "model",
//   "proven", "tolerance", "max_diff", "previous_diff" (or null), "tokens", "seconds",
//   "why" (when not proven)} of at most kMaxEngineReportBytes; answered with ACKED, recorded
//   as a store event kEngine (or an anomaly kEngineMismatch). Older publishers answer ERROR.
//   HELLO without a version asks for the latest version's MANIFEST; with one, for that
//   version's, if the publisher still serves it (ERROR kNotFound otherwise). In adapter mode
//   the publisher keeps serving the base its newest adapter applies to, so a receiver that
//   joins after the first adapter without a base of its own fetches that base this way.
//   A CHUNK carries the publisher's latest sequence and epoch, so a receiver learns of a
//   newer version (or a restarted publisher) on its very next chunk and skips to it.
//
// Epochs and sequence numbers: a publisher picks a random non-zero 64-bit epoch when it
// starts and numbers each version it publishes 1, 2, ... within that epoch. A receiver
// ignores announcements of its own epoch that are not newer than what it holds; a newer
// one (or a hole), or ANY announcement of another epoch (a restarted publisher), means
// "send HELLO again and take the latest". Once it has synced from a new epoch, a receiver
// ignores announcements of the epochs it left (the last 16), so stale ones cannot bounce it.
//
// Beacons: the publisher re-sends ANNOUNCE for its latest version (sequence 0 and a zero
// version before anything is published) every heartbeat interval, so a receiver that
// missed an announcement (PUB drops, a SUB still reconnecting to a restarted publisher)
// catches up within one interval, and an idle receiver that hears nothing for its timeout
// knows the publisher is gone.
//
// Flow control: the receiver keeps at most `credit` FETCHes outstanding; the publisher
// answers each FETCH with exactly one CHUNK, so it never queues more than credit chunks
// per receiver (zguide ch. 7 file transfer).
//
// Limits (both sides): ZMQ_MAXMSGSIZE = kMaxFrameBytes on every socket; a FETCH length is
// at most kMaxChunkBytes; a manifest holds at most kMaxTensors tensors and kMaxAuxFiles
// aux files, names at most kMaxNameBytes, JSON nesting at most kMaxManifestDepth; receiver
// ids match [A-Za-z0-9._-]{1,64}; a publisher tracks at most kMaxReceivers receiver ids
// (a lost one is forgotten to make room; a new id past that is answered with ERROR) and
// records an ACK only for a version its store holds.
// Every frame is parsed defensively: a malformed one yields kCorruption naming the field,
// never a crash; the publisher answers it with ERROR (or drops it when unroutable).
// ---------------------------------------------------------------------------------------
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "convert/layout.h"
#include "core/status.h"
#include "store/store.h"

namespace ferry::sync {

inline constexpr std::string_view kMagic = "FSY2";
inline constexpr uint32_t kMaxChunkBytes = 16u << 20;             // 16 MiB
inline constexpr int64_t kMaxFrameBytes = kMaxChunkBytes + 4096;  // header or chunk + slack
inline constexpr size_t kMaxTensors = 1u << 16;
inline constexpr size_t kMaxAuxFiles = 256;
inline constexpr size_t kMaxNameBytes = 512;
inline constexpr size_t kMaxReceiverIdBytes = 64;
inline constexpr uint64_t kMaxAuxBytes = 64u << 20;
inline constexpr int kMaxManifestDepth = 8;  // {"tensors": [{"shape": [..]}]} is 4
inline constexpr size_t kMaxReceivers = 1024;
inline constexpr size_t kMaxEngineReportBytes = 4096;
inline constexpr uint32_t kMaxCredit = 1024;      // FETCHes a receiver may keep outstanding
inline constexpr int kSendHwm = kMaxCredit + 64;  // publisher's reply queue per peer

enum class MsgType : uint8_t {
  kHello = 1,
  kManifest = 2,
  kFetch = 3,
  kChunk = 4,
  kAck = 5,
  kAcked = 6,
  kAnnounce = 7,
  kError = 8,
  kEngine = 9,
};
enum class ItemKind : uint8_t { kTensor = 0, kAux = 1 };

// A decoded header frame plus the optional payload frame. Which fields are meaningful
// depends on `type` (see the table above).
struct Message {
  MsgType type = MsgType::kError;
  uint64_t sequence = 0;                // MANIFEST, ANNOUNCE; CHUNK: latest sequence
  uint64_t epoch = 0;                   // MANIFEST, CHUNK, ANNOUNCE: the publisher's epoch
  store::Digest version;                // FETCH, CHUNK, ACK, ACKED, ANNOUNCE
  store::Digest computed;               // ACK
  std::optional<store::Digest> proven;  // ACK (adapter mode): the merged id the receiver proved
  std::optional<store::Digest> wanted;  // HELLO: the version whose manifest is asked for (none: the latest)
  ItemKind kind = ItemKind::kTensor;    // FETCH, CHUNK
  uint32_t index = 0;                   // FETCH, CHUNK
  uint64_t offset = 0;                  // FETCH, CHUNK
  uint32_t length = 0;                  // FETCH
  uint32_t code = 0;                    // ERROR: a StatusCode value
  std::string payload;                  // HELLO/ACK: receiver id; MANIFEST, ENGINE: JSON; ERROR: text
  std::span<const std::byte> bytes;     // CHUNK: view into the received payload frame
};

// How versions are published (the MANIFEST's "mode"):
//   kMerged   every tensor of the version is sent; the receiver activates what it received.
//   kAdapter  the version is an adapter (kind adapter, base_version set); the publisher
//             also names its merged version (a stored version of kind merged, layout hf,
//             whose adapter_version is the adapter and base_version the adapter's base);
//             the receiver merges onto its base and proves the merged id. Or the version
//             is the base itself (kind base or full), served whole before the first
//             adapter: a receiver copies the tensors its local base holds (verified) and
//             fetches the rest, and merges later adapters onto the base it received.
//   kDelta    as kMerged, but the receiver copies tensors it already holds in its active
//             version (matched by tensor digest, verified while copying) instead of
//             fetching them.
enum class PublishMode { kMerged, kAdapter, kDelta };
// "merged", "adapter" or "delta".
std::string_view PublishModeName(PublishMode mode);
// Parses "merged" | "adapter" | "delta"; kInvalidArgument naming the value otherwise.
[[nodiscard]] Result<PublishMode> ParsePublishMode(std::string_view name);

// What a receiver needs to fetch, check and activate one version.
struct Manifest {
  store::Digest version;
  uint64_t sequence = 0;
  uint64_t epoch = 0;
  store::VersionKind kind = store::VersionKind::kFull;  // the stored version's kind
  Layout layout = Layout::kHf;
  PublishMode mode = PublishMode::kMerged;      // the publication mode
  std::optional<store::Digest> base_version;    // adapter mode only (the base: its own id)
  std::optional<store::Digest> merged_version;  // adapter mode only: the merged hf id to prove
  std::vector<store::TensorRow> tensors;        // name, dtype, shape, digest, nbytes; sorted by name
  std::vector<store::AuxFile> aux;              // sorted by name
};

// Encodes the header frame of `m` (payload and bytes are sent as a second frame by the caller).
std::string EncodeHeader(const Message& m);
// Whether `type` carries a payload frame.
bool HasPayload(MsgType type);
// Decodes a header frame and optional payload frame. kCorruption naming the field when the
// magic, type, length or a field is wrong, or the payload frame is missing/unexpected.
// `payload` may be null (no second frame). `m.bytes` views `payload` (CHUNK only).
[[nodiscard]] Result<Message> Decode(std::span<const std::byte> header, const std::span<const std::byte>* payload);

// The manifest of a stored version: id, kind, layout, base_version, tensors and aux from
// `r`; sequence, epoch, mode and merged_version are left for the caller to fill in.
Manifest ManifestFor(const store::VersionRecord& r);
// The manifest JSON (see the table above) of `m`.
std::string EncodeManifest(const Manifest& m);
// Parses and validates a manifest (limits, sorted unique names, known dtypes, sizes that
// match shapes, safe aux file names, known kind/layout/mode; adapter mode with kind adapter
// and both base_version and merged_version, or the base itself: kind base or full,
// base_version = version, no merged_version). kCorruption naming the field at fault.
[[nodiscard]] Result<Manifest> DecodeManifest(std::string_view json);

// Whether `id` is a valid receiver id ([A-Za-z0-9._-]{1,64}).
bool IsValidReceiverId(std::string_view id);
// Whether `name` may be written as an auxiliary file inside a version directory: at most
// kMaxNameBytes and an auxiliary file name by the one rule (core/aux_files.h CheckAuxFileName).
bool IsSafeFileName(std::string_view name);

}  // namespace ferry::sync
