// CPU expert executor: routed SwiGLU experts computed in place from host memory.
//
// Bandwidth-bound by design: each selected expert's weights stream from DRAM exactly once
// per call, in 4-row blocks that are re-used from L1 for every token routed to the expert.
// Two phases with one barrier between them (none per expert):
//   1. gate_up: work units = (expert, block of intermediate rows); h = silu(x Wg^T) * (x Wu^T)
//   2. down:    work units = blocks of output rows; a thread owns out[:, rows] outright and
//               adds every expert's contribution there, so no atomics and a fixed sum order.
// Weights are BF16 or FP32; accumulation is FP32. SIMD: AVX-512 (+VNNI-BF16 when the
// activations are themselves BF16), AVX2+FMA, or scalar, chosen at run time.
#include <torch/extension.h>

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------- thread pool
class Pool {
 public:
  explicit Pool(const std::vector<int>& cpus) : n_(std::max<size_t>(1, cpus.size())) {
    // the caller runs share 0 unpinned: pinning it would also confine Python and torch
    for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t, cpus] { loop(t, cpus[t]); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
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
      for (int i = 0; i < 20000 && gen_.load(std::memory_order_acquire) == seen; ++i) _mm_pause();
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
template <typename W>
__attribute__((target("avx512f"))) void dot4_avx512(const W* w, int64_t stride, const float* x, int len,
                                                    float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 16 <= len; i += 16) {
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
__attribute__((target("avx512f,avx512bf16"))) void dot4_bf16dp(const uint16_t* w, int64_t stride,
                                                              const uint16_t* xb, int len, float* out) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int i = 0;
  for (; i + 32 <= len; i += 32) {
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

enum Isa { SCALAR = 0, AVX2 = 1, AVX512 = 2, AVX512_BF16 = 3 };

Isa detect() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
    if (__builtin_cpu_supports("avx512bf16")) return AVX512_BF16;
#endif
    return AVX512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
  return SCALAR;
}

// One row-dot over float activations, dispatched by ISA (the bf16-dp path is handled apart).
template <typename W>
inline void dot4(Isa isa, const W* w, int64_t stride, const float* x, int len, float* out) {
  if (isa >= AVX512) return dot4_avx512(w, stride, x, len, out);
  if (isa == AVX2) return dot4_avx2(w, stride, x, len, out);
  dot4_scalar(w, stride, x, len, out);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// ---------------------------------------------------------------- executor
struct Executor {
  Pool pool;
  Isa isa;
  std::mutex call_mutex;  // one MoE call at a time: the pool is shared
  Executor(const std::vector<int>& cpus, int isa_cap) : pool(cpus), isa(std::min<Isa>(detect(), Isa(isa_cap))) {}

  template <typename W>
  void run(const float* x, const int64_t* ids, const float* gw, int T, int K, const W* gu, const W* dn,
           int H, int I, float* out, bool bf16_act) {
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
    // phase 1: gate and up rows of every selected expert
    pool.run([&](int tid) {
      const int units = G * ib, u0 = int(int64_t(units) * tid / nt), u1 = int(int64_t(units) * (tid + 1) / nt);
      float g4[4], v4[4];
      for (int u = u0; u < u1; ++u) {
        const int g = u / ib, r0 = (u % ib) * RB, r1 = std::min(I, r0 + RB);
        const int64_t e = ids[order[starts[g]]];
        const W* wg = gu + e * int64_t(2 * I) * H;
        for (int r = r0; r < r1; r += 4) {
          const int nr = std::min(4, r1 - r);
          for (int q = starts[g]; q < starts[g + 1]; ++q) {
            const int tok = order[q] / K;
            if (nr == 4) {
              if (dp) {
                dot4_bf16dp(reinterpret_cast<const uint16_t*>(wg) + int64_t(r) * H, H, xb.data() + int64_t(tok) * H, H, g4);
                dot4_bf16dp(reinterpret_cast<const uint16_t*>(wg) + int64_t(I + r) * H, H, xb.data() + int64_t(tok) * H, H, v4);
              } else {
                dot4(isa, wg + int64_t(r) * H, H, x + int64_t(tok) * H, H, g4);
                dot4(isa, wg + int64_t(I + r) * H, H, x + int64_t(tok) * H, H, v4);
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
              const float hv = silu(g4[j]) * v4[j];
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
      const int b0 = int(int64_t(hb_blocks) * tid / nt), b1 = int(int64_t(hb_blocks) * (tid + 1) / nt);
      float d4[4];
      for (int blk = b0; blk < b1; ++blk) {
        const int r0 = blk * RB, r1 = std::min(H, r0 + RB);
        for (int r = r0; r < r1; ++r)
          for (int t = 0; t < T; ++t) out[int64_t(t) * H + r] = 0.f;
        for (int g = 0; g < G; ++g) {
          const int64_t e = ids[order[starts[g]]];
          const W* wd = dn + e * int64_t(H) * I;
          for (int r = r0; r < r1; r += 4) {
            const int nr = std::min(4, r1 - r);
            for (int q = starts[g]; q < starts[g + 1]; ++q) {
              const int tok = order[q] / K;
              const float wq = gw[order[q]];
              if (nr == 4) {
                if (dp)
                  dot4_bf16dp(reinterpret_cast<const uint16_t*>(wd) + int64_t(r) * I, I, hb.data() + size_t(q) * I, I, d4);
                else
                  dot4(isa, wd + int64_t(r) * I, I, h.data() + size_t(q) * I, I, d4);
              } else {
                for (int j = 0; j < nr; ++j) {
                  float s = 0.f;
                  for (int i = 0; i < I; ++i)
                    s += load1(wd + int64_t(r + j) * I, i) * (dp ? bf16_to_f32(hb[size_t(q) * I + i]) : h[size_t(q) * I + i]);
                  d4[j] = s;
                }
              }
              for (int j = 0; j < nr; ++j) out[int64_t(tok) * H + r + j] += wq * d4[j];
            }
          }
        }
      }
    });
  }
};

std::vector<std::unique_ptr<Executor>> g_execs;

int64_t create(std::vector<int64_t> cpus, int64_t isa_cap) {
  std::vector<int> c(cpus.begin(), cpus.end());
  g_execs.emplace_back(new Executor(c, int(isa_cap)));
  return int64_t(g_execs.size()) - 1;
}

int64_t isa_of(int64_t handle) { return g_execs.at(handle)->isa; }

// x [T, H] f32, ids [T, K] i64 (flat expert ids), w [T, K] f32, gate_up [N, 2I, H], down [N, H, I]
// (both bf16 or both f32) -> out [T, H] f32. bf16_act: x holds bf16-exact values (bf16 model).
torch::Tensor forward(int64_t handle, torch::Tensor x, torch::Tensor ids, torch::Tensor w,
                      torch::Tensor gate_up, torch::Tensor down, bool bf16_act) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && ids.dtype() == torch::kInt64 && w.dtype() == torch::kFloat32,
              "moe_cpu.forward: x f32, ids i64, w f32 expected");
  TORCH_CHECK(gate_up.dtype() == down.dtype(), "gate_up and down banks must share a dtype");
  TORCH_CHECK(gate_up.is_contiguous() && down.is_contiguous(), "banks must be contiguous");
  x = x.contiguous(), ids = ids.contiguous(), w = w.contiguous();
  const int T = x.size(0), H = x.size(1), K = ids.size(1), I = down.size(2);
  const int64_t N = gate_up.size(0);
  TORCH_CHECK(gate_up.size(1) == 2 * I && gate_up.size(2) == H && down.size(1) == H, "bank shapes");
  auto idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) TORCH_CHECK(idp[i] >= -1 && idp[i] < N, "expert id out of range");
  auto out = torch::empty({T, H}, x.options());
  Executor& ex = *g_execs.at(handle);
  std::lock_guard<std::mutex> g(ex.call_mutex);
  if (gate_up.dtype() == torch::kBFloat16) {
    ex.run<uint16_t>(x.data_ptr<float>(), idp, w.data_ptr<float>(), T, K,
                     reinterpret_cast<const uint16_t*>(gate_up.data_ptr()),
                     reinterpret_cast<const uint16_t*>(down.data_ptr()), H, I, out.data_ptr<float>(), bf16_act);
  } else {
    TORCH_CHECK(gate_up.dtype() == torch::kFloat32, "banks must be bf16 or f32");
    ex.run<float>(x.data_ptr<float>(), idp, w.data_ptr<float>(), T, K, gate_up.data_ptr<float>(),
                  down.data_ptr<float>(), H, I, out.data_ptr<float>(), false);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("create", &create, "create an executor with a pinned thread pool");
  m.def("isa", &isa_of, "ISA level in use: 0 scalar, 1 avx2, 2 avx512, 3 avx512-bf16");
  m.def("forward", &forward, "routed experts on the CPU", py::call_guard<py::gil_scoped_release>());
}
