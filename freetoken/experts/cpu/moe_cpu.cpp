// CPU expert executor: routed SwiGLU experts computed in place from host memory.
//
// Bandwidth-bound by design: each selected expert's weights stream from DRAM exactly once
// per call, in 4-row blocks that are re-used from L1 for every token routed to the expert.
// Two phases with one barrier between them (none per expert):
//   1. gate_up: work units = (expert, block of intermediate rows); h = silu(x Wg^T) * (x Wu^T),
//               or GPT-OSS's clamped SwiGLU over the biased products (ExpertFn below)
//   2. down:    work units = blocks of output rows; a thread owns out[:, rows] outright and
//               adds every expert's contribution there, so no atomics and a fixed sum order.
// Weights are BF16 or FP32, or quantized as published (fp8_block, mxfp4, nvfp4: see
// "quantized banks" below), dequantized in registers; accumulation is FP32. SIMD: AVX-512
// (+VNNI-BF16 when the activations are themselves BF16), AVX2+FMA, or scalar, chosen at run time.
#include <torch/extension.h>

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------- thread pool
// Pause loops a worker spins for the next job before it sleeps, where the caller does not say:
// FREETOKEN_CPU_SPIN (A/B runs), else 20000 (decode calls come every few hundred microseconds)
static int default_spin() {
  const char* v = std::getenv("FREETOKEN_CPU_SPIN");
  return v != nullptr ? std::max(0, std::atoi(v)) : 20000;
}

class Pool {
 public:
  // spin: pause loops a worker spins for the next job before it sleeps
  explicit Pool(const std::vector<int>& cpus, int spin = default_spin()) : n_(std::max<size_t>(1, cpus.size())), spin_(spin) {
    // the caller runs share 0 unpinned: pinning it would also confine Python and torch
    for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t, cpus] { loop(t, cpus[t]); });
  }
  ~Pool() { stop(); }
  // Ends the workers (joined); later runs go on the caller alone. Idempotent.
  void stop() {
    if (workers_.empty()) return;
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    n_ = 1;
  }
  int size() const { return n_; }
  // Runs f(tid) on every thread (the caller is thread 0) and returns when all are done.
  void run(const std::function<void(int)>& f) {
    job_ = &f;
    left_.store(n_ - 1);
    {
      std::lock_guard<std::mutex> g(m_);
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    f(0);
    while (left_.load(std::memory_order_acquire) > 0) _mm_pause();
  }

 private:
  static void pin(int cpu) {
    if (cpu < 0) return;
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    pthread_setaffinity_np(pthread_self(), sizeof(s), &s);
  }
  void loop(int tid, int cpu) {
    pin(cpu);
    uint64_t seen = 0;
    for (;;) {
      // spin briefly (decode calls come every few hundred microseconds), then sleep
      for (int i = 0; i < spin_ && gen_.load(std::memory_order_acquire) == seen; ++i) _mm_pause();
      if (gen_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [&] { return gen_.load() != seen; });
      }
      seen = gen_.load();
      if (stop_) return;
      (*job_)(tid);
      left_.fetch_sub(1, std::memory_order_release);
    }
  }
  int n_;
  int spin_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> left_{0};
  const std::function<void(int)>* job_ = nullptr;
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
};

// ---------------------------------------------------------------- dot kernels
// dot4(rows, stride, x, len, out): out[j] = sum_i row_j[i] * x[i] for 4 rows j.
inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
inline float load1(const float* p, int i) { return p[i]; }
inline float load1(const uint16_t* p, int i) { return bf16_to_f32(p[i]); }

template <typename W>
void dot4_scalar(const W* w, int64_t stride, const float* x, int len, float* out) {
  for (int j = 0; j < 4; ++j) {
    float acc = 0.f;
    for (int i = 0; i < len; ++i) acc += load1(w + j * stride, i) * x[i];
    out[j] = acc;
  }
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The four sums of four vectors in one tree, each summed in _mm512_reduce_add_ps's pairing (GCC's:
// lane i + lane i+8, then + i+4, then + i+2, then the two left), so out[p] is bit for bit
// 0.5f * _mm512_reduce_add_ps(v[p]) (and the AVX2 int8 kernel's hsum8 of its two halves), in 17
// instructions where four reductions and products take about 40. The int8 kernels end every 4-row call with
// it: by instruction count, about a tenth of a 512-column call (the down projection).
__attribute__((target("avx512f"))) inline void half_sums4(const __m512* v, float* out) {
  // lanes i and i + 8 of a and b -> [a's 8 | b's 8], likewise c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x44), _mm512_shuffle_f32x4(v[0], v[1], 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x44), _mm512_shuffle_f32x4(v[2], v[3], 0xEE));
  // + i + 4 -> [a's 4 | b's 4 | c's 4 | d's 4]
  const __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const __m512 t = _mm512_add_ps(s, _mm512_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));  // + i + 2
  const __m512 u = _mm512_add_ps(t, _mm512_shuffle_ps(t, t, _MM_SHUFFLE(2, 3, 0, 1)));  // the two left
  const __m512 r = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), u);
  _mm_storeu_ps(out, _mm_mul_ps(_mm512_castps512_ps128(r), _mm_set1_ps(0.5f)));
}

template <typename W>
__attribute__((target("avx2,fma"))) void dot4_avx2(const W* w, int64_t stride, const float* x, int len,
                                                   float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 xv = _mm256_loadu_ps(x + i);  // one activation load feeds four rows
    a0 = _mm256_fmadd_ps(load8(w + i), xv, a0);
    a1 = _mm256_fmadd_ps(load8(w + stride + i), xv, a1);
    a2 = _mm256_fmadd_ps(load8(w + 2 * stride + i), xv, a2);
    a3 = _mm256_fmadd_ps(load8(w + 3 * stride + i), xv, a3);
  }
  out[0] = hsum8(a0), out[1] = hsum8(a1), out[2] = hsum8(a2), out[3] = hsum8(a3);
  for (; i < len; ++i)
    for (int j = 0; j < 4; ++j) out[j] += load1(w + j * stride, i) * x[i];
}

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
// next: the 4-row block (same stride) this thread reads after this one, or null. Its lines are
// prefetched in step with the ones being read: each row is one 4 KiB page of a 2048-wide bf16
// bank, where the hardware prefetchers stop, so without this every row starts cold.
// FREETOKEN_CPU_PREFETCH=0 turns it off (for an A/B run of bench/cpu_experts.py in one call).
static const bool g_block_prefetch = [] {
  const char* v = std::getenv("FREETOKEN_CPU_PREFETCH");
  return v == nullptr || std::strcmp(v, "0") != 0;
}();
// How a phase's work items are dealt to the pool's threads: FREETOKEN_CPU_SCHEDULE=dynamic pulls
// them in chunks from a shared counter, anything else (the default, measured on the H200) gives
// each thread a fixed share (see Share).
static const bool g_dynamic = [] {
  const char* v = std::getenv("FREETOKEN_CPU_SCHEDULE");
  return v != nullptr && std::strcmp(v, "dynamic") == 0;
}();

// Which work items [lo, hi) of [0, n) thread tid takes the k-th time it asks (k = 0, 1, ...).
// Static: its fixed share, once. Dynamic: chunks of about n / (4 nt) from a shared counter, so
// a worker that another process keeps off its (pinned) core holds up one chunk, not a whole
// share, while the others take the rest. The results are the same either way: each item
// writes its own outputs, summed in one fixed order inside the item.
struct Share {
  std::atomic<int> next{0};
  bool take(int n, int tid, int nt, int k, int& lo, int& hi) {
    if (!g_dynamic) {
      lo = int(int64_t(n) * tid / nt), hi = int(int64_t(n) * (tid + 1) / nt);
      return k == 0 && lo < hi;
    }
    const int chunk = std::max(1, n / (4 * nt));
    lo = next.fetch_add(chunk, std::memory_order_relaxed);
    hi = std::min(n, lo + chunk);
    return lo < n;
  }
};

// Prefetches as volatile asm, which no optimization may drop: GCC 12 dropped the intrinsic's
// prefetches twice here (GCC 13 kept them). The block prefetch below: its interprocedural passes (modref /
// pure-const; -fno-ipa-modref kept them) removed every one from the bf16 kernels, whose
// `next` argument then looked unused. The quantized kernels' hint switch: below.
// tests/test_cpu_prefetch.py checks the built extension for them.
inline void prefetch_t0(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_t1(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_t2(const void* p) { asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_nta(const void* p) { asm volatile("prefetchnta %0" : : "m"(*static_cast<const char*>(p))); }

template <typename W>
inline void prefetch4(const W* next, int64_t stride, int i) {
  if (next && g_block_prefetch)
    for (int j = 0; j < 4; ++j) prefetch_t0(next + j * stride + i);
}
// noclone (this and dot4_bf16dp): dense.h calls them with a null `next` for its last rows, and a
// clone specialised for that would carry no prefetch; tests/test_cpu_prefetch.py reads every
// copy of these kernels for one
template <typename W>
__attribute__((target("avx512f"), noclone)) void dot4_avx512(const W* w, int64_t stride, const float* x, int len,
                                                    float* out, const W* next = nullptr) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 16 <= len; i += 16) {
    if (sizeof(W) == 4 || (i & 31) == 0) prefetch4(next, stride, i);  // one line per row
    __m512 xv = _mm512_loadu_ps(x + i);
    a0 = _mm512_fmadd_ps(load16(w + i), xv, a0);
    a1 = _mm512_fmadd_ps(load16(w + stride + i), xv, a1);
    a2 = _mm512_fmadd_ps(load16(w + 2 * stride + i), xv, a2);
    a3 = _mm512_fmadd_ps(load16(w + 3 * stride + i), xv, a3);
  }
  out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
  for (; i < len; ++i)
    for (int j = 0; j < 4; ++j) out[j] += load1(w + j * stride, i) * x[i];
}

// BF16 x BF16 -> FP32 with VDPBF16PS: 32 products per instruction, no conversions.
// xb is the activation row already in bf16 (exact when the model runs in bf16).
__attribute__((target("avx512f,avx512bf16"), noclone)) void dot4_bf16dp(const uint16_t* w, int64_t stride,
                                                              const uint16_t* xb, int len, float* out,
                                                              const uint16_t* next = nullptr) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 32 <= len; i += 32) {
    prefetch4(next, stride, i);
    __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), xv);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + stride + i), xv);
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + 2 * stride + i), xv);
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + 3 * stride + i), xv);
  }
  out[0] = _mm512_reduce_add_ps(a0), out[1] = _mm512_reduce_add_ps(a1);
  out[2] = _mm512_reduce_add_ps(a2), out[3] = _mm512_reduce_add_ps(a3);
  for (; i < len; ++i)
    for (int j = 0; j < 4; ++j) out[j] += bf16_to_f32(w[j * stride + i]) * bf16_to_f32(xb[i]);
}

// Four rows against four activation rows at once (a prompt chunk's tokens routed to one expert):
// each weight vector is loaded and widened once for four tokens instead of once per token, 16
// accumulators in registers. Every (row, token) dot keeps dot4_avx512's per-lane order and its
// reduction, so the results are dot4's bit for bit (test_token_blocks_give_the_per_token_bits).
// out[j][t]: row j against xs[t].
template <typename W>
__attribute__((target("avx512f"), noclone)) void dot4x4_avx512(const W* w, int64_t stride, const float* const* xs,
                                                      int len, float (*out)[4], const W* next = nullptr) {
  __m512 a[4][4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) a[j][t] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= len; i += 16) {
    if (sizeof(W) == 4 || (i & 31) == 0) prefetch4(next, stride, i);
    const __m512 w0 = load16(w + i), w1 = load16(w + stride + i), w2 = load16(w + 2 * stride + i),
                 w3 = load16(w + 3 * stride + i);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512 xv = _mm512_loadu_ps(xs[t] + i);
      a[0][t] = _mm512_fmadd_ps(w0, xv, a[0][t]);
      a[1][t] = _mm512_fmadd_ps(w1, xv, a[1][t]);
      a[2][t] = _mm512_fmadd_ps(w2, xv, a[2][t]);
      a[3][t] = _mm512_fmadd_ps(w3, xv, a[3][t]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) out[j][t] = _mm512_reduce_add_ps(a[j][t]);
  for (; i < len; ++i)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) out[j][t] += load1(w + j * stride, i) * xs[t][i];
}

// The same with bf16 activations through VDPBF16PS (dot4_bf16dp's order and reduction).
__attribute__((target("avx512f,avx512bf16"), noclone)) void dot4x4_bf16dp(const uint16_t* w, int64_t stride,
                                                                const uint16_t* const* xs, int len,
                                                                float (*out)[4], const uint16_t* next = nullptr) {
  __m512 a[4][4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) a[j][t] = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= len; i += 32) {
    prefetch4(next, stride, i);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + stride + i),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 2 * stride + i),
                   w3 = (__m512bh)_mm512_loadu_si512(w + 3 * stride + i);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[t] + i);
      a[0][t] = _mm512_dpbf16_ps(a[0][t], w0, xv);
      a[1][t] = _mm512_dpbf16_ps(a[1][t], w1, xv);
      a[2][t] = _mm512_dpbf16_ps(a[2][t], w2, xv);
      a[3][t] = _mm512_dpbf16_ps(a[3][t], w3, xv);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) out[j][t] = _mm512_reduce_add_ps(a[j][t]);
  for (; i < len; ++i)
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) out[j][t] += bf16_to_f32(w[j * stride + i]) * bf16_to_f32(xs[t][i]);
}

// Four tokens at a time where an expert has them (FREETOKEN_CPU_TOKEN_BLOCK=0: one at a time, for
// an A/B run of bench/cpu_experts.py; the results are the same bits either way).
static const bool g_token_block = [] {
  const char* v = std::getenv("FREETOKEN_CPU_TOKEN_BLOCK");
  return v == nullptr || std::strcmp(v, "0") != 0;
}();

// Quantized banks: an expert with at least this many of a call's tokens has each 4-row block
// decoded once for all of them (qdot4xn_*) instead of once per two tokens (per token on AVX2 and
// with int8); the same bits either way. Exact activations on AVX-512, fp4 with float ones on AVX2
// (qdot4xn_fp4_avx2), int8 ones on the VBMI / VNNI / AVX2 kernels (qdot4xn_q8): on a CPU without
// AVX-512 these are the only multi-token paths. Not with FREETOKEN_CPU_TOKEN_BLOCK=0 (one token at
// a time throughout).
// FREETOKEN_CPU_DECODE_ONCE=N sets it, 0 turns it off (A/B runs); set_decode_once changes it at
// run time (bench/cpu_experts.py's A/B rows in one process).
static std::atomic<int> g_decode_once{[] {
  const char* v = std::getenv("FREETOKEN_CPU_DECODE_ONCE");
  return v == nullptr ? 4 : int(std::min<long>(std::max<long>(0, std::strtol(v, nullptr, 10)), 1 << 30));
}()};

// Which fp4 kernels take each row's block scales decoded once per call (fp4_block_scales)
// instead of per chunk: the same bits either way. A mask: 1 the AVX2 kernels, 2 the AVX-512 ones.
// The default is 1. Measured A/B in one process (benchmarks/README.md, forty-fifth session): the
// AVX2 int8 kernel gained 1.15-1.2x on the dev machine and up to 1.18x on the Xeon, where its
// scales were a quarter of its instructions; the AVX-512 kernels gained 3-12% on calls whose
// experts sit in the caches but ran 2-8% slower from DRAM on the Xeon (float and int8), and a
// 12-layer CPU-only decode was no faster, so they keep making their scales per chunk for now.
// FREETOKEN_CPU_ROW_SCALES=M (or set_row_scales at run time) sets the mask, for A/B runs.
static std::atomic<int> g_row_scales{[] {
  const char* v = std::getenv("FREETOKEN_CPU_ROW_SCALES");
  return v == nullptr ? 1 : int(std::strtol(v, nullptr, 10) & 3);
}()};
constexpr int ROW_SCALES_AVX2 = 1, ROW_SCALES_AVX512 = 2;
// How the one-token fp4 kernels with int8 or bf16 activations walk a 4-row block: 128 columns
// of all four rows at a time (0, the default; one activation chunk serves four rows), or each
// row to its end before the next (1). A 4-row block of a 2048-wide fp4 bank is one 4 KiB page,
// and the hardware's L2 streamer follows one ascending run per page: four rows read side by side
// are four interleaved runs, one row after another is one. Each row's sums are the same either
// way (the same chunks in the same order). FREETOKEN_CPU_ROW_SEQ=1 or set_row_seq, for A/B runs.
static std::atomic<int> g_row_seq{[] {
  const char* v = std::getenv("FREETOKEN_CPU_ROW_SEQ");
  return v != nullptr && std::strcmp(v, "1") == 0 ? 1 : 0;
}()};

enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

Isa detect() {
  __builtin_cpu_init();
  // every AVX-512 CPU but Xeon Phi has BW; every AVX2 one F16C (the quantized kernels use both)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c")) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
    if (__builtin_cpu_supports("avx512bf16")) return AVX512_BF16;
#endif
    return AVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return AVX2;
  return SCALAR;
}

