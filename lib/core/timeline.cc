// Timeline's recording and its Chrome trace JSON (core/timeline.h).
#include "bagua/core/timeline.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "bagua/core/errors.h"

namespace bagua {
namespace {

nlohmann::json lane_name(int rank, int lane, const char* name) {
  return {{"name", "thread_name"},
          {"ph", "M"},
          {"pid", rank},
          {"tid", lane},
          {"args", {{"name", name}}}};
}

}  // namespace

void Timeline::push(std::string_view name, std::string_view category, int lane, std::int64_t ts_us,
                    std::int64_t dur_us, bool instant, Args args) {
  if (args.size() > kMaxArgs) {
    throw InvalidArgument(
        fmt::format("timeline event '{}': {} arguments, at most {}", name, args.size(), kMaxArgs));
  }
  std::lock_guard lock(mutex_);
  if (count_ >= kMaxEvents) {
    ++dropped_;
    return;
  }
  if (count_ % kBlockEvents == 0) blocks_.push_back(std::make_unique<Event[]>(kBlockEvents));
  Event& event = blocks_.back()[count_ % kBlockEvents];
  event.ts_us = ts_us;
  event.dur_us = dur_us;
  event.instant = instant;
  event.name = intern_locked(name);
  event.category = intern_locked(category);
  event.lane = lane;
  event.arg_count = static_cast<std::uint32_t>(args.size());
  std::size_t i = 0;
  for (const TimelineArg& arg : args) {
    StoredArg& stored = event.args[i++];
    stored.key = intern_locked(arg.key());
    stored.kind = arg.kind();
    switch (arg.kind()) {
      case TimelineArg::Kind::kInteger: stored.value.integer = arg.integer(); break;
      case TimelineArg::Kind::kReal: stored.value.real = arg.real(); break;
      case TimelineArg::Kind::kText: stored.value.text = intern_locked(arg.text()); break;
    }
  }
  ++count_;
}

std::uint32_t Timeline::intern_locked(std::string_view text) {
  if (const auto found = ids_.find(text); found != ids_.end()) return found->second;
  const auto id = static_cast<std::uint32_t>(names_.size());
  names_.emplace_back(text);
  ids_.emplace(names_.back(), id);
  return id;
}

std::string Timeline::to_json() const {
  std::lock_guard lock(mutex_);
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank_},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  events.push_back(lane_name(rank_, kTrainingLane, "training"));
  events.push_back(lane_name(rank_, kCommunicationLane, "communication"));
  events.push_back(lane_name(rank_, kBackgroundLane, "background"));
  for (std::size_t n = 0; n < count_; ++n) {
    const Event& e = blocks_[n / kBlockEvents][n % kBlockEvents];
    nlohmann::json args = nlohmann::json::object();
    for (std::uint32_t i = 0; i < e.arg_count; ++i) {
      const StoredArg& arg = e.args[i];
      auto& value = args[names_[arg.key]];
      switch (arg.kind) {
        case TimelineArg::Kind::kInteger: value = arg.value.integer; break;
        case TimelineArg::Kind::kReal: value = arg.value.real; break;
        case TimelineArg::Kind::kText: value = names_[arg.value.text]; break;
      }
    }
    nlohmann::json event = {{"name", names_[e.name]}, {"cat", names_[e.category]},
                            {"ts", e.ts_us},          {"pid", rank_},
                            {"tid", e.lane},          {"args", std::move(args)}};
    if (e.instant) {
      event["ph"] = "i";
      event["s"] = "t";
    } else {
      event["ph"] = "X";
      event["dur"] = e.dur_us;
    }
    events.push_back(std::move(event));
  }
  return nlohmann::json{{"traceEvents", std::move(events)},
                        {"displayTimeUnit", "ms"},
                        {"otherData", {{"rank", rank_}, {"dropped_events", dropped_}}}}
      .dump();
}

}  // namespace bagua
