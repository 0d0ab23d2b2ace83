// The error hierarchy of the runtime.
//
// Every failure the runtime reports is one of these; the Python module maps
// each to its own exception class (InvalidArgument -> ValueError subclass,
// TimeoutError -> TimeoutError subclass, the rest -> RuntimeError subclasses).
// User-input checks (BAGUA_CHECK_ARG) are distinct from internal invariants
// (BAGUA_CHECK_INTERNAL) so a message tells whose mistake it was.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace bagua {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed something the runtime cannot accept.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A wait ran past its deadline (watchdog or transport timeout).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// The transport (Gloo, NCCL, CUDA) reported a failure.
class BackendError : public Error {
 public:
  using Error::Error;
};

// The rendezvous store failed.
class StoreError : public Error {
 public:
  using Error::Error;
};

// A broken invariant inside the runtime: a bug, please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

// `e` with `context` before its message ("context: message"), of the same
// class (any other exception becomes a BackendError), so that Python raises
// the same exception type, now saying where it happened.
inline std::exception_ptr with_context(const std::exception& e, std::string_view context) {
  const std::string message = fmt::format("{}: {}", context, e.what());
  if (dynamic_cast<const TimeoutError*>(&e)) return std::make_exception_ptr(TimeoutError(message));
  if (dynamic_cast<const InvalidArgument*>(&e)) {
    return std::make_exception_ptr(InvalidArgument(message));
  }
  if (dynamic_cast<const StoreError*>(&e)) return std::make_exception_ptr(StoreError(message));
  if (dynamic_cast<const InternalError*>(&e))
    return std::make_exception_ptr(InternalError(message));
  return std::make_exception_ptr(BackendError(message));
}

}  // namespace bagua

#define BAGUA_CHECK_ARG(cond, ...)                                                      \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      throw ::bagua::InvalidArgument(fmt::format(__VA_ARGS__) + " [check: " #cond "]"); \
    }                                                                                   \
  } while (0)

#define BAGUA_CHECK_INTERNAL(cond, ...)                                               \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      throw ::bagua::InternalError(fmt::format("{}:{}: ", __FILE__, __LINE__) +       \
                                   fmt::format(__VA_ARGS__) + " [check: " #cond "]"); \
    }                                                                                 \
  } while (0)
