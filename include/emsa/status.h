// emsa/status.h — errors as values.
//
// Every fallible emsa call returns a Status (or a Result<T>, which holds a value or a Status).
// emsa never throws across its public boundary and never calls exit(). The numeric codes are the
// same as the C ABI's EMSA_STATUS_* values (include/emsa/emsa.h), so they cross it unchanged.
// Messages say what was wrong and what to do instead; they name the offending field or tensor.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace emsa {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // a caller's value is wrong (budget, dtype, shape, options)
  kParseError = 2,       // a file or string could not be read as what it claims to be
  kUnsupported = 3,      // valid but not supported (a dtype, an ISA, a feature without a GPU)
  kInfeasible = 4,       // the plan cannot meet the budget; the message names the smallest one
  kOutOfMemory = 5,      // an arena could not be allocated
  kCudaError = 6,        // a CUDA call failed; the message carries the CUDA error string
  kIoError = 7,          // a file could not be opened, read or written
  kNotFound = 8,         // a named thing (parameter, field, device) does not exist
  kInternal = 9,         // a broken invariant inside emsa: a bug, please report it
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status ParseError(std::string msg) { return {StatusCode::kParseError, std::move(msg)}; }
  static Status Unsupported(std::string msg) { return {StatusCode::kUnsupported, std::move(msg)}; }
  static Status Infeasible(std::string msg) { return {StatusCode::kInfeasible, std::move(msg)}; }
  static Status OutOfMemory(std::string msg) { return {StatusCode::kOutOfMemory, std::move(msg)}; }
  static Status CudaError(std::string msg) { return {StatusCode::kCudaError, std::move(msg)}; }
  static Status IoError(std::string msg) { return {StatusCode::kIoError, std::move(msg)}; }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: budget must be positive" (or "OK").
  std::string ToString() const;
  // Prefixes context: Status::ParseError("x").Annotate("probe.json") -> "probe.json: x".
  Status Annotate(const std::string& context) const;

 private:
  Status(StatusCode code, std::string msg) : code_(code), message_(std::move(msg)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or the Status that explains why there is none. Construct from either.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  // An OK status carries no value: that misuse becomes an Internal error, never a fake value.
  Result(Status status)  // NOLINT: implicit by design
      : status_(status.ok() ? Status::Internal("Result constructed from an OK status")
                            : std::move(status)) {}
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace emsa

#define EMSA_CONCAT_INNER_(a, b) a##b
#define EMSA_CONCAT_(a, b) EMSA_CONCAT_INNER_(a, b)

#define EMSA_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::emsa::Status emsa_status_ = (expr);        \
    if (!emsa_status_.ok()) return emsa_status_; \
  } while (0)

#define EMSA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.status();               \
  lhs = std::move(tmp).value()

// EMSA_ASSIGN_OR_RETURN(auto x, ParseThing(s));
#define EMSA_ASSIGN_OR_RETURN(lhs, expr) \
  EMSA_ASSIGN_OR_RETURN_IMPL_(EMSA_CONCAT_(emsa_result_, __LINE__), lhs, expr)
