// Dense projections of a decode step on the CPU: out [M, N] = x [M, K] @ w [N, K]^T (+ b [N])
// for the few rows M of a decode step (model/linear.py host_gemv sends M <= HOST_ROWS here).
//
// Why: at one row a dense projection is a matrix-vector product, bound by reading w once. torch's
// CPU GEMM read a bf16 weight at ~16 GB/s on the 2-core dev machine (the Qwen3.6 lm_head, 1 GB:
// 64 ms through F.linear, 103 ms through layers.lm_head's w @ h^T form), against ~30 GB/s that
// the machine reads; in a pure-CPU decode step of a Qwen3.6 slice the dense GEMMs were 95% of the
// time (bench/cpu_gemv.py). The expert kernels' 4-row dot products (moe_cpu.cpp dot4, dot4_bf16dp)
// read at 93-96% of the read probe: the same kernels serve here, one weight block of 4 rows at a
// time against every row of x (the block stays in L1 while the M rows read it), the next block
// prefetched as this one is read.
//
// Arithmetic: bf16 x with bf16 w on AVX512-BF16 multiplies bf16 by bf16 exactly into fp32
// (VDPBF16PS); otherwise x in fp32 (bf16 x widened exactly) times w widened to fp32, fused
// multiply-adds. Either way the products are exact and summed in fp32 as torch's GEMM does, in
// another order; the bias is added in fp32 and the caller rounds once to x's dtype.
//
// Threads: the module pool of attention.h (on_threads, torch's intra-op thread count), each
// thread a contiguous share of the 4-row blocks (its own stream of memory for the prefetchers).
// A header that moe_cpu.cpp includes after attention.h (one translation unit); cpu/__init__.py
// puts its hash in the build flags.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ft_dense {

constexpr int MAX_ROWS = 64;  // the rows one call takes (the caller sends far fewer)

// Two rows of x against a 4-row block at once (8 accumulators): each weight vector loaded once
// for both, twice the independent sums in flight. Past one row the 4-row kernel re-read its block
// from L1 for every row of x, bound by its 4-sum dependency chains (the bf16 lm_head at 4 rows:
// 23.7 GB/s against 29.7 at one). Same products and order per row as dot4 / dot4_bf16dp.
// noclone, as those: tests/test_cpu_prefetch.py finds the prefetch in every copy.
// the 8 accumulators' sums: o0 for the first row of x, o1 for the second (4 weight rows each)
__attribute__((target("avx512f"))) inline void sums8(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 b0,
                                                     __m512 b1, __m512 b2, __m512 b3, float* o0, float* o1) {
  o0[0] = _mm512_reduce_add_ps(a0), o0[1] = _mm512_reduce_add_ps(a1);
  o0[2] = _mm512_reduce_add_ps(a2), o0[3] = _mm512_reduce_add_ps(a3);
  o1[0] = _mm512_reduce_add_ps(b0), o1[1] = _mm512_reduce_add_ps(b1);
  o1[2] = _mm512_reduce_add_ps(b2), o1[3] = _mm512_reduce_add_ps(b3);
}

static __attribute__((target("avx512f,avx512bf16"), noclone)) void dot4x2_bf16dp(
    const uint16_t* w, int64_t stride, const uint16_t* x0, const uint16_t* x1, int len, float* o0, float* o1,
    const uint16_t* next) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int i = 0;
  for (; i + 32 <= len; i += 32) {
    prefetch4(next, stride, i);
    const __m512bh u = (__m512bh)_mm512_loadu_si512(x0 + i), v = (__m512bh)_mm512_loadu_si512(x1 + i);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + i), w1 = (__m512bh)_mm512_loadu_si512(w + stride + i);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2 * stride + i);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 3 * stride + i);
    a0 = _mm512_dpbf16_ps(a0, w0, u), b0 = _mm512_dpbf16_ps(b0, w0, v);
    a1 = _mm512_dpbf16_ps(a1, w1, u), b1 = _mm512_dpbf16_ps(b1, w1, v);
    a2 = _mm512_dpbf16_ps(a2, w2, u), b2 = _mm512_dpbf16_ps(b2, w2, v);
    a3 = _mm512_dpbf16_ps(a3, w3, u), b3 = _mm512_dpbf16_ps(b3, w3, v);
  }
  sums8(a0, a1, a2, a3, b0, b1, b2, b3, o0, o1);
  for (; i < len; ++i)
    for (int j = 0; j < 4; ++j) {
      const float wv = bf16_to_f32(w[j * stride + i]);
      o0[j] += wv * bf16_to_f32(x0[i]), o1[j] += wv * bf16_to_f32(x1[i]);
    }
}

