// The error hierarchy of the runtime.
//
// Every failure the runtime reports is one of these; the Python module maps
// each to its own exception class (InvalidArgument -> ValueError subclass,
// TimeoutError -> TimeoutError subclass, the rest -> RuntimeError subclasses).
// User-input checks (BAGUA_CHECK_ARG) are distinct from internal invariants
// (BAGUA_CHECK_INTERNAL) so a message tells whose mistake it was.
#pragma once

#include <stdexcept>
#include <string>

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
