#pragma once
// wgmma.mma_async wrappers, m64nNk16 with float32 accumulators, A and B from
// shared memory through descriptors, B N-major (imm-trans-b = 1: B is [K, N]
// row-major). The accumulator operand list is N/2 registers long and inline asm
// wants its operands spelled out, so one macro writes each (N, type) pair from
// the register lists below. Used only under __CUDA_ARCH_FEAT_SM90_ALL (sm_90a).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace opforge::gemm::wgmma_detail {

template <int N, typename T>
struct Wgmma;

// The accumulators d[i .. i + n) as "+f" operands.
#define OPF_WGMMA_D4(i) "+f"(d[(i)]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define OPF_WGMMA_D16(i) OPF_WGMMA_D4(i), OPF_WGMMA_D4((i) + 4), OPF_WGMMA_D4((i) + 8), OPF_WGMMA_D4((i) + 12)
#define OPF_WGMMA_D32(i) OPF_WGMMA_D16(i), OPF_WGMMA_D16((i) + 16)
#define OPF_WGMMA_D64(i) OPF_WGMMA_D32(i), OPF_WGMMA_D32((i) + 32)
#define OPF_WGMMA_D128(i) OPF_WGMMA_D64(i), OPF_WGMMA_D64((i) + 64)

// "%0, ..., %31": the asm names of 32 accumulator operands.
#define OPF_WGMMA_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

// "%0, ..., %63": the asm names of 64 accumulator operands.
#define OPF_WGMMA_REGS64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
  "%62, %63"

// "%0, ..., %127": the asm names of 128 accumulator operands.
#define OPF_WGMMA_REGS128 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, " \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, " \
  "%62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, " \
  "%101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, " \
  "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"


// One specialisation: N columns, NREG = N / 2 accumulators per thread, TY the
// PTX type (bf16, f16); the descriptors and scale_d follow the accumulators as
// operands NREG, NREG + 1 and NREG + 2 (A_OP, B_OP, S_OP, written out because
// the asm string needs them as literals).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define OPF_WGMMA_ASM(N, NREG, TY, A_OP, B_OP, S_OP)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #S_OP ", 0;\n"                         \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" OPF_WGMMA_REGS##NREG \
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
#undef OPF_WGMMA_REGS32
#undef OPF_WGMMA_REGS64
#undef OPF_WGMMA_REGS128
#undef OPF_WGMMA_D4
#undef OPF_WGMMA_D16
#undef OPF_WGMMA_D32
#undef OPF_WGMMA_D64
#undef OPF_WGMMA_D128

}  // namespace opforge::gemm::wgmma_detail