template <typename W>
static __attribute__((target("avx512f"), noclone)) void dot4x2_avx512(const W* w, int64_t stride, const float* x0,
                                                                    const float* x1, int len, float* o0, float* o1,
                                                                    const W* next) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int i = 0;
  for (; i + 16 <= len; i += 16) {
    if (sizeof(W) == 4 || (i & 31) == 0) prefetch4(next, stride, i);
    const __m512 u = _mm512_loadu_ps(x0 + i), v = _mm512_loadu_ps(x1 + i);
    const __m512 w0 = load16(w + i), w1 = load16(w + stride + i), w2 = load16(w + 2 * stride + i);
    const __m512 w3 = load16(w + 3 * stride + i);
    a0 = _mm512_fmadd_ps(w0, u, a0), b0 = _mm512_fmadd_ps(w0, v, b0);
    a1 = _mm512_fmadd_ps(w1, u, a1), b1 = _mm512_fmadd_ps(w1, v, b1);
    a2 = _mm512_fmadd_ps(w2, u, a2), b2 = _mm512_fmadd_ps(w2, v, b2);
    a3 = _mm512_fmadd_ps(w3, u, a3), b3 = _mm512_fmadd_ps(w3, v, b3);
  }
  sums8(a0, a1, a2, a3, b0, b1, b2, b3, o0, o1);
  for (; i < len; ++i)
    for (int j = 0; j < 4; ++j) {
      const float wv = load1(w + j * stride, i);
      o0[j] += wv * x0[i], o1[j] += wv * x1[i];
    }
}

// rows [n0, n1) of w (row stride K) against the M rows of x (fp32, or bf16 in xb for the dp path)
template <typename W>
void rows(Isa isa, bool dp, const W* w, int64_t K, int64_t n0, int64_t n1, int64_t N, const float* x,
          const uint16_t* xb, int M, const float* b, float* out) {
  float acc[4], acc2[4];
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* blk = w + n * K;
    const W* next = n + 8 <= n1 ? blk + 4 * K : nullptr;  // this thread's next block: prefetched meanwhile
    int m = 0;
    for (; isa >= AVX512 && m + 2 <= M; m += 2) {  // rows of x in pairs
      if constexpr (std::is_same<W, uint16_t>::value) {
        if (dp) {
          dot4x2_bf16dp(blk, K, xb + m * K, xb + (m + 1) * K, int(K), acc, acc2, m == 0 ? next : nullptr);
        } else {
          dot4x2_avx512(blk, K, x + m * K, x + (m + 1) * K, int(K), acc, acc2, m == 0 ? next : nullptr);
        }
      } else {
        dot4x2_avx512(blk, K, x + m * K, x + (m + 1) * K, int(K), acc, acc2, m == 0 ? next : nullptr);
      }
      float* o = out + int64_t(m) * N + n;
      for (int j = 0; j < 4; ++j) o[j] = acc[j] + (b ? b[n + j] : 0.f), o[N + j] = acc2[j] + (b ? b[n + j] : 0.f);
    }
    for (; m < M; ++m) {
      if constexpr (std::is_same<W, uint16_t>::value) {
        if (dp) {
          dot4_bf16dp(blk, K, xb + m * K, int(K), acc, m == 0 ? next : nullptr);
        } else {
          dot4(isa, blk, K, x + m * K, int(K), acc, m == 0 ? next : nullptr);
        }
      } else {
        dot4(isa, blk, K, x + m * K, int(K), acc, m == 0 ? next : nullptr);
      }
      float* o = out + int64_t(m) * N + n;
      for (int j = 0; j < 4; ++j) o[j] = acc[j] + (b ? b[n + j] : 0.f);
    }
  }
  for (; n < n1; ++n) {  // the last 1-3 rows: one row read as a block of 4 with stride 0
    const W* row = w + n * K;
    for (int m = 0; m < M; ++m) {
      if constexpr (std::is_same<W, uint16_t>::value) {
        if (dp) {
          dot4_bf16dp(row, 0, xb + m * K, int(K), acc);
        } else {
          dot4(isa, row, 0, x + m * K, int(K), acc);
        }
      } else {
        dot4(isa, row, 0, x + m * K, int(K), acc);
      }
      out[int64_t(m) * N + n] = acc[0] + (b ? b[n] : 0.f);
    }
  }
}

