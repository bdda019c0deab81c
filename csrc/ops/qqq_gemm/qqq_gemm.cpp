// qqq_gemm: the QQQ GEMM tutorial's W4A8 GEMM (the QQQ method), int8 per-token activations
// times int4 weights packed for the kernel (LAYOUT.md), int32 accumulation,
// out = (a @ Wq) * s_tok[:, None] * s_ch[None, :] in float16, bfloat16 or float32.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "opforge/stable/common.h"
#include "qqq_gemm_kernel.h"

namespace opforge {
namespace {

constexpr const char* kQqqGemm = "opforge::qqq_gemm";
constexpr int64_t kUnit = 32;
// |a * q * s| <= 128 * 128 per product: K * 2^14 must stay below 2^31.
constexpr int64_t kMaxK = (std::numeric_limits<int32_t>::max() >> 14) / kUnit * kUnit;
constexpr int kGroupScaleMax = 16;

void check_dtype(const char* name, const Tensor& t, ScalarType want, const char* why) {
  check_defined(kQqqGemm, name, t);
  OPFORGE_CHECK_VALUE(t.scalar_type() == want, kQqqGemm, ": ", name, " must be ", dtype_name(want), " (", why,
                      "), got ", dtype_name(t.scalar_type()));
}

void check_device(const char* name, const Tensor& t, const Tensor& a) {
  OPFORGE_CHECK(same_device(t, a), kQqqGemm, ": a and ", name, " must be on the same device, got ",
                device_name(a), " and ", device_name(t));
}

// The CUDA kernel reads 16-byte vectors: a view at an odd offset is copied
// (the tensors it applies to are small next to the weights). clone keeps the
// strides of a dense input, so the copy of a row-major view is row-major, in
// a fresh (aligned) allocation.
Tensor aligned(const Tensor& t) {
  Tensor c = dense(t);
  if (c.is_cuda() && reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 != 0) {
    c = torch::stable::clone(c);
  }
  return c;
}

// A q value in [-8, 7] from the packed layout: word ((nb * KB + kb) * 32 +
// g * 4 + t) * 4 + j, nibble 2 * i + h holds q[kb*32 + h*16 + t*4 + i][nb*32 + g*4 + j].
// Unpacks one 32-column stripe into qs[c][k] (column-major: the dot products
// below then run over contiguous k), times the group scales.
void unpack_stripe(const int32_t* w, const int8_t* s_group, int64_t group_size, int64_t N,
                   int64_t K, int64_t nb, int8_t* qs) {
  const int64_t KB = K / kUnit;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int32_t* unit = w + (nb * KB + kb) * 128;
    for (int g = 0; g < 8; ++g)
      for (int t = 0; t < 4; ++t)
        for (int j = 0; j < 4; ++j) {
          const auto word = static_cast<uint32_t>(unit[(g * 4 + t) * 4 + j]);
          const int c = g * 4 + j;
          for (int i = 0; i < 4; ++i)
            for (int h = 0; h < 2; ++h) {
              const int nib = static_cast<int>((word >> (4 * (2 * i + h))) & 0xFu);
              int q = nib >= 8 ? nib - 16 : nib;
              const int64_t k = kb * kUnit + h * 16 + t * 4 + i;
              if (s_group != nullptr) q *= s_group[(k / group_size) * N + nb * kUnit + c];
              qs[c * K + k] = static_cast<int8_t>(q);  // q * s in [-128, 112]: checked scales
            }
        }
  }
}

template <typename out_t>
void qqq_gemm_cpu(const Tensor& a, const Tensor& w, const Tensor& s_tok, const Tensor& s_ch,
                  const Tensor* s_group, int64_t group_size, const Tensor& out) {
  const int64_t M = a.size(0), K = a.size(1), N = out.size(1);
  const int8_t* A = a.const_data_ptr<int8_t>();
  const int32_t* W = w.const_data_ptr<int32_t>();
  const float* ST = s_tok.const_data_ptr<float>();
  const float* SC = s_ch.const_data_ptr<float>();
  const int8_t* SG = s_group != nullptr ? s_group->const_data_ptr<int8_t>() : nullptr;
  out_t* O = out.mutable_data_ptr<out_t>();
  // One task per 32-column stripe: unpack it once, then every row's 32 dot
  // products in int32, exact as the tensor cores' sums.
  torch::stable::parallel_for(0, N / kUnit, 1, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> qs(static_cast<size_t>(kUnit * K));
    for (int64_t nb = begin; nb < end; ++nb) {
      unpack_stripe(W, SG, group_size, N, K, nb, qs.data());
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* row = A + m * K;
        for (int64_t c = 0; c < kUnit; ++c) {
          const int8_t* col = qs.data() + c * K;
          int32_t acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(row[k]) * col[k];
          const int64_t n = nb * kUnit + c;
          // The CUDA kernel's epilogue, operation for operation.
          const float v = (static_cast<float>(acc) * ST[m]) * SC[n];
          O[m * N + n] = static_cast<out_t>(v);
        }
      }
    }
  });
}

