// Paged decode attention on the CPU: one query token per row against its keys, read in place
// from the page pool through the block table (no gather, no fp32 copy of K/V).
//
// Shapes as kernels/paged_attention.py's paged_decode_attention_torch (the reference this is
// tested against): q [B, nh, hd]; k_pages, v_pages [pages, kvh, P, hd] (f32 or bf16, one dtype
// with q); block_table [B, W] int32; lens [B] int32 (0: an idle row, output zeros); window
// (0: none): a row of length n sees keys max(0, n - window) .. n-1; sinks [nh] f32 or empty:
// a learned logit per head joining each softmax's denominator (GPT-OSS).
//
// Work: tasks (row, KV head, split of the key range), spread over a pool of torch's intra-op
// thread count (on_threads: moe_cpu.cpp's Pool; at::parallel_for ran on one thread here, as this
// module is built without OpenMP, measured flat from 1 to 16 threads); a task takes every query head of its KV group against its keys, one page
// (P contiguous keys of the head) at a time: the group's P scores, one rescale of the running
// sums per page (online softmax in fp32), then the values. A second pass merges the splits of
// each (row, KV head) and folds the sink in. Splits exist only to give the threads enough tasks
// at batch 1 (a long context, few KV heads). The inner loops are plain C++ that the compiler
// vectorizes, built for AVX-512, AVX2 and the baseline (target_clones: chosen at load).
//
// A header that moe_cpu.cpp includes, so the module is one translation unit: torch's headers are
// parsed once per build (a second .cpp cost ~25 s more on a 2-core machine). Its own names live
// in namespace ft_attention; cpu/__init__.py puts this file's hash in the build flags, so an edit
// here rebuilds the module.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <functional>
#include <mutex>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace ft_attention {

constexpr int64_t MIN_SPLIT_KEYS = 512;  // a split covers at least this many keys
constexpr int MAX_GROUP = 64;            // query heads per KV head
constexpr int MAX_PAGE = 256;            // keys per page

inline float bf16_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The hot loops, built for AVX-512, AVX2 and the baseline (target_clones picks at load time).
// Every loop is one the compiler vectorizes without -ffast-math: float sums in lanes, exp by a
// polynomial (page_exp).
#define FT_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))

// s[g][j] = scale * q[g] . k[j] for the G query heads of a group and n keys (k: [n, hd] f32):
// each dot in LANES partial sums (a vector), added up at the end (a fixed order on every ISA)
constexpr int LANES = 16;
FT_CLONES void page_scores(const float* q, const float* k, int G, int n, int hd, float scale, float* s) {
  const int body = hd / LANES * LANES;
  for (int j = 0; j < n; ++j) {
    const float* kj = k + int64_t(j) * hd;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + int64_t(g) * hd;
      float part[LANES];
      for (int l = 0; l < LANES; ++l) part[l] = 0.f;
      for (int c = 0; c < body; c += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += qg[c + l] * kj[c + l];
      float d = 0.f;
      for (int l = 0; l < LANES; ++l) d += part[l];
      for (int c = body; c < hd; ++c) d += qg[c] * kj[c];
      s[g * MAX_PAGE + j] = d * scale;
    }
  }
}

// x[j] = exp(x[j] - mx), j < n: 2^t split into 2^round(t) (the exponent bits) and 2^f, |f| <= 1/2,
// by its Taylor series to degree 6 (relative error ~2e-7); t = (x - mx) log2(e) <= 0, clamped at
// -126 (the smallest normal exponent). Branch-free and call-free, so it vectorizes: the clamp a
// select, the rounding the 1.5 * 2^23 trick (round to nearest even in the default mode)
FT_CLONES void page_exp(float* x, int n, float mx) {
  for (int j = 0; j < n; ++j) {
    float t = (x[j] - mx) * 1.44269504f;
    t = t < -126.f ? -126.f : t;
    const float r = (t + 12582912.f) - 12582912.f, f = (t - r) * 0.69314718f;
    const float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720))))));
    const int32_t bits = (int32_t(r) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[j] = p * scale;
  }
}

// acc[g] += sum_j p[g][j] v[j] (v: [n, hd] f32), j ascending: LANES columns of one head's sum
// stay in registers over the page's keys
FT_CLONES void page_values(const float* p, const float* v, int G, int n, int hd, float* acc) {
  const int body = hd / LANES * LANES;
  for (int g = 0; g < G; ++g) {
    const float* pg = p + g * MAX_PAGE;
    float* ag = acc + int64_t(g) * hd;
    for (int c = 0; c < body; c += LANES) {
      float a[LANES];
      for (int l = 0; l < LANES; ++l) a[l] = ag[c + l];
      for (int j = 0; j < n; ++j) {
        const float w = pg[j];
        const float* vj = v + int64_t(j) * hd + c;
        for (int l = 0; l < LANES; ++l) a[l] += w * vj[l];
      }
      for (int l = 0; l < LANES; ++l) ag[c + l] = a[l];
    }
    for (int c = body; c < hd; ++c)
      for (int j = 0; j < n; ++j) ag[c] += pg[j] * v[int64_t(j) * hd + c];
  }
}

