// A gated DeltaNet layer's decode step on the CPU, between its in-projection and out-projection:
// the causal conv over the stored window and SiLU, the gates, q/k l2-norms, the delta rule with
// the recurrent state updated in place, the gated RMSNorm. kernels/deltanet_decode.py does the
// same on CUDA in Triton; the reference for both is GatedDeltaNet.decode's torch path
// (model/deltanet.py: recurrent_gated_delta_step, _gates_and_heads, _finish), whose points of
// rounding to a bf16 activation dtype are kept here (rnd below).
//
// Why: in torch the step is ~40 small ops, five of them full passes over the 2 MB state of a
// Qwen3.6 layer (32 heads of 128 x 128 fp32) with temporaries of its size: 2.5 ms a layer on the
// 2-core dev machine, where the recurrent step alone runs in 0.17 ms here. Per (row, value head)
// the state is read twice (kv from the decayed rows, then the update with the readout summed as
// each row is written), its 64 KB staying in L2 between the passes.
//
// Rows whose `active` is 0 keep their conv window and state (a slot mid-prefill may be written
// by a prompt forward on another thread) and get zeros out. Threads: attention.h's module pool
// (on_threads, torch's intra-op thread count). A header that moe_cpu.cpp includes.
#pragma once
#include <torch/extension.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

namespace ft_deltanet {

// kv[j] = sum_i (d S[i][j]) k[i], rows in order (the same order on every ISA; lanes are j)
FT_CLONES void decayed_kv(const float* S, const float* k, float d, int dk, int dv, float* kv) {
  for (int j = 0; j < dv; ++j) kv[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    const float* row = S + int64_t(i) * dv;
    const float ki = k[i];
    for (int j = 0; j < dv; ++j) kv[j] += (row[j] * d) * ki;
  }
}

// S[i][j] = d S[i][j] + k[i] delta[j]; out[j] = sum_i S[i][j] q[i] (the new S)
FT_CLONES void update_rows(float* S, const float* k, const float* q, const float* delta, float d, int dk, int dv,
                           float* out) {
  for (int j = 0; j < dv; ++j) out[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    float* row = S + int64_t(i) * dv;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < dv; ++j) {
      const float s = row[j] * d + ki * delta[j];
      row[j] = s;
      out[j] += s * qi;
    }
  }
}

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }
// the value a torch op in T would have stored: rounded to bf16 where T is, as is in fp32
template <typename T>
inline float rnd(float v) { return static_cast<float>(static_cast<T>(v)); }
inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

struct Shape {
  int64_t B, C, K, hk, hv, dk, dv;
};

