// BAGUA_HOST_DEVICE marks element-wise math that is compiled for the CPU path
// and, by nvcc, for the CUDA kernels in kernels/: one formula, two targets.
#pragma once

#if defined(__CUDACC__)
#define BAGUA_HOST_DEVICE __host__ __device__
#else
#define BAGUA_HOST_DEVICE
#endif
