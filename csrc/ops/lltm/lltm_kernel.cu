#include "lltm_kernel.h"
#include "lltm_math.h"
#include "opforge/cuda_utils.cuh"

namespace opforge {
namespace {

using cuda::from_opmath;
using cuda::opmath_t;
using cuda::to_opmath;

// One thread per (row, state) element, grid-stride over batch * state with
// 64-bit indices. Consecutive threads take consecutive state columns, so each
// of the three gate blocks of a row is read and written coalesced. The
// elements are independent and the matmuls dominate the cell's time, so this
// is a plain streaming loop rather than elementwise_kernel's vector form
// (which needs every tensor indexed alike, not [b, s] against [b, k*S + s]).
template <typename T>
__global__ void __launch_bounds__(cuda::kThreads)
    lltm_forward_kernel(T* __restrict__ gates, const T* __restrict__ old_cell, T* __restrict__ new_h,
                        T* __restrict__ new_cell, int64_t n, int64_t state) {
  using U = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t b = i / state;
    const int64_t s = i - b * state;
    T* g = gates + b * 3 * state + s;
    const auto r = lltm::forward_element<U>(to_opmath(g[0]), to_opmath(g[state]),
                                            to_opmath(g[2 * state]), to_opmath(old_cell[i]));
    g[0] = from_opmath<T>(r.input_gate);
    g[state] = from_opmath<T>(r.output_gate);
    g[2 * state] = from_opmath<T>(r.candidate_cell);
    new_cell[i] = from_opmath<T>(r.new_cell);
    new_h[i] = from_opmath<T>(r.new_h);
  }
}

// The launcher's LltmBackwardArgs with typed pointers.
template <typename T>
struct BackwardArgs {
  T* __restrict__ d_gates;
  T* __restrict__ d_old_cell;
  const T* __restrict__ grad_h;
  int64_t gh_b, gh_s;
  const T* __restrict__ grad_cell;
  int64_t gc_b, gc_s;
  const T* __restrict__ grad_gates;
  const T* __restrict__ new_cell;
  const T* __restrict__ gates;
};

template <typename T>
__global__ void __launch_bounds__(cuda::kThreads)
    lltm_backward_kernel(const BackwardArgs<T> a, int64_t n, int64_t state) {
  using U = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t b = i / state;
    const int64_t s = i - b * state;
    const int64_t row = b * 3 * state + s;
    // Each null pointer is null for the whole launch: uniform branches.
    const U gh = a.grad_h != nullptr ? to_opmath(a.grad_h[b * a.gh_b + s * a.gh_s]) : U(0);
    const U gc = a.grad_cell != nullptr ? to_opmath(a.grad_cell[b * a.gc_b + s * a.gc_s]) : U(0);
    U gi = U(0), go = U(0), gcc = U(0);
    if (a.grad_gates != nullptr) {
      gi = to_opmath(a.grad_gates[row]);
      go = to_opmath(a.grad_gates[row + state]);
      gcc = to_opmath(a.grad_gates[row + 2 * state]);
    }
    const auto r = lltm::backward_element<U>(gh, gc, to_opmath(a.new_cell[i]), to_opmath(a.gates[row]),
                                             to_opmath(a.gates[row + state]),
                                             to_opmath(a.gates[row + 2 * state]), gi, go, gcc);
    a.d_gates[row] = from_opmath<T>(r.d_input_gate);
    a.d_gates[row + state] = from_opmath<T>(r.d_output_gate);
    a.d_gates[row + 2 * state] = from_opmath<T>(r.d_candidate_cell);
    if (a.d_old_cell != nullptr) a.d_old_cell[i] = from_opmath<T>(r.d_old_cell);
  }
}

// d_bias[j] = sum over the batch of d_gates[b, j]. A block owns 32 adjacent
// columns (a warp reads one contiguous row segment per step) and its 8 warps
// stride the batch; the 8 partial sums meet in shared memory and are added in
// warp order, so the result does not depend on scheduling. PyTorch's sum(0)
// did this before: its multi-block reduction reads staging memory that
// compute-sanitizer's initcheck reports as uninitialised (2,108 reports for
// torch.randn(1025, 900).sum(0) alone on an H200), which made every
// sanitizer run of lltm_backward fail on a kernel that is not ours.
constexpr int kSumCols = 32, kSumWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kSumCols* kSumWarps)
    column_sum_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t rows, int64_t cols) {
  using U = opmath_t<T>;
  __shared__ U part[kSumWarps][kSumCols];
  const int64_t col = int64_t{blockIdx.x} * kSumCols + threadIdx.x;
  U sum = U(0);
  if (col < cols) {
    for (int64_t r = threadIdx.y; r < rows; r += kSumWarps) sum += to_opmath(x[r * cols + col]);
  }
  part[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    U total = part[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kSumWarps; ++w) total += part[w][threadIdx.x];
    out[col] = from_opmath<T>(total);
  }
}

}  // namespace

const char* lltm_column_sum_cuda(DType dtype, const void* x, void* out, int64_t rows, int64_t cols, void* stream) {
  if (cols == 0) return nullptr;
  const auto blocks = static_cast<unsigned>((cols + kSumCols - 1) / kSumCols);
  const auto s = static_cast<cudaStream_t>(stream);
  OPFORGE_CUDA_DISPATCH(dtype, T, {
    column_sum_kernel<T><<<blocks, dim3(kSumCols, kSumWarps), 0, s>>>(static_cast<const T*>(x), static_cast<T*>(out), rows,
                                                                      cols);
    return cuda::last_error();
  })
}

const char* lltm_forward_cuda(DType dtype, void* gates, const void* old_cell, void* new_h,
                              void* new_cell, int64_t batch, int64_t state, void* stream) {
  const int64_t n = batch * state;
  if (n == 0) return nullptr;
  const unsigned grid = cuda::grid_for(n, cuda::kThreads);
  const auto s = static_cast<cudaStream_t>(stream);
  OPFORGE_CUDA_DISPATCH(dtype, T, {
    lltm_forward_kernel<T><<<grid, cuda::kThreads, 0, s>>>(
        static_cast<T*>(gates), static_cast<const T*>(old_cell), static_cast<T*>(new_h),
        static_cast<T*>(new_cell), n, state);
    return cuda::last_error();
  })
}

const char* lltm_backward_cuda(DType dtype, const LltmBackwardArgs& args, void* stream) {
  const int64_t n = args.batch * args.state;
  if (n == 0) return nullptr;
  const unsigned grid = cuda::grid_for(n, cuda::kThreads);
  const auto s = static_cast<cudaStream_t>(stream);
  OPFORGE_CUDA_DISPATCH(dtype, T, {
    const BackwardArgs<T> a{static_cast<T*>(args.d_gates),
                            static_cast<T*>(args.d_old_cell),
                            static_cast<const T*>(args.grad_h),
                            args.grad_h_strides[0],
                            args.grad_h_strides[1],
                            static_cast<const T*>(args.grad_cell),
                            args.grad_cell_strides[0],
                            args.grad_cell_strides[1],
                            static_cast<const T*>(args.grad_gates),
                            static_cast<const T*>(args.new_cell),
                            static_cast<const T*>(args.gates)};
    lltm_backward_kernel<T><<<grid, cuda::kThreads, 0, s>>>(a, n, args.state);
    return cuda::last_error();
  })
}

}  // namespace opforge
