// Lib-internal: the wire protocol of the window service (bagua/runtime/
// window_service.h), shared by its files: window_service.cc (collective
// calls, local reads), window_requests.cc (put, get, update: the client side),
// window_mutex.cc (win_mutex) and window_server.cc (the progress thread that
// answers peers' requests).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "bagua/comm/communicator.h"
#include "bagua/core/tensor_view.h"
#include "bagua/runtime/window_service.h"

namespace bagua {
namespace window_protocol {

enum Op : std::int64_t { kPut = 1, kAccumulate = 2, kGet = 3, kLock = 4, kUnlock = 5 };

// Why a target refused a request (the reply's status).
enum Status : std::int64_t {
  kOk = 0,
  kNoWindow = 1,   // the target has no window of that name
  kNoBuffer = 2,   // the requester is not its in-neighbour: no buffer kept for it
  kWrongSize = 3,  // the target's window holds another number of bytes
  kNotHolder = 4,  // a mutex release by a rank that does not hold the mutex
};

inline std::string_view op_name(std::int64_t op) {
  switch (op) {
    case kPut: return "win_put";
    case kAccumulate: return "win_accumulate";
    case kGet: return "win_get";
    case kLock: return "win_mutex acquire";
    case kUnlock: return "win_mutex release";
    default: return "unknown window op";
  }
}

// Tags on the service channel: request headers, replies, and the data chunks
// of each direction (chunk i on base + i, so a chunk can only land in its own
// place).
constexpr std::uint64_t kRequestTag = 0x5749'0001;
constexpr std::uint64_t kReplyTag = 0x5749'0002;
constexpr std::uint64_t kRequestData = 0x57ULL << 48 | 1ULL << 40;
constexpr std::uint64_t kReplyData = 0x57ULL << 48 | 2ULL << 40;

inline double as_double(std::int64_t bits) { return std::bit_cast<double>(bits); }
inline std::int64_t as_bits(double value) { return std::bit_cast<std::int64_t>(value); }

inline TensorView int64_view(std::int64_t* data, std::size_t count) {
  return TensorView{data, static_cast<std::int64_t>(count), DType::kInt64, {}};
}

inline TensorView byte_view(std::span<std::byte> bytes) {
  return TensorView{bytes.data(), static_cast<std::int64_t>(bytes.size()), DType::kUInt8, {}};
}

inline std::size_t chunk_count(std::size_t bytes, std::size_t chunk) {
  return bytes == 0 ? 0 : (bytes + chunk - 1) / chunk;
}

// The chunks of `bytes` as messages to / from `peer`, tagged base + index.
inline std::vector<PeerMessage> chunks(std::span<std::byte> bytes, std::size_t chunk, int peer,
                                       std::uint64_t base) {
  std::vector<PeerMessage> out;
  for (std::size_t i = 0; i < chunk_count(bytes.size(), chunk); ++i) {
    const std::size_t offset = i * chunk;
    const std::size_t n = std::min(chunk, bytes.size() - offset);
    out.push_back({byte_view(bytes.subspan(offset, n)), peer, base + i});
  }
  return out;
}

// dst := (accumulate ? dst : 0) + weight * src, elementwise in T.
inline void scale_into(std::byte* dst, const std::byte* src, std::int64_t numel, DType dtype,
                       double weight, bool accumulate) {
  auto run = [&](auto tag) {
    using T = decltype(tag);
    auto* d = reinterpret_cast<T*>(dst);
    const auto* s = reinterpret_cast<const T*>(src);
    const T w = static_cast<T>(weight);
    for (std::int64_t i = 0; i < numel; ++i) d[i] = accumulate ? d[i] + w * s[i] : w * s[i];
  };
  if (dtype == DType::kFloat64) {
    run(double{});
  } else {
    run(float{});
  }
}

inline void scale_in_place(const TensorView& x, double weight) {
  if (weight == 1.0) return;
  scale_into(x.bytes(), x.bytes(), x.numel, x.dtype, weight, false);
}

}  // namespace window_protocol

// Request header: fixed size, so the any-source receive knows its length.
struct WindowService::Request {
  std::int64_t op = 0;
  std::int64_t id = 0;  // window_id's bits
  std::int64_t source = -1;
  std::int64_t weight = 0;  // double bits
  std::int64_t p = 0;       // double bits: weight * the sender's p
  std::int64_t nbytes = 0;
  std::int64_t with_p = 0;
  std::int64_t reserved = 0;
};
struct WindowService::Reply {
  std::int64_t status = window_protocol::kOk;
  std::int64_t p = 0;  // GET: the target's p (double bits)
  std::int64_t nbytes = 0;
  std::int64_t reserved = 0;
};

}  // namespace bagua
