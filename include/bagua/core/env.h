// Every BAGUA_* environment variable, declared and documented in one place,
// read once (at the first env() call) and cached. The C++ runtime reads its
// own; the Python package reads the rest through `bagua_core.env()`.
//
// One rule for all of them: unset or empty means the default; any other
// value must parse as the variable's type, else env() throws InvalidArgument
// naming the variable and the value (it is never silently replaced).
//
//   variable                      type          default             field
//   BAGUA_LOG_LEVEL               level (1)     warn                log_level
//   BAGUA_COMM_TIMEOUT_S          seconds (3)   300                 comm_timeout
//   BAGUA_DEFAULT_BUCKET_SIZE     bytes >= 1    10485760 (10 MiB)   default_bucket_bytes
//   BAGUA_BACKEND                 gloo|nccl     gloo                backend
//   BAGUA_CHECK_COLLECTIVES       bool (2)      1                   check_collectives
//   BAGUA_SHARED_MEMORY           bool (2)      1                   shared_memory
//   BAGUA_SHARED_MEMORY_MIN_BYTES bytes >= 1    1                   shared_memory_min_bytes
//   BAGUA_SHARED_MEMORY_DIRECT    bool (2)      1                   shared_memory_direct
//   BAGUA_GLOO_HOSTNAME           string        (unset)             gloo_hostname
//   BAGUA_TIMELINE                directory     (unset: off)        timeline
//   BAGUA_AUTOTUNE                bool (2)      0                   autotune
//   BAGUA_AUTOTUNE_PLAN           path          (unset)             autotune_plan
//   BAGUA_AUTOTUNE_OUTPUT         path          bagua_autotune.json autotune_output
//   BAGUA_AUTOTUNE_WARMUP_STEPS   integer >= 1  10                  autotune_warmup_steps
//   BAGUA_AUTOTUNE_WINDOW_STEPS   integer >= 1  10                  autotune_window_steps
//   BAGUA_AUTOTUNE_MAX_TRIALS     integer >= 1  10                  autotune_max_trials
//   BAGUA_AUTOTUNE_MAX_SECONDS    integer >= 1  300                 autotune_max_seconds
//   BAGUA_ALGORITHM               name (4)      (unset: measure)    algorithm
//   BAGUA_CHECK_REPLICAS          integer >= 1  (unset: off)        check_replicas_every
//   BAGUA_HOST_THREADS            1 to 256      (unset: torch's)    host_threads
//   BAGUA_LOW_PRECISION_SEGMENT   elements >= 1 1048576             low_precision_segment
//   (1) trace, debug, info, warn (warning), error (err), critical, off
//   (2) 1, true, yes, on / 0, false, no, off (any case)
//   (3) > 0 and <= 1e9, kept in whole milliseconds rounded up (>= 1 ms)
//   (4) gradient_allreduce, bytegrad, powersgd, powersgd_8bit: what
//       algorithm="auto" runs, instead of choosing by measurement
// Their meaning is in docs/environment.md. The launcher's variables (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
// GLOO_SOCKET_IFNAME belong to torchrun and are read by the Python package.
//
// When the first read happens: creating a communicator or a backend reads
// the variables (the runtime logs when a communicator is ready), so an
// invalid value fails there, before any destructor could be the first to log.
#pragma once

#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "bagua/core/errors.h"