// One row-dot over float activations, dispatched by ISA (the bf16-dp path is handled apart).
template <typename W>
inline void dot4(Isa isa, const W* w, int64_t stride, const float* x, int len, float* out, const W* next = nullptr) {
  if (isa >= AVX512) return dot4_avx512(w, stride, x, len, out, next);
  if (isa == AVX2) return dot4_avx2(w, stride, x, len, out);
  dot4_scalar(w, stride, x, len, out);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// ---------------------------------------------------------------- the expert function
// What an expert computes between its two projections (experts/executor.py's Activation) and
// its optional bias banks. Plain (SiLU, no biases: Qwen, DeepSeek) takes the same code as before;
// anything else costs a per-row epilogue (a branch that always goes the same way in a call, and a
// few flops per intermediate row against the H multiply-adds of its dot products).
enum Act { ACT_SILU = 0, ACT_SWIGLU_CLAMP = 1, ACT_SILU_CLAMP = 2 };  // Activation.code

struct ExpertFn {
  int act = ACT_SILU;
  float alpha = 1.702f, limit = 7.f;  // swiglu_clamp only
  const void* gu_bias = nullptr;  // [N, 2I]: gate rows then up rows, as gate_up's rows
  const void* dn_bias = nullptr;  // [N, H]
  bool bias_bf16 = false;         // both biases bf16 (else f32)
  bool bias_round = false;        // f32 biases in a bf16 model: rounded to bf16 on load, as the
                                  // reference's bias.to(x.dtype) does (arithmetic stays f32, as x's)
  bool plain() const { return act == ACT_SILU && gu_bias == nullptr && dn_bias == nullptr; }
  float bias(const void* b, int64_t i) const {
    if (bias_bf16) return bf16_to_f32(static_cast<const uint16_t*>(b)[i]);
    const float f = static_cast<const float*>(b)[i];
    return bias_round ? bf16_to_f32(f32_to_bf16(f)) : f;
  }
  // h of intermediate row r of expert e from its gate and up products g, u
  float h(int64_t e, int I, int r, float g, float u) const {
    if (gu_bias != nullptr) {
      g += bias(gu_bias, e * 2 * I + r);
      u += bias(gu_bias, e * 2 * I + I + r);
    }
    if (act == ACT_SILU) return silu(g) * u;
    if (act == ACT_SILU_CLAMP)  // DeepSeek-V4: silu(min(g, limit)) * clamp(u, -limit, limit)
      return silu(std::min(g, limit)) * std::min(std::max(u, -limit), limit);
    // min / max order as torch.clamp: a NaN stays NaN. sigmoid underflows to 0 for very negative
    // g (exp overflows to inf), as torch.sigmoid does: h = -0, never NaN
    g = std::min(g, limit);
    u = std::min(std::max(u, -limit), limit);
    return (u + 1.f) * (g * (1.f / (1.f + std::exp(-(g * alpha)))));
  }
  // the down product of output row r of expert e, with its bias
  float y(int64_t e, int H, int r, float d) const { return dn_bias != nullptr ? d + bias(dn_bias, e * H + r) : d; }
};

// ---------------------------------------------------------------- quantized banks
// The published bytes are read in place (experts/banks.py): no copy, no dequantized buffer.
// Every kernel computes four rows per pass against one activation row (each activation load
// feeds the four rows), dequantizing in registers:
//   fp8_block  e4m3 -> f16 bits by a shift and a mask (the value times 2^-8, exact, e4m3
//              subnormals as f16 subnormals) -> f32 by vcvtph2ps (F16C); the 128x128 block's
//              scale (times 2^8) multiplies the partial sum of each 128 columns. (Building f32
//              bits directly needs an f32 subnormal times 2^120 for e4m3 subnormals, a slow
//              path in hardware: 2.3x slower on random bytes on the dev machine's AMD EPYC.)
//   mxfp4 / nvfp4  e2m1 codes -> f32 through a 16-entry table in a register (vpermps;
//              AVX2: an 8-entry magnitude table and the sign bit xor-ed in), or -> bf16 through
//              vpermw for VDPBF16PS when the activations are bf16. The packed bytes are loaded
//              64 (AVX2: 32) at a time and shifted by 4j: vector j holds the codes of columns
//              8k + j (bf16: 4k + j) in lane k, so the activation row is stored once per call in
//              that order ("layout" below). Lane k then always sums columns [8k, 8k + 8) of its
//              chunk, inside one scale block (32 or 16 columns), so the per-lane partial sums
//              are multiplied by a vector of block scales (e8m0: 2^(s-127); e4m3 * scale_2) once
//              per chunk.
// Results are the fp32 sums over the exact dequantized weights, in a fixed order per row; the
// work split, the phases and the order of the sums are run()'s, so the thread count changes
// nothing. bf16 activations use VDPBF16PS for the fp4 formats only (fp8 takes the f32 path:
// its e4m3 -> bf16 conversion would need the same subnormal handling for no gain).
enum Fmt { FMT_FP8 = 1, FMT_MXFP4 = 2, FMT_NVFP4 = 3 };

struct QBank {  // one projection of every expert; logical matrix [R, C] per expert
  const uint8_t* v = nullptr;  // values [N, R, vrow] (e4m3 bytes or packed e2m1 pairs)
  const uint8_t* s = nullptr;  // scales: fp8 [N, sR, srow] in sdt; mxfp4 e8m0 / nvfp4 e4m3 [N, R, srow]
  const float* s2 = nullptr;   // nvfp4: [N, halves]
  int64_t R = 0, C = 0, vrow = 0, srow = 0, sR = 0;
  int sdt = 0;  // fp8 scale dtype: 0 f32, 1 bf16, 2 f16
  int halves = 1;
  int fmt = 0;
};

struct QRow {
  const uint8_t* v;  // the row's values
  const uint8_t* s;  // its scales (fp8: the scale row of its 128-row block)
  float s2;          // nvfp4 scale_2 of its half (1 otherwise)
};

inline QRow qrow(const QBank& b, int64_t e, int64_t r) {
  QRow q;
  q.v = b.v + (e * b.R + r) * b.vrow;
  const int64_t half = (b.halves == 2 && r >= b.R / 2) ? 1 : 0;
  if (b.fmt == FMT_FP8) {
    const int64_t hr = b.R / b.halves, per = (hr + 127) / 128;  // block rows per half
    const int64_t br = half * per + (r - half * hr) / 128;
    const int es = b.sdt == 0 ? 4 : 2;
    q.s = b.s + ((e * b.sR + br) * b.srow) * es;
  } else {
    q.s = b.s + (e * b.R + r) * b.srow;
  }
  q.s2 = b.fmt == FMT_NVFP4 ? b.s2[e * b.halves + half] : 1.f;
  return q;
}

alignas(64) const float E2M1_F32[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                        -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
alignas(64) const uint16_t E2M1_BF16[32] = {  // twice: vpermw reads 5 index bits
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// e4m3 (float8_e4m3fn) -> f32, exact (subnormals too); 0x7f/0xff (NaN) are not expected
inline float e4m3_f32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15, m = b & 7;
  const float f = e ? bits_f32(((e + 120) << 23) | (m << 20)) : float(m) * 0x1p-9f;
  return (b & 0x80) ? -f : f;
}
inline float e8m0_f32(uint8_t s) { return s ? bits_f32(uint32_t(s) << 23) : 0x1p-127f; }  // 255: not expected
inline float f16_f32(uint16_t h) {
  const float f = bits_f32(uint32_t(h & 0x7FFF) << 13) * 0x1p112f;
  return (h & 0x8000) ? -f : f;
}
inline float fp8_scale(const uint8_t* s, int sdt, int64_t cb) {
  if (sdt == 0) {
    float f;
    std::memcpy(&f, s + 4 * cb, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, s + 2 * cb, 2);
  return sdt == 1 ? bf16_to_f32(h) : f16_f32(h);
}
inline uint64_t load_bytes(const uint8_t* p, int n) {  // n <= 8 bytes, zero-filled above
  uint64_t u = 0;
  std::memcpy(&u, p, n);
  return u;
}
// a chunk's scale bytes: a fixed-size load for a full chunk (a variable memcpy there would
// store byte by byte and stall the vector load that follows), exact bytes for the last one
template <int FULL>
inline uint64_t chunk_scales(const uint8_t* p, int n) {
  if (n == FULL) {
    uint64_t u = 0;
    std::memcpy(&u, p, FULL);
    return u;
  }
  return load_bytes(p, n);
}

// Software prefetch of the bank bytes a fixed distance ahead of the ones being read: the rows of
// one expert's bank are read in address order (4-row blocks, then the next block or work unit),
// and the dequantizing kernels spend more time per byte than the bf16 one, so the hardware
// prefetchers alone leave much of the DRAM latency exposed (on the 2-core dev machine, one
// thread: mxfp4 7.6 -> 18.8 GB/s). 8 KiB ahead is two 4-row blocks of a 2048-wide fp4 bank, one
// of fp8 (there, 2 threads: fp8 26-28 GB/s at 4 KiB, 33-40 at 8 KiB; fp4 the same at both).
// FREETOKEN_CPU_PREFETCH_BYTES sets the distance (default 8192) and FREETOKEN_CPU_PREFETCH_HINT
// the cache level the lines go to (t0: L1; t1 / t2, the default: L2; nta; off), for A/B runs of
// bench/cpu_experts.py on a new machine class (CpuExpertExecutor checks the values). Why L2 may
// win there: a T0 prefetch holds one of the core's L1 fill buffers (16 on recent Xeons) until its
// line arrives, so with a ~110 ns DRAM latency one core cannot have more than ~9 GB/s in flight;
// an L2 prefetch waits in the L2's larger queue instead. On the H200's Xeon host the fp4 kernels
// read 5.3 GB/s a core at 6 threads against the 10.5 a plain read gets.
// Both are plain globals, so the kernels keep them in registers across a call: set once at
// start-up, and by set_prefetch, a benchmark hook that may only run while no kernel does (the
// dense GEMVs read the hint too, on torch's threads, outside any executor's lock): bench's A/B
// calls it between timed calls on the calling thread. Nothing in the engine calls it.
static int g_pf = [] {
  const char* v = std::getenv("FREETOKEN_CPU_PREFETCH_BYTES");
  return v != nullptr && *v ? std::max(0, std::atoi(v)) : 8192;
}();
// The default is t2: on the dev machine's Xeon (2 threads, MXFP4, int8 activations) 23.2-23.9
// GB/s against 20.9-21.5 with t0 in three alternating runs, the exact kernels equal; on the H200
// host's (a2ea4b3, 6 threads, exact kernels) 31.3 / 33.2 against 30.2 / 23.0 at batch 1 / 4.
static int g_pf_hint = [] {  // 0 t0, 1 t1, 2 t2, 3 nta, -1 off
  const char* v = std::getenv("FREETOKEN_CPU_PREFETCH_HINT");
  if (v == nullptr || !*v || !std::strcmp(v, "t2")) return 2;
  return !std::strcmp(v, "t0") ? 0 : !std::strcmp(v, "t1") ? 1 : !std::strcmp(v, "nta") ? 3 : -1;
}();
// GCC 12 compiled a four-case switch of _mm_prefetch over the hint into nothing: its builds of
// the quantized kernels had no prefetch from 075c2a8 until found in the disassembly (GCC 13,
// the GPU host's, kept them; volatile asm prefetches now, above).
inline void prefetch_line(const char* p) {
  if (g_pf_hint == 0) prefetch_t0(p);
  else if (g_pf_hint == 1) prefetch_t1(p);
  else if (g_pf_hint == 2) prefetch_t2(p);
  else if (g_pf_hint == 3) prefetch_nta(p);
}
inline void prefetch_ahead(const uint8_t* p) { prefetch_line(reinterpret_cast<const char*>(p + g_pf)); }
inline void prefetch_scales(const QRow* rows, int bytes) {  // each row's scales, g_pf / 16 ahead
  for (int p = 0; p < 4; ++p)
    for (int o = 0; o < bytes; o += 64) prefetch_line(reinterpret_cast<const char*>(rows[p].s + o + g_pf / 16));
}
// The same with the hint a template argument (row_runs.h chooses it once per call: the runtime
// switch above is three branches per 64-byte load); HINT_RUNTIME reads g_pf_hint as above.
constexpr int HINT_RUNTIME = -2;
template <int HINT>
inline void prefetch_hinted(const char* p) {
  if (HINT == HINT_RUNTIME) prefetch_line(p);
  else if (HINT == 0) prefetch_t0(p);
  else if (HINT == 1) prefetch_t1(p);
  else if (HINT == 2) prefetch_t2(p);
  else if (HINT == 3) prefetch_nta(p);
}
template <int HINT>
inline void prefetch_ahead_h(const uint8_t* p) { prefetch_hinted<HINT>(reinterpret_cast<const char*>(p + g_pf)); }
template <int HINT>
inline void prefetch_scales_h(const QRow* rows, int bytes) {
  for (int p = 0; p < 4; ++p)
    for (int o = 0; o < bytes; o += 64) prefetch_hinted<HINT>(reinterpret_cast<const char*>(rows[p].s + o + g_pf / 16));
}

// Activation layouts. A row of C values is stored in chunks of g*L columns (the last chunk
// may be shorter: nl = its columns / g lanes); inside a chunk, column 8k+j (g = 8) or 4k+j
// (g = 4, bf16 words) goes to position j*nl + k. g = 1: the natural order.
struct Layout {
  int g = 1, L = 1;
  int pos(int c, int C) const {
    if (g == 1) return c;
    const int w = g * L, base = c / w * w, nl = std::min(L, (C - base) / g), o = c - base;
    return base + (o % g) * nl + o / g;
  }
};

// --- scalar: the reference's arithmetic, weight by weight (w exactly as quant.py builds it)
template <int FMT>
void qdot4_scalar(const QRow* rows, const float* x, int C, int sdt, float* out) {
  for (int p = 0; p < 4; ++p) {
    const QRow& q = rows[p];
    float acc = 0.f;
    for (int c = 0; c < C; ++c) {
      float w;
      if (FMT == FMT_FP8) {
        w = e4m3_f32(q.v[c]) * fp8_scale(q.s, sdt, c / 128);
      } else {
        const float e = E2M1_F32[(q.v[c >> 1] >> ((c & 1) * 4)) & 15];
        w = FMT == FMT_MXFP4 ? e * e8m0_f32(q.s[c / 32]) : (e * e4m3_f32(q.s[c / 16])) * q.s2;
      }
      acc += w * x[c];
    }
    out[p] = acc;
  }
}

// --- AVX2 + FMA
__attribute__((target("avx2,fma,f16c"))) inline __m256 fp4_scales_avx2(int fmt, const QRow& q, int base, int nl) {
  // lane k of a chunk sums columns [8k, 8k + 8): block k/4 (mxfp4, 32) or k/2 (nvfp4, 16)
  if (fmt == FMT_MXFP4) {
    const __m128i b = _mm_cvtsi32_si128(int(chunk_scales<2>(q.s + base / 32, nl / 4)));
    const __m256i e = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)));
    const __m256i zero = _mm256_and_si256(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(0x00400000));
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(e, 23), zero));
  }
  // e4m3 -> f16 bits (value * 2^-8) -> f32, as the fp8 kernels convert (no f32 subnormal)
  const __m128i b = _mm_cvtsi32_si128(int(chunk_scales<4>(q.s + base / 16, nl / 2)));
  const __m128i e = _mm_cvtepi8_epi16(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0)));
  const __m256 f = _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(e, 7), _mm_set1_epi16(short(0xBF80))));
  return _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(256.f)), _mm256_set1_ps(q.s2));
}

// The block scales of a call's 4 rows as f32, decoded once per row, 8 at a time, into a
// per-thread buffer ([4][*stride] floats), for the AVX2 and the AVX-512 kernels alike. Per chunk a
// kernel then takes a row's lane scales with one load and one permute (fp4_half_scales_avx2 for a
// 64-column chunk, fp4_chunk_scales for a 128-column one) where fp4_scales_avx2 / _avx512 spend
// about six instructions on every chunk. The values are theirs bit for bit (e8m0 0 -> 2^-127;
// NVFP4 (f * 2^8) * scale_2 in the same order); blocks past a row's last one (a short last
// chunk's idle lanes) read what chunk_scales' zero bytes give there (2^-127 / 0).
// A per-thread buffer of at least `floats` floats, 64-byte aligned; each SLOT is one kernel's
// (a kernel call at a time per thread uses it).
template <int SLOT>
inline float* thread_scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats + 16) buf.resize(floats + 16);
  return buf.data() + ((16 - (reinterpret_cast<uintptr_t>(buf.data()) / 4) % 16) % 16);
}
template <int FMT>
__attribute__((target("avx2,fma,f16c"))) inline const float* fp4_block_scales(const QRow* rows, int C, int* stride) {
  const int nb = FMT == FMT_MXFP4 ? C / 32 : C / 16;  // whole blocks, as the chunks' nl / 4 (nl / 2) count them
  // >= the 4 (8) floats every 128-column chunk reads, a short last one too, and so the 2 (4) of
  // every 64-column one (with C a multiple of the block, as every bank's is, that is nb rounded
  // up; the max guards any other C), zero bytes past nb
  const int ss = (std::max(nb, (C + 127) / 128 * (FMT == FMT_MXFP4 ? 4 : 8)) + 15) / 16 * 16;
  float* S = thread_scratch<1>(size_t(4) * ss);
  for (int p = 0; p < 4; ++p)
    for (int g = 0; g < ss; g += 8) {
      // chunk_scales: a fixed 8-byte load for a whole group (a variable-size memcpy here stored byte by byte)
      const __m128i b = _mm_cvtsi64_si128(int64_t(chunk_scales<8>(rows[p].s + g, std::max(0, std::min(8, nb - g)))));
      __m256 f;
      if (FMT == FMT_MXFP4) {
        const __m256i e = _mm256_cvtepu8_epi32(b);
        const __m256i zero = _mm256_and_si256(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(0x00400000));
        f = _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(e, 23), zero));
      } else {
        const __m128i e = _mm_cvtepi8_epi16(b);
        f = _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(e, 7), _mm_set1_epi16(short(0xBF80))));
        f = _mm256_mul_ps(_mm256_mul_ps(f, _mm256_set1_ps(256.f)), _mm256_set1_ps(rows[p].s2));
      }
      _mm256_store_ps(S + size_t(p) * ss + g, f);
    }
  *stride = ss;
  return S;
}
template <int FMT>
__attribute__((target("avx2"))) inline __m256 fp4_half_scales_avx2(const float* s, int c64) {
  if (FMT == FMT_MXFP4)  // two floats, loaded as one 64-bit lane (no read past them)
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s + 2 * c64)))),
                                    _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s + 4 * c64)), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

template <int FMT, bool RS, int HINT = HINT_RUNTIME>
__attribute__((target("avx2,fma,f16c"))) void qdot4_fp4_avx2_rs(const QRow* rows, const float* x, int C, float* out) {
  // 8 magnitudes, each xor-ed with its own index << 28: c = code >> 4j has the sign in bit 3,
  // so (c << 28) is the sign at bit 31 plus the index at bits 28-30, which the table cancels
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 mag = _mm256_castsi256_ps(_mm256_xor_si256(
      _mm256_castps_si256(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f)), _mm256_slli_epi32(idx, 28)));
  __m256 acc[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm256_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales_h<HINT>(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0; base < C; base += 64) {
    const int nl = std::min(8, (C - base) / 8);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(nl), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i v[4];
    __m256 t[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead_h<HINT>(rows[p].v + base / 2);
      v[p] = nl == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[p].v + base / 2))
                     : _mm256_maskload_epi32(reinterpret_cast<const int*>(rows[p].v + base / 2), lanes);
      t[p] = _mm256_setzero_ps();
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256 xj = nl == 8 ? _mm256_loadu_ps(x + base + 8 * j) : _mm256_maskload_ps(x + base + j * nl, lanes);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i c = _mm256_srli_epi32(v[p], 4 * j);
        const __m256 m = _mm256_permutevar8x32_ps(mag, c);
        t[p] = _mm256_fmadd_ps(_mm256_xor_ps(m, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28))), xj, t[p]);
      }
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m256 sc = RS ? fp4_half_scales_avx2<FMT>(bs + p * ss, base / 64) : fp4_scales_avx2(FMT, rows[p], base, nl);
      acc[p] = _mm256_fmadd_ps(t[p], sc, acc[p]);
    }
  }
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) out[p] = hsum8(acc[p]);
}

// qdot4_fp4_avx2 with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says
template <int FMT>
__attribute__((target("avx2,fma,f16c"))) inline void qdot4_fp4_avx2(const QRow* rows, const float* x, int C, float* out) {
  if (g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX2) return qdot4_fp4_avx2_rs<FMT, true>(rows, x, C, out);
  return qdot4_fp4_avx2_rs<FMT, false>(rows, x, C, out);
}

// qdot4_fp4_avx2 for n activation rows (a prompt chunk's tokens of one expert, float activations
// on a CPU without AVX-512, the exact path's default there): the four rows' weights decoded once
// into a per-thread buffer (per 64-column chunk: 8 x 4 vectors of f32 weights and 4 lane-scale
// vectors, 1.1 KB; 36 KB for a 2,048-column row block), then each token's partial sums, scaling
// and reduction exactly as qdot4_fp4_avx2 makes them, so out[t] is its result bit for bit. Per
// token and 8 weights: a load and an FMA instead of 5 instructions.
template <int FMT>
__attribute__((target("avx2,fma,f16c"))) void qdot4xn_fp4_avx2(const QRow* rows, const float* const* xs, int n, int C,
                                                              float (*out)[4]) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 mag = _mm256_castsi256_ps(_mm256_xor_si256(
      _mm256_castps_si256(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f)), _mm256_slli_epi32(idx, 28)));
  const int nch = (C + 63) / 64;
  float* W = thread_scratch<3>(size_t(nch) * 36 * 8);  // [nch][8 j][4 p] weights, then [nch][4 p] scales
  float* S = W + size_t(nch) * 32 * 8;
  int ss = 0;
  const float* bs = fp4_block_scales<FMT>(rows, C, &ss);
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int ch = 0, base = 0; ch < nch; ++ch, base += 64) {  // the decode, once for all n tokens
    const int nl = std::min(8, (C - base) / 8);
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(nl), idx);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead(rows[p].v + base / 2);
      const __m256i v = nl == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[p].v + base / 2))
                                : _mm256_maskload_epi32(reinterpret_cast<const int*>(rows[p].v + base / 2), lanes);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256i c = _mm256_srli_epi32(v, 4 * j);
        _mm256_store_ps(W + ((size_t(ch) * 8 + j) * 4 + p) * 8,
                        _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, c), _mm256_castsi256_ps(_mm256_slli_epi32(c, 28))));
      }
      _mm256_store_ps(S + (size_t(ch) * 4 + p) * 8, fp4_half_scales_avx2<FMT>(bs + p * ss, ch));
    }
  }
  for (int t = 0; t < n; ++t) {
    const float* x = xs[t];
    __m256 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm256_setzero_ps();
    for (int ch = 0, base = 0; ch < nch; ++ch, base += 64) {
      const int nl = std::min(8, (C - base) / 8);
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(nl), idx);
      __m256 tp[4];
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) tp[p] = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m256 xj = nl == 8 ? _mm256_loadu_ps(x + base + 8 * j) : _mm256_maskload_ps(x + base + j * nl, lanes);
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) tp[p] = _mm256_fmadd_ps(_mm256_load_ps(W + ((size_t(ch) * 8 + j) * 4 + p) * 8), xj, tp[p]);
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) acc[p] = _mm256_fmadd_ps(tp[p], _mm256_load_ps(S + (size_t(ch) * 4 + p) * 8), acc[p]);
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[t][p] = hsum8(acc[p]);
  }
}

__attribute__((target("avx2,fma,f16c"))) void qdot4_fp8_avx2(const QRow* rows, const float* x, int C, int sdt, float* out) {
  // e4m3 -> f16 bits (sign-extended byte << 7, masked): the value times 2^-8, exact (e4m3
  // subnormals become f16 subnormals, which vcvtph2ps converts without a slow path; an f32
  // subnormal times 2^120 takes one); the 2^8 goes into the block scale.
  const __m256i mask = _mm256_set1_epi16(short(0xBF80));
  __m256 acc[4];
  float rest[4] = {0.f, 0.f, 0.f, 0.f};
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm256_setzero_ps();
  for (int base = 0, cb = 0; base < C; base += 128, ++cb) {
    const int end = std::min(C, base + 128);
    __m256 t[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) t[p] = _mm256_setzero_ps();
    int c = base;
    for (; c + 16 <= end; c += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        prefetch_ahead(rows[p].v + c);
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[p].v + c)));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), mask);
        t[p] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), x0, t[p]);
        t[p] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), x1, t[p]);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const float sc = fp8_scale(rows[p].s, sdt, cb);
      float r = 0.f;
      for (int k = c; k < end; ++k) r += e4m3_f32(rows[p].v[k]) * x[k];
      acc[p] = _mm256_fmadd_ps(t[p], _mm256_set1_ps(sc * 256.f), acc[p]);
      rest[p] += r * sc;
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) out[p] = hsum8(acc[p]) + rest[p];
}

