// Checking and tuning the W4A8 GEMM kernels (csrc/ops/qqq_gemm/qqq_*.cuh)
// without torch: every tile configuration below is first compared bit for bit
// with a CPU reference (the op's CPU kernel's arithmetic: exact int32 sums, the
// same float32 epilogue) on odd shapes, per channel and per group, with forced
// split counts; a bad group scale must give NaN. Then each is timed on the
// target shapes (K = N = 8192, 4096 x 11008, 11008 x 4096; M = 1 .. 128) against
// the weight-read floor (packed bytes at the measured device copy bandwidth).
//
//   nvcc -std=c++17 -O3 -Icsrc -gencode=arch=compute_90a,code=sm_90a \
//        benchmarks/qqq_tune.cu -o /tmp/qqq_tune && /tmp/qqq_tune [--MODE]
//   (or: bash benchmarks/gpu_run.sh tune qqq [--MODE])
//
// Times: CUDA events around the call alone (plan, counter memset and kernel),
// median of 25 calls after 3 warm-ups, the L2 flushed before each call by
// writing 256 MB ("dirty") or by reading 256 MB ("clean", as opforge bench
// does); the op's launcher is also timed without a flush. Prints "FAIL"
// lines and exits 1 on any mismatch. `--check-only`: the op configurations'
// checks alone; `--sanitize`: a few small ones (for compute-sanitizer).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

// The op's launcher in this translation unit: its configurations, its plan
// (qqq::dispatch, what qqq_gemm_cuda runs) and the kernel templates.
#include "ops/qqq_gemm/qqq_dispatch.cuh"
#include "tune_common.cuh"

using namespace opforge;
using namespace opforge::qqq;


static int g_failures = 0;
// --sanitize: a few small cases per configuration, for compute-sanitizer's slow tools.
static bool g_light = false;

struct Problem {
  int M, K, N, gs;  // gs = -1: per channel
  std::vector<int8_t> a, q, sg;
  std::vector<float> st, sc;
  std::vector<int32_t> packed;
};

// LAYOUT.md: word ((nb * KB + kb) * 32 + g * 4 + t) * 4 + j, nibble 2 i + h
// holds q[kb*32 + h*16 + t*4 + i][nb*32 + g*4 + j].
static std::vector<int32_t> pack(const std::vector<int8_t>& q, int K, int N) {
  std::vector<int32_t> w(static_cast<size_t>(K) * N / 8, 0);
  const int KB = K / 32;
  for (int nb = 0; nb < N / 32; ++nb)
    for (int kb = 0; kb < KB; ++kb)
      for (int g = 0; g < 8; ++g)
        for (int t = 0; t < 4; ++t)
          for (int j = 0; j < 4; ++j) {
            uint32_t word = 0;
            for (int i = 0; i < 4; ++i)
              for (int h = 0; h < 2; ++h) {
                const int k = kb * 32 + h * 16 + t * 4 + i, n = nb * 32 + g * 4 + j;
                word |= (static_cast<uint32_t>(q[static_cast<size_t>(k) * N + n]) & 0xFu) << (4 * (2 * i + h));
              }
            w[((static_cast<size_t>(nb) * KB + kb) * 32 + g * 4 + t) * 4 + j] = static_cast<int32_t>(word);
          }
  return w;
}

static Problem make_problem(int M, int K, int N, int gs, uint32_t seed, bool extremes = false) {
  std::mt19937 rng(seed);
  Problem p{M, K, N, gs, {}, {}, {}, {}, {}, {}};
  p.a.resize(static_cast<size_t>(M) * K);
  p.q.resize(static_cast<size_t>(K) * N);
  for (auto& v : p.a) v = extremes ? (rng() & 1 ? 127 : -128) : static_cast<int8_t>(static_cast<int>(rng() % 256) - 128);
  for (auto& v : p.q) v = extremes ? (rng() & 1 ? 7 : -8) : static_cast<int8_t>(static_cast<int>(rng() % 16) - 8);
  if (gs > 0) {
    p.sg.resize(static_cast<size_t>(K / gs) * N);
    for (auto& v : p.sg) v = extremes ? (rng() & 1 ? 16 : 1) : static_cast<int8_t>(1 + rng() % 16);
  }
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  p.st.resize(M);
  p.sc.resize(N);
  for (auto& v : p.st) v = u(rng) * 1e-3f;
  for (auto& v : p.sc) v = u(rng) * 1e-3f;
  p.packed = pack(p.q, K, N);
  return p;
}

// The op's CPU kernel, in float32 output.
static std::vector<float> reference(const Problem& p) {
  std::vector<float> out(static_cast<size_t>(p.M) * p.N);
  std::vector<int32_t> col(p.K);
  for (int n = 0; n < p.N; ++n) {
    for (int k = 0; k < p.K; ++k) {
      int v = p.q[static_cast<size_t>(k) * p.N + n];
      if (p.gs > 0) v *= p.sg[static_cast<size_t>(k / p.gs) * p.N + n];
      col[k] = v;
    }
    for (int m = 0; m < p.M; ++m) {
      int32_t acc = 0;
      const int8_t* row = p.a.data() + static_cast<size_t>(m) * p.K;
      for (int k = 0; k < p.K; ++k) acc += static_cast<int32_t>(row[k]) * col[k];
      out[static_cast<size_t>(m) * p.N + n] = (static_cast<float>(acc) * p.st[m]) * p.sc[n];
    }
  }
  return out;
}

struct Device {
  int8_t *a = nullptr, *sg = nullptr;
  int32_t* w = nullptr;
  float *st = nullptr, *sc = nullptr;
  void* out = nullptr;
  uint8_t* ws = nullptr;
  size_t ws_bytes = 0;
};