namespace bagua {

struct EnvConfig {
  // Read by the C++ runtime.
  std::string log_level = "warn";
  std::chrono::milliseconds comm_timeout{300'000};
  std::int64_t default_bucket_bytes = 10LL * 1024 * 1024;
  bool shared_memory = true;
  std::int64_t shared_memory_min_bytes = 1;
  bool shared_memory_direct = true;
  // Read by the Python package; an empty string means unset.
  std::string backend = "gloo";
  bool check_collectives = true;
  std::string gloo_hostname;
  std::string timeline;
  bool autotune = false;
  std::string autotune_plan;
  std::string autotune_output = "bagua_autotune.json";
  std::int64_t autotune_warmup_steps = 10;
  std::int64_t autotune_window_steps = 10;
  std::int64_t autotune_max_trials = 10;
  std::int64_t autotune_max_seconds = 300;
  // Every this many steps the engines compare their weights across ranks
  // (Python's data_parallel.replicas); 0: never.
  std::int64_t check_replicas_every = 0;
  std::string algorithm;
  // Threads of PowerSGD's host passes (core/host_threads.h); 0: unset, the
  // algorithm then takes torch.get_num_threads().
  std::int64_t host_threads = 0;
  // Elements per segment of C_LP_S's pipeline (ops/centralized_low_precision.h):
  // ByteGrad's layout, so the same on every rank.
  std::int64_t low_precision_segment = 1024 * 1024;
};

namespace detail {

// The value of `name`, or null when it is unset or empty.
inline const char* env_value(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

[[noreturn]] inline void env_invalid(const char* name, std::string_view value,
                                     std::string_view expected) {
  throw InvalidArgument(
      fmt::format("environment variable {}='{}' is invalid: expected {}", name, value, expected));
}

inline std::string env_lower(std::string_view text) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower;
}

inline std::string env_string(const char* name, std::string fallback) {
  const char* value = env_value(name);
  return value != nullptr ? std::string(value) : std::move(fallback);
}

// One of `choices` (compared in lower case; the lower-case form is returned).
inline std::string env_choice(const char* name, std::string fallback,
                              std::initializer_list<std::string_view> choices) {
  const char* value = env_value(name);
  if (value == nullptr) return fallback;
  std::string lower = env_lower(value);
  for (const auto choice : choices) {
    if (lower == choice) return lower;
  }
  std::string expected = "one of";
  for (const auto choice : choices) expected += fmt::format(" '{}'", choice);
  env_invalid(name, value, expected);
}

inline bool env_bool(const char* name, bool fallback) {
  const char* value = env_value(name);
  if (value == nullptr) return fallback;
  const std::string lower = env_lower(value);
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  env_invalid(name, value, "a boolean (1, true, yes, on / 0, false, no, off)");
}

inline std::int64_t env_positive_int(const char* name, std::int64_t fallback) {
  const char* value = env_value(name);
  if (value == nullptr) return fallback;
  const std::string_view text(value);
  std::int64_t parsed = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), parsed);
  if (error != std::errc() || end != text.data() + text.size() || parsed < 1) {
    env_invalid(name, value, "an integer >= 1");
  }
  return parsed;
}

inline double env_positive_seconds(const char* name, double fallback) {
  const char* value = env_value(name);
  if (value == nullptr) return fallback;
  char* end = nullptr;
  const double parsed = std::strtod(value, &end);
  if (end == value || *end != '\0' || !std::isfinite(parsed) || parsed <= 0) {
    env_invalid(name, value, "a number of seconds > 0");
  }
  return parsed;
}

// A timeout in whole milliseconds, rounded up so that a tiny positive value
// (0.0001 s) is never 0 ms: a wait that fails at once, or that a backend
// reads as "no timeout". The upper bound keeps every deadline
// (steady_clock::now() + timeout, in int64 nanoseconds) from overflowing;
// 1e9 s is 31 years, long enough to mean "never".
inline std::chrono::milliseconds env_timeout(const char* name, double fallback_seconds) {
  constexpr double kMaxSeconds = 1e9;
  const double seconds = env_positive_seconds(name, fallback_seconds);
  if (seconds > kMaxSeconds) {
    env_invalid(name, env_value(name),
                fmt::format("a number of seconds > 0 and <= {}", kMaxSeconds));
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000.0)));
}