// --- AVX-512 (F; the bf16 path also BW and BF16)
__attribute__((target("avx512f,avx2,fma,f16c"))) inline __m512 fp4_scales_avx512(int fmt, const QRow& q, int base, int nl) {
  if (fmt == FMT_MXFP4) {
    const __m128i b = _mm_cvtsi32_si128(int(chunk_scales<4>(q.s + base / 32, nl / 4)));
    const __m512i e = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)));
    const __mmask16 z = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), z, _mm512_set1_epi32(0x00400000)));
  }
  const __m128i b = _mm_cvtsi64_si128(int64_t(chunk_scales<8>(q.s + base / 16, nl / 2)));
  const __m256i e = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
  const __m512 f = _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(e, 7), _mm256_set1_epi16(short(0xBF80))));
  return _mm512_mul_ps(_mm512_mul_ps(f, _mm512_set1_ps(256.f)), _mm512_set1_ps(q.s2));
}


// Chunk ch's 16 lane scales of one row's decoded block scales s: lane l covers columns
// [8l, 8l + 8) of the chunk, in block l / 4 (MXFP4, 32 columns) or l / 2 (NVFP4, 16).
template <int FMT>
__attribute__((target("avx512f"))) inline __m512 fp4_chunk_scales(const float* s, int ch) {
  if (FMT == FMT_MXFP4)
    return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                 _mm512_castps128_ps512(_mm_load_ps(s + 4 * ch)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                               _mm512_castps256_ps512(_mm256_load_ps(s + 8 * ch)));
}

template <int FMT, bool RS>
__attribute__((target("avx512f,avx2,fma,f16c"))) void qdot4_fp4_avx512_rs(const QRow* rows, const float* x, int C, float* out) {
  const __m512 table = _mm512_load_ps(E2M1_F32);
  __m512 acc[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0; base < C; base += 128) {
    const int nl = std::min(16, (C - base) / 8);
    const __mmask16 m = __mmask16((1u << nl) - 1);
    __m512i v[4];
    __m512 t0[4], t1[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead(rows[p].v + base / 2);
      v[p] = nl == 16 ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
      t0[p] = t1[p] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j += 2) {
      const __m512 x0 = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j) : _mm512_maskz_loadu_ps(m, x + base + j * nl);
      const __m512 x1 = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j + 16) : _mm512_maskz_loadu_ps(m, x + base + (j + 1) * nl);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        t0[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v[p], 4 * j), table), x0, t0[p]);
        t1[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v[p], 4 * j + 4), table), x1, t1[p]);
      }
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512 sc = RS ? fp4_chunk_scales<FMT>(bs + p * ss, base / 128) : fp4_scales_avx512(FMT, rows[p], base, nl);
      acc[p] = _mm512_fmadd_ps(_mm512_add_ps(t0[p], t1[p]), sc, acc[p]);
    }
  }
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) out[p] = _mm512_reduce_add_ps(acc[p]);
}

// qdot4_fp4_avx512 with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says
template <int FMT>
__attribute__((target("avx512f,avx2,fma,f16c"))) inline void qdot4_fp4_avx512(const QRow* rows, const float* x, int C, float* out) {
  if (g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX512) return qdot4_fp4_avx512_rs<FMT, true>(rows, x, C, out);
  return qdot4_fp4_avx512_rs<FMT, false>(rows, x, C, out);
}

// qdot4_fp4_avx512 for two activation rows at once (a prompt chunk's tokens of one expert): each
// code lookup (shift + permute) feeds both tokens; every token's partial sums t0 / t1, their
// scaling and reduction are qdot4_fp4_avx512's, so out[t] is its result bit for bit.
template <int FMT, bool RS>
__attribute__((target("avx512f,avx2,fma,f16c"))) void qdot4x2_fp4_avx512_rs(const QRow* rows, const float* const* xs, int C,
                                                                    float (*out)[4]) {
  const __m512 table = _mm512_load_ps(E2M1_F32);
  // the scaled sums live in memory, touched once per 128 columns: in registers beside the 16
  // partial sums, the codes, the table and the activations they were 35, and GCC spilled the hot
  // partial sums instead (objdump: 85 zmm stack accesses); a store and reload is exact
  alignas(64) float acc[2][4][16] = {};
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0; base < C; base += 128) {
    const int nl = std::min(16, (C - base) / 8);
    const __mmask16 m = __mmask16((1u << nl) - 1);
    __m512i v[4];
    __m512 t0[2][4], t1[2][4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead(rows[p].v + base / 2);
      v[p] = nl == 16 ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
      t0[0][p] = t1[0][p] = t0[1][p] = t1[1][p] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j += 2) {
      __m512 x0[2], x1[2];
#pragma GCC unroll 2
      for (int t = 0; t < 2; ++t) {
        const float* x = xs[t];
        x0[t] = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j) : _mm512_maskz_loadu_ps(m, x + base + j * nl);
        x1[t] = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j + 16) : _mm512_maskz_loadu_ps(m, x + base + (j + 1) * nl);
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512 w0 = _mm512_permutexvar_ps(_mm512_srli_epi32(v[p], 4 * j), table);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v[p], 4 * j + 4), table);
#pragma GCC unroll 2
        for (int t = 0; t < 2; ++t) {
          t0[t][p] = _mm512_fmadd_ps(w0, x0[t], t0[t][p]);
          t1[t][p] = _mm512_fmadd_ps(w1, x1[t], t1[t][p]);
        }
      }
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512 sc = RS ? fp4_chunk_scales<FMT>(bs + p * ss, base / 128) : fp4_scales_avx512(FMT, rows[p], base, nl);
#pragma GCC unroll 2
      for (int t = 0; t < 2; ++t)
        _mm512_store_ps(acc[t][p], _mm512_fmadd_ps(_mm512_add_ps(t0[t][p], t1[t][p]), sc, _mm512_load_ps(acc[t][p])));
    }
  }
#pragma GCC unroll 2
  for (int t = 0; t < 2; ++t)
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[t][p] = _mm512_reduce_add_ps(_mm512_load_ps(acc[t][p]));
}

// qdot4x2_fp4_avx512 with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says
template <int FMT>
__attribute__((target("avx512f,avx2,fma,f16c"))) inline void qdot4x2_fp4_avx512(const QRow* rows, const float* const* xs, int C,
                                                                    float (*out)[4]) {
  if (g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX512) return qdot4x2_fp4_avx512_rs<FMT, true>(rows, xs, C, out);
  return qdot4x2_fp4_avx512_rs<FMT, false>(rows, xs, C, out);
}

// bf16 activations (a bf16 model): e2m1 -> bf16 by vpermw, 32 products per VDPBF16PS. Word k
// of vector j is column 4k + j; a dot pair (2k', 2k'+1) lands in f32 lane k' = columns
// [8k', 8k' + 8) of the chunk, the same lane -> scale-block map as the f32 kernel.
// Row p alone through qdot4_fp4_bf16dp_rs (g_row_seq): each of its chunks as the side-by-side
// loop below makes it, so acc is that loop's acc[p] bit for bit.
template <int FMT, bool RS>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) inline __m512 bf16dp_row(const QRow& r, const uint16_t* xb,
                                                                                     int C, __m512i table, const float* s) {
  __m512 acc = _mm512_setzero_ps();
  for (int base = 0; base < C; base += 128) {
    const int nl = std::min(16, (C - base) / 8), nw = 2 * nl;
    const __mmask16 m = __mmask16((1u << nl) - 1);
    prefetch_ahead(r.v + base / 2);
    const __m512i v = nl == 16 ? _mm512_loadu_si512(r.v + base / 2) : _mm512_maskz_loadu_epi32(m, r.v + base / 2);
    __m512 t = _mm512_setzero_ps();
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i xj = nl == 16 ? _mm512_loadu_si512(xb + base + 32 * j) : _mm512_maskz_loadu_epi32(m, xb + base + j * nw);
      t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * j), table), (__m512bh)xj);
    }
    acc = _mm512_fmadd_ps(t, RS ? fp4_chunk_scales<FMT>(s, base / 128) : fp4_scales_avx512(FMT, r, base, nl), acc);
  }
  return acc;
}

template <int FMT, bool RS, bool SEQ>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) void qdot4_fp4_bf16dp_rs(const QRow* rows, const uint16_t* xb,
                                                                                     int C, float* out) {
  const __m512i table = _mm512_load_si512(E2M1_BF16);
  __m512 acc[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  if (SEQ) {
    for (int p = 0; p < 4; ++p) acc[p] = bf16dp_row<FMT, RS>(rows[p], xb, C, table, bs + p * ss);
  } else {
    for (int base = 0; base < C; base += 128) {
      const int nl = std::min(16, (C - base) / 8), nw = 2 * nl;
      const __mmask16 m = __mmask16((1u << nl) - 1);
      __m512i v[4];
      __m512 t[4];
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        prefetch_ahead(rows[p].v + base / 2);
        v[p] = nl == 16 ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
        t[p] = _mm512_setzero_ps();
      }
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i xj = nl == 16 ? _mm512_loadu_si512(xb + base + 32 * j) : _mm512_maskz_loadu_epi32(m, xb + base + j * nw);
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512i w = _mm512_permutexvar_epi16(_mm512_srli_epi16(v[p], 4 * j), table);
          t[p] = _mm512_dpbf16_ps(t[p], (__m512bh)w, (__m512bh)xj);
        }
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512 sc = RS ? fp4_chunk_scales<FMT>(bs + p * ss, base / 128) : fp4_scales_avx512(FMT, rows[p], base, nl);
        acc[p] = _mm512_fmadd_ps(t[p], sc, acc[p]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) out[p] = _mm512_reduce_add_ps(acc[p]);
}

// qdot4_fp4_bf16dp with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says,
// and its rows side by side or one after another, as g_row_seq says
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) inline void qdot4_fp4_bf16dp(const QRow* rows, const uint16_t* xb,
                                                                                     int C, float* out) {
  const bool rs = g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX512;
  if (g_row_seq.load(std::memory_order_relaxed))
    return rs ? qdot4_fp4_bf16dp_rs<FMT, true, true>(rows, xb, C, out) : qdot4_fp4_bf16dp_rs<FMT, false, true>(rows, xb, C, out);
  return rs ? qdot4_fp4_bf16dp_rs<FMT, true, false>(rows, xb, C, out) : qdot4_fp4_bf16dp_rs<FMT, false, false>(rows, xb, C, out);
}

// qdot4_fp4_bf16dp for two activation rows at once (a bf16 model's prompt chunk, or a GPU engine's
// CPU experts): each code lookup feeds both tokens; every token's partial sums, their scaling and
// reduction are qdot4_fp4_bf16dp's, so out[t] is its result bit for bit.
template <int FMT, bool RS>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) void qdot4x2_fp4_bf16dp_rs(
    const QRow* rows, const uint16_t* const* xbs, int C, float (*out)[4]) {
  const __m512i table = _mm512_load_si512(E2M1_BF16);
  __m512 acc[2][4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[0][p] = acc[1][p] = _mm512_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0; base < C; base += 128) {
    const int nl = std::min(16, (C - base) / 8), nw = 2 * nl;
    const __mmask16 m = __mmask16((1u << nl) - 1);
    __m512i v[4];
    __m512 t[2][4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead(rows[p].v + base / 2);
      v[p] = nl == 16 ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
      t[0][p] = t[1][p] = _mm512_setzero_ps();
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i xj[2];
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q)
        xj[q] = nl == 16 ? _mm512_loadu_si512(xbs[q] + base + 32 * j) : _mm512_maskz_loadu_epi32(m, xbs[q] + base + j * nw);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i w = _mm512_permutexvar_epi16(_mm512_srli_epi16(v[p], 4 * j), table);
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) t[q][p] = _mm512_dpbf16_ps(t[q][p], (__m512bh)w, (__m512bh)xj[q]);
      }
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512 sc = RS ? fp4_chunk_scales<FMT>(bs + p * ss, base / 128) : fp4_scales_avx512(FMT, rows[p], base, nl);
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) acc[q][p] = _mm512_fmadd_ps(t[q][p], sc, acc[q][p]);
    }
  }
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q)
  #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[q][p] = _mm512_reduce_add_ps(acc[q][p]);
}

// qdot4x2_fp4_bf16dp with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) inline void qdot4x2_fp4_bf16dp(
    const QRow* rows, const uint16_t* const* xbs, int C, float (*out)[4]) {
  if (g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX512) return qdot4x2_fp4_bf16dp_rs<FMT, true>(rows, xbs, C, out);
  return qdot4x2_fp4_bf16dp_rs<FMT, false>(rows, xbs, C, out);
}

// The decode-once kernels' per-thread buffer of at least `floats` floats, 64-byte aligned (one
// kernel call at a time per thread uses it: it holds that call's decoded rows).
inline float* decode_scratch(size_t floats) { return thread_scratch<0>(floats); }

// qdot4x2_fp4_avx512 for n activation rows (a float model's prompt chunk: the CPU engine's default
// dtype), as qdot4xn_fp4_bf16dp below: the four rows decoded once into a per-thread buffer (per
// 128-column chunk: 8 x 4 vectors of f32 weights and 4 lane-scale vectors, 2.25 KB, so 36 KB for a
// 2,048-column row block), then the tokens two at a time. Each token's partial sums t0 / t1, their
// scaling and reduction are qdot4_fp4_avx512's, so out[t] is its result bit for bit.
template <int FMT>
__attribute__((target("avx512f,avx2,fma,f16c"))) void qdot4xn_fp4_avx512(const QRow* rows, const float* const* xs, int n,
                                                                    int C, float (*out)[4]) {
  const int nch = (C + 127) / 128;
  float* W = decode_scratch(size_t(nch) * 36 * 16);  // [nch][8 j][4 p] weights, then [nch][4 p] scales
  float* S = W + size_t(nch) * 32 * 16;
  const __m512 table = _mm512_load_ps(E2M1_F32);
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {  // the decode, once for all n tokens
    const int nl = std::min(16, (C - base) / 8);
    const __mmask16 m = __mmask16((1u << nl) - 1);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead(rows[p].v + base / 2);
      const __m512i v = nl == 16 ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        _mm512_store_ps(W + ((size_t(ch) * 8 + j) * 4 + p) * 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * j), table));
      _mm512_store_ps(S + (size_t(ch) * 4 + p) * 16, fp4_scales_avx512(FMT, rows[p], base, nl));
    }
  }
  int t0i = 0;
  for (; t0i + 2 <= n; t0i += 2) {  // two tokens a pass: each decoded vector loaded once for both
    // the scaled sums in memory, as in qdot4x2_fp4_avx512 (registers hold the 16 partial sums)
    alignas(64) float acc[2][4][16] = {};
    for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {
      const int nl = std::min(16, (C - base) / 8);
      const __mmask16 m = __mmask16((1u << nl) - 1);
      __m512 t0[2][4], t1[2][4];
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) t0[0][p] = t1[0][p] = t0[1][p] = t1[1][p] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int j = 0; j < 8; j += 2) {
        __m512 x0[2], x1[2];
#pragma GCC unroll 2
        for (int t = 0; t < 2; ++t) {
          const float* x = xs[t0i + t];
          x0[t] = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j) : _mm512_maskz_loadu_ps(m, x + base + j * nl);
          x1[t] = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j + 16) : _mm512_maskz_loadu_ps(m, x + base + (j + 1) * nl);
        }
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512 w0 = _mm512_load_ps(W + ((size_t(ch) * 8 + j) * 4 + p) * 16);
          const __m512 w1 = _mm512_load_ps(W + ((size_t(ch) * 8 + j + 1) * 4 + p) * 16);
#pragma GCC unroll 2
          for (int t = 0; t < 2; ++t) {
            t0[t][p] = _mm512_fmadd_ps(w0, x0[t], t0[t][p]);
            t1[t][p] = _mm512_fmadd_ps(w1, x1[t], t1[t][p]);
          }
        }
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512 sc = _mm512_load_ps(S + (size_t(ch) * 4 + p) * 16);
#pragma GCC unroll 2
        for (int t = 0; t < 2; ++t)
          _mm512_store_ps(acc[t][p], _mm512_fmadd_ps(_mm512_add_ps(t0[t][p], t1[t][p]), sc, _mm512_load_ps(acc[t][p])));
      }
    }
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t)
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) out[t0i + t][p] = _mm512_reduce_add_ps(_mm512_load_ps(acc[t][p]));
  }
  if (t0i < n) {  // an odd count's last token
    const float* x = xs[t0i];
    __m512 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
    for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {
      const int nl = std::min(16, (C - base) / 8);
      const __mmask16 m = __mmask16((1u << nl) - 1);
      __m512 t0[4], t1[4];
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) t0[p] = t1[p] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int j = 0; j < 8; j += 2) {
        const __m512 x0 = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j) : _mm512_maskz_loadu_ps(m, x + base + j * nl);
        const __m512 x1 = nl == 16 ? _mm512_loadu_ps(x + base + 16 * j + 16) : _mm512_maskz_loadu_ps(m, x + base + (j + 1) * nl);
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          t0[p] = _mm512_fmadd_ps(_mm512_load_ps(W + ((size_t(ch) * 8 + j) * 4 + p) * 16), x0, t0[p]);
          t1[p] = _mm512_fmadd_ps(_mm512_load_ps(W + ((size_t(ch) * 8 + j + 1) * 4 + p) * 16), x1, t1[p]);
        }
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p)
        acc[p] = _mm512_fmadd_ps(_mm512_add_ps(t0[p], t1[p]), _mm512_load_ps(S + (size_t(ch) * 4 + p) * 16), acc[p]);
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[t0i][p] = _mm512_reduce_add_ps(acc[p]);
  }
}

// qdot4x2_fp8_avx512 for n activation rows, as the fp4 forms above: each row's e4m3 values widened
// to f32 once into the per-thread buffer (per 128-column chunk: up to 8 x 4 vectors and 4 block
// scales), then the tokens two at a time. For C a multiple of 16 only (the caller's gate: every
// published shape), where qdot4_fp8_avx512 has no scalar rest; each token's block sums, scaling
// and reduction are that kernel's in its order (its rest, +0, added as it adds it), so out[t] is
// its result bit for bit.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void qdot4xn_fp8_avx512(const QRow* rows, const float* const* xs,
                                                                                   int n, int C, int sdt, float (*out)[4]) {
  const int nch = (C + 127) / 128;
  float* W = decode_scratch(size_t(nch) * 32 * 16 + size_t(nch) * 4);  // [nch][8 g][4 p] x 16, then [nch][4 p] scales
  float* S = W + size_t(nch) * 32 * 16;
  const __m512i mask = _mm512_set1_epi16(short(0xBF80));
  for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {  // the widening, once for all n tokens
    const int ng = (std::min(C, base + 128) - base) / 16;
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const uint8_t* v = rows[p].v + base;
      int g = 0;
      for (; g + 2 <= ng; g += 2) {
        prefetch_ahead(v + 16 * g);
        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * g)));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), mask);
        _mm512_store_ps(W + ((size_t(ch) * 8 + g) * 4 + p) * 16, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
        _mm512_store_ps(W + ((size_t(ch) * 8 + g + 1) * 4 + p) * 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
      }
      if (g < ng) {
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16 * g)));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm512_castsi512_si256(mask));
        _mm512_store_ps(W + ((size_t(ch) * 8 + g) * 4 + p) * 16, _mm512_cvtph_ps(h));
      }
      S[size_t(ch) * 4 + p] = fp8_scale(rows[p].s, sdt, ch) * 256.f;
    }
  }
  for (int t0 = 0; t0 < n; t0 += 2) {  // two tokens a pass (the last alone where n is odd)
    const int nt = std::min(2, n - t0);
    __m512 acc[2][4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[0][p] = acc[1][p] = _mm512_setzero_ps();
    for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {
      const int ng = (std::min(C, base + 128) - base) / 16;
      __m512 t[2][4];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) t[0][p] = t[1][p] = _mm512_setzero_ps();
      for (int g = 0; g < ng; ++g) {
        __m512 x[2];
        x[0] = _mm512_loadu_ps(xs[t0] + base + 16 * g);
        x[1] = nt == 2 ? _mm512_loadu_ps(xs[t0 + 1] + base + 16 * g) : x[0];
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512 w = _mm512_load_ps(W + ((size_t(ch) * 8 + g) * 4 + p) * 16);
#pragma GCC unroll 2
          for (int q = 0; q < 2; ++q) t[q][p] = _mm512_fmadd_ps(w, x[q], t[q][p]);
        }
      }
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512 sc = _mm512_set1_ps(S[size_t(ch) * 4 + p]);
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) acc[q][p] = _mm512_fmadd_ps(t[q][p], sc, acc[q][p]);
      }
    }
    // qdot4_fp8_avx512's scalar rest, empty at these widths: +0 (there 0 * an infinite block scale
    // would make it NaN; finite scales, which every checkpoint has, give the same bits)
    const float rest = 0.f;
    for (int q = 0; q < nt; ++q)
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) out[t0 + q][p] = _mm512_reduce_add_ps(acc[q][p]) + rest;
  }
}

