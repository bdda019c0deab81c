#pragma once
// Launchers of the add kernels: raw pointers, element count and stream, no
// torch types, so add_kernel.cu compiles without torch headers.

#include <cstdint>

#include "opforge/dtype.h"

namespace opforge {

// out[i] = a[i] + b[i] for i in [0, n). Returns nullptr or the CUDA error.
const char* add_cuda(DType dtype, void* out, const void* a, const void* b, int64_t n, void* stream);

}  // namespace opforge
