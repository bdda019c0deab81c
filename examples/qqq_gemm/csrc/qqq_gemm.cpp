// The torch-facing function of the example's module: checks, then opforge's
// CUDA launcher (WITH_CUDA, set by setup.py when it builds the kernel) or a
// CPU loop with the same arithmetic (exact int32 sums, then
// half(((float)acc * s_tok[m]) * s_ch[n])), so both agree with
// torch.ops.opforge.qqq_gemm bit for bit.
#include "qqq_gemm.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstdint>

#ifdef WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "qqq_gemm_kernel.h"
#endif

namespace {

// q[k][n] from the packed layout (LAYOUT.md): word ((nb*KB + kb)*32 + g*4 + t)*4 + j,
// nibble 2i + h holds q[kb*32 + h*16 + t*4 + i][nb*32 + g*4 + j].
int q_at(const int32_t* w, int64_t K, int64_t k, int64_t n) {
  const int64_t kb = k / 32, r = k % 32, h = r / 16, t = (r % 16) / 4, i = r % 4;
  const int64_t nb = n / 32, c = n % 32, g = c / 4, j = c % 4;
  const auto word = static_cast<uint32_t>(w[((nb * (K / 32) + kb) * 32 + g * 4 + t) * 4 + j]);
  const int nib = static_cast<int>((word >> (4 * (2 * i + h))) & 0xFu);
  return nib >= 8 ? nib - 16 : nib;
}

}  // namespace

at::Tensor qqq_gemm(const at::Tensor& a, const at::Tensor& w_packed, const at::Tensor& s_tok,
                       const at::Tensor& s_ch, const std::optional<at::Tensor>& s_group, int64_t group_size) {
  TORCH_CHECK(a.scalar_type() == at::kChar && a.dim() == 2, "qqq_gemm: a must be a 2-D int8 tensor, got ", a.scalar_type(),
              " of shape ", a.sizes());
  const int64_t M = a.size(0), K = a.size(1), N = w_packed.size(1);
  TORCH_CHECK(K % 32 == 0 && N % 32 == 0, "qqq_gemm: K and N must be multiples of 32, got K = ", K, ", N = ", N);
  TORCH_CHECK(w_packed.scalar_type() == at::kInt && w_packed.sizes() == at::IntArrayRef({K / 8, N}) && w_packed.is_contiguous(),
              "qqq_gemm: w_packed must be a contiguous int32 [K / 8, N] = [", K / 8, ", ", N, "], got ", w_packed.sizes());
  TORCH_CHECK(s_tok.scalar_type() == at::kFloat && s_ch.scalar_type() == at::kFloat && s_tok.numel() == M && s_ch.numel() == N,
              "qqq_gemm: s_tok and s_ch must be float32 of M and N elements");
  const bool grouped = s_group.has_value() && s_group->defined();
  TORCH_CHECK(grouped ? group_size > 0 && K % group_size == 0 : group_size == -1, "qqq_gemm: bad group_size ", group_size);
  for (const auto* t : {&w_packed, &s_tok, &s_ch}) {
    TORCH_CHECK(t->device() == a.device(), "qqq_gemm: all tensors must be on ", a.device(), ", got one on ", t->device());
  }
  const at::Tensor ac = a.contiguous(), st = s_tok.contiguous(), sc = s_ch.contiguous();
  const at::Tensor sg = grouped ? s_group->contiguous() : at::Tensor();
  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kHalf));
  if (out.numel() == 0) return out;
#ifdef WITH_CUDA
  if (a.is_cuda()) {
    const c10::cuda::CUDAGuard guard(a.device());
    const int64_t ws_bytes = opforge::qqq_gemm_workspace_bytes(M, N, K, group_size);
    at::Tensor ws = at::empty({ws_bytes}, a.options().dtype(at::kByte));
    const opforge::QqqGemmArgs args{ac.data_ptr<int8_t>(), w_packed.data_ptr<int32_t>(), st.data_ptr<float>(), sc.data_ptr<float>(),
                                    grouped ? sg.data_ptr<int8_t>() : nullptr, out.data_ptr(), M, N, K, group_size,
                                    opforge::DType::Float16, ws_bytes ? ws.data_ptr() : nullptr};
    const char* err = opforge::qqq_gemm_cuda(args, at::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == nullptr, "qqq_gemm: CUDA error: ", err);
    return out;
  }
#endif
  TORCH_CHECK(a.is_cpu(), "qqq_gemm: this build has no CUDA kernel; got a tensor on ", a.device());
  const int8_t* A = ac.data_ptr<int8_t>();
  const int32_t* W = w_packed.data_ptr<int32_t>();
  const int8_t* G = grouped ? sg.data_ptr<int8_t>() : nullptr;
  at::Half* O = out.data_ptr<at::Half>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int s = G ? G[(k / group_size) * N + n] : 1;
        acc += static_cast<int32_t>(A[m * K + k]) * q_at(W, K, k, n) * s;
      }
      O[m * N + n] = static_cast<at::Half>((static_cast<float>(acc) * st.data_ptr<float>()[m]) * sc.data_ptr<float>()[n]);
    }
  }
  return out;
}
