// Status and Result<T>: the error type used across every module edge in Ferry.
//
// A Status is either OK or carries a code and a human-readable message. Messages name
// what failed (a file, a tensor, a field) so that the CLI can print them as they are.
// Foreign errors (std::system_error, rocksdb::Status, zmq::error_t, c10::Error) are
// translated at the edge where they occur.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace ferry {

// The values travel in sync ERROR frames (sync/protocol.h): append new codes, never renumber.
enum class StatusCode {
  kOk = 0,
  kInvalidArgument,     // the caller passed something unusable (flags, names)
  kNotFound,            // a file, tensor or version does not exist
  kCorruption,          // a file or message is malformed or fails a check
  kIOError,             // the operating system refused a read or a write
  kUnsupported,         // well-formed but not something Ferry can handle
  kAlreadyExists,       // an output exists and overwriting was not asked for
  kFailedPrecondition,  // the state does not allow the operation
  kInternal,            // a bug in Ferry
  kUnavailable,         // a peer did not answer in time or is unreachable: transient, retry later
};

// Returns a stable lowercase name for `code` ("invalid_argument", ...).
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  // An OK status.
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status InvalidArgument(std::string msg) { return {StatusCode::kInvalidArgument, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Corruption(std::string msg) { return {StatusCode::kCorruption, std::move(msg)}; }
  static Status IOError(std::string msg) { return {StatusCode::kIOError, std::move(msg)}; }
  static Status Unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  static Status AlreadyExists(std::string msg) { return {StatusCode::kAlreadyExists, std::move(msg)}; }
  static Status FailedPrecondition(std::string msg) { return {StatusCode::kFailedPrecondition, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status Unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

  // Returns a copy whose message is "<context>: <message>". OK stays OK.
  Status WithContext(std::string_view context) const;

  // "OK" or "<code name>: <message>".
  std::string ToString() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Either a value or a non-OK Status. Constructing from an OK Status is a bug and
// yields kInternal.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(v_).ok()) v_ = Status::Internal("Result constructed from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // REQUIRES: !ok() for a meaningful status; returns OK when a value is held.
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }

  // REQUIRES: ok().
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace ferry

#define FERRY_CONCAT_INNER_(a, b) a##b
#define FERRY_CONCAT_(a, b) FERRY_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (a Status) is not OK.
#define FERRY_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::ferry::Status ferry_status_ = (expr);        \
    if (!ferry_status_.ok()) return ferry_status_; \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its status from the enclosing function.
#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_ASSIGN_OR_RETURN_IMPL_(FERRY_CONCAT_(ferry_result_, __LINE__), lhs, expr)
#define FERRY_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()