// Phase 1, channels [c0, c1) of every active row: conv over [window | x] in fp32 (products
// rounded as torch's `window * w` is), + bias, SiLU -> conv_out (fp32 holding T values), and the
// window shifted.
template <typename T>
void conv_rows(const Shape& s, const T* x, int64_t sx, T* st, const T* w, const T* bias, const bool* act,
               int64_t c0, int64_t c1, float* conv_out) {
  const int64_t K = s.K;
  for (int64_t b = 0; b < s.B; ++b) {
    if (act && !act[b]) continue;  // an idle row's window may be written by another thread meanwhile
    const T* xr = x + b * sx;
    T* sr = st + b * s.C * (K - 1);
    for (int64_t c = c0; c < c1; ++c) {
      T* win = sr + c * (K - 1);
      const T* wc = w + c * K;
      float acc = 0.f;
      for (int64_t j = 0; j < K - 1; ++j) acc += rnd<T>(to_f(win[j]) * to_f(wc[j]));
      acc += rnd<T>(to_f(xr[c]) * to_f(wc[K - 1]));
      float y = rnd<T>(acc);
      if (bias) y = rnd<T>(y + to_f(bias[c]));
      conv_out[b * s.C + c] = rnd<T>(y * sigmoid(y));
      for (int64_t j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
      if (K > 1) win[K - 2] = xr[c];
    }
  }
}

// Phase 2, one (row b, value head h): gates, normalised q/k of its key head, the delta rule on
// its state, the gated RMSNorm of the readout -> out[b, h*dv ..] in T.
template <typename T>
void head_step(const Shape& s, int64_t b, int64_t h, const float* conv_out, const T* z, int64_t sz, const T* bb,
               const T* aa, int64_t sba, const float* neg_a, const float* dt_bias, float* S, const float* norm_w,
               bool w_rounds, float eps, T* out, int64_t so, float* buf) {
  const int64_t dk = s.dk, dv = s.dv, kh = h / (s.hv / s.hk);
  float* q = buf;
  float* k = buf + dk;
  float* kv = buf + 2 * dk;
  float* delta = kv + dv;
  float* o = delta + dv;
  const float* row = conv_out + b * s.C;
  float qq = 0.f, kk = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    q[i] = row[kh * dk + i], k[i] = row[s.hk * dk + kh * dk + i];
    qq += q[i] * q[i], kk += k[i] * k[i];
  }
  // l2norm(x) = x * rsqrt(sum x^2 + 1e-6); q then scaled by dk^-0.5
  const float qn = 1.f / std::sqrt(qq + 1e-6f), kn = 1.f / std::sqrt(kk + 1e-6f);
  const float scale = float(1.0 / std::sqrt(double(dk)));
  for (int64_t i = 0; i < dk; ++i) q[i] = (q[i] * qn) * scale, k[i] *= kn;
  const float beta = rnd<T>(sigmoid(to_f(bb[b * sba + h])));
  const float xa = to_f(aa[b * sba + h]) + dt_bias[h];
  const float g = neg_a[h] * (xa > 20.f ? xa : std::log1p(std::exp(xa)));
  const float d = std::exp(g);
  const float* v = row + 2 * s.hk * dk + h * dv;
  ft_deltanet::decayed_kv(S, k, d, int(dk), int(dv), kv);
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - kv[j]) * beta;
  ft_deltanet::update_rows(S, k, q, delta, d, int(dk), int(dv), o);
  float ss = 0.f;
  for (int64_t j = 0; j < dv; ++j) {
    o[j] = rnd<T>(o[j]);  // core.to(dtype)
    ss += o[j] * o[j];
  }
  const float inv = 1.f / std::sqrt(ss / float(dv) + eps);
  const T* zr = z + b * sz + h * dv;
  T* orow = out + b * so + h * dv;
  for (int64_t j = 0; j < dv; ++j) {
    float y = norm_w[j] * rnd<T>(o[j] * inv);
    if (w_rounds) y = rnd<T>(y);
    const float zf = to_f(zr[j]);
    orow[j] = static_cast<T>(y * (zf * sigmoid(zf)));
  }
}

}  // namespace ft_deltanet