inline EnvConfig read_env() {
  EnvConfig c;
  c.log_level =
      env_choice("BAGUA_LOG_LEVEL", c.log_level,
                 {"trace", "debug", "info", "warn", "warning", "error", "err", "critical", "off"});
  c.comm_timeout = env_timeout("BAGUA_COMM_TIMEOUT_S", 300.0);
  c.default_bucket_bytes = env_positive_int("BAGUA_DEFAULT_BUCKET_SIZE", c.default_bucket_bytes);
  c.shared_memory = env_bool("BAGUA_SHARED_MEMORY", c.shared_memory);
  c.shared_memory_min_bytes =
      env_positive_int("BAGUA_SHARED_MEMORY_MIN_BYTES", c.shared_memory_min_bytes);
  c.shared_memory_direct = env_bool("BAGUA_SHARED_MEMORY_DIRECT", c.shared_memory_direct);
  c.backend = env_choice("BAGUA_BACKEND", c.backend, {"gloo", "nccl"});
  c.check_collectives = env_bool("BAGUA_CHECK_COLLECTIVES", c.check_collectives);
  c.gloo_hostname = env_string("BAGUA_GLOO_HOSTNAME", c.gloo_hostname);
  c.timeline = env_string("BAGUA_TIMELINE", c.timeline);
  c.autotune = env_bool("BAGUA_AUTOTUNE", c.autotune);
  c.autotune_plan = env_string("BAGUA_AUTOTUNE_PLAN", c.autotune_plan);
  c.autotune_output = env_string("BAGUA_AUTOTUNE_OUTPUT", c.autotune_output);
  c.autotune_warmup_steps =
      env_positive_int("BAGUA_AUTOTUNE_WARMUP_STEPS", c.autotune_warmup_steps);
  c.autotune_window_steps =
      env_positive_int("BAGUA_AUTOTUNE_WINDOW_STEPS", c.autotune_window_steps);
  c.autotune_max_trials = env_positive_int("BAGUA_AUTOTUNE_MAX_TRIALS", c.autotune_max_trials);
  c.autotune_max_seconds = env_positive_int("BAGUA_AUTOTUNE_MAX_SECONDS", c.autotune_max_seconds);
  c.check_replicas_every = env_positive_int("BAGUA_CHECK_REPLICAS", c.check_replicas_every);
  c.host_threads = env_positive_int("BAGUA_HOST_THREADS", c.host_threads);
  if (c.host_threads > 256) {
    env_invalid("BAGUA_HOST_THREADS", env_value("BAGUA_HOST_THREADS"), "an integer from 1 to 256");
  }
  c.low_precision_segment =
      env_positive_int("BAGUA_LOW_PRECISION_SEGMENT", c.low_precision_segment);
  c.algorithm = env_choice("BAGUA_ALGORITHM", c.algorithm,
                           {"gradient_allreduce", "bytegrad", "powersgd", "powersgd_8bit"});
  return c;
}

// The cached configuration. Every version ever read is kept, so a reference
// returned by env() stays valid after a reload.
class EnvCache {
 public:
  const EnvConfig& get() {
    if (const EnvConfig* current = current_.load(std::memory_order_acquire)) return *current;
    std::lock_guard lock(mutex_);
    if (const EnvConfig* current = current_.load(std::memory_order_relaxed)) return *current;
    return store_locked(read_env());
  }

  const EnvConfig& reload() {
    EnvConfig fresh = read_env();  // throws before anything changes
    std::lock_guard lock(mutex_);
    return store_locked(std::move(fresh));
  }

 private:
  const EnvConfig& store_locked(EnvConfig config) {
    versions_.push_back(std::move(config));
    current_.store(&versions_.back(), std::memory_order_release);
    return versions_.back();
  }

  std::mutex mutex_;
  std::deque<EnvConfig> versions_;
  std::atomic<const EnvConfig*> current_{nullptr};
};

inline EnvCache& env_cache() {
  static auto* cache = new EnvCache();  // never destroyed: readable during exit
  return *cache;
}

}  // namespace detail

// The configuration, read at the first call (InvalidArgument if a variable
// is invalid; the next call reads again).
inline const EnvConfig& env() { return detail::env_cache().get(); }

// Tests only: reads the variables again, for a test that changed one in its
// own process. Values already copied out (a communicator's timeout, the
// logger's level) keep the old reading.
inline const EnvConfig& reload_env() { return detail::env_cache().reload(); }

}  // namespace bagua