// qdot4_fp4_bf16dp for n activation rows (a prompt chunk's tokens of one expert). The pair kernel
// above decodes the four rows again for every two tokens: at ~16 tokens an expert (a 512-token
// chunk, top-8 of 256) the lookups cost as much as the products. Here the rows are decoded once
// into a per-thread buffer (per 128-column chunk: 4 x 4 vectors of bf16 words and 4 lane-scale
// vectors, 1.25 KB, so a 2,048-column row block is 20 KB, in L1) and the tokens then read it two at
// a time. Each token's partial sums, their scaling and reduction are qdot4_fp4_bf16dp's, in its
// order, so out[t] is its result bit for bit.
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) void qdot4xn_fp4_bf16dp(
    const QRow* rows, const uint16_t* const* xbs, int n, int C, float (*out)[4]) {
  const int nch = (C + 127) / 128;
  float* base0 = decode_scratch(size_t(nch) * 20 * 16);  // [nch][4 j][4 p] words, then [nch][4 p] scales
  __m512i* W = reinterpret_cast<__m512i*>(base0);
  __m512* S = reinterpret_cast<__m512*>(base0) + size_t(nch) * 16;
  const __m512i table = _mm512_load_si512(E2M1_BF16);
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {  // the decode, once for all n tokens
    const int nl = std::min(16, (C - base) / 8);
    const __mmask16 m = __mmask16((1u << nl) - 1);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      prefetch_ahead(rows[p].v + base / 2);
      const __m512i v = nl == 16 ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        _mm512_store_si512(W + (size_t(ch) * 4 + j) * 4 + p, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * j), table));
      _mm512_store_ps(S + size_t(ch) * 4 + p, fp4_scales_avx512(FMT, rows[p], base, nl));
    }
  }
  int t0 = 0;
  for (; t0 + 2 <= n; t0 += 2) {  // two tokens a pass: each decoded vector loaded once for both
    __m512 acc[2][4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[0][p] = acc[1][p] = _mm512_setzero_ps();
    for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {
      const int nl = std::min(16, (C - base) / 8), nw = 2 * nl;
      const __mmask16 m = __mmask16((1u << nl) - 1);
      __m512 t[2][4];
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) t[0][p] = t[1][p] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i xj[2];
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) {
          const uint16_t* xb = xbs[t0 + q];
          xj[q] = nl == 16 ? _mm512_loadu_si512(xb + base + 32 * j) : _mm512_maskz_loadu_epi32(m, xb + base + j * nw);
        }
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512i w = _mm512_load_si512(W + (size_t(ch) * 4 + j) * 4 + p);
#pragma GCC unroll 2
          for (int q = 0; q < 2; ++q) t[q][p] = _mm512_dpbf16_ps(t[q][p], (__m512bh)w, (__m512bh)xj[q]);
        }
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512 sc = _mm512_load_ps(reinterpret_cast<const float*>(S + size_t(ch) * 4 + p));
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) acc[q][p] = _mm512_fmadd_ps(t[q][p], sc, acc[q][p]);
      }
    }
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q)
    #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) out[t0 + q][p] = _mm512_reduce_add_ps(acc[q][p]);
  }
  if (t0 < n) {  // an odd count's last token
    const uint16_t* xb = xbs[t0];
    __m512 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
    for (int ch = 0, base = 0; ch < nch; ++ch, base += 128) {
      const int nl = std::min(16, (C - base) / 8), nw = 2 * nl;
      const __mmask16 m = __mmask16((1u << nl) - 1);
      __m512 t[4];
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) t[p] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i xj = nl == 16 ? _mm512_loadu_si512(xb + base + 32 * j) : _mm512_maskz_loadu_epi32(m, xb + base + j * nw);
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p)
          t[p] = _mm512_dpbf16_ps(t[p], (__m512bh)_mm512_load_si512(W + (size_t(ch) * 4 + j) * 4 + p), (__m512bh)xj);
      }
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p)
        acc[p] = _mm512_fmadd_ps(t[p], _mm512_load_ps(reinterpret_cast<const float*>(S + size_t(ch) * 4 + p)), acc[p]);
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[t0][p] = _mm512_reduce_add_ps(acc[p]);
  }
}

__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void qdot4_fp8_avx512(const QRow* rows, const float* x, int C,
                                                                                 int sdt, float* out) {
  // as qdot4_fp8_avx2: e4m3 -> f16 bits (value * 2^-8, exact) -> vcvtph2ps; 2^8 in the block scale
  const __m512i mask = _mm512_set1_epi16(short(0xBF80));
  __m512 acc[4];
  float rest[4] = {0.f, 0.f, 0.f, 0.f};
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
  for (int base = 0, cb = 0; base < C; base += 128, ++cb) {
    const int end = std::min(C, base + 128);
    __m512 t[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) t[p] = _mm512_setzero_ps();
    int c = base;
    for (; c + 32 <= end; c += 32) {
      const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        prefetch_ahead(rows[p].v + c);
        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[p].v + c)));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), mask);
        t[p] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), x0, t[p]);
        t[p] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), x1, t[p]);
      }
    }
    if (c + 16 <= end) {
      const __m512 x0 = _mm512_loadu_ps(x + c);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[p].v + c)));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm512_castsi512_si256(mask));
        t[p] = _mm512_fmadd_ps(_mm512_cvtph_ps(h), x0, t[p]);
      }
      c += 16;
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const float sc = fp8_scale(rows[p].s, sdt, cb);
      float r = 0.f;
      for (int k = c; k < end; ++k) r += e4m3_f32(rows[p].v[k]) * x[k];
      acc[p] = _mm512_fmadd_ps(t[p], _mm512_set1_ps(sc * 256.f), acc[p]);
      rest[p] += r * sc;
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) out[p] = _mm512_reduce_add_ps(acc[p]) + rest[p];
}

// qdot4_fp8_avx512 for two activation rows at once (a prompt chunk's tokens of one expert): each
// 32-byte load and e4m3 -> f32 conversion feeds both tokens; every token's block partial sums, its
// scalar rest, scaling and reduction are qdot4_fp8_avx512's in its order, so out[t] is that
// kernel's result bit for bit (tests/test_cpu_quantized.py test_token_pairs_give_the_per_token_bits).
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void qdot4x2_fp8_avx512(const QRow* rows, const float* const* xs,
                                                                                   int C, int sdt, float (*out)[4]) {
  const __m512i mask = _mm512_set1_epi16(short(0xBF80));
  __m512 acc[2][4];
  float rest[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[0][p] = acc[1][p] = _mm512_setzero_ps();
  for (int base = 0, cb = 0; base < C; base += 128, ++cb) {
    const int end = std::min(C, base + 128);
    __m512 t[2][4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) t[0][p] = t[1][p] = _mm512_setzero_ps();
    int c = base;
    for (; c + 32 <= end; c += 32) {
      __m512 x0[2], x1[2];
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) x0[q] = _mm512_loadu_ps(xs[q] + c), x1[q] = _mm512_loadu_ps(xs[q] + c + 16);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        prefetch_ahead(rows[p].v + c);
        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[p].v + c)));
        const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), mask);
        const __m512 w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h)), w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) {
          t[q][p] = _mm512_fmadd_ps(w0, x0[q], t[q][p]);
          t[q][p] = _mm512_fmadd_ps(w1, x1[q], t[q][p]);
        }
      }
    }
    if (c + 16 <= end) {
      __m512 x0[2];
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) x0[q] = _mm512_loadu_ps(xs[q] + c);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[p].v + c)));
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm512_castsi512_si256(mask));
        const __m512 w = _mm512_cvtph_ps(h);
#pragma GCC unroll 2
        for (int q = 0; q < 2; ++q) t[q][p] = _mm512_fmadd_ps(w, x0[q], t[q][p]);
      }
      c += 16;
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const float sc = fp8_scale(rows[p].s, sdt, cb);
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) {
        float r = 0.f;
        for (int k = c; k < end; ++k) r += e4m3_f32(rows[p].v[k]) * xs[q][k];
        acc[q][p] = _mm512_fmadd_ps(t[q][p], _mm512_set1_ps(sc * 256.f), acc[q][p]);
        rest[q][p] += r * sc;
      }
    }
  }
#pragma GCC unroll 2
  for (int q = 0; q < 2; ++q)
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[q][p] = _mm512_reduce_add_ps(acc[q][p]) + rest[q][p];
}

// --- int8 activations (opt-in, Executor::q8; not bit-exact): llama.cpp's way for 4-bit banks.
// An activation row is quantized in blocks of 32 columns (scale d = max|x| / 127) and laid out
// in chunks of 128 columns: 64 bytes of its even columns, 64 of its odd ones (a byte's low
// nibble is the even column), then 16 f32 lane scales and 16 int32 lane offsets (lane l =
// columns [8l, 8l + 8) of the chunk, the fp4 kernels' lane -> scale-block map). A weight nibble
// becomes 2 * e2m1 + 12 in [0, 24] (VPSHUFB), unsigned as VPDPBUSD wants; the offset lane
// starts at -12 * (the lane's 8 quantized activations), which takes the +12 back out exactly.
constexpr int Q8_CHUNK = 128;
enum Q8Kernel { Q8_SCALAR = 0, Q8_AVX2 = 1, Q8_VNNI = 2, Q8_VBMI = 3 };  // which int8 kernel runs (Executor::q8k)
struct Q8Act {  // one quantized row: chunks of [64 even | 64 odd] int8, then per chunk 16 scales, 16 offsets
  const int8_t* q;
  const float* xs;
  const int32_t* off;
};
inline int q8_chunks(int C) { return (C + Q8_CHUNK - 1) / Q8_CHUNK; }

// quantize_q8's blocks: the int8 values in the kernels' order and each lane's scale (scalar)
inline void quantize_q8_blocks(const float* x, int C, int8_t* q, float* xs) {
  const int nch = q8_chunks(C);
  std::memset(q, 0, size_t(nch) * Q8_CHUNK);
  for (int b = 0; b < nch * 4; ++b) {  // 32-column blocks
    const int c0 = b * 32, c1 = std::min(C, c0 + 32);
    float amax = 0.f;
    for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[c]));
    // amax below 127 / FLT_MAX (denormal blocks) would make inv infinite: such a block is zero
    const float d = amax / 127.f, inv = amax > 127.f / FLT_MAX ? 127.f / amax : 0.f;
    const int ch = c0 / Q8_CHUNK;
    for (int c = c0; c < c1; ++c) {
      const int o = c - ch * Q8_CHUNK;
      // clamped: a NaN activation (skipped by the max above) must not reach the int8 cast
      q[size_t(ch) * Q8_CHUNK + (o & 1) * 64 + o / 2] = int8_t(std::nearbyint(std::fmin(std::fmax(x[c] * inv, -127.f), 127.f)));
    }
    for (int l = (c0 % Q8_CHUNK) / 8; l < (c0 % Q8_CHUNK) / 8 + 4; ++l) xs[ch * 16 + l] = d;
  }
}

// quantize_q8's offsets: -12 x the sum of each lane's eight values (the kernels' +12 bias on e2m1)
inline void q8_offsets(const int8_t* q, int nch, int32_t* off) {
  for (int ch = 0; ch < nch; ++ch)
    for (int l = 0; l < 16; ++l) {
      int32_t sum = 0;
      for (int j = 0; j < 4; ++j)
        sum += q[size_t(ch) * Q8_CHUNK + 4 * l + j] + q[size_t(ch) * Q8_CHUNK + 64 + 4 * l + j];
      off[ch * 16 + l] = -12 * sum;
    }
}

// quantize_q8_blocks with AVX-512, the same bits (tests/test_cpu_int8_act.py checks it): a
// decode call quantizes its activation row and its eight h rows on the caller's thread while
// the pool waits (on the dev machine the scalar form took 7-8 us a 2,048-wide row; issue 12's
// fixed cost per call). Per 32-column block: max |x| with NaN lanes skipped (vmaxps returns its
// second operand when either is NaN, as std::max(amax, NaN) keeps amax), the product clamped as
// fmin(fmax(v, -127), 127) clamps it (a NaN product goes to -127), rounded in the current
// rounding mode (vcvtps2dq, as nearbyint), even columns to the chunk's first half, odd ones to
// its second. Every byte of the chunks is written (a tail's missing columns load as 0).
__attribute__((target("avx512f"))) void quantize_q8_blocks_avx512(const float* x, int C, int8_t* q, float* xs) {
  const int nch = q8_chunks(C);
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (int b = 0; b < nch * 4; ++b) {
    const int c0 = b * 32, n = std::max(0, std::min(32, C - c0));
    const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? __mmask16(0xFFFF) : n > 16 ? __mmask16((1u << (n - 16)) - 1) : __mmask16(0);
    const __m512 a = _mm512_maskz_loadu_ps(m0, x + c0), a2 = _mm512_maskz_loadu_ps(m1, x + c0 + 16);
    __m512 mx = _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps());
    mx = _mm512_max_ps(_mm512_abs_ps(a2), mx);
    const float amax = _mm512_reduce_max_ps(mx);
    const float d = amax / 127.f, inv = amax > 127.f / FLT_MAX ? 127.f / amax : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    const int ch = c0 / Q8_CHUNK, o = (c0 % Q8_CHUNK) / 2;
    const __m512 pe = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_permutex2var_ps(a, ev, a2), vi), lo), hi);
    const __m512 po = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_permutex2var_ps(a, od, a2), vi), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + size_t(ch) * Q8_CHUNK + o), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(pe)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + size_t(ch) * Q8_CHUNK + 64 + o),
                     _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(po)));
    for (int l = (c0 % Q8_CHUNK) / 8; l < (c0 % Q8_CHUNK) / 8 + 4; ++l) xs[ch * 16 + l] = d;
  }
}

// quantize_q8_blocks with AVX2 (CPUs without AVX-512, the AVX2 int8 kernel's), the same bits:
// the block's max, product, clamp and rounding as the AVX-512 form computes them (vmaxps keeping
// its second operand on a NaN, vcvtps2dq), 8 lanes at a time; the 32 values then go to their
// even / odd places by scalar stores (a block's 32 bytes: cheaper than the arithmetic was).
__attribute__((target("avx2,fma"))) void quantize_q8_blocks_avx2(const float* x, int C, int8_t* q, float* xs) {
  const int nch = q8_chunks(C);
  std::memset(q, 0, size_t(nch) * Q8_CHUNK);
  const __m256 sign = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int b = 0; b < nch * 4; ++b) {
    const int c0 = b * 32, n = std::max(0, std::min(32, C - c0));
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) {  // missing columns load as 0
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * k), lane);
      v[k] = _mm256_maskload_ps(x + c0 + 8 * k, m);
      mx = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), mx);  // |x|; a NaN lane keeps mx
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
    const float d = amax / 127.f, inv = amax > 127.f / FLT_MAX ? 127.f / amax : 0.f;
    const int ch = c0 / Q8_CHUNK, o = (c0 % Q8_CHUNK) / 2;
    alignas(32) int32_t r[32];
    for (int k = 0; k < 4; ++k)
      _mm256_store_si256(reinterpret_cast<__m256i*>(r + 8 * k),
                         _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(inv)), lo), hi)));
    int8_t* dst = q + size_t(ch) * Q8_CHUNK;
    for (int k = 0; k < 16; ++k) {
      dst[o + k] = int8_t(r[2 * k]);
      dst[64 + o + k] = int8_t(r[2 * k + 1]);
    }
    for (int l = (c0 % Q8_CHUNK) / 8; l < (c0 % Q8_CHUNK) / 8 + 4; ++l) xs[ch * 16 + l] = d;
  }
}

// x [C] f32 -> q [chunks * 128] int8, xs [chunks * 16] f32, off [chunks * 16] int32 (C a
// multiple of 16, as every 4-bit bank's is; the tail of the last chunk is zero): in a vector
// form where the CPU has AVX-512 or AVX2, else the scalar one
inline void quantize_q8(Isa isa, const float* x, int C, int8_t* q, float* xs, int32_t* off) {
  if (isa >= AVX512)
    quantize_q8_blocks_avx512(x, C, q, xs);
  else if (isa >= AVX2)
    quantize_q8_blocks_avx2(x, C, q, xs);
  else
    quantize_q8_blocks(x, C, q, xs);
  q8_offsets(q, q8_chunks(C), off);
}

alignas(16) const int8_t E2M1_X2_PLUS12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The scalar form of qdot4_fp4_q8 (its exact integer arithmetic), for CPUs without VNNI and
// for checking the vector kernel.
template <int FMT>
void qdot4_fp4_q8_scalar(const QRow* rows, const Q8Act& a, int C, float* out) {
  for (int p = 0; p < 4; ++p) {
    const QRow& r = rows[p];
    float acc = 0.f;
    for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch)
      for (int l = 0; l < 16 && base + 8 * l < C; ++l) {
        int32_t t = a.off[ch * 16 + l];
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = r.v[(base + 8 * l) / 2 + j];
          t += E2M1_X2_PLUS12[byte & 15] * a.q[size_t(ch) * Q8_CHUNK + 4 * l + j];
          t += E2M1_X2_PLUS12[byte >> 4] * a.q[size_t(ch) * Q8_CHUNK + 64 + 4 * l + j];
        }
        const int c = base + 8 * l;
        const float sw = FMT == FMT_MXFP4 ? e8m0_f32(r.s[c / 32]) : e4m3_f32(r.s[c / 16]) * r.s2;
        acc += float(t) * (sw * a.xs[ch * 16 + l]);
      }
    out[p] = 0.5f * acc;
  }
}

// qdot4_fp4_q8 for CPUs with AVX2 but no AVX512-VNNI (most consumer Intel CPUs, AMD before Zen 4;
// the exact AVX2 kernel spends ~5 instructions on every 8 weights, this one ~14 on 64): a chunk
// in two 256-bit halves (lanes 0-7, 8-15). VPMADDUBSW multiplies the unsigned codes (2 e2m1 + 12,
// in [0, 24]) by the signed activations into 16-bit pair sums (at most 2 x 24 x 127 = 6,096; the
// even and odd columns' sums added, 12,192: no saturation), VPMADDWD by ones sums them into each
// lane's 32 bits: the integers VPDPBUSD gives. The lanes' f32 arithmetic is the VNNI kernel's
// (the same scales, fp4_scales_avx2's per 64 columns; cvt, scale, fma), and the two halves are
// reduced in _mm512_reduce_add_ps's order (hi + lo, then hsum8's), so the outputs are the VNNI
// kernel's bit for bit (test_int8_avx2_kernel_equals_the_vnni_one).
template <int FMT, bool RS, int HINT = HINT_RUNTIME>
__attribute__((target("avx2,fma,f16c"))) void qdot4_fp4_q8_avx2_rs(const QRow* rows, const Q8Act& a, int C, float* out) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2_PLUS12)));
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 acc[2][4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[0][p] = acc[1][p] = _mm256_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales_h<HINT>(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
    const int nl = std::min(16, (C - base) / 8);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int nh = std::min(8, nl - 8 * h);  // this half's lanes
      if (nh <= 0) break;
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(nh), lane);
      const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + size_t(ch) * Q8_CHUNK + 32 * h));
      const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + size_t(ch) * Q8_CHUNK + 64 + 32 * h));
      const __m256i off = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.off + ch * 16 + 8 * h));
      const __m256 xs = _mm256_loadu_ps(a.xs + ch * 16 + 8 * h);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const uint8_t* src = rows[p].v + base / 2 + 32 * h;
        prefetch_ahead_h<HINT>(src);
        const __m256i v = nh == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                  : _mm256_maskload_epi32(reinterpret_cast<const int*>(src), m);
        const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nib));
        const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        const __m256i t = _mm256_add_epi32(off, _mm256_madd_epi16(pairs, ones));
        const __m256 sw = RS ? fp4_half_scales_avx2<FMT>(bs + p * ss, 2 * ch + h) : fp4_scales_avx2(FMT, rows[p], base + 64 * h, nh);
        acc[h][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(sw, xs), acc[h][p]);
      }
    }
  }
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) out[p] = 0.5f * hsum8(_mm256_add_ps(acc[1][p], acc[0][p]));
}

// qdot4_fp4_q8_avx2 with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says
template <int FMT>
__attribute__((target("avx2,fma,f16c"))) inline void qdot4_fp4_q8_avx2(const QRow* rows, const Q8Act& a, int C, float* out) {
  if (g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX2) return qdot4_fp4_q8_avx2_rs<FMT, true>(rows, a, C, out);
  return qdot4_fp4_q8_avx2_rs<FMT, false>(rows, a, C, out);
}

// One 128-column chunk of a quantized activation row, as both int8 kernels read it: its lanes
// (nl of 16 where the row ends inside it), even and odd columns, lane offsets and scales.
struct Q8Chunk {
  int nl;
  __mmask16 m;
  __m512i xe, xo, off;
  __m512 xs;
  // a row's 64 bytes of packed codes for this chunk (fewer at the row's end), the lines
  // g_pf bytes ahead prefetched
  __attribute__((target("avx512f,avx512bw"))) __m512i codes(const QRow& r, int base) const {
    prefetch_ahead(r.v + base / 2);
    return nl == 16 ? _mm512_loadu_si512(r.v + base / 2) : _mm512_maskz_loadu_epi32(m, r.v + base / 2);
  }
};
__attribute__((target("avx512f,avx512bw"))) inline Q8Chunk q8_chunk(const Q8Act& a, int C, int base, int ch) {
  Q8Chunk c;
  c.nl = std::min(16, (C - base) / 8);
  c.m = __mmask16((1u << c.nl) - 1);
  c.xe = _mm512_loadu_si512(a.q + size_t(ch) * Q8_CHUNK);
  c.xo = _mm512_loadu_si512(a.q + size_t(ch) * Q8_CHUNK + 64);
  c.off = _mm512_loadu_si512(a.off + ch * 16);
  c.xs = _mm512_loadu_ps(a.xs + ch * 16);
  return c;
}

