// ferryd's control protocol: how `ferry daemon ...` (and any script) asks a running ferryd for
// its status or to pause, resume, snapshot or stop. LibTorch-free: both sides link it.
//
// Transport (daemon/control/server.h, client.h): a ZeroMQ ROUTER socket in ferryd, a DEALER
// (or REQ) socket in the client. By default ipc://DIR/.ferryd/control in a private directory
// (sync/endpoints.h: mode 0700, refused when another user owns it); tcp:// only with CURVE keys
// and an allow-list of client keys, exactly the policy of sync's publisher.
//
// Messages: one JSON object per ZeroMQ message (one frame; a REQ client's empty delimiter
// frame is accepted and echoed), UTF-8, at most kMaxControlMessageBytes (64 KiB).
//
//   request  {"v":1,"id":N,"command":C}
//            v        the protocol version, the number 1
//            id       an unsigned integer chosen by the client, echoed in the reply
//            command  "status" | "pause" | "resume" | "snapshot" | "stop"
//            No other field is allowed; each field appears once.
//   reply    {"v":1,"id":N,"ok":true, ...the command's fields...}
//            {"v":1,"id":N,"ok":false,"error":{"code":CODE,"field":F,"message":M}}
//            id       the request's id; null when the request's id could not be read
//            CODE     a StatusCodeName (core/status.h): "invalid_argument", "unsupported",
//                     "failed_precondition", "internal", ...
//            field    the request field at fault ("message" for the message as a whole: too
//                     large, not JSON, not an object); absent when no field is at fault
//            M        a human-readable sentence naming what was refused
//
// The command's fields (ferryd fills them; `ferry daemon` shows them):
//   status    pid, state ("running" | "pausing" | "paused" | "stopping"), step, total_steps, epoch,
//             generator_version (32 hex), generator ({"engine": "colocated"}, or {"engine":
//             "vllm", "url", "served_as"}: the server and the name it serves that version under),
//             last_checkpoint ("checkpoint-N" or null), reward,
//             reward_trend (mean reward of the last 10 logged steps minus the 10 before),
//             learning_rate, steps_per_second, uptime_seconds
//   pause     state: ferryd finishes the current step and holds
//   resume    state
//   snapshot  version (the checkpoint's version id, 32 hex), checkpoint ("checkpoint-N"), step
//   stop      state ("stopping"): ferryd finishes the step, checkpoints and exits 0
//
// Refusals (each answered with an error reply; the server keeps serving every client):
//   a message over 64 KiB, or not one frame      invalid_argument, field "message"
//   not JSON (or not UTF-8), not an object       invalid_argument, field "message"
//   a field given twice                          invalid_argument, that field
//   a field other than v, id, command            invalid_argument, that field
//   v, id or command missing or of another type  invalid_argument, that field
//   v other than 1                               unsupported, field "v"
//   an unknown command                           invalid_argument, field "command"
// A frame over kMaxTransportBytes (1 MiB) is not read at all: libzmq drops that connection
// (the memory a client can make the server hold stays bounded), other clients are unaffected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace ferry::control {

inline constexpr int kControlProtocolVersion = 1;
// Largest message the server parses; larger ones get an error reply.
inline constexpr size_t kMaxControlMessageBytes = 64 * 1024;
// Largest frame libzmq accepts on a control socket (ZMQ_MAXMSGSIZE); beyond it the
// connection is dropped without a reply.
inline constexpr size_t kMaxTransportBytes = 1024 * 1024;

enum class ControlCommand { kStatus, kPause, kResume, kSnapshot, kStop };

// "status", "pause", "resume", "snapshot", "stop".
[[nodiscard]] std::string_view ControlCommandName(ControlCommand command);
// The command named `name`; kInvalidArgument naming it and the accepted names otherwise.
[[nodiscard]] Result<ControlCommand> ParseControlCommand(std::string_view name);

// A parsed request.
struct ControlRequest {
  uint64_t id = 0;
  ControlCommand command = ControlCommand::kStatus;
};

// What a refused request's error reply carries besides its Status (filled by ParseRequest).
struct RequestFault {
  std::optional<uint64_t> id;  // the request's id when it could be read
  std::string field;           // the field at fault ("" is a field's name too); "message" for the whole message
};

// Parses one request message under the rules above. On refusal the Status names the field
// (kInvalidArgument, or kUnsupported for a version other than 1) and, when `fault` is not
// null, *fault receives the id (if readable) and the field for the error reply.
[[nodiscard]] Result<ControlRequest> ParseRequest(std::string_view message, RequestFault* fault = nullptr);

// The request's JSON text, {"v":1,"id":N,"command":C}.
[[nodiscard]] std::string SerializeRequest(const ControlRequest& request);

// A reply: ok with the command's fields (an object), or an error.
struct ControlReply {
  std::optional<uint64_t> id;
  bool ok = true;
  nlohmann::json fields = nlohmann::json::object();  // ok: the command's fields
  Status error;                                      // !ok: the code and message
  std::optional<std::string> error_field;            // !ok: the field at fault (may be ""), if any
};

// The reply's JSON text ({"v":1,"id":...,"ok":...} first, then the fields or "error").
// Invalid UTF-8 in strings becomes U+FFFD. kInvalidArgument when ok and `fields` is not an
// object or uses one of the names v, id, ok, error; kInternal when !ok and `error` is OK.
[[nodiscard]] Result<std::string> SerializeReply(const ControlReply& reply);

// Parses a reply (client side): kCorruption naming the field when it is not a reply as
// defined above (over 1 MiB, not a JSON object, nested over 16 levels, v not 1, id not an unsigned integer or
// null, ok not a boolean, an error reply without a known code or a message).
[[nodiscard]] Result<ControlReply> ParseReply(std::string_view message);

// The StatusCode whose StatusCodeName is `name` (not "ok"); nullopt for any other name.
[[nodiscard]] std::optional<StatusCode> StatusCodeFromName(std::string_view name);

}  // namespace ferry::control
