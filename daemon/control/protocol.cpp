// The control protocol's messages (daemon/control/protocol.h).
#include "daemon/control/protocol.h"

#include <array>
#include <set>
#include <utility>

namespace ferry::control {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

constexpr std::array<ControlCommand, 5> kCommands = {ControlCommand::kStatus, ControlCommand::kPause,
                                                     ControlCommand::kResume, ControlCommand::kSnapshot,
                                                     ControlCommand::kStop};
constexpr std::array<std::string_view, 3> kRequestFields = {"v", "id", "command"};
// Replies nested deeper than this are refused.
constexpr int kMaxReplyDepth = 16;
// Hostile text is shown at most this long in messages and error replies.
constexpr size_t kMaxShownBytes = 64;

// `s` as a JSON string literal, cut to kMaxShownBytes, non-ASCII escaped, invalid UTF-8 as U+FFFD.
std::string Quote(std::string_view s) {
  const bool cut = s.size() > kMaxShownBytes;
  const std::string shown =
      Json(std::string(s.substr(0, kMaxShownBytes))).dump(-1, ' ', true, Json::error_handler_t::replace);
  return cut ? shown + "..." : shown;
}

bool IsRequestField(std::string_view name) {
  for (std::string_view f : kRequestFields) {
    if (f == name) return true;
  }
  return false;
}

std::string AcceptedCommands() {
  std::string s;
  for (ControlCommand c : kCommands) {
    if (!s.empty()) s += ", ";
    s += ControlCommandName(c);
  }
  return s;
}

// Records `field` in *fault and returns `status`.
Status Refuse(RequestFault* fault, std::string field, Status status) {
  if (fault != nullptr) fault->field = std::move(field);
  return status;
}

Status BadField(RequestFault* fault, std::string_view field, const std::string& what) {
  return Refuse(fault, std::string(field.substr(0, kMaxShownBytes)),
                Status::InvalidArgument("control request: field " + Quote(field) + ": " + what));
}

}  // namespace

std::string_view ControlCommandName(ControlCommand command) {
  switch (command) {
    case ControlCommand::kStatus: return "status";
    case ControlCommand::kPause: return "pause";
    case ControlCommand::kResume: return "resume";
    case ControlCommand::kSnapshot: return "snapshot";
    case ControlCommand::kStop: return "stop";
  }
  return "unknown";
}

Result<ControlCommand> ParseControlCommand(std::string_view name) {
  for (ControlCommand c : kCommands) {
    if (ControlCommandName(c) == name) return c;
  }
  return Status::InvalidArgument("control command " + Quote(name) + " is not one of " + AcceptedCommands());
}

std::optional<StatusCode> StatusCodeFromName(std::string_view name) {
  for (int i = static_cast<int>(StatusCode::kInvalidArgument); i <= static_cast<int>(StatusCode::kUnavailable); ++i) {
    if (StatusCodeName(static_cast<StatusCode>(i)) == name) return static_cast<StatusCode>(i);
  }
  return std::nullopt;
}

Result<ControlRequest> ParseRequest(std::string_view message, RequestFault* fault) {
  if (fault != nullptr) *fault = RequestFault{};
  if (message.size() > kMaxControlMessageBytes) {
    return Refuse(fault, "message",
                  Status::InvalidArgument("control request: message of " + std::to_string(message.size()) +
                                          " bytes is over the limit of " + std::to_string(kMaxControlMessageBytes)));
  }
  // Values nested inside a top-level field are discarded while parsing (nothing deep is
  // kept), but the fields they belonged to are remembered; so are fields given twice.
  std::set<std::string> structured;
  std::set<std::string> seen;
  std::optional<std::string> duplicate;
  std::string last_key;
  const Json::parser_callback_t callback = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1) {
      last_key = parsed.get<std::string>();
      if (!seen.insert(last_key).second && !duplicate) duplicate = last_key;
    }
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) && depth == 1) {
      structured.insert(last_key);
      return false;
    }
    return true;
  };
  const Json j = Json::parse(message.begin(), message.end(), callback, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return Refuse(fault, "message", Status::InvalidArgument("control request: message is not JSON (UTF-8)"));
  }
  if (!j.is_object()) {
    return Refuse(fault, "message",
                  Status::InvalidArgument(std::string("control request: message is a JSON ") + j.type_name() +
                                          ", not an object"));
  }
  const auto id_it = j.find("id");
  if (id_it != j.end() && id_it->is_number_unsigned() && fault != nullptr && duplicate != "id") {
    fault->id = id_it->get<uint64_t>();
  }
  if (duplicate) return BadField(fault, *duplicate, "given more than once");
  for (const std::string& name : seen) {
    if (!IsRequestField(name)) {
      return BadField(fault, name, "not a field of a control request (v, id, command)");
    }
  }
  const auto wrong_type = [&](std::string_view field) { return structured.count(std::string(field)) > 0; };

  const auto v = j.find("v");
  if (wrong_type("v") || (v != j.end() && !v->is_number())) return BadField(fault, "v", "must be the number 1");
  if (v == j.end()) return BadField(fault, "v", "missing (the protocol version, 1)");
  if (!v->is_number_unsigned() || v->get<uint64_t>() != static_cast<uint64_t>(kControlProtocolVersion)) {
    return Refuse(fault, "v",
                  Status::Unsupported("control request: field \"v\": protocol version " + v->dump() +
                                      " is not supported (this ferryd speaks version 1)"));
  }
  if (wrong_type("id") || (id_it != j.end() && !id_it->is_number_unsigned())) {
    return BadField(fault, "id", "must be an unsigned integer");
  }
  if (id_it == j.end()) return BadField(fault, "id", "missing");
  const auto command = j.find("command");
  if (wrong_type("command") || (command != j.end() && !command->is_string())) {
    return BadField(fault, "command", "must be a string (" + AcceptedCommands() + ")");
  }
  if (command == j.end()) return BadField(fault, "command", "missing (" + AcceptedCommands() + ")");
  const std::string& name = command->get_ref<const std::string&>();
  auto parsed = ParseControlCommand(name);
  if (!parsed.ok()) return BadField(fault, "command", Quote(name) + " is not one of " + AcceptedCommands());
  return ControlRequest{id_it->get<uint64_t>(), *parsed};
}

