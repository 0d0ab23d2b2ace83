// Every BAGUA_* environment variable the C++ runtime reads, declared and
// documented in one place, read once and cached.
//
//   BAGUA_LOG_LEVEL            trace|debug|info|warn|error|off (default: warn)
//   BAGUA_COMM_TIMEOUT_S       seconds before a communication wait becomes an
//                              error naming rank, op and bucket (default: 300)
//   BAGUA_DEFAULT_BUCKET_SIZE  bucket size target in bytes (default: 10 MiB)
//
// Python-only variables (launcher, store) are listed in docs/environment.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

namespace bagua {

struct EnvConfig {
  std::string log_level = "warn";
  std::chrono::milliseconds comm_timeout{300'000};
  std::int64_t default_bucket_bytes = 10LL * 1024 * 1024;
};

namespace detail {

inline std::string env_string(const char* name, std::string fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::move(fallback);
}

inline double env_double(const char* name, double fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  double parsed = std::strtod(value, &end);
  return (end != value && parsed > 0) ? parsed : fallback;
}

}  // namespace detail

inline const EnvConfig& env() {
  static const EnvConfig config = [] {
    EnvConfig c;
    c.log_level = detail::env_string("BAGUA_LOG_LEVEL", c.log_level);
    c.comm_timeout = std::chrono::milliseconds(
        static_cast<std::int64_t>(detail::env_double("BAGUA_COMM_TIMEOUT_S", 300.0) * 1000.0));
    c.default_bucket_bytes = static_cast<std::int64_t>(detail::env_double(
        "BAGUA_DEFAULT_BUCKET_SIZE", static_cast<double>(c.default_bucket_bytes)));
    return c;
  }();
  return config;
}

}  // namespace bagua