template <int FMT, bool RS>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c"))) void qdot4_fp4_q8_rs(const QRow* rows, const Q8Act& a,
                                                                                      int C, float* out) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2_PLUS12)));
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 acc[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
    const Q8Chunk c = q8_chunk(a, C, base, ch);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = c.codes(rows[p], base);
      const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, nib));
      const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
      const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c.off, lo, c.xe), hi, c.xo);
      const __m512 sw = RS ? fp4_chunk_scales<FMT>(bs + p * ss, ch) : fp4_scales_avx512(FMT, rows[p], base, c.nl);
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sw, c.xs), acc[p]);
    }
  }
  half_sums4(acc, out);
}

// qdot4_fp4_q8 with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c"))) inline void qdot4_fp4_q8(const QRow* rows, const Q8Act& a,
                                                                                      int C, float* out) {
  if (g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX512) return qdot4_fp4_q8_rs<FMT, true>(rows, a, C, out);
  return qdot4_fp4_q8_rs<FMT, false>(rows, a, C, out);
}

// The same sums with fewer instructions per 64 bytes where AVX512-VBMI is there (Ice Lake,
// Sapphire Rapids, Zen 4): at batch 1 the kernel above is bound by its own instructions as much
// as by DRAM (on the dev machine's Xeon, 2 threads: 27.9 GB/s with the 8 experts in L3 against
// 20.0 from DRAM and a 28.8 GB/s read probe), so every instruction per chunk counts.
// - VPERMB looks a code up in a 64-entry table by the low 6 bits of its byte: the low nibble
//   needs no mask, the high one (a 16-bit shift by 4 leaves the next byte's low bits above it)
//   none either, each entry repeating the 16-entry table (5 instructions -> 3).
// - The block scales, as in every fp4 kernel, are decoded once per row (fp4_block_scales) and
//   taken per chunk by one load and one permute (until the forty-fifth session this kernel made
//   them per chunk from the scale bytes by a masked VPERMB, a shift and a max: 4 instructions).
// The integers and the f32 arithmetic are the kernel above's, bit for bit. (With the constant
// moved to the end of the row instead, the sums differed in their last bits, and the int8
// rounding of the intermediate activations then flipped more often: a whole-model test saw 4
// steps of 9 move by ~1e-3 against its reference.)
alignas(64) const int8_t E2M1_X2_PLUS12_64[64] = {
    12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
    12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// A chunk's lane scales as the VBMI kernel made them before fp4_block_scales (the A/B's other
// side, FREETOKEN_CPU_ROW_SCALES=0): one masked VPERMB of the chunk's scale bytes into byte 0 of
// each lane (MXFP4: lane l <- byte l / 4; e8m0 -> f32 bits by a shift, a 0 byte -> 2^-127 by a
// max); NVFP4 into byte 1 of each 16-bit word (lane l <- byte l / 2), then e4m3 -> f16 as
// fp4_scales_avx512 does, times 2^8 * scale_2 in one multiply: f * (2^8 s2) rounds as
// (f * 2^8) * s2 does, f * 2^8 being exact.
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,f16c"))) inline __m512 vbmi_chunk_scales(const QRow& r, int base, int nl) {
  if (FMT == FMT_MXFP4) {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i b = _mm512_castsi128_si512(_mm_cvtsi32_si128(int(chunk_scales<4>(r.s + base / 32, nl / 4))));
    const __m512i e = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, idx, b);
    return _mm512_castsi512_ps(_mm512_max_epi32(_mm512_slli_epi32(e, 23), _mm512_set1_epi32(0x00400000)));
  }
  const __m256i idx = _mm256_set_epi16(7 << 8, 7 << 8, 6 << 8, 6 << 8, 5 << 8, 5 << 8, 4 << 8, 4 << 8,
                                       3 << 8, 3 << 8, 2 << 8, 2 << 8, 1 << 8, 1 << 8, 0, 0);
  const __m256i b = _mm256_castsi128_si256(_mm_cvtsi64_si128(int64_t(chunk_scales<8>(r.s + base / 16, nl / 2))));
  const __m256i w = _mm256_maskz_permutexvar_epi8(0xAAAAAAAAu, idx, b);  // byte << 8 per word
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(w, 1), _mm256_set1_epi16(short(0xBF80)))),
                       _mm512_set1_ps(256.f * r.s2));
}

// One row's 128-column chunk in qdot4_fp4_q8_vbmi_rs, added to its accumulator (s: the row's
// block scales decoded once, with RS)
template <int FMT, bool RS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"), always_inline)) inline void vbmi_step(
    const QRow& r, const Q8Chunk& c, __m512i lut, const float* s, int base, int ch, __m512& acc) {
  const __m512i v = c.codes(r, base);
  const __m512i lo = _mm512_permutexvar_epi8(v, lut);
  const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut);
  const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c.off, lo, c.xe), hi, c.xo);
  const __m512 sw = RS ? fp4_chunk_scales<FMT>(s, ch) : vbmi_chunk_scales<FMT>(r, base, c.nl);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sw, c.xs), acc);
}

template <int FMT, bool RS, bool SEQ>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))) void qdot4_fp4_q8_vbmi_rs(
    const QRow* rows, const Q8Act& a, int C, float* out) {
  const __m512i lut = _mm512_load_si512(E2M1_X2_PLUS12_64);
  __m512 acc[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
  int ss = 0;  // bs: [4][ss] f32 block scales, the VNNI kernel's (RS; else made per chunk)
  const float* bs = RS ? fp4_block_scales<FMT>(rows, C, &ss) : nullptr;
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  if (SEQ) {
    for (int p = 0; p < 4; ++p)
      for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch)
        vbmi_step<FMT, RS>(rows[p], q8_chunk(a, C, base, ch), lut, bs + p * ss, base, ch, acc[p]);
  } else {
    for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
      const Q8Chunk c = q8_chunk(a, C, base, ch);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) vbmi_step<FMT, RS>(rows[p], c, lut, bs + p * ss, base, ch, acc[p]);
    }
  }
  half_sums4(acc, out);
}

// qdot4_fp4_q8_vbmi with the block scales decoded once per row (RS) or per chunk, as g_row_scales's mask says,
// and its rows side by side or one after another, as g_row_seq says
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))) inline void qdot4_fp4_q8_vbmi(
    const QRow* rows, const Q8Act& a, int C, float* out) {
  const bool rs = g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX512;
  if (g_row_seq.load(std::memory_order_relaxed))
    return rs ? qdot4_fp4_q8_vbmi_rs<FMT, true, true>(rows, a, C, out) : qdot4_fp4_q8_vbmi_rs<FMT, false, true>(rows, a, C, out);
  return rs ? qdot4_fp4_q8_vbmi_rs<FMT, true, false>(rows, a, C, out) : qdot4_fp4_q8_vbmi_rs<FMT, false, false>(rows, a, C, out);
}

#include "row_runs.h"

// The int8 kernels (VBMI and VNNI: their codes and lane scales are the same values) for n
// activation rows, a prompt chunk's tokens of one expert: the four rows' codes looked up once
// into a per-thread buffer (per 128-column chunk: 4 rows x their even and odd int8 weights, then
// 4 lane-scale vectors, 768 bytes; 12 KB for a 2,048-column row block), then each token's
// integer dots, scaling and reduction exactly as qdot4_fp4_q8 makes them, so out[t] is its result
// bit for bit. Until this, int8 activations took a prompt's tokens one at a time, looking every
// block up again for each (a 512-token prompt on the 12-layer MXFP4 slice: 69 tok/s against 94
// with the exact kernels decoding once).
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c"))) void qdot4xn_fp4_q8(const QRow* rows, const Q8Act* as, int n,
                                                                                       int C, float (*out)[4]) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2_PLUS12)));
  const __m512i nib = _mm512_set1_epi8(15);
  const int nch = q8_chunks(C);
  __m512i* D = reinterpret_cast<__m512i*>(thread_scratch<2>(size_t(nch) * 12 * 16));  // [nch][4 x (lo, hi) | 4 scales]
  int ss = 0;
  const float* bs = fp4_block_scales<FMT>(rows, C, &ss);
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
    Q8Chunk c;  // only its lanes: codes() reads the row's bytes as the one-token kernels do
    c.nl = std::min(16, (C - base) / 8);
    c.m = __mmask16((1u << c.nl) - 1);
    __m512i* d = D + size_t(ch) * 12;
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i v = c.codes(rows[p], base);
      d[2 * p] = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, nib));
      d[2 * p + 1] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib));
      d[8 + p] = _mm512_castps_si512(fp4_chunk_scales<FMT>(bs + p * ss, ch));
    }
  }
  for (int t = 0; t < n; ++t) {
    __m512 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
    for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
      const Q8Chunk c = q8_chunk(as[t], C, base, ch);
      const __m512i* d = D + size_t(ch) * 12;
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i q = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c.off, d[2 * p], c.xe), d[2 * p + 1], c.xo);
        acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(_mm512_castsi512_ps(d[8 + p]), c.xs), acc[p]);
      }
    }
    half_sums4(acc, out[t]);
  }
}

// qdot4xn_fp4_q8 for CPUs without AVX-512 (most consumer ones): qdot4_fp4_q8_avx2's codes and
// half-chunk lane scales looked up once per 4-row block into the per-thread buffer (per chunk and
// half: 4 rows x (even, odd codes, lane scales), 768 bytes a chunk), then each token's integer
// dots (VPMADDUBSW + VPMADDWD), scaling and reduction exactly as that kernel makes them: out[t] is
// its result bit for bit. Per token and 32 bytes of codes: 8 instructions instead of 13.
template <int FMT>
__attribute__((target("avx2,fma,f16c"))) void qdot4xn_fp4_q8_avx2(const QRow* rows, const Q8Act* as, int n, int C,
                                                                 float (*out)[4]) {
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(E2M1_X2_PLUS12)));
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int nch = q8_chunks(C);
  __m256i* D = reinterpret_cast<__m256i*>(thread_scratch<2>(size_t(nch) * 24 * 8));  // [nch][2 halves][4 x (lo, hi, sw)]
  int ss = 0;
  const float* bs = fp4_block_scales<FMT>(rows, C, &ss);
  prefetch_scales(rows, FMT == FMT_MXFP4 ? C / 32 : C / 16);
  for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
    const int nl = std::min(16, (C - base) / 8);
    for (int h = 0; h < 2; ++h) {
      const int nh = std::min(8, nl - 8 * h);
      if (nh <= 0) break;
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(nh), lane);
      __m256i* d = D + size_t(ch) * 24 + 12 * h;
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const uint8_t* src = rows[p].v + base / 2 + 32 * h;
        prefetch_ahead(src);
        const __m256i v = nh == 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))
                                  : _mm256_maskload_epi32(reinterpret_cast<const int*>(src), m);
        d[3 * p] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nib));
        d[3 * p + 1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
        d[3 * p + 2] = _mm256_castps_si256(fp4_half_scales_avx2<FMT>(bs + p * ss, 2 * ch + h));
      }
    }
  }
  for (int t = 0; t < n; ++t) {
    const Q8Act& a = as[t];
    __m256 acc[2][4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[0][p] = acc[1][p] = _mm256_setzero_ps();
    for (int base = 0, ch = 0; base < C; base += Q8_CHUNK, ++ch) {
      const int nl = std::min(16, (C - base) / 8);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        if (nl - 8 * h <= 0) break;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + size_t(ch) * Q8_CHUNK + 32 * h));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + size_t(ch) * Q8_CHUNK + 64 + 32 * h));
        const __m256i off = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.off + ch * 16 + 8 * h));
        const __m256 xs = _mm256_loadu_ps(a.xs + ch * 16 + 8 * h);
        const __m256i* d = D + size_t(ch) * 24 + 12 * h;
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(d[3 * p], xe), _mm256_maddubs_epi16(d[3 * p + 1], xo));
          const __m256i q = _mm256_add_epi32(off, _mm256_madd_epi16(pairs, ones));
          acc[h][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(_mm256_castsi256_ps(d[3 * p + 2]), xs), acc[h][p]);
        }
      }
    }
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[t][p] = 0.5f * hsum8(_mm256_add_ps(acc[1][p], acc[0][p]));
  }
}

inline void qdot4_q8(int kernel, int fmt, const QRow* rows, const Q8Act& a, int C, float* out) {
  const bool mx = fmt == FMT_MXFP4;
  if (kernel == Q8_VBMI) return mx ? qdot4_fp4_q8_vbmi<FMT_MXFP4>(rows, a, C, out) : qdot4_fp4_q8_vbmi<FMT_NVFP4>(rows, a, C, out);
  if (kernel == Q8_VNNI) return mx ? qdot4_fp4_q8<FMT_MXFP4>(rows, a, C, out) : qdot4_fp4_q8<FMT_NVFP4>(rows, a, C, out);
  if (kernel == Q8_AVX2) return mx ? qdot4_fp4_q8_avx2<FMT_MXFP4>(rows, a, C, out) : qdot4_fp4_q8_avx2<FMT_NVFP4>(rows, a, C, out);
  return mx ? qdot4_fp4_q8_scalar<FMT_MXFP4>(rows, a, C, out) : qdot4_fp4_q8_scalar<FMT_NVFP4>(rows, a, C, out);
}

// The int8 kernels' decode-once form by kernel and format (VBMI and VNNI share one)
inline void qdot4xn_q8(int kernel, int fmt, const QRow* rows, const Q8Act* as, int n, int C, float (*out)[4]) {
  if (kernel < Q8_AVX2) {  // the scalar kernel has no decode-once form (run_q does not send it here)
    for (int t = 0; t < n; ++t) qdot4_q8(kernel, fmt, rows, as[t], C, out[t]);
    return;
  }
  const bool mx = fmt == FMT_MXFP4;
  if (kernel == Q8_AVX2) return mx ? qdot4xn_fp4_q8_avx2<FMT_MXFP4>(rows, as, n, C, out) : qdot4xn_fp4_q8_avx2<FMT_NVFP4>(rows, as, n, C, out);
  mx ? qdot4xn_fp4_q8<FMT_MXFP4>(rows, as, n, C, out) : qdot4xn_fp4_q8<FMT_NVFP4>(rows, as, n, C, out);
}

// The activation layout each (format, ISA, bf16-dot) kernel reads.
inline Layout layout_for(int fmt, Isa isa, bool dp) {
  Layout l;
  if (fmt == FMT_FP8 || isa == SCALAR) return l;
  if (dp) l.g = 4, l.L = 32;
  else l.g = 8, l.L = isa >= AVX512 ? 16 : 8;
  return l;
}

// Four rows of a quantized bank against one activation row in its layout (x f32; xb bf16 for dp).
inline void qdot4(Isa isa, int fmt, bool dp, const QRow* rows, const float* x, const uint16_t* xb, int C, int sdt,
                  float* out) {
  if (fmt == FMT_FP8) {
    if (isa >= AVX512) return qdot4_fp8_avx512(rows, x, C, sdt, out);
    if (isa == AVX2) return qdot4_fp8_avx2(rows, x, C, sdt, out);
    return qdot4_scalar<FMT_FP8>(rows, x, C, sdt, out);
  }
  const bool mx = fmt == FMT_MXFP4;
  if (dp) return mx ? qdot4_fp4_bf16dp<FMT_MXFP4>(rows, xb, C, out) : qdot4_fp4_bf16dp<FMT_NVFP4>(rows, xb, C, out);
  if (isa >= AVX512) return mx ? qdot4_fp4_avx512<FMT_MXFP4>(rows, x, C, out) : qdot4_fp4_avx512<FMT_NVFP4>(rows, x, C, out);
  if (isa == AVX2) return mx ? qdot4_fp4_avx2<FMT_MXFP4>(rows, x, C, out) : qdot4_fp4_avx2<FMT_NVFP4>(rows, x, C, out);
  return mx ? qdot4_scalar<FMT_MXFP4>(rows, x, C, sdt, out) : qdot4_scalar<FMT_NVFP4>(rows, x, C, sdt, out);
}

// The two-token form of the bf16-activation fp4 kernels (run_q with dp, where pair2 holds).
inline void qdot4x2_dp(int fmt, const QRow* rows, const uint16_t* const* xbs, int C, float (*out)[4]) {
  if (fmt == FMT_MXFP4) return qdot4x2_fp4_bf16dp<FMT_MXFP4>(rows, xbs, C, out);
  qdot4x2_fp4_bf16dp<FMT_NVFP4>(rows, xbs, C, out);
}

// The n-token forms (the rows decoded once for all n tokens of an expert): fp4 with bf16
// activations (qdot4xn_fp4_bf16dp, rows xb) or float ones (qdot4xn_fp4_avx512, rows xf), fp8 with
// float ones and C a multiple of 16 (qdot4xn_fp8_avx512, rows xf); on AVX2 (isa), fp4 with float
// activations (qdot4xn_fp4_avx2).
inline void qdot4xn(int fmt, bool dp, const float* const* xf, const uint16_t* const* xb, int n, const QRow* rows, int C,
                    int sdt, float (*out)[4], Isa isa = AVX512) {
  if (isa == AVX2)  // fp4 with float activations on a CPU without AVX-512 (qdot4xn_fp4_avx2)
    return fmt == FMT_MXFP4 ? qdot4xn_fp4_avx2<FMT_MXFP4>(rows, xf, n, C, out) : qdot4xn_fp4_avx2<FMT_NVFP4>(rows, xf, n, C, out);
  if (fmt == FMT_FP8) return qdot4xn_fp8_avx512(rows, xf, n, C, sdt, out);
  const bool mx = fmt == FMT_MXFP4;
  if (dp) return mx ? qdot4xn_fp4_bf16dp<FMT_MXFP4>(rows, xb, n, C, out) : qdot4xn_fp4_bf16dp<FMT_NVFP4>(rows, xb, n, C, out);
  mx ? qdot4xn_fp4_avx512<FMT_MXFP4>(rows, xf, n, C, out) : qdot4xn_fp4_avx512<FMT_NVFP4>(rows, xf, n, C, out);
}

// The two-token form of qdot4's exact AVX-512 kernels (run_q takes it where pair2 holds).
inline void qdot4x2(int fmt, const QRow* rows, const float* const* xs, int C, int sdt, float (*out)[4]) {
  if (fmt == FMT_FP8) return qdot4x2_fp8_avx512(rows, xs, C, sdt, out);
  if (fmt == FMT_MXFP4) return qdot4x2_fp4_avx512<FMT_MXFP4>(rows, xs, C, out);
  qdot4x2_fp4_avx512<FMT_NVFP4>(rows, xs, C, out);
}

// ---------------------------------------------------------------- executor
struct Executor {
  Pool pool;
  Isa isa;
  std::mutex call_mutex;  // one MoE call at a time: the pool is shared
  // int8 activations for the 4-bit banks (set_act_int8; off: the exact kernels); q8k: which
  // int8 kernel (VBMI, VNNI, AVX2, or the scalar form: no AVX2, an ISA cap, tests)
  bool q8 = false;
  int q8k = Q8_SCALAR;  // the int8 kernel (Q8Kernel)
  // the last quantized call's time by part, us (timing(): where a call's fixed cost goes, issue
  // 12): the wrapper's checks, the grouping and layouts, x's quantization, phase 1, h's
  // quantization, phase 2. Six clock reads a call (~20 ns each).
  double last_us[6] = {0, 0, 0, 0, 0, 0};
  // each column's place in a layout, for the x (k = 0) and h (k = 1) rows: computed once per
  // (layout, width) instead of every call (a division-heavy 2,560-column loop: 12-14 us of a
  // decode call's fixed cost on the dev machine). Calls hold call_mutex: one writer at a time.
  std::vector<int> pos_[2];
  int pos_key_[2][3] = {{0, 0, -1}, {0, 0, -1}};
  const std::vector<int>& positions(const Layout& lay, int C, int k) {
    int* key = pos_key_[k];
    if (key[0] != lay.g || key[1] != lay.L || key[2] != C) {
      pos_[k].resize(C);
      for (int c = 0; c < C; ++c) pos_[k][c] = lay.pos(c, C);
      key[0] = lay.g, key[1] = lay.L, key[2] = C;
    }
    return pos_[k];
  }
  using clk = std::chrono::steady_clock;
  static double us(clk::time_point a, clk::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }
  Executor(const std::vector<int>& cpus, int isa_cap, int spin)
      : pool(cpus, spin < 0 ? default_spin() : spin), isa(std::min<Isa>(detect(), Isa(isa_cap))) {}