Tensor qqq_gemm(const Tensor& a_in, const Tensor& w_packed, const Tensor& s_tok_in, const Tensor& s_ch_in,
                const std::optional<Tensor>& s_group_in, int64_t group_size, std::optional<ScalarType> out_dtype) {
  check_dtype("a", a_in, ScalarType::Char, "per-token quantised activations");
  check_2d(kQqqGemm, "a", a_in, "[M, K]");
  check_dtype("w_packed", w_packed, ScalarType::Int, "int4 weights packed by opforge.quant.quantize_weight_w4");
  // The same packed memory either way (LAYOUT.md); 3-D names its stripes of 32 columns and its
  // units of 32 k, the two dimensions tensor parallelism shards (opforge.quant.stripe_view).
  OPFORGE_CHECK(w_packed.dim() == 2 || w_packed.dim() == 3, kQqqGemm,
                ": w_packed must be 2-D [K / 8, N] or 3-D [N / 32, K / 32, 128], got shape ", dims(w_packed.sizes()));
  const bool stripes = w_packed.dim() == 3;
  check_dtype("s_tok", s_tok_in, ScalarType::Float, "per-token activation scales");
  check_dtype("s_ch", s_ch_in, ScalarType::Float, "per-channel weight scales");
  check_device("w_packed", w_packed, a_in);
  check_device("s_tok", s_tok_in, a_in);
  check_device("s_ch", s_ch_in, a_in);
  const int64_t M = a_in.size(0), K = a_in.size(1), N = stripes ? w_packed.size(0) * kUnit : w_packed.size(1);
  OPFORGE_CHECK(K % kUnit == 0, kQqqGemm, ": K = a.size(1) must be a multiple of ", kUnit,
                " (the packed unit), got ", K);
  OPFORGE_CHECK(N % kUnit == 0, kQqqGemm, ": N = w_packed.size(1) must be a multiple of ", kUnit,
                " (the packed unit), got ", N);
  OPFORGE_CHECK(K <= kMaxK, kQqqGemm, ": K must be at most ", kMaxK,
                " so that the int32 accumulator cannot overflow, got ", K);
  OPFORGE_CHECK(M <= std::numeric_limits<int32_t>::max() && N <= std::numeric_limits<int32_t>::max(),
                kQqqGemm, ": M and N must be below 2^31, got M = ", M, ", N = ", N);
  if (stripes) {
    check_shape(kQqqGemm, "w_packed", w_packed, {N / kUnit, K / kUnit, kUnit * 4}, "[N / 32, K / 32, 128]");
  } else {
    check_shape(kQqqGemm, "w_packed", w_packed, {K / 8, N}, "[K / 8, N]");
  }
  OPFORGE_CHECK(w_packed.is_contiguous(), kQqqGemm,
                ": w_packed must be contiguous (its memory is the packed layout), got strides ",
                dims(w_packed.strides()));
  OPFORGE_CHECK(!w_packed.is_cuda() || reinterpret_cast<uintptr_t>(w_packed.const_data_ptr()) % 16 == 0,
                kQqqGemm, ": w_packed must be 16-byte aligned on the GPU, got address ",
                w_packed.const_data_ptr(), " (a view at an offset? pass the tensor quantize_weight_w4 made)");
  check_shape(kQqqGemm, "s_tok", s_tok_in, {M}, "[M]");
  check_shape(kQqqGemm, "s_ch", s_ch_in, {N}, "[N]");
  std::optional<Tensor> s_group;
  if (s_group_in.has_value() && s_group_in->defined()) {
    s_group = *s_group_in;
    check_dtype("s_group", *s_group, ScalarType::Char, "integer group scales in [1, 16]");
    check_device("s_group", *s_group, a_in);
    OPFORGE_CHECK(group_size > 0 && group_size % kUnit == 0 && K % group_size == 0, kQqqGemm,
                  ": group_size must be a positive multiple of ", kUnit, " that divides K = ", K,
                  " when s_group is given, got ", group_size);
    check_shape(kQqqGemm, "s_group", *s_group, {K / group_size, N}, "[K / group_size, N]");
  } else {
    OPFORGE_CHECK(group_size == -1, kQqqGemm, ": group_size must be -1 (per channel) when s_group is None, got ",
                  group_size);
  }
  const ScalarType odt = out_dtype.value_or(ScalarType::Half);
  OPFORGE_CHECK_VALUE(odt == ScalarType::Half || odt == ScalarType::BFloat16 || odt == ScalarType::Float, kQqqGemm,
                      ": out_dtype must be float16, bfloat16 or float32, got ", dtype_name(odt));

  const Tensor a = aligned(a_in);
  const Tensor s_tok = dense(s_tok_in);
  const Tensor s_ch = aligned(s_ch_in);
  if (s_group.has_value()) s_group = aligned(*s_group);
  const Tensor* sg = s_group.has_value() ? &*s_group : nullptr;
  Tensor out = empty({M, N}, odt, a);

  run_kernel(
      kQqqGemm, out,
      [&](auto stream) -> const char* {
        const int64_t ws_bytes = qqq_gemm_workspace_bytes(M, N, K, group_size);
        const Tensor ws = empty({ws_bytes}, ScalarType::Byte, a);
        QqqGemmArgs args{a.const_data_ptr<int8_t>(),
                         w_packed.const_data_ptr<int32_t>(),
                         s_tok.const_data_ptr<float>(),
                         s_ch.const_data_ptr<float>(),
                         sg != nullptr ? sg->const_data_ptr<int8_t>() : nullptr,
                         out.mutable_data_ptr(),
                         M,
                         N,
                         K,
                         group_size,
                         to_dtype(odt),
                         ws_bytes > 0 ? ws.mutable_data_ptr() : nullptr};
        return qqq_gemm_cuda(args, stream);
      },
      [&] {
        if (sg != nullptr && sg->numel() > 0) {
          // The kernel's int8 product q * s needs s in [1, 16]; on the CPU the
          // values are at hand (row-major, from aligned()), so a bad one is an
          // error (CUDA writes NaN, LAYOUT.md).
          const int8_t* v = sg->const_data_ptr<int8_t>();
          const auto [lo_it, hi_it] = std::minmax_element(v, v + sg->numel());
          const int lo = *lo_it, hi = *hi_it;
          OPFORGE_CHECK(lo >= 1 && hi <= kGroupScaleMax, kQqqGemm, ": s_group values must lie in [1, ",
                        kGroupScaleMax, "], got values in [", lo, ", ", hi, "]");
        }
        switch (odt) {
          case ScalarType::Half: qqq_gemm_cpu<c10::Half>(a, w_packed, s_tok, s_ch, sg, group_size, out); break;
          case ScalarType::BFloat16:
            qqq_gemm_cpu<c10::BFloat16>(a, w_packed, s_tok, s_ch, sg, group_size, out);
            break;
          default: qqq_gemm_cpu<float>(a, w_packed, s_tok, s_ch, sg, group_size, out); break;
        }
      });
  return out;
}

void register_qqq_gemm_kernels(Library& m) { m.impl("qqq_gemm", TORCH_BOX(&qqq_gemm)); }

}  // namespace
}  // namespace opforge

OPFORGE_LIBRARY_FRAGMENT(opforge, m) {
  m.def(
      "qqq_gemm(Tensor a, Tensor w_packed, Tensor s_tok, Tensor s_ch, Tensor? s_group=None, "
      "int group_size=-1, ScalarType? out_dtype=None) -> Tensor");
}

OPFORGE_REGISTER_KERNELS(opforge, opforge::register_qqq_gemm_kernels)