template <typename T>
static T* upload(const std::vector<T>& v) {
  if (v.empty()) return nullptr;
  T* d = nullptr;
  CHECK(cudaMalloc(&d, v.size() * sizeof(T)));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

static Device upload(const Problem& p, DType out_dtype) {
  Device d;
  d.a = upload(p.a);
  d.w = upload(p.packed);
  d.st = upload(p.st);
  d.sc = upload(p.sc);
  d.sg = upload(p.sg);
  const size_t esz = out_dtype == DType::Float32 ? 4 : 2;
  CHECK(cudaMalloc(&d.out, std::max<size_t>(1, static_cast<size_t>(p.M) * p.N * esz)));
  return d;
}

static void release(Device& d) {
  for (void* ptr : {static_cast<void*>(d.a), static_cast<void*>(d.sg), static_cast<void*>(d.w), static_cast<void*>(d.st),
                    static_cast<void*>(d.sc), d.out, static_cast<void*>(d.ws)})
    if (ptr) CHECK(cudaFree(ptr));
  d = Device{};
}

static QqqGemmArgs args_of(const Problem& p, Device& d, DType out_dtype) {
  return QqqGemmArgs{d.a, d.w, d.st, d.sc, d.sg, d.out, p.M, p.N, p.K, p.gs, out_dtype, d.ws};
}

template <class C>
static const char* run(const Problem& p, Device& d, DType dt, int force_splits, int sms, qqq::Plan* used = nullptr) {
  const qqq::Plan plan = qqq::make_plan<C>(p.M, p.N, p.K, sms, force_splits);
  if (used) *used = plan;
  if (static_cast<size_t>(plan.workspace_bytes()) > d.ws_bytes) {
    if (d.ws) CHECK(cudaFree(d.ws));
    d.ws_bytes = plan.workspace_bytes();
    CHECK(cudaMalloc(&d.ws, d.ws_bytes));
    CHECK(cudaMemset(d.ws, 0, d.ws_bytes));  // counters start at zero, as the launcher's memset leaves them
  }
  QqqGemmArgs args = args_of(p, d, dt);
  return p.gs > 0 ? qqq::launch<C, true>(args, plan, nullptr) : qqq::launch<C, false>(args, plan, nullptr);
}

template <class C>
static void check_config(const char* name, int sms) {
  struct Case {
    int M, K, N, gs;
    bool extremes;
  };
  const Case cases[] = {
      {1, 32, 32, -1, false},   {7, 96, 96, 32, false},     {16, 256, 160, 128, false}, {33, 4096, 128, 128, false},
      {100, 384, 288, 64, false}, {128, 1024, 256, -1, false}, {200, 512, 96, 128, false}, {5, 11008, 64, 128, false},
      {3, 1024, 96, -1, true},  {64, 1024, 64, 128, true},   {17, 0, 64, -1, false},      {129, 2048, 416, 128, false},
      {24, 1024, 192, 256, false}, {20, 768, 128, 64, true},
  };
  int n_ok = 0, n_runs = 0;
  int index = -1;
  for (const Case& c : cases) {
    ++index;
    // Two per-channel cases among them: the direct kernel has its own code for each scheme.
    if (g_light && index != 0 && index != 1 && index != 2 && index != 5 && index != 9) continue;
    const Problem p = make_problem(c.M, c.K, c.N, c.gs, 1234u + c.M * 7 + c.K + c.N, c.extremes);
    const std::vector<float> ref = reference(p);
    for (DType dt : {DType::Float32, DType::Float16}) {
      if (g_light && dt == DType::Float16) continue;
      Device d = upload(p, dt);
      for (int force : {0, 1, 3}) {
        ++n_runs;
        qqq::Plan plan;
        CHECK(cudaMemset(d.out, 0xFF, static_cast<size_t>(p.M) * p.N * (dt == DType::Float32 ? 4 : 2)));  // NaN poison
        const char* err = run<C>(p, d, dt, force, sms, &plan);
        CHECK(cudaDeviceSynchronize());
        if (err) {
          std::printf("FAIL %s M=%d K=%d N=%d gs=%d: launch error %s\n", name, c.M, c.K, c.N, c.gs, err);
          ++g_failures;
          continue;
        }
        size_t bad = 0, first = 0;
        float got_first = 0, want_first = 0;
        if (dt == DType::Float32) {
          std::vector<float> got(ref.size());
          CHECK(cudaMemcpy(got.data(), d.out, got.size() * 4, cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < got.size(); ++i)
            if (std::memcmp(&got[i], &ref[i], 4) != 0 && bad++ == 0) first = i, got_first = got[i], want_first = ref[i];
        } else {
          std::vector<__half> got(ref.size());
          CHECK(cudaMemcpy(got.data(), d.out, got.size() * 2, cudaMemcpyDeviceToHost));
          for (size_t i = 0; i < got.size(); ++i) {
            const __half want = __float2half_rn(ref[i]);
            if (std::memcmp(&got[i], &want, 2) != 0 && bad++ == 0)
              first = i, got_first = __half2float(got[i]), want_first = __half2float(want);
          }
        }
        if (bad) {
          std::printf("FAIL %s M=%d K=%d N=%d gs=%d %s splits=%d: %zu/%zu differ, first [%zu, %zu] got %g want %g\n", name, c.M,
                      c.K, c.N, c.gs, dt == DType::Float32 ? "f32" : "f16", plan.splits, bad, ref.size(), first / p.N, first % p.N,
                      got_first, want_first);
          ++g_failures;
        } else {
          ++n_ok;
        }
      }
      release(d);
    }
  }
  // A group scale outside [1, 16]: NaN in its tile, never a plausible number.
  {
    Problem p = make_problem(16, 256, 64, 128, 99u);
    p.sg[1 * 64 + 5] = 17;
    Device d = upload(p, DType::Float32);
    for (int force : {1, 2}) {
      const char* err = run<C>(p, d, DType::Float32, force, sms);
      CHECK(cudaDeviceSynchronize());
      std::vector<float> got(static_cast<size_t>(p.M) * p.N);
      CHECK(cudaMemcpy(got.data(), d.out, got.size() * 4, cudaMemcpyDeviceToHost));
      const bool nan_there = std::isnan(got[5]) && std::isnan(got[static_cast<size_t>(15) * 64 + 5]);
      ++n_runs;
      if (err || !nan_there) {
        std::printf("FAIL %s: group scale 17 did not give NaN (splits %d)\n", name, force);
        ++g_failures;
      } else {
        ++n_ok;
      }
    }
    release(d);
  }
  std::printf("check %-28s %d/%d runs bit-exact (f32 and f16 outputs, splits auto/1/3, NaN on a bad group scale)\n", name, n_ok, n_runs);
}

// The op's launcher itself (configuration and splits chosen per call) on the same cases.
static void check_op_launcher(int sms) {
  (void)sms;
  const int cases[][4] = {{1, 8192, 256, -1}, {5, 2048, 8192, -1}, {16, 4096, 4096, -1}, {16, 4096, 1024, 128}, {33, 11008, 128, 128}, {59, 256, 1024, -1},
                          {64, 1024, 512, 128}, {64, 1024, 512, -1}, {128, 1024, 4096, 128}, {200, 512, 96, -1}, {7, 0, 64, -1},
                          {9, 512, 256, 64}, {20, 1024, 256, 64}, {40, 2048, 384, 256}, {3, 2048, 640, 128},
                          {97, 1024, 640, -1}, {128, 2048, 384, -1}, {100, 512, 256, 64},
                          {48, 2048, 384, -1}};
  int ok = 0, runs = 0;
  for (const auto& c : cases) {
    if (g_light && c[0] * static_cast<int64_t>(c[1]) * c[2] > (int64_t{1} << 24)) continue;
    const Problem p = make_problem(c[0], c[1], c[2], c[3], 77u + c[0] + c[1]);
    const std::vector<float> ref = reference(p);
    Device d = upload(p, DType::Float32);
    d.ws_bytes = static_cast<size_t>(qqq::workspace_bytes(p.M, p.N, p.K, p.gs));
    if (d.ws_bytes) CHECK(cudaMalloc(&d.ws, d.ws_bytes));
    for (int rep = 0; rep < 2; ++rep) {  // twice: the counters must be left as found
      ++runs;
      CHECK(cudaMemset(d.out, 0xFF, static_cast<size_t>(p.M) * p.N * 4));
      const char* err = qqq::dispatch(args_of(p, d, DType::Float32), nullptr);
      CHECK(cudaDeviceSynchronize());
      std::vector<float> got(ref.size());
      CHECK(cudaMemcpy(got.data(), d.out, got.size() * 4, cudaMemcpyDeviceToHost));
      const bool same = !err && std::memcmp(got.data(), ref.data(), got.size() * 4) == 0;
      if (!same) {
        std::printf("FAIL op launcher M=%d K=%d N=%d gs=%d: %s\n", p.M, p.K, p.N, p.gs, err ? err : "differs");
        ++g_failures;
      } else {
        ++ok;
      }
    }
    release(d);
  }
  std::printf("check %-28s %d/%d runs bit-exact\n", "op launcher (qqq::dispatch)", ok, runs);
}

// --- timing ---

static uint8_t* g_flush = nullptr;
static uint32_t* g_sink = nullptr;
constexpr size_t kFlushBytes = 256u << 20;


static int g_sms = 0;
static void launch_stream_read(const void* p, size_t bytes) {
  read_all<<<g_sms * 4, 512>>>(static_cast<const uint4*>(p), bytes / 16, 0x1E3779B9u, g_sink);
}

// Flush modes: "dirty" writes 256 MB (opforge bench's zero_(): the L2 is left
// full of dirty lines that the timed kernel's reads must write back),
// "clean" reads 256 MB (the L2 left full of clean lines), "none" (the
// weights partly in L2 from the previous call).
enum class Flush { Dirty, Clean, None };

template <typename F>
static float median_us(F launch, Flush flush = Flush::Dirty, int reps = 25) {
  EventTimer timer;
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    if (flush == Flush::Dirty) CHECK(cudaMemsetAsync(g_flush, i & 0xFF, kFlushBytes));
    if (flush == Flush::Clean) launch_stream_read(g_flush, kFlushBytes);
    ts.push_back(timer.us(launch));
  }
  return median_of(ts);
}

static double g_copy_gbps = 0;

// The timed problems share one weight per (K, N, scheme) and one activation
// per M, made once on the host and uploaded (K = N = 8192 is 67M weights).
struct Timed {
  Problem p;  // sizes only
  Device d;
};

static Timed make_timed(int M, int K, int N, int gs, const Device& weights) {
  Timed t;
  t.p.M = M, t.p.K = K, t.p.N = N, t.p.gs = gs;
  std::mt19937 rng(11u + M);
  std::vector<int8_t> a(static_cast<size_t>(M) * K);
  for (auto& v : a) v = static_cast<int8_t>(static_cast<int>(rng() % 255) - 127);
  std::vector<float> st(M, 1e-3f);
  t.d = weights;
  t.d.a = upload(a);
  t.d.st = upload(st);
  CHECK(cudaMalloc(&t.d.out, static_cast<size_t>(M) * N * 2));
  t.d.ws = nullptr;
  t.d.ws_bytes = 0;
  return t;
}

static void release_timed(Timed& t) {
  for (void* ptr : {static_cast<void*>(t.d.a), static_cast<void*>(t.d.st), t.d.out, static_cast<void*>(t.d.ws)})
    if (ptr) CHECK(cudaFree(ptr));
}

static Device make_weights(int K, int N, int gs) {
  uint32_t x = 2463534242u;  // xorshift32: 67M draws in well under a second
  auto next = [&] { return x ^= x << 13, x ^= x >> 17, x ^= x << 5; };
  std::vector<int8_t> q(static_cast<size_t>(K) * N);
  for (auto& v : q) v = static_cast<int8_t>(static_cast<int>(next() % 16) - 8);
  Device d;
  d.w = upload(pack(q, K, N));
  std::vector<float> sc(N, 1e-3f);
  d.sc = upload(sc);
  if (gs > 0) {
    std::vector<int8_t> sg(static_cast<size_t>(K / gs) * N);
    for (auto& v : sg) v = static_cast<int8_t>(1 + next() % 16);
    d.sg = upload(sg);
  }
  return d;
}

static double floor_us(const Problem& p) { return (static_cast<double>(p.K) * p.N / 2) / (g_copy_gbps * 1e3); }

template <class C>
static void time_config(const char* name, Timed& t, int sms, const std::vector<int>& forced, Flush flush = Flush::Dirty) {
  const Problem& p = t.p;
  for (int force : forced) {
    qqq::Plan plan;
    const char* err = run<C>(p, t.d, DType::Float16, force, sms, &plan);
    CHECK(cudaDeviceSynchronize());
    if (err) {
      std::printf("FAIL time %s: %s\n", name, err);
      ++g_failures;
      continue;
    }
    const float us = median_us([&] { run<C>(p, t.d, DType::Float16, force, sms); }, flush);
    std::printf("time K=%5d N=%5d M=%3d %-9s %-18s splits=%2d ctas=%5d %8.2f us %5.1f%% of weight floor\n", p.K, p.N, p.M,
                p.gs > 0 ? "group128" : "channel", name, plan.splits, plan.tiles_m * plan.tiles_n * plan.splits, us,
                100.0 * floor_us(p) / us);
  }
}

// The op's own launcher under each flush, against reading the packed weights alone.
static void time_op(Timed& t, float read_dirty, float read_clean) {
  const Problem& p = t.p;
  if (t.d.ws) CHECK(cudaFree(t.d.ws));
  t.d.ws = nullptr;
  t.d.ws_bytes = static_cast<size_t>(qqq::workspace_bytes(p.M, p.N, p.K, p.gs));
  if (t.d.ws_bytes) CHECK(cudaMalloc(&t.d.ws, t.d.ws_bytes));
  const QqqGemmArgs args = args_of(p, t.d, DType::Float16);
  float us[3];
  for (Flush f : {Flush::Dirty, Flush::Clean, Flush::None})
    us[static_cast<int>(f)] = median_us([&] { qqq::dispatch(args, nullptr); }, f);
  std::printf("op   K=%5d N=%5d M=%3d %-9s dirty %7.2f us (%4.1f%% of floor, read-only %6.2f)  clean %7.2f us (%4.1f%%, "
              "read-only %6.2f)  no flush %7.2f us\n",
              p.K, p.N, p.M, p.gs > 0 ? "group128" : "channel", us[0], 100 * floor_us(p) / us[0], read_dirty, us[1],
              100 * floor_us(p) / us[1], read_clean, us[2]);
}

// Informational variants (not the op's): <MBW, WM, WN, WK, UK, STAGES, MINB>
using S_64x256 = Config<1, 1, 2, 4, 2, 4>;
using S_64x512_3st = Config<1, 1, 2, 4, 4, 3>;
using S_32x1024 = Config<1, 1, 1, 8, 4, 4>;
using M32_64x512 = Config<2, 1, 2, 4, 4, 4>;
using L_128x128_2cta = Config<4, 2, 4, 1, 4, 3, 2>;
using L_64x128 = Config<2, 2, 4, 1, 4, 4>;
// Deeper pipelines for small M (--small): more weight bytes in flight per SM.
using N_6st = Config<1, 1, 2, 4, 4, 6, 1>;
using N_8st = Config<1, 1, 2, 4, 4, 8, 1>;
using W_8st = Config<1, 1, 4, 2, 4, 8, 1>;
using S_32x512_6st = Config<1, 1, 1, 8, 2, 6, 1>;

// Weights straight into registers (qqq_direct_kernel), --direct:
// <MBW, 1, WN, WK, 4, units ahead, MINB, true>.
using D_2x4_12 = Config<1, 1, 2, 4, 4, 12, 1, true>;
using D_4x2_8 = Config<1, 1, 4, 2, 4, 8, 1, true>;

// The warp-specialised wgmma kernel (qqq_ws.cuh, sm_90a), --ws:
// <BM, consumer warpgroups, stages, fragment sets, MINB>.
using WS128x2 = WsConfig<128, 2, 4, 2>;
using WS128x2f4 = WsConfig<128, 2, 4, 4>;
using WS128x1 = WsConfig<128, 1, 6, 2>;
using WS64x2 = WsConfig<64, 2, 6, 2>;
using WS64x1 = WsConfig<64, 1, 6, 2>;
using WS64x1b2 = WsConfig<64, 1, 4, 2, 2>;
using WS32x2 = WsConfig<32, 2, 6, 2>;
using WS32x1 = WsConfig<32, 1, 8, 2>;
using WS32x2f4 = WsConfig<32, 2, 6, 4>;
using WS64x1b2f4 = WsConfig<64, 1, 4, 4, 2>;
// Probes (wrong results, timed only): no conversion; no wgmma.
using WS128x1_noconv = WsConfig<128, 1, 6, 2, 1, false, 1>;
using WS128x1_nomma = WsConfig<128, 1, 6, 2, 1, false, 2>;
using WS128x1_s4 = WsConfig<128, 1, 4, 2>;
using WS128x1_s8 = WsConfig<128, 1, 8, 2>;
using WS32x1_noconv = WsConfig<32, 1, 8, 2, 1, false, 1>;
using WS32x1_nomma = WsConfig<32, 1, 8, 2, 1, false, 2>;
// The weights by one TMA box per slot (WTMA), and the op's candidates.
using WS32x1b2 = WsConfig<32, 1, 8, 2, 2>;
using WS32x1t_nomma = WsConfig<32, 1, 8, 2, 1, true, 2>;
// Group scales folded into per-slot partial sums (FOLD sets) instead of
// applied in the conversion: the op's M <= 32 and M <= 64 shapes, and deeper.
// (The op's Ws32Group and Ws64, 2 CTAs per SM.) Ws32's one CTA per SM, folded.
using WS32fold_b1 = WsConfig<32, 1, 8, 2, 1, true, 0, true>;
// --m128: 64-row tiles at three CTAs per SM (--m128 reads ptxas's verdict
// from the timings: a spill would show).
using WS64b3 = WsConfig<64, 1, 4, 2, 3, true, 0, true>;

// The three target shapes, each scheme: per_weights(weights, K, N, gs,
// read-only time under the reading flush), then per_m(problem, read-only
// time) for each M.
template <typename W, typename F>
static void for_small_cases(std::initializer_list<int> Ms, W&& per_weights, F&& per_m) {
  const int shapes[3][2] = {{8192, 8192}, {4096, 11008}, {11008, 4096}};
  for (const auto& s : shapes) {
    const int K = s[0], N = s[1];
    for (int gs : {-1, 128}) {
      Device weights = make_weights(K, N, gs);
      const float read_clean =
          median_us([&] { launch_stream_read(weights.w, static_cast<size_t>(K) * N / 2); }, Flush::Clean);
      per_weights(weights, K, N, read_clean);
      for (int M : Ms) {
        Timed t = make_timed(M, K, N, gs, weights);
        std::printf("small K=%5d N=%5d M=%3d %-9s read-only %6.2f us\n", K, N, M, gs > 0 ? "group128" : "channel", read_clean);
        per_m(t, read_clean);
        release_timed(t);
      }
      release(weights);  // the weights-only Device: w, sc, sg
    }
  }
}

static void direct_m(int sms) {
  check_config<D_2x4_12>("D_2x4_12", sms);
  check_config<D_4x2_8>("D_4x2_8", sms);
  if (g_failures) return;
  for_small_cases(
      {1, 8, 16},
      [](const Device& weights, int K, int N, float read_clean) {
        // What a split's counter memset adds in front of a kernel.
        const float memset_read = median_us(
            [&] {
              CHECK(cudaMemsetAsync(g_flush, 0, 1024));
              launch_stream_read(weights.w, static_cast<size_t>(K) * N / 2);
            },
            Flush::Clean);
        std::printf("memset K=%5d N=%5d read-only %6.2f us, after a 1 KB memset %6.2f us\n", K, N, read_clean, memset_read);
      },
      [&](Timed& t, float read_clean) {
        const std::vector<int> autos = {0}, some = {0, 1, 2};
        time_config<Narrow>("Narrow", t, sms, autos, Flush::Clean);
        time_config<Wide>("Wide", t, sms, autos, Flush::Clean);
        time_config<DirectPair>("DirectPair", t, sms, some, Flush::Clean);
        time_config<DirectStripe>("DirectStripe", t, sms, some, Flush::Clean);
        time_config<D_2x4_12>("D_2x4_12", t, sms, autos, Flush::Clean);
        time_config<D_4x2_8>("D_4x2_8", t, sms, some, Flush::Clean);
        time_op(t, 0, read_clean);
      });
}

// `reps` calls of configuration C (forced splits), each after the reading
// flush, then a synchronisation: what ncu profiles.
template <class C>
static void flushed_calls(const Device& weights, int M, int K, int N, int gs, int splits, int sms, int reps) {
  Timed t = make_timed(M, K, N, gs, weights);
  for (int rep = 0; rep < reps; ++rep) {
    launch_stream_read(weights.w, static_cast<size_t>(K) * N / 2);
    run<C>(t.p, t.d, DType::Float16, splits, sms);
  }
  CHECK(cudaDeviceSynchronize());
  release_timed(t);
}

// --ws-probe: what bounds the wgmma kernel (per channel, K = N = 8192).
static void ws_probe(int sms) {
  Device weights = make_weights(8192, 8192, -1);
  for (int M : {32, 128}) {
    Timed t = make_timed(M, 8192, 8192, -1, weights);
    const std::vector<int> s2 = {2, 4};
    if (M == 128) {
      time_config<WS128x1>("WS128x1", t, sms, s2, Flush::Clean);
      time_config<WS128x1_noconv>("WS128x1_noconv", t, sms, s2, Flush::Clean);
      time_config<WS128x1_nomma>("WS128x1_nomma", t, sms, s2, Flush::Clean);
      time_config<WS128x1_s4>("WS128x1_s4", t, sms, s2, Flush::Clean);
      time_config<WS128x1_s8>("WS128x1_s8", t, sms, s2, Flush::Clean);
    } else {
      time_config<WS32x1>("WS32x1", t, sms, s2, Flush::Clean);
      time_config<WS32x1_noconv>("WS32x1_noconv", t, sms, s2, Flush::Clean);
      time_config<WS32x1_nomma>("WS32x1_nomma", t, sms, s2, Flush::Clean);
    }
    release_timed(t);
  }
  release(weights);  // the weights-only Device: w, sc, sg
}

// --ws-probe under QQQ_NCU_ONLY (experiments/qqq_ncu.sh probe's ncu step, -c 2): the
// two calls ncu profiles, and nothing before them.
static void ws_probe_ncu(int sms) {
  Device weights = make_weights(8192, 8192, -1);
  flushed_calls<WS32x1>(weights, 32, 8192, 8192, -1, 4, sms, 1);
  flushed_calls<WS128x1>(weights, 128, 8192, 8192, -1, 2, sms, 1);
  release(weights);  // the weights-only Device: w, sc, sg
}

static void ws_m(int sms) {
  check_config<WS32x1>("WS32x1", sms);
  check_config<WS32x1b2>("WS32x1b2", sms);
  check_config<WS64x1b2>("WS64x1b2", sms);
  check_config<WS128x1>("WS128x1", sms);
  check_config<WS128x2>("WS128x2", sms);
  if (g_failures) return;
  for_small_cases(
      {32, 64, 128}, [](const Device&, int, int, float) {},
      [&](Timed& t, float read_clean) {
        const std::vector<int> autos = {0}, some = {0, 2, 4}, more = {0, 1, 2, 4};
        const int M = t.p.M;
        time_op(t, 0, read_clean);
        if (M <= 32) {
          time_config<WS32x1>("WS32x1", t, sms, some, Flush::Clean);
          time_config<Ws32>("Ws32 (op)", t, sms, some, Flush::Clean);
          time_config<WS32x1b2>("WS32x1b2", t, sms, autos, Flush::Clean);
          time_config<Ws32Group>("Ws32Group (op)", t, sms, autos, Flush::Clean);
          if (t.p.gs < 0) time_config<WS32x1t_nomma>("WS32x1t_nomma", t, sms, {4}, Flush::Clean);
        } else if (M <= 64) {
          time_config<WS64x1b2>("WS64x1b2", t, sms, some, Flush::Clean);
          time_config<Ws64>("Ws64 (op)", t, sms, some, Flush::Clean);
        } else {
          time_config<WS128x1>("WS128x1", t, sms, more, Flush::Clean);
          time_config<Ws128>("Ws128 (op)", t, sms, more, Flush::Clean);
          time_config<WS128x2>("WS128x2", t, sms, autos, Flush::Clean);
          time_config<Ws128Group>("Ws128Group (op)", t, sms, autos, Flush::Clean);
        }
      });
}

// --fold: the group scales folded per slot (per group 128) at M = 1 .. 128
// beside the op's choice, the staged tiles and the in-conversion scales; the
// wgmma kernel per channel at M <= 16 (the direct kernel's range). Its first
// run also timed two sets of partial sums (WsConfig's FOLD was a count then;
// benchmarks/qqq_notes.md), since removed.
static void fold_m(int sms) {
  check_config<WS32fold_b1>("WS32fold_b1", sms);
  if (g_failures) return;
  for_small_cases(
      {1, 4, 8, 16, 32, 64, 128}, [](const Device&, int, int, float) {},
      [&](Timed& t, float read_clean) {
        const std::vector<int> autos = {0}, some = {0, 2, 4};
        const int M = t.p.M;
        time_op(t, 0, read_clean);
        if (t.p.gs < 0) {
          if (M <= 16) time_config<Ws32>("Ws32 (op, M<=32)", t, sms, some, Flush::Clean);
          return;
        }
        if (M == 4 || M == 8) return;
        if (M <= 16) {
          time_config<Narrow>("Narrow", t, sms, autos, Flush::Clean);
          time_config<Wide>("Wide", t, sms, autos, Flush::Clean);
        }
        if (M <= 32) {
          time_config<Ws32Group>("Ws32Group (op)", t, sms, some, Flush::Clean);
          time_config<WS32fold_b1>("WS32fold_b1", t, sms, some, Flush::Clean);
        } else if (M <= 64) {
          time_config<Ws64>("Ws64 (op)", t, sms, some, Flush::Clean);
        } else {
          time_config<Ws64>("Ws64 (op, M<=128)", t, sms, some, Flush::Clean);
          time_config<Ws128Group>("Ws128Group", t, sms, autos, Flush::Clean);
        }
      });
}

// --m128: per channel at M = 80 and 128, the op's 128-row tiles against
// 64-row tiles (Ws64, two CTAs per SM; WS64b3, three) with forced splits:
// at 4096 x 11008 the 86 column tiles of Ws128 fill 86 of 132 SMs.
static void m128(int sms) {
  check_config<WS64b3>("WS64b3", sms);
  if (g_failures) return;
  for_small_cases(
      {80, 128}, [](const Device&, int, int, float) {},
      [&](Timed& t, float read_clean) {
        if (t.p.gs > 0) return;
        time_op(t, 0, read_clean);
        time_config<Ws128>("Ws128 (op)", t, sms, {0, 1, 2, 4}, Flush::Clean);
        time_config<Ws64>("Ws64", t, sms, {0, 1, 2, 3, 4}, Flush::Clean);
        time_config<WS64b3>("WS64b3", t, sms, {0, 1, 2, 3}, Flush::Clean);
      });
}

// --rows32: at M = 64 and 128, both schemes, the 32-row tiles (Ws32 at one
// CTA per SM, Ws32Group's shape at two) against Ws64 and the op's choice:
// smaller tiles, more CTAs. (results/qqq-rows32_nvidia-h200_2026-11-23.txt
// was run as --m128 with QQQ_M128_ROWS32 set, the same cases.)
static void rows32(int sms) {
  for_small_cases(
      {64, 128}, [](const Device&, int, int, float) {},
      [&](Timed& t, float read_clean) {
        const std::vector<int> autos = {0}, some = {0, 1, 2};
        time_op(t, 0, read_clean);
        time_config<Ws64>("Ws64", t, sms, autos, Flush::Clean);
        if (t.p.gs < 0) time_config<Ws32>("Ws32", t, sms, some, Flush::Clean);
        time_config<Ws32Group>("Ws32Group", t, sms, some, Flush::Clean);
      });
}

// The direct shapes at two CTAs per SM (<= 128 registers): the fold's
// partial sums take the op's shapes past 128 registers, one CTA per SM.
using DStripe2 = Config<1, 1, 1, 8, 4, 8, 2, true, true>;
using DPair2 = Config<1, 1, 2, 4, 4, 8, 2, true, true>;

// --dfold: per group 128 at M <= 16, the direct kernel with the group scales
// folded per block of 4 units against the wgmma kernel's fold (Ws32Group) and
// the direct kernel per channel.
static void dfold(int sms) {
  check_config<DStripe2>("DStripe2", sms);
  check_config<DPair2>("DPair2", sms);
  if (g_failures) return;
  for_small_cases(
      {1, 4, 8, 16}, [](const Device&, int, int, float) {},
      [&](Timed& t, float read_clean) {
        time_op(t, 0, read_clean);
        const std::vector<int> autos = {0};
        time_config<DirectStripe>("DirectStripe", t, sms, autos, Flush::Clean);
        time_config<DirectPair>("DirectPair", t, sms, autos, Flush::Clean);
        time_config<DStripe2>("DStripe2", t, sms, autos, Flush::Clean);
        time_config<DPair2>("DPair2", t, sms, autos, Flush::Clean);
        if (t.p.gs > 0) time_config<Ws32Group>("Ws32Group", t, sms, autos, Flush::Clean);
      });
}

// --ncu: one call each (after a warm-up) of the read-only kernel and the M = 1
// kernels at K = N = 8192, for ncu's kernel-only durations.
static void ncu_m1(int sms) {
  for (int gs : {-1, 128}) {
    Device weights = make_weights(8192, 8192, gs);
    Timed t = make_timed(1, 8192, 8192, gs, weights);
    for (int rep = 0; rep < 2; ++rep) {
      launch_stream_read(weights.w, size_t{8192} * 8192 / 2);
      run<Narrow>(t.p, t.d, DType::Float16, 0, sms);
      run<DirectPair>(t.p, t.d, DType::Float16, 0, sms);
    }
    CHECK(cudaDeviceSynchronize());
    release_timed(t);
  }
}

// --ncu-ws: one call each (after a warm-up) of the wgmma kernel at K = N =
// 8192: WS128x1 at M = 128 per channel and per group, WS32x2 at M = 32.
static void ncu_ws(int sms) {
  for (int gs : {-1, 128}) {
    Device weights = make_weights(8192, 8192, gs);
    flushed_calls<WS128x1>(weights, 128, 8192, 8192, gs, 2, sms, 2);
    if (gs < 0) flushed_calls<WS32x2>(weights, 32, 8192, 8192, gs, 4, sms, 2);
    release(weights);  // the weights-only Device: w, sc, sg
  }
}

// --small: the M <= 16 variants under the clean (reading) flush that opforge
// bench uses, beside the read-only floor of the same bytes.
static void small_m(int sms) {
  check_config<N_8st>("N_8st", sms);
  check_config<W_8st>("W_8st", sms);
  check_config<S_32x512_6st>("S_32x512_6st", sms);
  for_small_cases(
      {1, 16}, [](const Device&, int, int, float) {},
      [&](Timed& t, float) {
        const std::vector<int> autos = {0}, some = {0, 1, 2};
        time_config<Narrow>("Narrow", t, sms, autos, Flush::Clean);
        time_config<Wide>("Wide", t, sms, autos, Flush::Clean);
        time_config<N_6st>("N_6st", t, sms, some, Flush::Clean);
        time_config<N_8st>("N_8st", t, sms, some, Flush::Clean);
        time_config<W_8st>("W_8st", t, sms, some, Flush::Clean);
        time_config<S_32x512_6st>("S_32x512_6st", t, sms, some, Flush::Clean);
      });
}

int main(int argc, char** argv) {
  g_light = argc > 1 && std::strcmp(argv[1], "--sanitize") == 0;
  const bool check_only = g_light || (argc > 1 && std::strcmp(argv[1], "--check-only") == 0);
  const bool small = argc > 1 && std::strcmp(argv[1], "--small") == 0;
  const bool direct = argc > 1 && std::strcmp(argv[1], "--direct") == 0;
  const bool ws = argc > 1 && std::strcmp(argv[1], "--ws") == 0;
  const bool fold = argc > 1 && std::strcmp(argv[1], "--fold") == 0;
  const bool m128_mode = argc > 1 && std::strcmp(argv[1], "--m128") == 0;
  const bool rows32_mode = argc > 1 && std::strcmp(argv[1], "--rows32") == 0;
  const bool dfold_mode = argc > 1 && std::strcmp(argv[1], "--dfold") == 0;
  const bool ws_probe_mode = argc > 1 && std::strcmp(argv[1], "--ws-probe") == 0;
  const bool ncu_probe = ws_probe_mode && std::getenv("QQQ_NCU_ONLY") != nullptr;
  if (argc > 1 && (std::strcmp(argv[1], "--ncu") == 0 || std::strcmp(argv[1], "--ncu-ws") == 0 || ncu_probe)) {
    int dev = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, dev));
    CHECK(cudaMalloc(&g_sink, 4));
    if (std::strcmp(argv[1], "--ncu") == 0) ncu_m1(g_sms);
    else if (ncu_probe) ws_probe_ncu(g_sms);
    else ncu_ws(g_sms);
    return 0;
  }
  int dev = 0;
  CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  const int sms = g_sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);

  check_config<Narrow>("Narrow (op, M<=16)", sms);
  check_config<Wide>("Wide (op, M<=16)", sms);
  check_config<DirectStripe>("DirectStripe (op, M<=16)", sms);
  check_config<DirectPair>("DirectPair (op, M<=16)", sms);
  check_config<M32>("M32 (op)", sms);
  check_config<M64Channel>("M64Channel (op)", sms);
  check_config<M64Group>("M64Group (op)", sms);
  check_config<Large>("Large (op, M>64)", sms);
  // The wgmma kernel's configurations (sm_90a; the launcher takes them at M > 16 there).
  check_config<Ws32>("Ws32 (op, M<=32)", sms);
  check_config<Ws32Group>("Ws32Group (op, M<=64)", sms);
  check_config<Ws64>("Ws64 (op, M<=128)", sms);
  check_config<Ws128>("Ws128 (op, M>128)", sms);
  check_config<Ws128Group>("Ws128Group (op, M>64)", sms);
  check_op_launcher(sms);
  if (check_only || g_failures) {
    std::printf(g_failures ? "%d FAILURES in the checks\n" : "all checks passed\n", g_failures);
    return g_failures ? 1 : 0;
  }
  CHECK(cudaMalloc(&g_flush, kFlushBytes));
  CHECK(cudaMemset(g_flush, 1, kFlushBytes));
  CHECK(cudaMalloc(&g_sink, 4));
  if (small || direct || ws || ws_probe_mode || fold || m128_mode || rows32_mode || dfold_mode) {
    g_copy_gbps = 4200;  // the floor column only; measured below in the full run
    if (small) small_m(sms);
    if (direct) direct_m(sms);
    if (ws) ws_m(sms);
    if (fold) fold_m(sms);
    if (m128_mode) m128(sms);
    if (rows32_mode) rows32(sms);
    if (dfold_mode) dfold(sms);
    if (ws_probe_mode) ws_probe(sms);
    std::printf(g_failures ? "%d FAILURES\n" : "all checks passed\n", g_failures);
    return g_failures ? 1 : 0;
  }
  check_config<S_32x1024>("S_32x1024", sms);
  check_config<L_128x128_2cta>("L_128x128_2cta", sms);

  {
    const size_t bytes = size_t{1} << 30;
    void *src, *dst;
    CHECK(cudaMalloc(&src, bytes));
    CHECK(cudaMalloc(&dst, bytes));
    CHECK(cudaMemset(src, 1, bytes));
    const float us = median_us([&] { CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, Flush::Dirty, 10);
    g_copy_gbps = 2.0 * bytes / (us * 1e3);
    const float read_us = median_us([&] { launch_stream_read(src, bytes); }, Flush::Clean, 10);
    std::printf("device copy: %.0f GB/s (bytes read + written); streaming read of 1 GiB: %.0f GB/s\n", g_copy_gbps,
                bytes / (read_us * 1e3));
    CHECK(cudaFree(src));
    CHECK(cudaFree(dst));
  }

  const int shapes[3][2] = {{8192, 8192}, {4096, 11008}, {11008, 4096}};
  for (const auto& s : shapes) {
    const int K = s[0], N = s[1];
    for (int gs : {-1, 128}) {
      Device weights = make_weights(K, N, gs);
      const size_t wbytes = static_cast<size_t>(K) * N / 2;
      const float read_dirty = median_us([&] { launch_stream_read(weights.w, wbytes); }, Flush::Dirty);
      const float read_clean = median_us([&] { launch_stream_read(weights.w, wbytes); }, Flush::Clean);
      for (int M : {1, 16, 32, 64, 128}) {
        Timed t = make_timed(M, K, N, gs, weights);
        time_op(t, read_dirty, read_clean);
        release_timed(t);
      }
      const std::vector<int> autos = {0};
      for (int M : {1, 16}) {
        Timed t = make_timed(M, K, N, gs, weights);
        time_config<Narrow>("Narrow", t, sms, autos);
        time_config<Wide>("Wide", t, sms, {0, 1});
        time_config<S_64x256>("S_64x256", t, sms, autos);
        time_config<S_64x512_3st>("S_64x512_3st", t, sms, autos);
        time_config<S_32x1024>("S_32x1024", t, sms, autos);
        release_timed(t);
      }
      {
        Timed t = make_timed(32, K, N, gs, weights);
        time_config<M32>("M32", t, sms, autos);
        time_config<M32_64x512>("M32_64x512", t, sms, autos);
        release_timed(t);
      }
      {
        Timed t = make_timed(64, K, N, gs, weights);
        time_config<M64Channel>("M64Channel", t, sms, autos);
        time_config<M64Group>("M64Group", t, sms, autos);
        time_config<L_64x128>("L_64x128", t, sms, autos);
        release_timed(t);
      }
      {
        Timed t = make_timed(128, K, N, gs, weights);
        time_config<Large>("Large", t, sms, autos);
        time_config<L_128x128_2cta>("L_128x128_2cta", t, sms, autos);
        time_config<M64Channel>("M64Channel(M128)", t, sms, autos);
        release_timed(t);
      }
      release(weights);  // the weights-only Device: w, sc, sg
    }
  }
  std::printf(g_failures ? "%d FAILURES\n" : "all checks passed\n", g_failures);
  return g_failures ? 1 : 0;
}
