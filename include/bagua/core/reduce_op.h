// ReduceOp: the reduction operators of the collectives, named as in
// torch.distributed, with their names. In core because the element math
// (element_math.h) combines values under them on the CPU and the GPU alike.
#pragma once

#include <cstdint>
#include <string_view>

namespace bagua {

enum class ReduceOp : std::uint8_t { kSum, kAvg, kMin, kMax, kProduct };

constexpr std::string_view to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "unknown";
}

}  // namespace bagua