  template <typename W>
  void run(const float* x, const int64_t* ids, const float* gw, int T, int K, const W* gu, const W* dn,
           int H, int I, float* out, bool bf16_act, const ExpertFn& fn = ExpertFn()) {
    const bool plain = fn.plain();
    // group (token, slot) pairs by expert, in ascending expert id: a fixed summation order
    const int P = T * K;
    std::vector<int> order(P);
    for (int p = 0; p < P; ++p) order[p] = p;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    std::vector<int> starts;  // group g covers order[starts[g], starts[g+1])
    int first = 0;  // pairs with the "no expert" id (-1, rows that are not running) sort first: skip them
    while (first < P && ids[order[first]] < 0) ++first;
    for (int p = first; p < P; ++p)
      if (p == first || ids[order[p]] != ids[order[p - 1]]) starts.push_back(p);
    starts.push_back(P);
    const int G = int(starts.size()) - 1;
    std::vector<float> h(size_t(P) * I);  // intermediate activations, row per pair (in `order`)
    const bool dp = bf16_act && isa == AVX512_BF16 && std::is_same<W, uint16_t>::value;
    std::vector<uint16_t> xb, hb;
    if (dp) {
      xb.resize(size_t(T) * H);
      for (size_t i = 0; i < xb.size(); ++i) xb[i] = f32_to_bf16(x[i]);
      hb.resize(size_t(P) * I);
    }
    const int nt = pool.size();
    constexpr int RB = 16;  // rows per work unit
    const int ib = (I + RB - 1) / RB;
    const bool quad = g_token_block && isa >= AVX512;  // 4-token blocks (dot4x4_*) where a group has them
    // phase 1: gate and up rows of every selected expert
    Share sh1, sh2;
    pool.run([&](int tid) {
      const int units = G * ib;
      float g4[4], v4[4];
      auto gate_rows = [&](int u) -> const W* {  // first gate row of work unit u (its up rows: + I * H)
        return gu + ids[order[starts[u / ib]]] * int64_t(2 * I) * H + int64_t((u % ib) * RB) * H;
      };
      for (int u0, u1, k = 0; sh1.take(units, tid, nt, k++, u0, u1);)
      for (int u = u0; u < u1; ++u) {
        const int g = u / ib, r0 = (u % ib) * RB, r1 = std::min(I, r0 + RB);
        const int64_t e = ids[order[starts[g]]];
        const W* wg = gu + e * int64_t(2 * I) * H;
        for (int r = r0; r < r1; r += 4) {
          const int nr = std::min(4, r1 - r);
          // the gate (and up) block read next: 4 rows on, or the next unit's first
          const W* nx_ = r + 4 < r1 ? wg + int64_t(r + 4) * H : (u + 1 < u1 ? gate_rows(u + 1) : nullptr);
          for (int q = starts[g]; q < starts[g + 1]; ++q) {
            if (nr == 4 && quad && starts[g + 1] - q >= 4) {  // four of the expert's tokens at once
              const W* nx = q == starts[g] ? nx_ : nullptr;
              float g44[4][4], v44[4][4];
              if (dp) {
                const uint16_t* xs[4];
                for (int t = 0; t < 4; ++t) xs[t] = xb.data() + int64_t(order[q + t] / K) * H;
                auto nb = reinterpret_cast<const uint16_t*>(nx);
                dot4x4_bf16dp(reinterpret_cast<const uint16_t*>(wg) + int64_t(r) * H, H, xs, H, g44, nb);
                dot4x4_bf16dp(reinterpret_cast<const uint16_t*>(wg) + int64_t(I + r) * H, H, xs, H, v44,
                              nb ? nb + int64_t(I) * H : nullptr);
              } else {
                const float* xs[4];
                for (int t = 0; t < 4; ++t) xs[t] = x + int64_t(order[q + t] / K) * H;
                dot4x4_avx512(wg + int64_t(r) * H, H, xs, H, g44, nx);
                dot4x4_avx512(wg + int64_t(I + r) * H, H, xs, H, v44, nx ? nx + int64_t(I) * H : nullptr);
              }
              for (int t = 0; t < 4; ++t)
                for (int j = 0; j < 4; ++j) {
                  const float hv = plain ? silu(g44[j][t]) * v44[j][t] : fn.h(e, I, r + j, g44[j][t], v44[j][t]);
                  h[size_t(q + t) * I + r + j] = hv;
                  if (dp) hb[size_t(q + t) * I + r + j] = f32_to_bf16(hv);
                }
              q += 3;
              continue;
            }
            const int tok = order[q] / K;
            if (nr == 4) {
              // the next block once per group: later tokens re-read this one from L1
              const W* nx = q == starts[g] ? nx_ : nullptr;
              if (dp) {
                auto nb = reinterpret_cast<const uint16_t*>(nx);
                dot4_bf16dp(reinterpret_cast<const uint16_t*>(wg) + int64_t(r) * H, H, xb.data() + int64_t(tok) * H, H, g4, nb);
                dot4_bf16dp(reinterpret_cast<const uint16_t*>(wg) + int64_t(I + r) * H, H, xb.data() + int64_t(tok) * H, H, v4,
                            nb ? nb + int64_t(I) * H : nullptr);
              } else {
                dot4(isa, wg + int64_t(r) * H, H, x + int64_t(tok) * H, H, g4, nx);
                dot4(isa, wg + int64_t(I + r) * H, H, x + int64_t(tok) * H, H, v4, nx ? nx + int64_t(I) * H : nullptr);
              }
            } else {
              for (int j = 0; j < nr; ++j) {
                float gs = 0.f, vs = 0.f;
                for (int i = 0; i < H; ++i) {
                  const float xi = dp ? bf16_to_f32(xb[int64_t(tok) * H + i]) : x[int64_t(tok) * H + i];
                  gs += load1(wg + int64_t(r + j) * H, i) * xi;
                  vs += load1(wg + int64_t(I + r + j) * H, i) * xi;
                }
                g4[j] = gs, v4[j] = vs;
              }
            }
            for (int j = 0; j < nr; ++j) {
              const float hv = plain ? silu(g4[j]) * v4[j] : fn.h(e, I, r + j, g4[j], v4[j]);
              h[size_t(q) * I + r + j] = hv;
              if (dp) hb[size_t(q) * I + r + j] = f32_to_bf16(hv);
            }
          }
        }
      }
    });
    // phase 2: down rows; each thread owns a range of output columns for all tokens
    const int hb_blocks = (H + RB - 1) / RB;
    pool.run([&](int tid) {
      float d4[4];
      for (int b0, b1, k = 0; sh2.take(hb_blocks, tid, nt, k++, b0, b1);)
      for (int blk = b0; blk < b1; ++blk) {
        const int r0 = blk * RB, r1 = std::min(H, r0 + RB);
        for (int r = r0; r < r1; ++r)
          for (int t = 0; t < T; ++t) out[int64_t(t) * H + r] = 0.f;
        for (int g = 0; g < G; ++g) {
          const int64_t e = ids[order[starts[g]]];
          const W* wd = dn + e * int64_t(H) * I;
          for (int r = r0; r < r1; r += 4) {
            const int nr = std::min(4, r1 - r);
            // the block read next: 4 rows on, the next expert's rows r0.., or the next row block's
            const W* nx_ = r + 4 < r1 ? wd + int64_t(r + 4) * I
                           : g + 1 < G ? dn + ids[order[starts[g + 1]]] * int64_t(H) * I + int64_t(r0) * I
                           : blk + 1 < b1 ? dn + ids[order[starts[0]]] * int64_t(H) * I + int64_t(r1) * I : nullptr;
            for (int q = starts[g]; q < starts[g + 1]; ++q) {
              if (nr == 4 && quad && starts[g + 1] - q >= 4) {  // four pairs at once, added in order
                const W* nx = q == starts[g] ? nx_ : nullptr;
                float d44[4][4];
                if (dp) {
                  const uint16_t* hs[4];
                  for (int t = 0; t < 4; ++t) hs[t] = hb.data() + size_t(q + t) * I;
                  dot4x4_bf16dp(reinterpret_cast<const uint16_t*>(wd) + int64_t(r) * I, I, hs, I, d44,
                                reinterpret_cast<const uint16_t*>(nx));
                } else {
                  const float* hs[4];
                  for (int t = 0; t < 4; ++t) hs[t] = h.data() + size_t(q + t) * I;
                  dot4x4_avx512(wd + int64_t(r) * I, I, hs, I, d44, nx);
                }
                for (int t = 0; t < 4; ++t) {
                  const int tok = order[q + t] / K;
                  const float wq = gw[order[q + t]];
                  for (int j = 0; j < 4; ++j)
                    out[int64_t(tok) * H + r + j] += wq * (plain ? d44[j][t] : fn.y(e, H, r + j, d44[j][t]));
                }
                q += 3;
                continue;
              }
              const int tok = order[q] / K;
              const float wq = gw[order[q]];
              if (nr == 4) {
                const W* nx = q == starts[g] ? nx_ : nullptr;  // once per group, as in phase 1
                if (dp)
                  dot4_bf16dp(reinterpret_cast<const uint16_t*>(wd) + int64_t(r) * I, I, hb.data() + size_t(q) * I, I, d4,
                              reinterpret_cast<const uint16_t*>(nx));
                else
                  dot4(isa, wd + int64_t(r) * I, I, h.data() + size_t(q) * I, I, d4, nx);
              } else {
                for (int j = 0; j < nr; ++j) {
                  float s = 0.f;
                  for (int i = 0; i < I; ++i)
                    s += load1(wd + int64_t(r + j) * I, i) * (dp ? bf16_to_f32(hb[size_t(q) * I + i]) : h[size_t(q) * I + i]);
                  d4[j] = s;
                }
              }
              if (plain)
                for (int j = 0; j < nr; ++j) out[int64_t(tok) * H + r + j] += wq * d4[j];
              else
                for (int j = 0; j < nr; ++j) out[int64_t(tok) * H + r + j] += wq * fn.y(e, H, r + j, d4[j]);
            }
          }
        }
      }
    });
  }
  // Quantized banks: the same two phases, work split and summation order as run(); each
  // 4-row block is dequantized in registers by qdot4 for every pair routed to the expert.
  void run_q(const float* x, const int64_t* ids, const float* gw, int T, int K, const QBank& gu, const QBank& dn,
             int H, int I, float* out, bool bf16_act, const ExpertFn& fn = ExpertFn()) {
    const clk::time_point t0 = clk::now();
    const int fmt = gu.fmt;
    const bool plain = fn.plain();
    const int P = T * K;
    std::vector<int> order(P);
    for (int p = 0; p < P; ++p) order[p] = p;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    std::vector<int> starts;
    int first = 0;  // NO_EXPERT (-1) pairs sort first: skipped
    while (first < P && ids[order[first]] < 0) ++first;
    for (int p = first; p < P; ++p)
      if (p == first || ids[order[p]] != ids[order[p - 1]]) starts.push_back(p);
    starts.push_back(P);
    const int G = int(starts.size()) - 1;
    const bool i8 = q8 && fmt != FMT_FP8;  // fp8 values are not small integers: exact kernels
    const bool dp = !i8 && bf16_act && isa == AVX512_BF16 && fmt != FMT_FP8;
    const Layout lay = i8 ? Layout() : layout_for(fmt, isa, dp);
    // two tokens at a time where an expert has them: the exact kernels on AVX-512, float
    // activations (qdot4x2_fp4_avx512 / qdot4x2_fp8_avx512) or bf16 ones (qdot4x2_fp4_bf16dp), the
    // same bits as one at a time; int8 activations take one token at a time
    const bool pair2 = g_token_block && !i8 && isa >= AVX512;
    const std::vector<int>& posH = positions(lay, H, 0);
    const std::vector<int>& posI = positions(lay, I, 1);
    // activations in the kernel's layout (bf16 for the dot-product path); h rows likewise
    std::vector<float> xl, hl;
    std::vector<uint16_t> xb, hb;
    if (dp) {
      xb.resize(size_t(T) * H);
      hb.resize(size_t(P) * I);
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < H; ++c) xb[size_t(t) * H + posH[c]] = f32_to_bf16(x[size_t(t) * H + c]);
    } else {
      hl.resize(size_t(P) * I);
      if (!i8) {  // int8: quantized below instead
        xl.resize(size_t(T) * H);
        for (int t = 0; t < T; ++t)
          for (int c = 0; c < H; ++c) xl[size_t(t) * H + posH[c]] = x[size_t(t) * H + c];
      }
    }
    // int8: x rows quantized once here, h rows between the phases
    const int chH = q8_chunks(H), chI = q8_chunks(I);
    std::vector<int8_t> xq, hq;
    std::vector<float> xqs, hqs;
    std::vector<int32_t> xqo, hqo;
    auto q8row = [](const std::vector<int8_t>& q, const std::vector<float>& s, const std::vector<int32_t>& o, int ch,
                    size_t row) { return Q8Act{q.data() + row * ch * Q8_CHUNK, s.data() + row * ch * 16, o.data() + row * ch * 16}; };
    // rows quantized over the pool's threads when there are many (a prefill chunk), else here (a
    // decode call: a pool hand-off costs more than its few rows)
    auto rows_over_pool = [&](int from, int n, size_t cols, const std::function<void(int)>& f) {
      if (size_t(n - from) * cols < (size_t(1) << 16)) {
        for (int r = from; r < n; ++r) f(r);
        return;
      }
      pool.run([&](int tid) {
        for (int r = from + tid; r < n; r += pool.size()) f(r);
      });
    };
    const clk::time_point t1 = clk::now();
    if (i8) {
      xq.resize(size_t(T) * chH * Q8_CHUNK), xqs.resize(size_t(T) * chH * 16), xqo.resize(size_t(T) * chH * 16);
      rows_over_pool(0, T, H, [&](int t) {
        quantize_q8(isa, x + size_t(t) * H, H, xq.data() + size_t(t) * chH * Q8_CHUNK, xqs.data() + size_t(t) * chH * 16,
                    xqo.data() + size_t(t) * chH * 16);
      });
    }
    const clk::time_point t2 = clk::now();
    const int nt = pool.size();
    constexpr int RB = 16;  // rows per work unit
    const int ib = (I + RB - 1) / RB;
    Share sh1, sh2;
    // decode once (qdot4xn) for an expert with at least g_decode_once of the call's tokens: the
    // fp4 formats on AVX-512, float or bf16 activations; fp8 where both widths are multiples of 16
    const int once_min = g_decode_once.load(std::memory_order_relaxed);
    // (on AVX2: fp4 with float activations, qdot4xn_fp4_avx2; there is no pair kernel there)
    const bool once = once_min > 0 && (pair2 ? fmt != FMT_FP8 || (H % 16 == 0 && I % 16 == 0)
                                             : g_token_block && !i8 && isa == AVX2 && fmt != FMT_FP8);
    // int8 activations: the VBMI / VNNI / AVX2 kernels' decode-once forms (qdot4xn_q8), same threshold
    const bool once8 = g_token_block && i8 && q8k >= Q8_AVX2 && once_min > 0;
    // one token on a run of an expert's rows (the decode calls) in one kernel call (row_runs.h): the
    // fp4 banks with int8 activations on VBMI or AVX2, bf16 ones (dp), float ones on AVX-512 or AVX2.
    // The exact AVX-512 kernels take an expert's tokens in pairs where it has two or more (pair2):
    // runs where it has one.
    int run_kind = -1;
    if (g_row_runs.load(std::memory_order_relaxed) && fmt != FMT_FP8) {
      if (i8) run_kind = q8k == Q8_VBMI ? RUN_Q8_VBMI : q8k == Q8_AVX2 ? RUN_Q8_AVX2 : -1;
      else run_kind = dp ? RUN_BF16DP : isa >= AVX512 ? RUN_F32 : isa == AVX2 ? RUN_F32_AVX2 : -1;
    }
    // a pair's activations for a run kernel (only the one its kind reads is set)
    auto run_x = [&](bool first, size_t row, int64_t cols) {
      struct { Q8Act a{}; const float* x = nullptr; const uint16_t* xb = nullptr; } r;
      if (i8) r.a = first ? q8row(xq, xqs, xqo, chH, row) : q8row(hq, hqs, hqo, chI, row);
      else if (dp) r.xb = (first ? xb.data() : hb.data()) + row * cols;
      else r.x = (first ? xl.data() : hl.data()) + row * cols;
      return r;
    };
    pool.run([&](int tid) {
      const int units = G * ib;
      float g4[4], v4[4];
      QRow rg[4], ru[4];
      std::vector<const float*> xf;     // the expert's token rows (decode-once path): float
      std::vector<const uint16_t*> x16;  // or bf16 (dp)
      std::vector<Q8Act> xa8;            // or int8 (once8)
      std::vector<float> gn, vn;         // [n][4] their gate and up dots
      for (int u0, u1, k = 0; sh1.take(units, tid, nt, k++, u0, u1);)
      for (int u = u0; u < u1; ++u) {
        const int g = u / ib, r0 = (u % ib) * RB, r1 = std::min(I, r0 + RB);
        const int64_t e = ids[order[starts[g]]];
        const int cnt = starts[g + 1] - starts[g];
        const bool many = (once || once8) && cnt >= once_min;
        if (run_kind >= 0 && !many && (i8 || !pair2 || cnt == 1) && (r1 - r0) % 4 == 0) {
          // each token's gate and up rows of the unit in one call each
          float gr[RB], vr[RB];
          for (int q = starts[g]; q < starts[g + 1]; ++q) {
            const auto xr = run_x(true, size_t(order[q] / K), H);
            qrun(run_kind, gu, e, r0, (r1 - r0) / 4, xr.a, xr.x, xr.xb, gr);
            qrun(run_kind, gu, e, I + r0, (r1 - r0) / 4, xr.a, xr.x, xr.xb, vr);
            for (int j = 0; j < r1 - r0; ++j) {
              const float hv = plain ? silu(gr[j]) * vr[j] : fn.h(e, I, r0 + j, gr[j], vr[j]);
              if (dp) hb[size_t(q) * I + posI[r0 + j]] = f32_to_bf16(hv);
              else hl[size_t(q) * I + posI[r0 + j]] = hv;
            }
          }
          continue;
        }
        if (many) {
          gn.resize(size_t(cnt) * 4), vn.resize(size_t(cnt) * 4);
          (i8 ? xa8.resize(cnt) : dp ? x16.resize(cnt) : xf.resize(cnt));
          for (int i = 0; i < cnt; ++i) {
            const int tok = order[starts[g] + i] / K;
            const size_t row = size_t(tok) * H;
            if (i8) xa8[i] = q8row(xq, xqs, xqo, chH, tok);
            else if (dp) x16[i] = xb.data() + row;
            else xf[i] = xl.data() + row;
          }
        }
        for (int r = r0; r < r1; r += 4) {
          const int nr = std::min(4, r1 - r);
          for (int j = 0; j < 4; ++j) {  // a short block repeats its last row
            rg[j] = qrow(gu, e, r + std::min(j, nr - 1));
            ru[j] = qrow(gu, e, I + r + std::min(j, nr - 1));
          }
          if (many) {
            float(*g2)[4] = reinterpret_cast<float(*)[4]>(gn.data());
            float(*v2)[4] = reinterpret_cast<float(*)[4]>(vn.data());
            if (i8) {
              qdot4xn_q8(q8k, fmt, rg, xa8.data(), cnt, H, g2);
              qdot4xn_q8(q8k, fmt, ru, xa8.data(), cnt, H, v2);
            } else {
              qdot4xn(fmt, dp, xf.data(), x16.data(), cnt, rg, H, gu.sdt, g2, isa);
              qdot4xn(fmt, dp, xf.data(), x16.data(), cnt, ru, H, gu.sdt, v2, isa);
            }
            for (int i = 0; i < cnt; ++i)
              for (int j = 0; j < nr; ++j) {
                const float hv = plain ? silu(g2[i][j]) * v2[i][j] : fn.h(e, I, r + j, g2[i][j], v2[i][j]);
                if (dp) hb[size_t(starts[g] + i) * I + posI[r + j]] = f32_to_bf16(hv);
                else hl[size_t(starts[g] + i) * I + posI[r + j]] = hv;
              }
            continue;
          }
          for (int q = starts[g]; q < starts[g + 1]; ++q) {
            if (pair2 && starts[g + 1] - q >= 2) {  // two of the expert's tokens at once (exact, AVX-512)
              const size_t t0 = size_t(order[q] / K), t1 = size_t(order[q + 1] / K);
              float g2[2][4], v2[2][4];
              if (dp) {
                const uint16_t* xs[2] = {xb.data() + t0 * H, xb.data() + t1 * H};
                qdot4x2_dp(fmt, rg, xs, H, g2);
                qdot4x2_dp(fmt, ru, xs, H, v2);
              } else {
                const float* xs[2] = {xl.data() + t0 * H, xl.data() + t1 * H};
                qdot4x2(fmt, rg, xs, H, gu.sdt, g2);
                qdot4x2(fmt, ru, xs, H, gu.sdt, v2);
              }
              for (int t = 0; t < 2; ++t)
                for (int j = 0; j < nr; ++j) {
                  const float hv = plain ? silu(g2[t][j]) * v2[t][j] : fn.h(e, I, r + j, g2[t][j], v2[t][j]);
                  if (dp) hb[size_t(q + t) * I + posI[r + j]] = f32_to_bf16(hv);
                  else hl[size_t(q + t) * I + posI[r + j]] = hv;
                }
              ++q;
              continue;
            }
            const int tok = order[q] / K;
            if (i8) {
              const Q8Act xa = q8row(xq, xqs, xqo, chH, tok);
              qdot4_q8(q8k, fmt, rg, xa, H, g4);
              qdot4_q8(q8k, fmt, ru, xa, H, v4);
            } else {
              const float* xr = dp ? nullptr : xl.data() + size_t(tok) * H;
              const uint16_t* xbr = dp ? xb.data() + size_t(tok) * H : nullptr;
              qdot4(isa, fmt, dp, rg, xr, xbr, H, gu.sdt, g4);
              qdot4(isa, fmt, dp, ru, xr, xbr, H, gu.sdt, v4);
            }
            for (int j = 0; j < nr; ++j) {
              const float hv = plain ? silu(g4[j]) * v4[j] : fn.h(e, I, r + j, g4[j], v4[j]);
              if (dp) hb[size_t(q) * I + posI[r + j]] = f32_to_bf16(hv);
              else hl[size_t(q) * I + posI[r + j]] = hv;
            }
          }
        }
      }
    });
    const clk::time_point t3 = clk::now();
    if (i8) {  // posI is the identity here: hl rows are in natural order
      hq.resize(size_t(P) * chI * Q8_CHUNK), hqs.resize(size_t(P) * chI * 16), hqo.resize(size_t(P) * chI * 16);
      rows_over_pool(first, P, I, [&](int q) {  // pairs before `first` run no expert
        quantize_q8(isa, hl.data() + size_t(q) * I, I, hq.data() + size_t(q) * chI * Q8_CHUNK,
                    hqs.data() + size_t(q) * chI * 16, hqo.data() + size_t(q) * chI * 16);
      });
    }
    const clk::time_point t4 = clk::now();
    const int hb_blocks = (H + RB - 1) / RB;
    pool.run([&](int tid) {
      float d4[4];
      QRow rd[4];
      std::vector<const float*> hf;     // the expert's h rows (decode-once path): float
      std::vector<const uint16_t*> h16;  // or bf16 (dp)
      std::vector<Q8Act> ha8;            // or int8 (once8)
      std::vector<float> dnn;            // [n][4] their down dots
      std::vector<float> dr;             // a pair's down rows over the thread's range (runs)
      for (int b0, b1, k = 0; sh2.take(hb_blocks, tid, nt, k++, b0, b1);) {
        for (int t = 0; t < T; ++t)
          for (int r = b0 * RB; r < std::min(H, b1 * RB); ++r) out[int64_t(t) * H + r] = 0.f;
        // expert by expert over the thread's whole row range, so each expert's down rows are one
        // contiguous stretch (block by block, a 4-bit bank gives 4 KB per expert, too short to
        // stream); every output still adds the experts in ascending order, as block by block
        for (int g = 0; g < G; ++g) {
          const int64_t e = ids[order[starts[g]]];
          const int cnt = starts[g + 1] - starts[g];
          const bool many = (once || once8) && cnt >= once_min;
          const int rr0 = b0 * RB, rr1 = std::min(H, b1 * RB);
          if (run_kind >= 0 && !many && (i8 || !pair2 || cnt == 1) && (rr1 - rr0) % 4 == 0) {
            // each pair's rows of the thread's range in one call
            dr.resize(size_t(rr1 - rr0));
            for (int q = starts[g]; q < starts[g + 1]; ++q) {
              const auto hr = run_x(false, size_t(q), I);
              qrun(run_kind, dn, e, rr0, (rr1 - rr0) / 4, hr.a, hr.x, hr.xb, dr.data());
              const int tok = order[q] / K;
              const float wq = gw[order[q]];
              if (plain)
                for (int j = 0; j < rr1 - rr0; ++j) out[int64_t(tok) * H + rr0 + j] += wq * dr[j];
              else
                for (int j = 0; j < rr1 - rr0; ++j) out[int64_t(tok) * H + rr0 + j] += wq * fn.y(e, H, rr0 + j, dr[j]);
            }
            continue;
          }
          if (many) {
            dnn.resize(size_t(cnt) * 4);
            (i8 ? ha8.resize(cnt) : dp ? h16.resize(cnt) : hf.resize(cnt));
            for (int i = 0; i < cnt; ++i) {
              const size_t row = size_t(starts[g] + i) * I;
              if (i8) ha8[i] = q8row(hq, hqs, hqo, chI, starts[g] + i);
              else if (dp) h16[i] = hb.data() + row;
              else hf[i] = hl.data() + row;
            }
          }
          for (int blk = b0; blk < b1; ++blk) {
            const int r0 = blk * RB, r1 = std::min(H, r0 + RB);
            for (int r = r0; r < r1; r += 4) {
              const int nr = std::min(4, r1 - r);
              for (int j = 0; j < 4; ++j) rd[j] = qrow(dn, e, r + std::min(j, nr - 1));
              if (many) {  // every token of the expert, added in the pairs' order as below
                float(*d2)[4] = reinterpret_cast<float(*)[4]>(dnn.data());
                if (i8) qdot4xn_q8(q8k, fmt, rd, ha8.data(), cnt, I, d2);
                else qdot4xn(fmt, dp, hf.data(), h16.data(), cnt, rd, I, dn.sdt, d2, isa);
                for (int i = 0; i < cnt; ++i) {
                  const int tok = order[starts[g] + i] / K;
                  const float wq = gw[order[starts[g] + i]];
                  for (int j = 0; j < nr; ++j)
                    out[int64_t(tok) * H + r + j] += wq * (plain ? d2[i][j] : fn.y(e, H, r + j, d2[i][j]));
                }
                continue;
              }
              for (int q = starts[g]; q < starts[g + 1]; ++q) {
                if (pair2 && starts[g + 1] - q >= 2) {  // two pairs at once, added in order
                  float d2[2][4];
                  if (dp) {
                    const uint16_t* hs[2] = {hb.data() + size_t(q) * I, hb.data() + size_t(q + 1) * I};
                    qdot4x2_dp(fmt, rd, hs, I, d2);
                  } else {
                    const float* hs[2] = {hl.data() + size_t(q) * I, hl.data() + size_t(q + 1) * I};
                    qdot4x2(fmt, rd, hs, I, dn.sdt, d2);
                  }
                  for (int t = 0; t < 2; ++t) {
                    const int tok = order[q + t] / K;
                    const float wq = gw[order[q + t]];
                    for (int j = 0; j < nr; ++j)
                      out[int64_t(tok) * H + r + j] += wq * (plain ? d2[t][j] : fn.y(e, H, r + j, d2[t][j]));
                  }
                  ++q;
                  continue;
                }
                const int tok = order[q] / K;
                const float wq = gw[order[q]];
                if (i8)
                  qdot4_q8(q8k, fmt, rd, q8row(hq, hqs, hqo, chI, q), I, d4);
                else
                  qdot4(isa, fmt, dp, rd, dp ? nullptr : hl.data() + size_t(q) * I, dp ? hb.data() + size_t(q) * I : nullptr,
                        I, dn.sdt, d4);
                if (plain)
                  for (int j = 0; j < nr; ++j) out[int64_t(tok) * H + r + j] += wq * d4[j];
                else
                  for (int j = 0; j < nr; ++j) out[int64_t(tok) * H + r + j] += wq * fn.y(e, H, r + j, d4[j]);
              }
            }
          }
        }
      }
    });
    const clk::time_point t5 = clk::now();
    const clk::time_point ts[6] = {t0, t1, t2, t3, t4, t5};
    for (int k = 1; k < 6; ++k) last_us[k] = us(ts[k - 1], ts[k]);
  }
};