// bf16 page rows -> f32 (n values)
FT_CLONES void widen_bf16(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_f32(src[i]);
}

// a page's rows as f32 (in place for f32 pages)
inline const float* rows_f32(const float* src, int64_t, float*) { return src; }
inline const float* rows_f32(const c10::BFloat16* src, int64_t n, float* buf) {
  widen_bf16(reinterpret_cast<const uint16_t*>(src), n, buf);
  return buf;
}

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }

// Runs f(tid) for tid < `threads` (the caller is one of them): a pool kept for the module's
// life (never freed: its threads may outlive Python's teardown), grown when a call wants more
// threads than it has; a call that wants fewer leaves the extra workers idle for it. (It was
// rebuilt whenever the count changed, and the decode step's users ask for different counts:
// attention min(threads, rows x KV heads), the dense rows and DeltaNet kernels all of them.)
// Its workers spin briefly between calls (decode calls come once per layer), then sleep, so they
// do not hold the cores the expert executor's pinned workers run on.
inline void on_threads(int threads, const std::function<void(int)>& f) {
  static std::mutex mu;
  static Pool* pool = nullptr;
  std::lock_guard<std::mutex> g(mu);
  threads = std::max(1, threads);
  if (threads == 1) return f(0);
  if (!pool || pool->size() < threads) {
    delete pool;
    pool = new Pool(std::vector<int>(threads, -1), 2000);
  }
  if (pool->size() == threads) return pool->run(f);
  pool->run([&](int tid) {
    if (tid < threads) f(tid);
  });
}

template <typename T>
void decode_impl(const torch::Tensor& q, const torch::Tensor& kp, const torch::Tensor& vp, const torch::Tensor& bt,
                 const torch::Tensor& lens, double scale, int64_t window, const torch::Tensor& sinks,
                 torch::Tensor& out) {
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), kvh = kp.size(1), P = kp.size(2), W = bt.size(1);
  const int G = int(nh / kvh);
  const T* qd = q.data_ptr<T>();
  const T* kd = kp.data_ptr<T>();
  const T* vd = vp.data_ptr<T>();
  const int32_t* btd = bt.data_ptr<int32_t>();
  const int32_t* ld = lens.data_ptr<int32_t>();
  const float* sk = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  const int64_t page_stride = kvh * P * hd, head_stride = P * hd;
  // splits per (row, KV head): enough tasks for the threads, each over >= MIN_SPLIT_KEYS keys
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, ld[b]);
  const int64_t span = window > 0 ? std::min<int64_t>(longest, window) : longest;
  const int64_t want = (at::get_num_threads() * 2 + B * kvh - 1) / std::max<int64_t>(B * kvh, 1);
  const int64_t S = std::max<int64_t>(1, std::min<int64_t>(want, span / MIN_SPLIT_KEYS));
  // partials: [B, kvh, S] x (m[G], l[G], acc[G, hd])
  std::vector<float> m_part(B * kvh * S * G), l_part(B * kvh * S * G), acc_part(B * kvh * S * G * hd);
  const int64_t tasks = B * kvh * S;
  const int threads = int(std::min<int64_t>(at::get_num_threads(), tasks));
  std::atomic<int64_t> next{0};  // tasks are taken in turn: splits of a short row finish early
  on_threads(threads, [&](int) {
    std::vector<float> qf(G * hd), s(G * MAX_PAGE), kbuf(P * hd), vbuf(P * hd);
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t b = t / (kvh * S), h = (t / S) % kvh, sp = t % S;
      float* m = &m_part[t * G];
      float* l = &l_part[t * G];
      float* acc = &acc_part[t * G * hd];
      std::fill(m, m + G, -std::numeric_limits<float>::infinity());
      std::fill(l, l + G, 0.f);
      std::fill(acc, acc + G * hd, 0.f);
      const int64_t n = ld[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
      const int64_t per = (n - lo + S - 1) / S;
      const int64_t a = lo + sp * per, e = std::min<int64_t>(n, a + per);
      if (a >= e) continue;
      const T* qh = qd + (b * nh + h * G) * hd;  // the group's query heads, contiguous
      for (int64_t i = 0; i < G * hd; ++i) qf[i] = to_f32(qh[i]);
      for (int64_t j = a; j < e;) {  // one page (or its part inside [a, e)) at a time
        const int64_t pg = btd[b * W + j / P], off = j % P;
        const int cnt = int(std::min<int64_t>(P - off, e - j));
        const int64_t base = pg * page_stride + h * head_stride + off * hd;
        if (j + cnt < e) {  // the next page's rows of this head: a jump in memory the prefetchers miss
          const int64_t nb = int64_t(btd[b * W + (j + cnt) / P]) * page_stride + h * head_stride;
          const char* nk = reinterpret_cast<const char*>(kd + nb);
          const char* nv = reinterpret_cast<const char*>(vd + nb);
          for (int64_t x = 0; x < head_stride * int64_t(sizeof(T)); x += 64) {
            __builtin_prefetch(nk + x);
            __builtin_prefetch(nv + x);
          }
        }
        page_scores(qf.data(), rows_f32(kd + base, cnt * hd, kbuf.data()), G, cnt, int(hd), float(scale), s.data());
        for (int g = 0; g < G; ++g) {  // online softmax: one rescale per page
          float* sg = &s[g * MAX_PAGE];
          float mx = m[g];
          for (int c = 0; c < cnt; ++c) mx = std::max(mx, sg[c]);
          const float corr = std::exp(m[g] - mx);  // exp(-inf) = 0 on the first page
          page_exp(sg, cnt, mx);
          float sum = 0.f;
          for (int c = 0; c < cnt; ++c) sum += sg[c];
          l[g] = l[g] * corr + sum;
          m[g] = mx;
          float* ag = acc + g * hd;
          for (int64_t c = 0; c < hd; ++c) ag[c] *= corr;
        }
        page_values(s.data(), rows_f32(vd + base, cnt * hd, vbuf.data()), G, cnt, int(hd), acc);
        j += cnt;
      }
    }
  });
  // merge the splits of each (row, KV head), fold the sink in, write in q's dtype
  T* od = out.data_ptr<T>();
  std::atomic<int64_t> next_row{0};
  on_threads(int(std::min<int64_t>(threads, B * kvh)), [&](int) {
    std::vector<float> o(hd);
    for (int64_t t; (t = next_row.fetch_add(1)) < B * kvh;) {
      const int64_t b = t / kvh, h = t % kvh;
      for (int g = 0; g < G; ++g) {
        const int64_t head = h * G + g;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < S; ++sp) mx = std::max(mx, m_part[(t * S + sp) * G + g]);
        if (sk) mx = std::max(mx, sk[head]);
        std::fill(o.begin(), o.end(), 0.f);
        float den = 0.f;
        if (mx > -std::numeric_limits<float>::infinity()) {
          for (int64_t sp = 0; sp < S; ++sp) {
            const int64_t i = (t * S + sp) * G + g;
            if (l_part[i] == 0.f) continue;  // an empty split
            const float w = std::exp(m_part[i] - mx);
            den += l_part[i] * w;
            const float* a = &acc_part[i * hd];
            for (int64_t c = 0; c < hd; ++c) o[c] += a[c] * w;
          }
          if (sk) den += std::exp(sk[head] - mx);
        }
        T* dst = od + (b * nh + head) * hd;
        const float inv = den > 0.f ? 1.f / den : 0.f;  // an idle row (no keys, no sink): zeros
        for (int64_t c = 0; c < hd; ++c) dst[c] = T(o[c] * inv);
      }
    }
  });
}

}  // namespace ft_attention

