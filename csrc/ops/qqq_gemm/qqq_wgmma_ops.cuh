#pragma once
// wgmma.mma_async m64nNk32, s32 += s8 x s8, for qqq_gemm on sm_90a: A (64
// weight columns x 32 k, INT4 -> INT8 in registers) from registers, B (the
// activations: N = the tile's rows of `a`) from shared memory through a
// descriptor, K-major (the only layout 8-bit wgmma takes). Accumulators: N / 2
// int32 per thread. The instruction exists only under __CUDA_ARCH_FEAT_SM90_ALL;
// elsewhere the kernel that calls it traps and is never launched.

#include <cstdint>

#include "opforge/asm_operands.h"

namespace opforge::qqq {
namespace {

template <int N>
struct WgmmaS8;

#define OPF_QQQ_D4(i) "+r"(d[(i)]), "+r"(d[(i) + 1]), "+r"(d[(i) + 2]), "+r"(d[(i) + 3])
#define OPF_QQQ_D8(i) OPF_QQQ_D4(i), OPF_QQQ_D4((i) + 4)
#define OPF_QQQ_D16(i) OPF_QQQ_D8(i), OPF_QQQ_D8((i) + 8)
#define OPF_QQQ_D32(i) OPF_QQQ_D16(i), OPF_QQQ_D16((i) + 16)
#define OPF_QQQ_D64(i) OPF_QQQ_D32(i), OPF_QQQ_D32((i) + 32)

// NREG = N / 2 accumulators; the four A registers and the descriptor follow
// them as operands A0 .. A0 + 3 and B_OP (literals: the asm string needs them).
// mma accumulates (scale-d = 1, an immediate); mma_or_set takes scale-d from
// a predicate: false overwrites the accumulators (the first k32 unit of a slot
// whose partial sums the group-scale fold restarts).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPF_QQQ_INSN(N, NREG, A0, A1, A2, A3, B_OP, SCALE_D)                                                  \
  "wgmma.mma_async.sync.aligned.m64n" #N "k32.s32.s8.s8 {" OPF_ASM_OPS##NREG "}, {%" #A0 ", %" #A1 ", %" #A2 \
  ", %" #A3 "}, %" #B_OP ", " SCALE_D ";\n"
#define OPF_QQQ_ASM(N, NREG, A0, A1, A2, A3, B_OP)                                       \
  asm volatile(OPF_QQQ_INSN(N, NREG, A0, A1, A2, A3, B_OP, "1")                          \
               : OPF_QQQ_D##NREG(0)                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
#define OPF_QQQ_ASM_P(N, NREG, A0, A1, A2, A3, B_OP, S_OP)                                                 \
  asm volatile("{\n.reg .pred sd;\nsetp.ne.b32 sd, %" #S_OP ", 0;\n" OPF_QQQ_INSN(N, NREG, A0, A1, A2, A3, \
                                                                                 B_OP, "sd") "}\n"         \
               : OPF_QQQ_D##NREG(0)                                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))
#else
#define OPF_QQQ_ASM(N, NREG, A0, A1, A2, A3, B_OP) ((void)d, (void)a, (void)desc_b)
#define OPF_QQQ_ASM_P(N, NREG, A0, A1, A2, A3, B_OP, S_OP) ((void)d, (void)a, (void)desc_b, (void)accumulate)
#endif

#define OPF_QQQ_WGMMA(N, NREG, A0, A1, A2, A3, B_OP, S_OP)                                                    \
  template <>                                                                                                \
  struct WgmmaS8<N> {                                                                                        \
    static __device__ __forceinline__ void mma(int32_t* d, const uint32_t (&a)[4], uint64_t desc_b) {        \
      OPF_QQQ_ASM(N, NREG, A0, A1, A2, A3, B_OP);                                                            \
    }                                                                                                        \
    static __device__ __forceinline__ void mma_or_set(int32_t* d, const uint32_t (&a)[4], uint64_t desc_b,   \
                                                      uint32_t accumulate) {                                 \
      OPF_QQQ_ASM_P(N, NREG, A0, A1, A2, A3, B_OP, S_OP);                                                    \
    }                                                                                                        \
  }

OPF_QQQ_WGMMA(32, 16, 16, 17, 18, 19, 20, 21);
OPF_QQQ_WGMMA(64, 32, 32, 33, 34, 35, 36, 37);
OPF_QQQ_WGMMA(128, 64, 64, 65, 66, 67, 68, 69);

#undef OPF_QQQ_WGMMA
#undef OPF_QQQ_ASM
#undef OPF_QQQ_ASM_P
#undef OPF_QQQ_INSN
#undef OPF_QQQ_D4
#undef OPF_QQQ_D8
#undef OPF_QQQ_D16
#undef OPF_QQQ_D32
#undef OPF_QQQ_D64

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format") for a
// K-major operand in the 128-byte swizzle that TMA writes: rows of 128 bytes,
// 8-row atoms of 1024 bytes (SBO, from one 8-row group to the next), LBO
// unused (1); bits 62-63 = 1: 128-byte swizzle. The k32 step u of a row starts
// 32 u bytes further: the swizzle applies to the absolute address bits, so a
// start inside the atom is valid while the atom is 1024-byte aligned.
__device__ __forceinline__ uint64_t swizzled_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (uint64_t{16 >> 4} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

}  // namespace
}  // namespace opforge::qqq
