#include "opforge/cuda_utils.cuh"
#include "square_kernel.h"

namespace opforge {
namespace {

struct SquareOp {
  template <typename U>
  __device__ U operator()(U x) const {
    return x * x;
  }
};

}  // namespace

const char* square_cuda(DType dtype, void* out, const void* x, int64_t n, void* stream) {
  OPFORGE_CUDA_DISPATCH(dtype, T, return cuda::launch_unary<T>(out, x, n, stream, SquareOp{});)
}

}  // namespace opforge