std::vector<std::unique_ptr<Executor>> g_execs;

Executor& exec_of(int64_t handle) {  // a literal message (see BANK_CHECK), not vector::at's
  TORCH_CHECK(handle >= 0 && handle < int64_t(g_execs.size()), "moe_cpu: unknown executor handle");
  return *g_execs[handle];
}

// spin: the pool's pause loops before a worker sleeps (-1: FREETOKEN_CPU_SPIN or 20000)
int64_t create(std::vector<int64_t> cpus, int64_t isa_cap, int64_t spin) {
  std::vector<int> c(cpus.begin(), cpus.end());
  g_execs.emplace_back(new Executor(c, int(isa_cap), int(spin)));
  return int64_t(g_execs.size()) - 1;
}

int64_t isa_of(int64_t handle) { return exec_of(handle).isa; }

bool cpu_has_vnni() {
  __builtin_cpu_init();
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_has_vbmi() {
  __builtin_cpu_init();
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
  // VL too: the NVFP4 scales' 256-bit masked VPERMB (every VBMI CPU has it; a hypervisor may mask bits)
  return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

// int8 activations for the executor's MXFP4 / NVFP4 calls (on) or the exact kernels (off).
// Returns the kernel that serves them: "vbmi" (AVX512-VBMI and VNNI), "vnni", "avx2" (AVX2
// without AVX512-VNNI), or "scalar" (no AVX2, or under a lower ISA cap: correct, slow; the
// caller warns); max_kernel caps it (Q8Kernel: 2 keeps the VNNI kernel where VBMI is there too,
// 1 the AVX2 one, for tests and A/B runs).
std::string set_act_int8(int64_t handle, bool on, int64_t max_kernel) {
  Executor& ex = exec_of(handle);
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> g(ex.call_mutex);  // not in the middle of a call
  ex.q8 = on;
  int k = Q8_SCALAR;
  if (on && ex.isa >= AVX512 && cpu_has_vnni()) k = cpu_has_vbmi() ? Q8_VBMI : Q8_VNNI;
  else if (on && ex.isa >= AVX2) k = Q8_AVX2;
  ex.q8k = std::min<int>(k, int(std::max<int64_t>(max_kernel, 0)));
  return ex.q8k == Q8_VBMI ? "vbmi" : ex.q8k == Q8_VNNI ? "vnni" : ex.q8k == Q8_AVX2 ? "avx2" : "scalar";
}

// The executor's worker threads end (after the call in flight, if any); the executor itself
// stays, so an address a host call holds stays valid, and runs single-threaded if called again.
// CpuExpertExecutor calls it when it is garbage collected: a process that makes many (tests,
// benchmarks) does not pile up pinned threads.
void release(int64_t handle) {
  Executor& ex = exec_of(handle);
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> g(ex.call_mutex);
  ex.pool.stop();
}

// The expert function of a call from its Python arguments: act (Activation.code), alpha, limit,
// and the bias banks gate_up_bias [N, 2I], down_bias [N, H] (None, or both bf16 or both f32).
ExpertFn make_fn(int64_t act, double alpha, double limit, const c10::optional<torch::Tensor>& gu_bias,
                 const c10::optional<torch::Tensor>& dn_bias, int64_t N, int H, int I, bool bf16_act) {
  // literal messages only (see BANK_CHECK); experts/cpu's Python side checks these first, with
  // the shapes in its message
  TORCH_CHECK(act >= ACT_SILU && act <= ACT_SILU_CLAMP, "moe_cpu: unknown expert activation code");
  ExpertFn f;
  f.act = int(act), f.alpha = float(alpha), f.limit = float(limit);
  const torch::Tensor* first = nullptr;
  auto take = [&](const c10::optional<torch::Tensor>& b, int64_t cols, const char* bad) -> const void* {
    if (!b.has_value() || !b->defined()) return nullptr;
    const torch::Tensor& t = *b;
    TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == cols && t.is_contiguous() && t.device().is_cpu() &&
                    (t.scalar_type() == torch::kBFloat16 || t.scalar_type() == torch::kFloat32),
                bad);
    TORCH_CHECK(first == nullptr || first->scalar_type() == t.scalar_type(), "moe_cpu: the two bias banks must share a dtype");
    first = &t;
    return t.data_ptr();
  };
  f.gu_bias = take(gu_bias, 2 * int64_t(I),
                   "moe_cpu: gate_up_bias must be a contiguous host tensor [N, 2I], bfloat16 or float32");
  f.dn_bias = take(dn_bias, H, "moe_cpu: down_bias must be a contiguous host tensor [N, H], bfloat16 or float32");
  f.bias_bf16 = first != nullptr && first->scalar_type() == torch::kBFloat16;
  f.bias_round = bf16_act && !f.bias_bf16;
  return f;
}

// x [T, H] f32, ids [T, K] i64 (flat expert ids), w [T, K] f32, gate_up [N, 2I, H], down [N, H, I]
// (both bf16 or both f32) -> out [T, H] f32. bf16_act: x holds bf16-exact values (bf16 model).
// act, alpha, limit, gate_up_bias, down_bias: the expert function (make_fn; default SiLU, no biases).
torch::Tensor forward(int64_t handle, torch::Tensor x, torch::Tensor ids, torch::Tensor w,
                      torch::Tensor gate_up, torch::Tensor down, bool bf16_act, int64_t act, double alpha,
                      double limit, c10::optional<torch::Tensor> gate_up_bias, c10::optional<torch::Tensor> down_bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && ids.dtype() == torch::kInt64 && w.dtype() == torch::kFloat32,
              "moe_cpu.forward: x f32, ids i64, w f32 expected");
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && w.sizes() == ids.sizes() && ids.size(0) == x.size(0) &&
                  gate_up.dim() == 3 && down.dim() == 3,
              "moe_cpu.forward: x [T, H], ids and w [T, K], banks [N, rows, cols] expected");
  TORCH_CHECK(gate_up.dtype() == down.dtype(), "gate_up and down banks must share a dtype");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(), "banks must be contiguous");
  x = x.contiguous(), ids = ids.contiguous(), w = w.contiguous();
  const int T = x.size(0), H = x.size(1), K = ids.size(1), I = down.size(2);
  const int64_t N = gate_up.size(0);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(1) == H, "bank shapes");
  auto idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) TORCH_CHECK(idp[i] >= -1 && idp[i] < N, "expert id out of range");
  const ExpertFn fn = make_fn(act, alpha, limit, gate_up_bias, down_bias, N, H, I, bf16_act);
  TORCH_CHECK(gate_up.dtype() == torch::kBFloat16 || gate_up.dtype() == torch::kFloat32, "banks must be bf16 or f32");
  auto out = torch::empty({T, H}, x.options());
  Executor& ex = exec_of(handle);
  // every check above throws with the GIL held (a check failing with it released is the likely
  // cause of a crash seen on the GPU machine's torch 2.11 / Python 3.12); only the compute runs
  // without it
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> g(ex.call_mutex);
  if (gate_up.dtype() == torch::kBFloat16) {
    ex.run<uint16_t>(x.data_ptr<float>(), idp, w.data_ptr<float>(), T, K,
                     reinterpret_cast<const uint16_t*>(gate_up.data_ptr()),
                     reinterpret_cast<const uint16_t*>(down.data_ptr()), H, I, out.data_ptr<float>(), bf16_act, fn);
  } else {
    ex.run<float>(x.data_ptr<float>(), idp, w.data_ptr<float>(), T, K, gate_up.data_ptr<float>(),
                  down.data_ptr<float>(), H, I, out.data_ptr<float>(), false, fn);
  }
  return out;
}

// ---------------------------------------------------------------- calls from inside a CUDA graph
// The GPU hands a decode step's CPU share to this executor in stream order: a host-function
// node (cuLaunchHostFunc, recorded in the graph) calls host_call(desc) once the step's
// inputs have landed in pinned buffers, and the device copies `out` back after it returns. The
// descriptor and buffers are fixed per batch shape (experts/cpu/hostcall.py), so one graph
// replays every step. No CUDA call happens here; an error cannot be thrown across the driver
// thread, so it is recorded in the descriptor and raised by Python at the next check.
struct HostCall {
  int64_t executor;     // the Executor's address (executor_address): no registry lookup on this thread
  const float* x;       // [T, H] f32
  const int64_t* ids;   // [T, K] flat ids, -1 = nothing on the CPU
  const float* w;       // [T, K] f32 gate weights
  float* out;           // [T, H] f32
  const void* gate_up;  // [N, 2I, H]
  const void* down;     // [N, H, I]
  int64_t n;            // N, for the id check
  int32_t T, K, H, I;
  int32_t bank_bf16;    // banks: 1 bf16, 0 f32
  int32_t bf16_act;     // x holds bf16-exact values
  int32_t error;        // set when a call failed (ids out of range, an exception)
  int64_t calls;        // calls made (telemetry)
  int64_t busy_ns;      // time spent computing (telemetry: the CPU branch's busy time)
  // the expert function (make_fn's; all zero = SiLU without biases, descriptors from before)
  const void* gate_up_bias;  // [N, 2I] or null
  const void* down_bias;     // [N, H] or null
  int32_t act;               // Activation.code
  int32_t bias_bf16;         // biases: 1 bf16, 0 f32
  float alpha, limit;        // swiglu_clamp's
  const void* qbanks;        // a QPair (qbanks_create) for quantized banks, else null (gate_up/down)
  int64_t stage;             // how far the last call got (a diagnosis of a call that never
                             // returned): 1 entered, 2 holds the executor's lock, 3 returned
};

// Quantized banks for HostCall.qbanks: checked once by make_bank, kept until qbanks_free (the
// tensors they point into belong to the CpuExpertExecutor, which outlives its descriptors).
struct QPair {
  QBank gu, dn;
};

void host_call(void* p) {
  HostCall* c = static_cast<HostCall*>(p);
  __atomic_store_n(&c->stage, int64_t(1), __ATOMIC_RELAXED);
  struct Returned {  // stage 3 on every way out
    HostCall* c;
    ~Returned() { __atomic_store_n(&c->stage, int64_t(3), __ATOMIC_RELEASE); }
  } returned{c};
  try {
    const auto t0 = std::chrono::steady_clock::now();
    bool any = false;
    for (int64_t i = 0; i < int64_t(c->T) * c->K; ++i) {
      if (c->ids[i] < -1 || c->ids[i] >= c->n) {  // never leave the last call's result behind
        std::memset(c->out, 0, sizeof(float) * size_t(c->T) * c->H);
        c->error = 1;
        return;
      }
      any |= c->ids[i] >= 0;
    }
    if (!any) {  // nothing on the CPU this call (fill-only moments of an adaptive split): no pool wake-up
      std::memset(c->out, 0, sizeof(float) * size_t(c->T) * c->H);
      c->calls += 1;
      return;
    }
    ExpertFn fn;
    fn.act = c->act, fn.alpha = c->alpha, fn.limit = c->limit;
    fn.gu_bias = c->gate_up_bias, fn.dn_bias = c->down_bias;
    fn.bias_bf16 = c->bias_bf16 != 0, fn.bias_round = c->bf16_act != 0 && c->bias_bf16 == 0;
    if (fn.act < ACT_SILU || fn.act > ACT_SILU_CLAMP) {
      std::memset(c->out, 0, sizeof(float) * size_t(c->T) * c->H);
      c->error = 2;
      return;
    }
    Executor& ex = *reinterpret_cast<Executor*>(c->executor);
    std::lock_guard<std::mutex> g(ex.call_mutex);
    __atomic_store_n(&c->stage, int64_t(2), __ATOMIC_RELAXED);
    if (c->qbanks) {
      const QPair& q = *static_cast<const QPair*>(c->qbanks);
      if (q.gu.R != 2 * int64_t(c->I) || q.gu.C != c->H || q.dn.R != c->H || q.dn.C != c->I) {  // not this call's banks
        std::memset(c->out, 0, sizeof(float) * size_t(c->T) * c->H);
        c->error = 2;
        return;
      }
      ex.run_q(c->x, c->ids, c->w, c->T, c->K, q.gu, q.dn, c->H, c->I, c->out, c->bf16_act != 0, fn);
    } else if (c->bank_bf16)
      ex.run<uint16_t>(c->x, c->ids, c->w, c->T, c->K, static_cast<const uint16_t*>(c->gate_up),
                       static_cast<const uint16_t*>(c->down), c->H, c->I, c->out, c->bf16_act != 0, fn);
    else
      ex.run<float>(c->x, c->ids, c->w, c->T, c->K, static_cast<const float*>(c->gate_up),
                    static_cast<const float*>(c->down), c->H, c->I, c->out, false, fn);
    c->calls += 1;
    c->busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  } catch (...) {
    std::memset(c->out, 0, sizeof(float) * size_t(c->T) * c->H);
    c->error = 2;
  }
}

// One quantized bank from its tensors (values, scale, scale_2 or an empty tensor), checked
// against the logical shape [N, R, C] and the format's layout (weights/quant.py). A failed check
// leaves a literal message in err (b is then unusable), which the bindings raise with a
// one-argument TORCH_CHECK. No message is built here: on the GPU machine (torch 2.11, Python
// 3.12) every error whose message this extension built (a TORCH_CHECK with several arguments,
// which formats through an ostringstream here, and a std::runtime_error from a concatenated
// std::string) crashed the process, while a literal TORCH_CHECK raised (bench/probe_cpp_errors.py,
// 2026-12-02). QuantBank (weights/quant.py) checks the same things first and names the shapes.
#define BANK_CHECK(cond, msg)                                                               \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      err = down ? "moe_cpu: down bank " msg : "moe_cpu: gate_up bank " msg;                \
      return b;                                                                             \
    }                                                                                       \
  } while (0)

QBank make_bank(int fmt, const torch::Tensor& v, const torch::Tensor& s, const torch::Tensor& s2, int64_t N,
                int64_t R, int64_t C, int halves, bool down, const char*& err) {
  QBank b;
  BANK_CHECK(v.is_contiguous() && s.is_contiguous(), "values and scales must be contiguous");
  BANK_CHECK(v.element_size() == 1 && v.dim() == 3 && v.size(0) == N && v.size(1) == R, "values shape");
  b.fmt = fmt, b.R = R, b.C = C, b.halves = halves;
  b.v = reinterpret_cast<const uint8_t*>(v.data_ptr());
  b.s = reinterpret_cast<const uint8_t*>(s.data_ptr());
  BANK_CHECK(s.dim() == 3 && s.size(0) == N, "scale shape");
  if (fmt == FMT_FP8) {
    BANK_CHECK(v.size(2) == C, "fp8 values must be [N, R, C]");
    const int64_t per = (R / halves + 127) / 128;
    BANK_CHECK(R % halves == 0 && s.size(1) == halves * per && s.size(2) == (C + 127) / 128,
               "fp8 scale must be one per 128 x 128 block of each half");
    const auto dt = s.scalar_type();
    BANK_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kFloat16,
               "fp8 scale dtype must be float32, bfloat16 or float16");
    b.sdt = dt == torch::kFloat32 ? 0 : dt == torch::kBFloat16 ? 1 : 2;
    b.vrow = C, b.srow = s.size(2), b.sR = s.size(1);
  } else {
    const int blk = fmt == FMT_MXFP4 ? 32 : 16;
    BANK_CHECK(C % blk == 0 && v.size(2) * 2 == C, "fp4 values must be [N, R, C/2], C a multiple of the block");
    BANK_CHECK(s.element_size() == 1 && s.size(1) == R && s.size(2) == C / blk, "fp4 scale must be [N, R, C/block]");
    b.vrow = C / 2, b.srow = C / blk, b.sR = R;
    if (fmt == FMT_NVFP4) {
      BANK_CHECK(s2.defined() && s2.scalar_type() == torch::kFloat32 && s2.is_contiguous() && s2.numel() == N * halves,
                 "nvfp4 scale_2 must be float32 [N, halves]");
      b.s2 = s2.data_ptr<float>();
    }
  }
  return b;
}
#undef BANK_CHECK