std::string SerializeRequest(const ControlRequest& request) {
  OrderedJson j;
  j["v"] = kControlProtocolVersion;
  j["id"] = request.id;
  j["command"] = std::string(ControlCommandName(request.command));
  return j.dump();
}

Result<std::string> SerializeReply(const ControlReply& reply) {
  OrderedJson j;
  j["v"] = kControlProtocolVersion;
  j["id"] = reply.id ? OrderedJson(*reply.id) : OrderedJson(nullptr);
  j["ok"] = reply.ok;
  if (reply.ok) {
    if (!reply.fields.is_object()) {
      return Status::InvalidArgument(std::string("control reply: fields are a JSON ") + reply.fields.type_name() +
                                     ", not an object");
    }
    for (const auto& [key, value] : reply.fields.items()) {
      if (key == "v" || key == "id" || key == "ok" || key == "error") {
        return Status::InvalidArgument("control reply: field \"" + key + "\" is reserved by the protocol");
      }
      // ordered_json and json are distinct types: carry the value over as text.
      j[key] = OrderedJson::parse(value.dump(-1, ' ', false, Json::error_handler_t::replace));
    }
  } else {
    if (reply.error.ok()) return Status::Internal("control reply: an error reply needs a non-OK status");
    OrderedJson e;
    e["code"] = std::string(StatusCodeName(reply.error.code()));
    if (reply.error_field) e["field"] = *reply.error_field;
    e["message"] = reply.error.message();
    j["error"] = std::move(e);
  }
  return j.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

Result<ControlReply> ParseReply(std::string_view message) {
  if (message.size() > kMaxTransportBytes) {
    return Status::Corruption("control reply: " + std::to_string(message.size()) + " bytes, over the 1 MiB limit");
  }
  // A reply's fields are shallow; deeper nesting is refused so that printing it cannot recurse deeply.
  bool too_deep = false;
  const Json::parser_callback_t depth_limit = [&too_deep](int depth, Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= kMaxReplyDepth) {
      too_deep = true;
      return false;
    }
    return true;
  };
  Json j = Json::parse(message.begin(), message.end(), depth_limit, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Corruption("control reply: not a JSON object");
  if (too_deep) {
    return Status::Corruption("control reply: nested deeper than " + std::to_string(kMaxReplyDepth) + " levels");
  }
  const auto bad = [](std::string_view field, std::string_view what) {
    return Status::Corruption("control reply: field \"" + std::string(field) + "\": " + std::string(what));
  };
  const auto v = j.find("v");
  if (v == j.end() || !v->is_number_unsigned() ||
      v->get<uint64_t>() != static_cast<uint64_t>(kControlProtocolVersion)) {
    return bad("v", "not protocol version 1");
  }
  ControlReply r;
  const auto id = j.find("id");
  if (id == j.end() || !(id->is_null() || id->is_number_unsigned()))
    return bad("id", "not an unsigned integer or null");
  if (id->is_number_unsigned()) r.id = id->get<uint64_t>();
  const auto ok = j.find("ok");
  if (ok == j.end() || !ok->is_boolean()) return bad("ok", "not a boolean");
  r.ok = ok->get<bool>();
  if (r.ok) {
    j.erase("v");
    j.erase("id");
    j.erase("ok");
    r.fields = std::move(j);
    return r;
  }
  const auto e = j.find("error");
  if (e == j.end() || !e->is_object()) return bad("error", "missing from an error reply");
  const auto code = e->find("code");
  const auto msg = e->find("message");
  if (code == e->end() || !code->is_string()) return bad("error.code", "not a string");
  const auto parsed = StatusCodeFromName(code->get_ref<const std::string&>());
  if (!parsed) return bad("error.code", Quote(code->get_ref<const std::string&>()) + " is not a status code");
  if (msg == e->end() || !msg->is_string()) return bad("error.message", "not a string");
  const auto field = e->find("field");
  if (field != e->end()) {
    if (!field->is_string()) return bad("error.field", "not a string");
    r.error_field = field->get<std::string>();
  }
  r.error = Status(*parsed, msg->get<std::string>());
  return r;
}

}  // namespace ferry::control