template <typename W>
void gemv(Isa isa, bool dp, const W* w, int64_t N, int64_t K, const float* x, const uint16_t* xb, int M,
          const float* b, float* out, int threads) {
  const int64_t blocks = (N + 3) / 4;
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, blocks / 16)));  // >= 64 rows a thread
  ft_attention::on_threads(threads, [&](int tid) {
    const int64_t lo = std::min(N, blocks * tid / threads * 4), hi = std::min(N, blocks * (tid + 1) / threads * 4);
    if (lo < hi) rows<W>(isa, dp, w, K, lo, hi, N, x, xb, M, b, out);
  });
}

// FP8 block weights (an FP8 checkpoint's dense projections kept as published, weights/dense_fp8.py:
// e4m3 values [N, K], one scale per 128 x 128 block). Each block of 4 rows is dequantized into a
// thread's fp32 scratch (4 x K values: L1/L2) exactly as Fp8BlockWeight.dequantize builds them, then
// read by the fp32 kernels above against every row of x. So a decode step reads the weight's e4m3
// bytes once from memory (a quarter of the same weight dequantized to fp32 at load, the CPU's
// --dense-fp8 dequant; half of bf16's), the conversion is paid once per block whatever M is, and the
// result is bit for bit dense_gemv's on the dequantized weight: M and the thread split change no bits.
//
// The conversion, as the expert executor's fp8 kernels: e4m3 -> f16 bits by a shift and a mask (the
// value times 2^-8, exact, subnormals included) -> f32 (vcvtph2ps), times the block's scale times
// 2^8: two exact factors whose product is rounded once, as value * scale is. e4m3's NaN codes
// (0x7f / 0xff; no release has them) decode as 480 x scale here, NaN in the reference.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline void dequant_fp8_avx512(const uint8_t* v, float sc, int n,
                                                                                   float* out) {
  const __m512i mask = _mm512_set1_epi16(short(0xBF80));
  const __m512 s = _mm512_set1_ps(sc * 256.f);
  int c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + c)));
    const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), mask);
    _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s));
    _mm512_storeu_ps(out + c + 16, _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s));
  }
  for (; c < n; ++c) out[c] = e4m3_f32(v[c]) * sc;
}

__attribute__((target("avx2,fma,f16c"))) inline void dequant_fp8_avx2(const uint8_t* v, float sc, int n, float* out) {
  const __m256i mask = _mm256_set1_epi16(short(0xBF80));
  const __m256 s = _mm256_set1_ps(sc * 256.f);
  int c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + c)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), mask);
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s));
    _mm256_storeu_ps(out + c + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s));
  }
  for (; c < n; ++c) out[c] = e4m3_f32(v[c]) * sc;
}

