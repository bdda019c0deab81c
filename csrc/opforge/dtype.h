#pragma once
// The element types opforge kernels take, as a plain enum. It is the one thing
// the torch-facing wrappers and the pure-CUDA launchers share, so the launchers
// can be compiled by nvcc without any torch header (CI has no CUDA torch).

#include <cstdint>

namespace opforge {

enum class DType : int32_t { Float32 = 0, Float16 = 1, BFloat16 = 2, Float64 = 3 };

}  // namespace opforge
