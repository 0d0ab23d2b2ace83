// Known inputs of the collective tests and the results they must give,
// computed independently of the code under test.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bagua/core/reduce_op.h"
#include "typed_buffer.h"

namespace bagua::testing {

// Input of `rank` at element i: small integers, exact in every dtype even
// after summing five ranks.
inline double input_value(int rank, std::int64_t i) {
  return static_cast<double>(1 + rank + i % 7);
}
// Inputs for products: 1 or 2, so a product over five ranks stays exact.
inline double product_input(int rank, std::int64_t i) {
  return static_cast<double>(1 + (rank + i) % 2);
}

inline double reference(ReduceOp op, int world, std::int64_t i, bool integer) {
  double result = op == ReduceOp::kProduct ? product_input(0, i) : input_value(0, i);
  for (int r = 1; r < world; ++r) {
    const double v = op == ReduceOp::kProduct ? product_input(r, i) : input_value(r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: result += v; break;
      case ReduceOp::kProduct: result *= v; break;
      case ReduceOp::kMin: result = std::min(result, v); break;
      case ReduceOp::kMax: result = std::max(result, v); break;
    }
  }
  if (op == ReduceOp::kAvg) result = integer ? std::trunc(result / world) : result / world;
  return result;
}

inline void fill(TypedBuffer& buffer, int rank, ReduceOp op) {
  for (std::int64_t i = 0; i < buffer.numel(); ++i) {
    buffer.set(i, op == ReduceOp::kProduct ? product_input(rank, i) : input_value(rank, i));
  }
}

}  // namespace bagua::testing