// Fused forms for a few rows of x on AVX-512 (no scratch: a decode step's 1-4 rows are bound by
// converting, not by reading, on a 2-core host, and the scratch's store and reload doubled the
// work per weight): 16 e4m3 bytes -> 16 weights exactly as dequant_fp8_avx512 makes them, then the
// fused multiply-adds of dot4_avx512 / dot4x2_avx512 in their order (16 lanes over the row, the
// lanes reduced at the end): the same bits as the scratch path. Taken where K is a multiple of 16
// (no tail columns, whose scalar products the scratch path leaves to dot4's own code).
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) inline __m512 fp8x16(const uint8_t* p, __m512 s256) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(short(0xBF80)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), s256);
}

// 4 rows (stride K; one scale row sr for all four: a block of 4 rows never straddles a 128-row
// scale block) against M <= 4 rows of x, len % 16 == 0; next: the thread's next block, prefetched
static __attribute__((target("avx512f,avx512bw,avx2,fma,f16c"), noclone)) void dot4_fp8_fused(
    const uint8_t* w, int64_t stride, const uint8_t* sr, int sdt, const float* x, int M, int len, float* o0,
    float* o1, const uint8_t* next) {
  const float* x1 = x + len;
  for (int m = 0; m < M; m += 2) {
    const bool two = m + 1 < M;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m512 s = _mm512_setzero_ps();
    const float* xa = x + int64_t(m) * len;
    const float* xb = x1 + int64_t(m) * len;
    for (int i = 0; i < len; i += 16) {
      if ((i & 127) == 0) s = _mm512_set1_ps(fp8_scale(sr, sdt, i >> 7) * 256.f);
      if (next && m == 0 && (i & 63) == 0)
        for (int j = 0; j < 4; ++j) prefetch_line(reinterpret_cast<const char*>(next + j * stride + i));
      const __m512 w0 = fp8x16(w + i, s), w1 = fp8x16(w + stride + i, s);
      const __m512 w2 = fp8x16(w + 2 * stride + i, s), w3 = fp8x16(w + 3 * stride + i, s);
      const __m512 u = _mm512_loadu_ps(xa + i);
      a0 = _mm512_fmadd_ps(w0, u, a0), a1 = _mm512_fmadd_ps(w1, u, a1);
      a2 = _mm512_fmadd_ps(w2, u, a2), a3 = _mm512_fmadd_ps(w3, u, a3);
      if (two) {
        const __m512 v = _mm512_loadu_ps(xb + i);
        b0 = _mm512_fmadd_ps(w0, v, b0), b1 = _mm512_fmadd_ps(w1, v, b1);
        b2 = _mm512_fmadd_ps(w2, v, b2), b3 = _mm512_fmadd_ps(w3, v, b3);
      }
    }
    float* p = o0 + int64_t(m) * 4;
    p[0] = _mm512_reduce_add_ps(a0), p[1] = _mm512_reduce_add_ps(a1);
    p[2] = _mm512_reduce_add_ps(a2), p[3] = _mm512_reduce_add_ps(a3);
    if (two) {
      float* q = o1 + int64_t(m) * 4;
      q[0] = _mm512_reduce_add_ps(b0), q[1] = _mm512_reduce_add_ps(b1);
      q[2] = _mm512_reduce_add_ps(b2), q[3] = _mm512_reduce_add_ps(b3);
    }
  }
}

// rows of x up to which AVX-512 takes the fused form; past them a block is dequantized once into
// the scratch and read by every row
constexpr int FP8_FUSED_ROWS = 4;

// one row of an FP8 block weight (its scale row s) dequantized to fp32, the next block's line at
// each 64 bytes of this row prefetched (next: the same row of the thread's next block, or null)
inline void dequant_fp8_row(Isa isa, const uint8_t* v, const uint8_t* s, int sdt, int64_t K, float* out,
                            const uint8_t* next) {
  for (int64_t c = 0, cb = 0; c < K; c += 128, ++cb) {
    if (next)
      for (int64_t o = c; o < std::min(K, c + 128); o += 64) prefetch_line(reinterpret_cast<const char*>(next + o));
    const float sc = fp8_scale(s, sdt, cb);
    const int n = int(std::min<int64_t>(128, K - c));
    if (isa >= AVX512) dequant_fp8_avx512(v + c, sc, n, out + c);
    else if (isa == AVX2) dequant_fp8_avx2(v + c, sc, n, out + c);
    else for (int j = 0; j < n; ++j) out[c + j] = e4m3_f32(v[c + j]) * sc;
  }
}

