// libFuzzer target for ferryd's control protocol (daemon/control/protocol.h): a control
// message comes from any local client (or, over tcp, any allow-listed key), so any bytes must
// parse to a request or to an error that names a field, never a crash, hang or unbounded
// allocation.
//
// Input layout: byte 0 selects the parser (mod 3), the rest is the message.
//   0  ParseRequest(message)
//   1  ParseReply(message)
//   2  MetricsToPrometheus(message, "run")
//
// Beyond "no sanitizer report": an accepted request re-serialises to a request that parses
// to the same id and command; a refused one names a field and yields an error reply that
// the client's ParseReply reads back with the same code, message and field; an accepted
// reply re-serialises to one that parses to the same fields.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "daemon/control/metrics.h"
#include "daemon/control/protocol.h"

namespace {

using ferry::control::ControlReply;
using ferry::control::RequestFault;

void Check(bool ok) {
  if (!ok) std::abort();
}

void FuzzRequest(std::string_view message) {
  RequestFault fault;
  auto request = ferry::control::ParseRequest(message, &fault);
  if (request.ok()) {
    const std::string again = ferry::control::SerializeRequest(*request);
    auto back = ferry::control::ParseRequest(again);
    Check(back.ok() && back->id == request->id && back->command == request->command);
    Check(ferry::control::SerializeRequest(*back) == again);
    return;
  }
  Check(!request.status().message().empty());
  Check(fault.field.size() <= 64);
  ControlReply reply;
  reply.ok = false;
  reply.id = fault.id;
  reply.error = request.status();
  reply.error_field = fault.field;
  auto text = ferry::control::SerializeReply(reply);
  Check(text.ok());
  Check(text->size() <= ferry::control::kMaxTransportBytes);
  auto parsed = ferry::control::ParseReply(*text);
  Check(parsed.ok() && !parsed->ok && parsed->id == fault.id && parsed->error_field.has_value());
  Check(parsed->error.code() == request.status().code());
  // Invalid UTF-8 in a quoted field name is replaced on the way out; both sides then agree.
  auto twice = ferry::control::SerializeReply(*parsed);
  Check(twice.ok() && *twice == *text);
}

void FuzzReply(std::string_view message) {
  auto reply = ferry::control::ParseReply(message);
  if (!reply.ok()) {
    Check(!reply.status().message().empty());
    return;
  }
  auto text = ferry::control::SerializeReply(*reply);
  if (!text.ok()) return;  // e.g. an ok reply whose fields use the reserved name "error"
  auto back = ferry::control::ParseReply(*text);
  Check(back.ok() && back->ok == reply->ok && back->id == reply->id);
  if (reply->ok) {
    auto again = ferry::control::SerializeReply(*back);
    Check(again.ok() && *again == *text);
  } else {
    Check(back->error.code() == reply->error.code());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: FuzzRequest(body); break;
    case 1: FuzzReply(body); break;
    case 2: {
      auto text = ferry::control::MetricsToPrometheus(body, "run");
      if (!text.ok()) Check(!text.status().message().empty());
      break;
    }
  }
  return 0;
}