// The gate_up and down QBanks of forward_q's bank arguments (I from the down values); err as
// make_bank's (nullptr when both are good).
std::pair<QBank, QBank> make_banks(int64_t fmt, const torch::Tensor& gu_v, const torch::Tensor& gu_s,
                                   const torch::Tensor& gu_s2, const torch::Tensor& dn_v, const torch::Tensor& dn_s,
                                   const torch::Tensor& dn_s2, int64_t H, const char*& err) {
  std::pair<QBank, QBank> banks;
  err = nullptr;
  if (fmt < FMT_FP8 || fmt > FMT_NVFP4) {
    err = "moe_cpu: unknown quantized format code (1 fp8_block, 2 mxfp4, 3 nvfp4)";
    return banks;
  }
  if (gu_v.dim() != 3 || dn_v.dim() != 3) {
    err = "moe_cpu: value banks must be [N, rows, bytes]";
    return banks;
  }
  const int64_t N = gu_v.size(0);
  if (dn_v.size(0) != N || dn_v.size(1) != H) {
    err = "moe_cpu: down bank must be [N, H, *]";
    return banks;
  }
  const int64_t I = fmt == FMT_FP8 ? dn_v.size(2) : dn_v.size(2) * 2;
  banks.first = make_bank(int(fmt), gu_v, gu_s, gu_s2, N, 2 * I, H, 2, false, err);
  if (err == nullptr) banks.second = make_bank(int(fmt), dn_v, dn_s, dn_s2, N, H, I, 1, true, err);
  return banks;
}

int64_t qbanks_create(int64_t fmt, torch::Tensor gu_v, torch::Tensor gu_s, torch::Tensor gu_s2, torch::Tensor dn_v,
                      torch::Tensor dn_s, torch::Tensor dn_s2) {
  const char* err = nullptr;
  TORCH_CHECK(dn_v.dim() == 3, "moe_cpu.qbanks_create: the down values must be [N, H, bytes]");
  auto banks = make_banks(fmt, gu_v, gu_s, gu_s2, dn_v, dn_s, dn_s2, dn_v.size(1), err);
  TORCH_CHECK(err == nullptr, err);  // a literal message: see BANK_CHECK
  return reinterpret_cast<int64_t>(new QPair{banks.first, banks.second});
}
void qbanks_free(int64_t addr) { delete reinterpret_cast<QPair*>(addr); }

// x [T, H] f32, ids [T, K] i64, w [T, K] f32; fmt 1 fp8_block, 2 mxfp4, 3 nvfp4; gate_up banks
// (values [N, 2I, *], scale, scale_2) and down banks ([N, H, *]) as experts/banks.py keeps them,
// the 1-byte tensors (e4m3, packed e2m1, e8m0) viewed as uint8 -> out [T, H] f32.
// act .. down_bias: the expert function, as forward's.
torch::Tensor forward_q(int64_t handle, torch::Tensor x, torch::Tensor ids, torch::Tensor w, int64_t fmt,
                        torch::Tensor gu_v, torch::Tensor gu_s, torch::Tensor gu_s2, torch::Tensor dn_v,
                        torch::Tensor dn_s, torch::Tensor dn_s2, bool bf16_act, int64_t act, double alpha,
                        double limit, c10::optional<torch::Tensor> gate_up_bias,
                        c10::optional<torch::Tensor> down_bias) {
  const auto t_in = Executor::clk::now();
  TORCH_CHECK(x.dtype() == torch::kFloat32 && ids.dtype() == torch::kInt64 && w.dtype() == torch::kFloat32,
              "moe_cpu.forward_q: x f32, ids i64, w f32 expected");
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && w.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "moe_cpu.forward_q: x [T, H], ids and w [T, K] expected");
  x = x.contiguous(), ids = ids.contiguous(), w = w.contiguous();
  const int T = x.size(0), H = x.size(1), K = ids.size(1);
  const int64_t N = gu_v.size(0);
  const char* err = nullptr;
  const auto [gu, dn] = make_banks(fmt, gu_v, gu_s, gu_s2, dn_v, dn_s, dn_s2, H, err);
  TORCH_CHECK(err == nullptr, err);  // a literal message: see BANK_CHECK
  const int I = int(dn.C);
  auto idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) TORCH_CHECK(idp[i] >= -1 && idp[i] < N, "expert id out of range");
  const ExpertFn fn = make_fn(act, alpha, limit, gate_up_bias, down_bias, N, H, I, bf16_act);
  auto out = torch::empty({T, H}, x.options());
  Executor& ex = exec_of(handle);
  py::gil_scoped_release nogil;  // after every check, as forward's
  std::lock_guard<std::mutex> g(ex.call_mutex);
  const double wrapper = Executor::us(t_in, Executor::clk::now());
  ex.run_q(x.data_ptr<float>(), idp, w.data_ptr<float>(), T, K, gu, dn, H, I, out.data_ptr<float>(), bf16_act, fn);
  ex.last_us[0] = wrapper;
  return out;
}

// Rows of one quantized bank (values [1, R, *], scales as forward_q's, scale_2 [1, 1] for nvfp4,
// R a multiple of 4) against activation rows x [M, C] f32 by the decode kernels themselves
// (qdot4 at the best ISA up to isa_cap; bf16_act: bf16 activations through VDPBF16PS where the
// CPU has it, as a bf16 model's calls) -> [M, R] f32: the test hook that reads what the kernels
// dequantize (a one-hot row of x gives each weight of a column times its scale, exactly).
torch::Tensor qdot_rows(int64_t fmt, torch::Tensor v, torch::Tensor s, torch::Tensor s2, torch::Tensor x,
                        int64_t isa_cap, bool bf16_act) {
  TORCH_CHECK(fmt >= FMT_FP8 && fmt <= FMT_NVFP4, "moe_cpu.qdot_rows: fmt 1 fp8_block, 2 mxfp4, 3 nvfp4");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == 1 && v.size(1) % 4 == 0, "moe_cpu.qdot_rows: values [1, R, *], R % 4 == 0");
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "moe_cpu.qdot_rows: x f32 [M, C]");
  TORCH_CHECK(isa_cap >= SCALAR && isa_cap <= AVX512_BF16, "moe_cpu.qdot_rows: isa_cap 0 to 3");
  const int64_t R = v.size(1), C = fmt == FMT_FP8 ? v.size(2) : v.size(2) * 2;
  TORCH_CHECK(x.size(1) == C, "moe_cpu.qdot_rows: x's columns must be the bank's");
  const char* err = nullptr;
  const QBank b = make_bank(int(fmt), v, s, s2, 1, R, C, 1, false, err);
  TORCH_CHECK(err == nullptr, err);
  x = x.contiguous();
  const Isa isa = std::min<Isa>(detect(), Isa(isa_cap));
  const bool dp = bf16_act && isa == AVX512_BF16 && fmt != FMT_FP8;
  const Layout lay = layout_for(int(fmt), isa, dp);
  const int M = x.size(0);
  auto out = torch::empty({M, R}, torch::kFloat32);
  std::vector<float> xl(C);
  std::vector<uint16_t> xb(C);
  const float* xp = x.data_ptr<float>();
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < C; ++c) {  // the kernel's layout, as run_q stores a row
      if (dp) xb[lay.pos(c, int(C))] = f32_to_bf16(xp[size_t(m) * C + c]);
      else xl[lay.pos(c, int(C))] = xp[size_t(m) * C + c];
    }
    for (int64_t r = 0; r < R; r += 4) {
      QRow rows[4];
      for (int j = 0; j < 4; ++j) rows[j] = qrow(b, 0, r + j);
      qdot4(isa, int(fmt), dp, rows, dp ? nullptr : xl.data(), dp ? xb.data() : nullptr, int(C), b.sdt,
            out.data_ptr<float>() + size_t(m) * R + r);
    }
  }
  return out;
}

// quantize_q8 on rows x [R, C] f32 with a vector form (vector: the CPU's best up to isa_cap, 2
// AVX-512, 1 AVX2) or the scalar one -> (q [R, chunks * 128] int8, xs [R, chunks * 16] f32,
// off [R, chunks * 16] i32): the test hook that checks the forms give the same bits
std::vector<torch::Tensor> quantize_q8_rows(torch::Tensor x, bool vector, int64_t isa_cap) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) % 16 == 0,
              "moe_cpu.quantize_q8_rows: x f32 [R, C] with C a multiple of 16 expected");
  x = x.contiguous();
  const int R = x.size(0), C = x.size(1), nch = q8_chunks(C);
  auto q = torch::empty({R, nch * Q8_CHUNK}, torch::kInt8);
  auto xs = torch::empty({R, nch * 16}, torch::kFloat32);
  auto off = torch::empty({R, nch * 16}, torch::kInt32);
  const Isa isa = vector ? Isa(std::min<int64_t>(detect(), std::max<int64_t>(isa_cap, 0))) : SCALAR;
  for (int r = 0; r < R; ++r)
    quantize_q8(isa, x.data_ptr<float>() + size_t(r) * C, C, q.data_ptr<int8_t>() + size_t(r) * nch * Q8_CHUNK,
                xs.data_ptr<float>() + size_t(r) * nch * 16, off.data_ptr<int32_t>() + size_t(r) * nch * 16);
  return {q, xs, off};
}

std::vector<double> timing(int64_t handle) {
  const Executor& ex = exec_of(handle);
  return std::vector<double>(ex.last_us, ex.last_us + 6);
}

// ---------------------------------------------------------------- doorbell
// The other way the GPU hands a decode step's CPU share over (hostcall.py, "doorbell"): no
// host-function node and no driver thread. A GPU kernel writes the inputs into the pinned
// buffers, the descriptor's address into bell->desc, a system-scope fence, then the call's
// sequence number into bell->seq; a resident thread here, spinning on seq, runs host_call on
// that descriptor and publishes seq in bell->done; a one-program GPU kernel spinning on done
// then copies the result back. Every signal is an SM load or store on mapped pinned memory,
// which interleaves with the zero-copy fill kernel's PCIe reads, where the host-function node
// was measured waiting for them. The bell's memory is allocated here and never freed, so the
// thread can outlive whatever Python tears down at exit.
struct Bell {
  int64_t seq;   // GPU -> CPU: the number of the call to run (monotonic)
  int64_t desc;  // GPU -> CPU: that call's HostCall address
  int64_t done;  // CPU -> GPU: the number of the last call whose result is in its `out`
  int64_t stop;  // Python -> CPU: the thread returns
  int64_t calls;    // calls answered (telemetry)
  int64_t gave_up;  // GPU -> Python: a wait kernel stopped polling without an answer
  int64_t entered;  // CPU -> Python: the number of the last call host_call was entered for
  int64_t idle_polls;  // CPU -> Python: sleeping polls so far (the thread is alive if it grows)
};

void bell_loop(Bell* b, int64_t start_delay_us) {
  using clk = std::chrono::steady_clock;
  if (start_delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(start_delay_us));
  // the last call answered, not the ring count seen at start: a thread scheduled late (a loaded
  // machine, many threads) could start after the GPU's first ring, take seq 1 as already seen
  // and never answer it (measured on the H200: "rung 1, seq 1, entered 0", idle polls growing).
  // `done` is 0 on a fresh page (zeroed before the thread starts) and only this thread writes it
  int64_t seen = __atomic_load_n(&b->done, __ATOMIC_ACQUIRE);
  auto last = clk::now();
  for (;;) {
    const int64_t s = __atomic_load_n(&b->seq, __ATOMIC_ACQUIRE);
    if (s != seen) {
      __atomic_store_n(&b->entered, s, __ATOMIC_RELAXED);
      host_call(reinterpret_cast<void*>(__atomic_load_n(&b->desc, __ATOMIC_ACQUIRE)));
      seen = s;
      b->calls += 1;
      __atomic_store_n(&b->done, s, __ATOMIC_RELEASE);
      last = clk::now();
      continue;
    }
    if (__atomic_load_n(&b->stop, __ATOMIC_ACQUIRE)) return;
    // spin while decode steps keep coming (a call every few hundred microseconds); after 5 ms
    // without one, poll every 50 us so an idle server does not hold a core
    if (clk::now() - last < std::chrono::milliseconds(5)) {
      _mm_pause();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      __atomic_store_n(&b->idle_polls, b->idle_polls + 1, __ATOMIC_RELAXED);
    }
  }
}

int64_t bell_create(int64_t start_delay_us) {
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, 4096, 4096) == 0, "bell_create: out of memory");
  std::memset(p, 0, 4096);
  std::thread(bell_loop, static_cast<Bell*>(p), start_delay_us).detach();
  return reinterpret_cast<int64_t>(p);
}

void bell_stop(int64_t addr) { __atomic_store_n(&reinterpret_cast<Bell*>(addr)->stop, int64_t(1), __ATOMIC_RELEASE); }

int64_t host_call_address() { return reinterpret_cast<int64_t>(&host_call); }
// executors live as long as the process (g_execs never shrinks): their addresses stay valid
int64_t executor_address(int64_t handle) { return reinterpret_cast<int64_t>(&exec_of(handle)); }
int64_t host_call_size() { return int64_t(sizeof(HostCall)); }

}  // namespace

// paged decode attention on the CPU, in this translation unit (attention.h)
#include "attention.h"
// a decode step's dense projections on the CPU (dense.h: the dot kernels above, attention.h's pool)
#include "dense.h"
// a gated DeltaNet layer's decode step on the CPU (deltanet.h)
#include "deltanet.h"
// flush-to-zero on the caller and torch's OpenMP team (denormals.h)
#include "denormals.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("flush_denormals", &flush_denormals, "set (or clear) flush-to-zero and denormals-are-zero on the caller and "
        "on the rest of torch's OpenMP team; -> 2 the team reached, 1 the caller only, plus 4 if the caller had them "
        "set (denormals.h)", py::arg("caller"), py::arg("team"));
  m.def("paged_decode", &paged_decode_cpu, "paged decode attention over host pages (attention.h)");
  m.def("dense_gemv", &dense_gemv, "x [M, K] @ w [N, K]^T + b for the few rows of a decode step (dense.h)",
        py::arg("x"), py::arg("w"), py::arg("b"), py::arg("isa_cap") = 3);
  m.def("dense_gemv_fp8", &dense_gemv_fp8, "x [M, K] @ an FP8 block weight's dequantized [N, K]^T + b for the few "
        "rows of a decode step, reading the e4m3 bytes in place (dense.h)", py::arg("x"), py::arg("values"),
        py::arg("scale_inv"), py::arg("b"), py::arg("isa_cap") = 3);
  m.def("dense_dequant_fp8", &dense_dequant_fp8, "an FP8 block weight dequantized to float32 [N, K] as "
        "Fp8BlockWeight.dequantize builds it (dense.h)", py::arg("values"), py::arg("scale_inv"));
  m.def("deltanet_decode", &deltanet_decode_cpu, "a gated DeltaNet layer's decode step between its projections, "
        "conv window and recurrent state in place (deltanet.h)");
  m.def("host_call_address", &host_call_address, "address of the host-function entry (a CUhostFn)");
  m.def("qbanks_create", &qbanks_create, "quantized banks for HostCall.qbanks (forward_q's bank arguments); returns its address");
  m.def("qbanks_free", &qbanks_free, "free a qbanks_create result");
  m.def("executor_address", &executor_address, "address of an executor, for HostCall.executor");
  m.def("bell_create", &bell_create, "a doorbell (4 KiB, never freed) and its resident thread; returns its address "
        "(start_delay_us: the thread starts that late, as on a loaded machine; tests)", py::arg("start_delay_us") = 0);
  m.def("bell_stop", &bell_stop, "the doorbell's thread returns (its memory stays)");
  m.def("host_call_size", &host_call_size, "sizeof the HostCall descriptor (checked against hostcall.py)");
  m.def("create", &create, "create an executor with a pinned thread pool", py::arg("cpus"), py::arg("isa_cap"),
        py::arg("spin") = -1);
  m.def("set_row_scales", [](int64_t mask) { return int64_t(g_row_scales.exchange(int(mask & 3))); },
        "which fp4 kernels take their block scales decoded once per call (a mask: 1 the AVX2 kernels, 2 the "
        "AVX-512 ones; default 1) instead of per chunk; returns the previous mask (the same bits either way: A/B runs)");
  m.def("set_row_runs", [](int64_t on) { return int64_t(g_row_runs.exchange(on ? 1 : 0)); },
        "the fp4 kernels' one-token calls (int8 on VBMI or AVX2, bf16 activations on AVX512-BF16, float ones on "
        "AVX-512 or AVX2): 1 (the default) a call per run of an expert's rows (row_runs.h), 0 a call per 4-row "
        "block; returns the previous setting (the same bits either way: A/B runs)",
        py::arg("on"));
  m.def("row_runs_here", [] { return t_row_runs; },
        "run calls made so far on the calling thread (which does all of a one-thread executor's work)");
  m.def("set_row_seq", [](int64_t on) { return int64_t(g_row_seq.exchange(on ? 1 : 0)); },
        "the one-token fp4 kernels with int8 or bf16 activations: 1 reads a 4-row block one row after another, "
        "0 (the default) its rows side by side; returns the previous setting (the same bits either way: A/B runs)",
        py::arg("on"));
  m.def("set_prefetch", [](int64_t hint, int64_t bytes) {
          const int64_t before = int64_t(g_pf_hint) * (int64_t(1) << 32) + g_pf;
          g_pf_hint = int(std::clamp<int64_t>(hint, -1, 3)), g_pf = int(std::clamp<int64_t>(bytes, 0, 1 << 20));
          return before;
        },
        "the quantized kernels' software look-ahead: hint (0 t0, 1 t1, 2 t2, 3 nta, -1 off) and distance in "
        "bytes (FREETOKEN_CPU_PREFETCH_HINT / _BYTES at start-up); returns the previous pair as hint * 2**32 + "
        "bytes. A benchmark hook: call it only while no CPU kernel runs on any thread (A/B runs)",
        py::arg("hint"), py::arg("bytes"));
  m.def("set_decode_once", [](int64_t n) { return int64_t(g_decode_once.exchange(int(std::clamp<int64_t>(n, 0, 1 << 30)))); },
        "quantized calls (exact activations on AVX-512, fp4 with float ones on AVX2, int8 on the VBMI / VNNI / "
        "AVX2 kernels): experts with at least n tokens decode each row block once for all of them (0: off); "
        "returns the previous n", py::arg("n"));
  m.def("isa", &isa_of, "ISA level in use: 0 scalar, 1 avx2, 2 avx512, 3 avx512-bf16");
  m.def("set_act_int8", &set_act_int8, "int8 activations for MXFP4 / NVFP4 banks (on) or exact ones; returns the kernel that serves them (vbmi, vnni, avx2 or scalar)",
        py::arg("handle"), py::arg("on"), py::arg("max_kernel") = int64_t(Q8_VBMI));
  m.def("qdot_rows", &qdot_rows, "rows of one quantized bank against rows of x by the decode kernels (a test hook: "
        "one-hot x reads what they dequantize)");
  m.def("quantize_q8_rows", &quantize_q8_rows, "the int8 activation quantization of rows x, vector form (the "
        "CPU's best up to isa_cap: 2 AVX-512, 1 AVX2) or scalar (a test hook)", py::arg("x"), py::arg("vector"),
        py::arg("isa_cap") = 3);
  m.def("timing", &timing, "the last quantized call's time by part, us: wrapper, grouping, x quantization, "
        "phase 1, h quantization, phase 2");
  m.def("release", &release, "end an executor's worker threads (it then runs on the caller alone)");
  // the expert function's arguments default to SiLU without biases (callers from before them)
  m.def("forward", &forward, "routed experts on the CPU", py::arg("handle"), py::arg("x"), py::arg("ids"),
        py::arg("w"), py::arg("gate_up"), py::arg("down"), py::arg("bf16_act"), py::arg("act") = 0,
        py::arg("alpha") = 1.702, py::arg("limit") = 7.0, py::arg("gate_up_bias") = py::none(),
        py::arg("down_bias") = py::none());
  m.def("forward_q", &forward_q, "routed experts from quantized banks (fp8_block, mxfp4, nvfp4) on the CPU",
        py::arg("handle"), py::arg("x"), py::arg("ids"), py::arg("w"), py::arg("fmt"), py::arg("gu_v"),
        py::arg("gu_s"), py::arg("gu_s2"), py::arg("dn_v"), py::arg("dn_s"), py::arg("dn_s2"), py::arg("bf16_act"),
        py::arg("act") = 0, py::arg("alpha") = 1.702, py::arg("limit") = 7.0, py::arg("gate_up_bias") = py::none(),
        py::arg("down_bias") = py::none());
}