inline void rows_fp8(Isa isa, const uint8_t* v, const uint8_t* s, int64_t srow, int sdt, int64_t K, int64_t n0, int64_t n1,
              int64_t N, const float* x, int M, const float* b, float* out) {
  const int64_t es = sdt == 0 ? 4 : 2;  // scale bytes: f32, or bf16 / f16 as the release has them
  thread_local std::vector<float> scratch;
  scratch.resize(size_t(4 * K));
  float* w = scratch.data();
  float acc[4], acc2[4];
  const bool fused = isa >= AVX512 && M <= FP8_FUSED_ROWS && K % 16 == 0;
  float f4[FP8_FUSED_ROWS * 4];  // the fused form's sums: row m of x, weight row j at [m * 4 + j]
  for (int64_t n = n0; n < n1; n += 4) {
    const int live = int(std::min<int64_t>(4, n1 - n));
    if (fused) {
      const uint8_t* sr = s + (n / 128) * srow * es;
      const uint8_t* next = n + 8 <= n1 ? v + (n + 4) * K : nullptr;
      // a short last block reads its last row in the places past it (stride 0 from there), as
      // the scratch path's stride-0 blocks do; those sums are dropped
      if (live == 4) {
        dot4_fp8_fused(v + n * K, K, sr, sdt, x, M, int(K), f4, f4 + 4, next);
      } else {
        for (int j = 0; j < live; ++j) {
          float t[FP8_FUSED_ROWS * 4];
          dot4_fp8_fused(v + (n + j) * K, 0, sr, sdt, x, M, int(K), t, t + 4, nullptr);
          for (int m = 0; m < M; ++m) f4[m * 4 + j] = t[m * 4];
        }
      }
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < live; ++j) out[int64_t(m) * N + n + j] = f4[m * 4 + j] + (b ? b[n + j] : 0.f);
      continue;
    }
    for (int j = 0; j < live; ++j) {
      const int64_t r = n + j;
      const uint8_t* next = r + 4 < n1 ? v + (r + 4) * K : nullptr;
      dequant_fp8_row(isa, v + r * K, s + (r / 128) * srow * es, sdt, K, w + j * K, next);
    }
    if (live < 4) {  // the last 1-3 rows: each read as a block of 4 with stride 0, as rows<W>'s
      for (int j = 0; j < live; ++j)
        for (int m = 0; m < M; ++m) {
          dot4(isa, w + j * K, 0, x + int64_t(m) * K, int(K), acc);
          out[int64_t(m) * N + n + j] = acc[0] + (b ? b[n + j] : 0.f);
        }
      break;
    }
    int m = 0;
    for (; isa >= AVX512 && m + 2 <= M; m += 2) {  // rows of x in pairs: dot4's order per row
      dot4x2_avx512(w, K, x + int64_t(m) * K, x + int64_t(m + 1) * K, int(K), acc, acc2, (const float*)nullptr);
      float* o = out + int64_t(m) * N + n;
      for (int j = 0; j < 4; ++j) o[j] = acc[j] + (b ? b[n + j] : 0.f), o[N + j] = acc2[j] + (b ? b[n + j] : 0.f);
    }
    for (; m < M; ++m) {
      dot4(isa, w, K, x + int64_t(m) * K, int(K), acc);
      float* o = out + int64_t(m) * N + n;
      for (int j = 0; j < 4; ++j) o[j] = acc[j] + (b ? b[n + j] : 0.f);
    }
  }
}

