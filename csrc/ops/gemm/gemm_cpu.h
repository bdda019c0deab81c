// The CPU GEMM's body, C[M, N] = A[M, K] @ B[K, N] (row-major, contiguous),
// written once and compiled once per instruction set: gemm.cpp includes this
// file inside a namespace per ISA (generic, avx2, avx512), each under its own
// `#pragma GCC target`, and picks one at run time. No include guard, on purpose.
//
// The including namespace provides:
//   Vec<T> (T = float, double): a SIMD register type V of W lanes with zero,
//     load, bcast, fma (a * b + c), add and store;
//   Blocking<T>: MR (rows of the register tile), NV (vectors per row: the tile
//     is MR x NR with NR = NV * W), MC, NC, KC (cache blocks, see gemm.cpp);
//   widen(src, dst, n) / narrow(src, dst, n): the storage dtype to the
//     accumulation type and back (round to nearest even), for every dtype.
// Every std and torch header this needs is included before the namespaces.
//
// The blocking is the GotoBLAS/BLIS scheme. C is cut into MC x NC tiles, one
// task each. Within a tile, for every KC-deep slice of K, the tile's slice of B
// (KC x NC, L2-resident) and of A (MC x KC) are copied into "packed" panels:
// B as NR-wide column panels, A as MR-tall row panels, each stored k-major, so
// the micro-kernel reads both with unit stride. The micro-kernel keeps an
// MR x NR block of C in registers over the whole slice: per k, NV vector loads
// of B, MR broadcasts of A and MR * NV FMAs. The tile accumulates in a
// separate buffer of the accumulation type (`ct`): half types are rounded once,
// at the end, and the buffer's padding to MR and NR absorbs every tail, so the
// micro-kernel has no edge cases (packed panels are zero past M and N).

template <typename T, int MR, int NV>
inline void micro_kernel(int64_t kc, const T* __restrict__ a, const T* __restrict__ b,
                         T* __restrict__ c, int64_t ldc, bool accumulate) {
  using Vt = Vec<T>;
  using V = typename Vt::V;
  constexpr int W = Vt::W;
  constexpr int NR = NV * W;
  V acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Vt::zero();
  for (int64_t k = 0; k < kc; ++k) {
    V bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = Vt::load(b + k * NR + j * W);
    for (int i = 0; i < MR; ++i) {
      const V av = Vt::bcast(a[k * MR + i]);
      for (int j = 0; j < NV; ++j) acc[i][j] = Vt::fma(av, bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      T* p = c + i * ldc + j * W;
      Vt::store(p, accumulate ? Vt::add(Vt::load(p), acc[i][j]) : acc[i][j]);
    }
  }
}

// Rows [0, mc) x columns [0, kc) of A (leading dimension lda) as MR-row panels:
// ap[p * kc * MR + k * MR + i] = A[p * MR + i, k], zero for rows past mc.
// `row` is kc elements of scratch for the widened row.
template <int MR, typename S, typename T>
void pack_a(const S* a, int64_t lda, int64_t mc, int64_t kc, T* ap, T* row) {
  for (int64_t p = 0; p * MR < mc; ++p) {
    T* dst = ap + p * kc * MR;
    for (int i = 0; i < MR; ++i) {
      const int64_t r = p * MR + i;
      if (r < mc) {
        widen(a + r * lda, row, kc);
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + i] = row[k];
      } else {
        for (int64_t k = 0; k < kc; ++k) dst[k * MR + i] = T(0);
      }
    }
  }
}

// Rows [0, kc) x columns [0, nc) of B (leading dimension ldb) as NR-column
// panels: bp[q * kc * NR + k * NR + j] = B[k, q * NR + j], zero past nc.
template <int NR, typename S, typename T>
void pack_b(const S* b, int64_t ldb, int64_t kc, int64_t nc, T* bp) {
  for (int64_t k = 0; k < kc; ++k) {
    const S* src = b + k * ldb;
    for (int64_t q = 0; q * NR < nc; ++q) {
      T* dst = bp + q * kc * NR + k * NR;
      const int64_t n = std::min<int64_t>(NR, nc - q * NR);
      widen(src + q * NR, dst, n);
      for (int64_t j = n; j < NR; ++j) dst[j] = T(0);
    }
  }
}

// C tiles [begin, end) of the grid of mc_blk x nc_blk tiles (row tiles
// fastest), each computed whole: every KC slice of K, then rounded once into C.
template <typename S>
void gemm_tiles(const S* a, const S* b, S* c, int64_t M, int64_t N, int64_t K, int64_t mc_blk,
                int64_t nc_blk, int64_t kc_blk, int64_t begin, int64_t end) {
  using T = typename Accumulate<S>::type;
  using Blk = Blocking<T>;
  constexpr int MR = Blk::MR;
  constexpr int NR = Blk::NV * Vec<T>::W;
  const int64_t kc_max = std::min(kc_blk, K);
  const int64_t mc_pad = round_up(mc_blk, MR);
  const int64_t nc_pad = round_up(nc_blk, NR);
  Buffer<T> ap(mc_pad * kc_max), bp(kc_max * nc_pad), ct(mc_pad * nc_pad), row(kc_max);
  const int64_t row_tiles = ceil_div(M, mc_blk);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t ic = (t % row_tiles) * mc_blk;
    const int64_t jc = (t / row_tiles) * nc_blk;
    const int64_t mc = std::min(mc_blk, M - ic);
    const int64_t nc = std::min(nc_blk, N - jc);
    const int64_t mcp = round_up(mc, MR);
    const int64_t ncp = round_up(nc, NR);
    for (int64_t pc = 0; pc < K; pc += kc_blk) {
      const int64_t kc = std::min(kc_blk, K - pc);
      pack_b<NR>(b + pc * N + jc, N, kc, nc, bp.get());
      pack_a<MR>(a + ic * K + pc, K, mc, kc, ap.get(), row.get());
      // A's MR x kc panel (a few KB) stays in L1 while the micro-kernel
      // sweeps the B panels, streamed from L2.
      for (int64_t ir = 0; ir < mcp; ir += MR) {
        for (int64_t jr = 0; jr < ncp; jr += NR) {
          micro_kernel<T, MR, Blk::NV>(kc, ap.get() + ir * kc, bp.get() + jr * kc,
                                       ct.get() + ir * ncp + jr, ncp, pc > 0);
        }
      }
    }
    for (int64_t i = 0; i < mc; ++i) narrow(ct.get() + i * ncp, c + (ic + i) * N + jc, nc);
  }
}

// The whole product on torch's parallel_for threads, one task per C tile.
template <typename S>
void gemm(const S* a, const S* b, S* c, int64_t M, int64_t N, int64_t K) {
  using T = typename Accumulate<S>::type;
  using Blk = Blocking<T>;
  constexpr int NR = Blk::NV * Vec<T>::W;
  const TileGrid g = tile_grid(M, N, K, Blk::MR, NR, Blk::MC, Blk::NC, Blk::KC);
  torch::stable::parallel_for(0, g.tiles, g.grain, [&](int64_t begin, int64_t end) {
    gemm_tiles<S>(a, b, c, M, N, K, g.mc, g.nc, g.kc, begin, end);
  });
}
