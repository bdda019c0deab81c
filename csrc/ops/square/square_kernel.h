#pragma once
// Launcher of the square kernel (the load_inline tutorial's square_matrix, elementwise).

#include <cstdint>

#include "opforge/dtype.h"

namespace opforge {

// out[i] = x[i] * x[i] for i in [0, n). Returns nullptr or the CUDA error.
const char* square_cuda(DType dtype, void* out, const void* x, int64_t n, void* stream);

}  // namespace opforge