inline void gemv_fp8(Isa isa, const uint8_t* v, const uint8_t* s, int64_t srow, int sdt, int64_t N, int64_t K,
              const float* x, int M, const float* b, float* out, int threads) {
  const int64_t blocks = (N + 3) / 4;
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, blocks / 16)));  // >= 64 rows a thread
  ft_attention::on_threads(threads, [&](int tid) {
    const int64_t lo = std::min(N, blocks * tid / threads * 4), hi = std::min(N, blocks * (tid + 1) / threads * 4);
    if (lo < hi) rows_fp8(isa, v, s, srow, sdt, K, lo, hi, N, x, M, b, out);
  });
}

}  // namespace ft_dense

// x [M, K] f32 or bf16, w [N, K] f32 or bf16 (contiguous rows), b [N] f32 or empty -> [M, N] f32.
// isa_cap: 3 the best this CPU has, lower for tests (2 AVX-512 without BF16 dot products, 1 AVX2,
// 0 scalar).
inline torch::Tensor dense_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor b, int64_t isa_cap) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && b.device().is_cpu(), "dense_gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "dense_gemv: x [M, K] and w [N, K] with one K expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= ft_dense::MAX_ROWS, "dense_gemv: 1 to 64 rows of x");
  TORCH_CHECK((w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16) &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "dense_gemv: x and w float32 or bfloat16");
  TORCH_CHECK(w.stride(1) == 1 && w.stride(0) == w.size(1), "dense_gemv: w must be contiguous");
  TORCH_CHECK(!b.numel() || (b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == w.size(0) &&
                             b.is_contiguous()),
              "dense_gemv: b [N] float32, or empty");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K <= (int64_t(1) << 30), "dense_gemv: K too large");
  const Isa isa = std::min<Isa>(detect(), Isa(isa_cap));
  const bool wb = w.scalar_type() == at::kBFloat16;
  // bf16 products exactly in VDPBF16PS only when x is bf16 itself (a bf16 model): never rounds x
  const bool dp = wb && x.scalar_type() == at::kBFloat16 && isa == AVX512_BF16;
  torch::Tensor xf = dp ? torch::Tensor() : x.to(at::kFloat).contiguous();  // exact for bf16 x
  torch::Tensor xb16 = dp ? x.contiguous() : torch::Tensor();
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* bp = b.numel() ? b.data_ptr<float>() : nullptr;
  const int threads = at::get_num_threads();
  py::gil_scoped_release nogil;
  if (wb) {
    ft_dense::gemv<uint16_t>(isa, dp, reinterpret_cast<const uint16_t*>(w.data_ptr()), N, K,
                             dp ? nullptr : xf.data_ptr<float>(),
                             dp ? reinterpret_cast<const uint16_t*>(xb16.data_ptr()) : nullptr, int(M), bp,
                             out.data_ptr<float>(), threads);
  } else {
    ft_dense::gemv<float>(isa, false, w.data_ptr<float>(), N, K, xf.data_ptr<float>(), nullptr, int(M), bp,
                          out.data_ptr<float>(), threads);
  }
  return out;
}

