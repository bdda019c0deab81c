#pragma once
// wgmma.mma_async wrappers, m64nNk16 with float32 accumulators, A and B from
// shared memory through descriptors, B N-major (imm-trans-b = 1: B is [K, N]
// row-major). The accumulator operand list is N/2 registers long and inline asm
// wants its operands spelled out, so one macro writes each (N, type) pair from
// the register lists of opforge/asm_operands.h. Used only under __CUDA_ARCH_FEAT_SM90_ALL (sm_90a).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "opforge/asm_operands.h"

namespace opforge::gemm::wgmma_detail {

template <int N, typename T>
struct Wgmma;

// The accumulators d[i .. i + n) as "+f" operands.
#define OPF_WGMMA_D4(i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define OPF_WGMMA_D16(i) OPF_WGMMA_D4(i), OPF_WGMMA_D4((i) + 4), OPF_WGMMA_D4((i) + 8), OPF_WGMMA_D4((i) + 12)
#define OPF_WGMMA_D32(i) OPF_WGMMA_D16(i), OPF_WGMMA_D16((i) + 16)
#define OPF_WGMMA_D64(i) OPF_WGMMA_D32(i), OPF_WGMMA_D32((i) + 32)
#define OPF_WGMMA_D128(i) OPF_WGMMA_D64(i), OPF_WGMMA_D64((i) + 64)

// One specialisation: N columns, NREG = N / 2 accumulators per thread, TY the
// PTX type (bf16, f16); the descriptors and scale_d follow the accumulators as
// operands NREG, NREG + 1 and NREG + 2 (A_OP, B_OP, S_OP, written out because
// the asm string needs them as literals).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPF_WGMMA_ASM(N, NREG, TY, A_OP, B_OP, S_OP)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #S_OP ", 0;\n"                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" OPF_ASM_OPS##NREG \
               "}, %" #A_OP ", %" #B_OP ", p, 1, 1, 0, 1;\n}\n"                                 \
               : OPF_WGMMA_D##NREG(0)                                                       \
               : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#else
#define OPF_WGMMA_ASM(N, NREG, TY, A_OP, B_OP, S_OP) ((void)d, (void)desc_a, (void)desc_b, (void)scale_d)
#endif

#define OPF_WGMMA(N, NREG, T, TY, A_OP, B_OP, S_OP)                                                      \
  template <>                                                                                     \
  struct Wgmma<N, T> {                                                                            \
    static __device__ __forceinline__ void mma(float (&d)[NREG], uint64_t desc_a, uint64_t desc_b, \
                                               int scale_d) {                                     \
      OPF_WGMMA_ASM(N, NREG, TY, A_OP, B_OP, S_OP);                                               \
    }                                                                                             \
  }

OPF_WGMMA(64, 32, __nv_bfloat16, "bf16", 32, 33, 34);
OPF_WGMMA(128, 64, __nv_bfloat16, "bf16", 64, 65, 66);
OPF_WGMMA(256, 128, __nv_bfloat16, "bf16", 128, 129, 130);
OPF_WGMMA(64, 32, __half, "f16", 32, 33, 34);
OPF_WGMMA(128, 64, __half, "f16", 64, 65, 66);
OPF_WGMMA(256, 128, __half, "f16", 128, 129, 130);

#undef OPF_WGMMA
#undef OPF_WGMMA_ASM
#undef OPF_WGMMA_D4
#undef OPF_WGMMA_D16
#undef OPF_WGMMA_D32
#undef OPF_WGMMA_D64
#undef OPF_WGMMA_D128

}  // namespace opforge::gemm::wgmma_detail
