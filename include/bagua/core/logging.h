// The runtime's logger: spdlog, level from BAGUA_LOG_LEVEL, arguments only
// formatted when the line will be printed (spdlog's fmt-style calls).
#pragma once

#include <memory>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "bagua/core/env.h"

namespace bagua {

inline spdlog::logger& log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto existing = spdlog::get("bagua");
    if (existing) return existing;
    auto created = spdlog::stderr_color_mt("bagua");
    created->set_level(spdlog::level::from_str(env().log_level));
    created->set_pattern("[%H:%M:%S.%e] [bagua] [%^%l%$] [pid %P] %v");
    return created;
  }();
  return *logger;
}

}  // namespace bagua