// x [M, K] f32 or bf16 (widened exactly), v [N, K] float8_e4m3fn (or its bytes as uint8),
// scale_inv [ceil(N/128), ceil(K/128)] f32, bf16 or f16, b [N] f32 or empty -> [M, N] f32: an FP8
// block weight's product for the few rows of a decode step. isa_cap as dense_gemv's (3 and 2 both
// take the AVX-512 fp8 kernel: it has no bf16 form).
inline torch::Tensor dense_gemv_fp8(torch::Tensor x, torch::Tensor v, torch::Tensor scale, torch::Tensor b,
                                    int64_t isa_cap) {
  TORCH_CHECK(x.device().is_cpu() && v.device().is_cpu() && scale.device().is_cpu() && b.device().is_cpu(),
              "dense_gemv_fp8: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && v.dim() == 2 && x.size(1) == v.size(1),
              "dense_gemv_fp8: x [M, K] and values [N, K] with one K expected");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= ft_dense::MAX_ROWS, "dense_gemv_fp8: 1 to 64 rows of x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "dense_gemv_fp8: x float32 or bfloat16");
  TORCH_CHECK((v.scalar_type() == at::kFloat8_e4m3fn || v.scalar_type() == at::kByte) && v.stride(1) == 1 &&
                  v.stride(0) == v.size(1),
              "dense_gemv_fp8: values must be contiguous float8_e4m3fn (or its bytes as uint8)");
  const int64_t M = x.size(0), K = x.size(1), N = v.size(0);
  TORCH_CHECK(K <= (int64_t(1) << 30), "dense_gemv_fp8: K too large");
  const int64_t sr = (N + 127) / 128, sc = (K + 127) / 128;
  const auto st = scale.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "dense_gemv_fp8: scale_inv float32, bfloat16 or float16");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == sr && scale.size(1) == sc && scale.is_contiguous(),
              "dense_gemv_fp8: scale_inv must be contiguous [ceil(N/128), ceil(K/128)]");
  TORCH_CHECK(!b.numel() || (b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == N && b.is_contiguous()),
              "dense_gemv_fp8: b [N] float32, or empty");
  const Isa isa = std::min<Isa>(detect(), Isa(isa_cap));
  const int sdt = st == at::kFloat ? 0 : st == at::kBFloat16 ? 1 : 2;
  torch::Tensor xf = x.to(at::kFloat).contiguous();  // exact for bf16 x
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const float* bp = b.numel() ? b.data_ptr<float>() : nullptr;
  const int threads = at::get_num_threads();
  py::gil_scoped_release nogil;
  ft_dense::gemv_fp8(isa, reinterpret_cast<const uint8_t*>(v.data_ptr()),
                     reinterpret_cast<const uint8_t*>(scale.data_ptr()), sc, sdt, N, K, xf.data_ptr<float>(),
                     int(M), bp, out.data_ptr<float>(), threads);
  return out;
}

// values [N, K] e4m3 (as dense_gemv_fp8's), scale_inv [ceil(N/128), ceil(K/128)] -> [N, K] f32: the
// weight as Fp8BlockWeight.dequantize(float32) builds it, bit for bit, over the module pool (torch's
// float8 -> float32 cast took ~80 ms for a 12,352 x 2,048 weight on the 2-core dev machine): what a
// prompt chunk's GEMM reads, a block of rows at a time (model/linear.py fp8_blocks_linear).
inline torch::Tensor dense_dequant_fp8(torch::Tensor v, torch::Tensor scale) {
  TORCH_CHECK(v.device().is_cpu() && scale.device().is_cpu(), "dense_dequant_fp8: CPU tensors only");
  TORCH_CHECK(v.dim() == 2 && (v.scalar_type() == at::kFloat8_e4m3fn || v.scalar_type() == at::kByte) &&
                  v.stride(1) == 1 && v.stride(0) == v.size(1),
              "dense_dequant_fp8: values must be contiguous float8_e4m3fn [N, K] (or its bytes as uint8)");
  const int64_t N = v.size(0), K = v.size(1);
  const auto st = scale.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "dense_dequant_fp8: scale_inv float32, bfloat16 or float16");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == (N + 127) / 128 && scale.size(1) == (K + 127) / 128 &&
                  scale.is_contiguous(),
              "dense_dequant_fp8: scale_inv must be contiguous [ceil(N/128), ceil(K/128)]");
  const int sdt = st == at::kFloat ? 0 : st == at::kBFloat16 ? 1 : 2;
  const int64_t es = sdt == 0 ? 4 : 2, sc = scale.size(1);
  auto out = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* vp = reinterpret_cast<const uint8_t*>(v.data_ptr());
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(scale.data_ptr());
  float* op = out.data_ptr<float>();
  const Isa isa = detect();
  const int threads = int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 16)));
  py::gil_scoped_release nogil;
  ft_attention::on_threads(threads, [&](int tid) {
    for (int64_t r = N * tid / threads; r < N * (tid + 1) / threads; ++r)
      ft_dense::dequant_fp8_row(isa, vp + r * K, sp + (r / 128) * sc * es, sdt, K, op + r * K, nullptr);
  });
  return out;
}