inline torch::Tensor paged_decode_cpu(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor block_table,
                               torch::Tensor lens, double scale, int64_t window, torch::Tensor sinks) {
  TORCH_CHECK(q.device().is_cpu() && k_pages.device().is_cpu() && v_pages.device().is_cpu(),
              "paged_decode_cpu: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(),
              "paged_decode_cpu: q [B, nh, hd], k_pages and v_pages [pages, kvh, P, hd]");
  TORCH_CHECK(q.scalar_type() == k_pages.scalar_type() && q.scalar_type() == v_pages.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "paged_decode_cpu: q, k_pages, v_pages must share one dtype, float32 or bfloat16");
  TORCH_CHECK(q.is_contiguous() && k_pages.is_contiguous() && v_pages.is_contiguous(),
              "paged_decode_cpu: contiguous tensors only");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && lens.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  lens.is_contiguous() && block_table.dim() == 2 && block_table.size(0) == q.size(0) &&
                  lens.numel() == q.size(0),
              "paged_decode_cpu: block_table [B, W] and lens [B], int32, contiguous");
  const int64_t nh = q.size(1), kvh = k_pages.size(1);
  TORCH_CHECK(q.size(2) == k_pages.size(3) && kvh > 0 && nh % kvh == 0 && nh / kvh <= ft_attention::MAX_GROUP &&
                  k_pages.size(2) <= ft_attention::MAX_PAGE,
              "paged_decode_cpu: head dims differ, or heads not a multiple of KV heads (<= 64 a group), or pages "
              "over 256 keys");
  TORCH_CHECK(!sinks.numel() || (sinks.scalar_type() == at::kFloat && sinks.numel() == nh && sinks.is_contiguous()),
              "paged_decode_cpu: sinks [nh] float32, or empty");
  auto out = torch::empty_like(q);
  py::gil_scoped_release nogil;  // after every check: a long context takes a while
  if (q.scalar_type() == at::kFloat)
    ft_attention::decode_impl<float>(q, k_pages, v_pages, block_table, lens, scale, window, sinks, out);
  else
    ft_attention::decode_impl<c10::BFloat16>(q, k_pages, v_pages, block_table, lens, scale, window, sinks, out);
  return out;
}