// mixed [B, C], z [B, Hv dv], b, a [B, Hv]: the in-projection's parts in the activation dtype T
// (float32 or bfloat16; row-strided views, columns contiguous); conv_state [>= B, C, K-1] and
// conv_w [C, K] (conv_b [C] or empty) in T; neg_a, dt_bias [Hv] and norm_w [dv] float32;
// state [>= B, Hv, dk, dv] float32; active [B] bool or empty. norm_rounds: norm_w is in T
// (w * norm(x) rounded to T, as torch's product of two T tensors). -> [B, Hv dv] in T.
inline torch::Tensor deltanet_decode_cpu(torch::Tensor mixed, torch::Tensor z, torch::Tensor b, torch::Tensor a,
                                         torch::Tensor conv_state, torch::Tensor conv_w, torch::Tensor conv_b,
                                         torch::Tensor neg_a, torch::Tensor dt_bias, torch::Tensor state,
                                         torch::Tensor norm_w, bool norm_rounds, double eps, int64_t hk,
                                         int64_t dk, torch::Tensor active) {
  const auto dt = mixed.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "deltanet_decode: activations float32 or bfloat16");
  for (const torch::Tensor* t : {&z, &b, &a, &conv_state, &conv_w})
    TORCH_CHECK(t->scalar_type() == dt && t->device().is_cpu(), "deltanet_decode: mixed, z, b, a, conv_state and "
                "conv_w must share the activation dtype, on the CPU");
  for (const torch::Tensor* t : {&mixed, &z, &b, &a})
    TORCH_CHECK(t->dim() == 2 && t->stride(1) == 1, "deltanet_decode: mixed, z, b, a [B, n] with contiguous columns");
  for (const torch::Tensor* t : {&neg_a, &dt_bias, &norm_w, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "deltanet_decode: neg_a, dt_bias, norm_w and state must be contiguous float32 host tensors");
  TORCH_CHECK(conv_state.is_contiguous() && conv_w.is_contiguous() && conv_state.dim() == 3 && conv_w.dim() == 2,
              "deltanet_decode: conv_state [S, C, K-1] and conv_w [C, K], contiguous");
  const int64_t B = mixed.size(0), C = mixed.size(1), K = conv_w.size(1), hv = b.size(1);
  TORCH_CHECK(hk > 0 && dk > 0 && hv > 0 && hv % hk == 0 && C > 2 * hk * dk && (C - 2 * hk * dk) % hv == 0,
              "deltanet_decode: mixed's width must be 2 hk dk + hv dv, with hv a multiple of hk");
  const int64_t dv = (C - 2 * hk * dk) / hv;
  TORCH_CHECK(z.size(0) == B && z.size(1) == hv * dv && b.size(0) == B && a.size(0) == B && a.size(1) == hv &&
                  neg_a.numel() == hv && dt_bias.numel() == hv && norm_w.numel() == dv,
              "deltanet_decode: z [B, hv dv], b and a [B, hv], neg_a and dt_bias [hv], norm_w [dv] expected");
  TORCH_CHECK(K >= 1 && conv_w.size(0) == C && conv_state.size(0) >= B && conv_state.size(1) == C &&
                  conv_state.size(2) == K - 1,
              "deltanet_decode: conv_w [C, K] and conv_state [>= B, C, K-1] expected");
  TORCH_CHECK(!conv_b.numel() || (conv_b.scalar_type() == dt && conv_b.numel() == C && conv_b.is_contiguous()),
              "deltanet_decode: conv_b [C] in the activation dtype, or empty");
  TORCH_CHECK(state.dim() == 4 && state.size(0) >= B && state.size(1) == hv && state.size(2) == dk && state.size(3) == dv,
              "deltanet_decode: state [>= B, hv, dk, dv] expected");
  TORCH_CHECK(!active.numel() || (active.scalar_type() == at::kBool && active.numel() == B && active.is_contiguous() &&
                                  active.device().is_cpu()),
              "deltanet_decode: active [B] bool, or empty");
  TORCH_CHECK(b.stride(0) == a.stride(0), "deltanet_decode: b and a must share a row stride");
  auto out = torch::zeros({B, hv * dv}, mixed.options());
  const ft_deltanet::Shape s{B, C, K, hk, hv, dk, dv};
  const bool* act = active.numel() ? active.data_ptr<bool>() : nullptr;
  const int threads = std::max(1, at::get_num_threads());
  py::gil_scoped_release nogil;
  std::vector<float> conv_out(size_t(B * C));
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* x = reinterpret_cast<const T*>(mixed.data_ptr());
    T* st = reinterpret_cast<T*>(conv_state.data_ptr());
    const T* w = reinterpret_cast<const T*>(conv_w.data_ptr());
    const T* bias = conv_b.numel() ? reinterpret_cast<const T*>(conv_b.data_ptr()) : nullptr;
    const int ct = int(std::max<int64_t>(1, std::min<int64_t>(threads, C / 256)));
    ft_attention::on_threads(ct, [&](int tid) {
      ft_deltanet::conv_rows<T>(s, x, mixed.stride(0), st, w, bias, act, C * tid / ct, C * (tid + 1) / ct,
                                conv_out.data());
    });
    std::atomic<int64_t> next{0};
    const int64_t tasks = B * hv;
    ft_attention::on_threads(int(std::min<int64_t>(threads, tasks)), [&](int) {
      std::vector<float> buf(2 * dk + 3 * dv);
      for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
        const int64_t row = t / hv, h = t % hv;
        if (act && !act[row]) continue;
        ft_deltanet::head_step<T>(s, row, h, conv_out.data(), reinterpret_cast<const T*>(z.data_ptr()), z.stride(0),
                                  reinterpret_cast<const T*>(b.data_ptr()), reinterpret_cast<const T*>(a.data_ptr()),
                                  b.stride(0), neg_a.data_ptr<float>(), dt_bias.data_ptr<float>(),
                                  state.data_ptr<float>() + t * dk * dv, norm_w.data_ptr<float>(), norm_rounds,
                                  float(eps), reinterpret_cast<T*>(out.data_ptr()), out.stride(0), buf.data());
      }
    });
  };
  if (dt == at::kFloat)
    run(float());
  else
    run(c10::BFloat16());
  return out;
}
