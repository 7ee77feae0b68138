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
