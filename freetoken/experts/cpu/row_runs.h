// One token's dots with a run of consecutive rows of one expert, for the fp4 kernels a decode
// call takes (included by moe_cpu.cpp, inside its namespace, after the one-token kernels: it uses
// QBank, QRow, Q8Act, Q8Chunk, vbmi_step, vbmi_chunk_scales and fp4_scales_avx512).
//
// Why: at batch 1 each 4-row block was one kernel call through the dispatch (qdot4 / qdot4_q8
// and the A/B switches' atomic loads), four qrow() computations, the call's prologue (constants,
// the scale prefetch loop) and a look-ahead whose hint was a runtime switch of three branches per
// 64-byte load. On the down projection (512 columns: 4 chunks a call) that cost about as many
// instructions as the int8 dots: on the 2-core dev machine (Zen 4), one thread, an expert in L2,
// the down rows ran at 15.1 GB/s against the gate/up rows' 22.6
// (benchmarks/results/cpu_experts-mxfp4-t1-runs0-devmachine-cpu.json).
//
// A run kernel takes nb consecutive 4-row blocks of one expert in one call: row pointers advance
// by the bank's strides, the hint is a template argument (chosen once per call), whole 128-column
// chunks need no mask (a short last chunk is taken as the per-block kernel takes it). Each row's
// arithmetic and the order of its sums are the per-block kernel's (the non-RS form, the AVX-512
// kernels' default), so out[i] is, bit for bit, what that kernel gives for the row
// (test_row_runs_give_the_per_block_bits):
// - qrun_fp4_q8_vbmi: int8 activations (--cpu-act int8), qdot4_fp4_q8_vbmi's vbmi_step + half_sums4;
// - qrun_fp4_bf16dp: bf16 activations (a bf16 model; the GPU cache's CPU branch), qdot4_fp4_bf16dp's;
// - qrun_fp4_avx512: float activations (the CPU engine's default), qdot4_fp4_avx512's;
// - qrun_fp4_avx2: a CPU without AVX-512, float or int8 activations: the AVX2 kernels per block.
// FREETOKEN_CPU_ROW_RUNS=0 / set_row_runs(0) goes back to a call per block (A/B runs).
#pragma once

static std::atomic<int> g_row_runs{[] {
  const char* v = std::getenv("FREETOKEN_CPU_ROW_RUNS");
  return v != nullptr && std::strcmp(v, "0") == 0 ? 0 : 1;
}()};
// run calls made on this thread (row_runs_here: a test's proof that the runs are taken; the
// calling thread does share 0 of every pool call, all of it with one thread)
thread_local int64_t t_row_runs = 0;

// The rows of one run: block blk's four QRows, and their scale lines prefetched as
// prefetch_scales does for a per-block call (rows r0 .. r0 + 4 nb of expert e, inside one NVFP4
// half: the caller keeps a run there)
struct RunRows {
  const uint8_t* v;
  const uint8_t* s;
  int64_t vrow, srow;
  float s2;
  int sbytes;
  RunRows(const QBank& b, int64_t e, int64_t r0)
      : v(b.v + (e * b.R + r0) * b.vrow), s(b.s + (e * b.R + r0) * b.srow), vrow(b.vrow), srow(b.srow),
        s2(b.fmt == FMT_NVFP4 ? b.s2[e * b.halves + (b.halves == 2 && r0 >= b.R / 2 ? 1 : 0)] : 1.f),
        sbytes(b.fmt == FMT_MXFP4 ? int(b.C) / 32 : int(b.C) / 16) {}
  template <int HINT, bool SCALES = true>  // SCALES: prefetch the scale lines (the AVX2 kernels do it themselves)
  void block(int blk, int pf, QRow* rows) const {
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const int64_t r = 4 * int64_t(blk) + p;
      rows[p] = QRow{v + r * vrow, s + r * srow, s2};
      if (SCALES)
        for (int o = 0; o < sbytes; o += 64) prefetch_hinted<HINT>(reinterpret_cast<const char*>(rows[p].s + o + pf / 16));
    }
  }
};

template <int FMT, int HINT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))) void qrun_fp4_q8_vbmi(
    const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, float* out) {
  const int C = int(b.C), full = C / Q8_CHUNK, pf = g_pf;
  const __m512i lut = _mm512_load_si512(E2M1_X2_PLUS12_64);
  const RunRows run(b, e, r0);
  for (int blk = 0; blk < nb; ++blk) {
    QRow rows[4];
    run.block<HINT>(blk, pf, rows);
    __m512 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
    int base = 0, ch = 0;
    for (; ch < full; base += Q8_CHUNK, ++ch) {
      Q8Chunk c;
      c.nl = 16;
      c.xe = _mm512_loadu_si512(a.q + size_t(ch) * Q8_CHUNK);
      c.xo = _mm512_loadu_si512(a.q + size_t(ch) * Q8_CHUNK + 64);
      c.off = _mm512_loadu_si512(a.off + ch * 16);
      c.xs = _mm512_loadu_ps(a.xs + ch * 16);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const uint8_t* src = rows[p].v + base / 2;
        prefetch_hinted<HINT>(reinterpret_cast<const char*>(src + pf));
        const __m512i w = _mm512_loadu_si512(src);
        const __m512i lo = _mm512_permutexvar_epi8(w, lut);
        const __m512i hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(w, 4), lut);
        const __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c.off, lo, c.xe), hi, c.xo);
        const __m512 sw = vbmi_chunk_scales<FMT>(rows[p], base, 16);
        acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(sw, c.xs), acc[p]);
      }
    }
    if (base < C) {  // the short last chunk, as the per-block kernel takes it
      const Q8Chunk c = q8_chunk(a, C, base, ch);
      #pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) vbmi_step<FMT, false>(rows[p], c, lut, nullptr, base, ch, acc[p]);
    }
    half_sums4(acc, out + 4 * blk);
  }
}

// one 128-column chunk of four rows in qdot4_fp4_bf16dp_rs's arithmetic (nl lanes: 16 but for a
// short last chunk), added to acc
template <int FMT, int HINT, bool FULL>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"), always_inline)) inline void bf16dp_chunk(
    const QRow* rows, const uint16_t* xb, int base, int nl, int pf, __m512i table, __m512* acc) {
  const int nw = 2 * nl;
  const __mmask16 m = __mmask16((1u << nl) - 1);
  __m512i v[4];
  __m512 t[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    prefetch_hinted<HINT>(reinterpret_cast<const char*>(rows[p].v + base / 2 + pf));
    v[p] = FULL ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
    t[p] = _mm512_setzero_ps();
  }
  #pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512i xj = FULL ? _mm512_loadu_si512(xb + base + 32 * j) : _mm512_maskz_loadu_epi32(m, xb + base + j * nw);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i w = _mm512_permutexvar_epi16(_mm512_srli_epi16(v[p], 4 * j), table);
      t[p] = _mm512_dpbf16_ps(t[p], (__m512bh)w, (__m512bh)xj);
    }
  }
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) acc[p] = _mm512_fmadd_ps(t[p], fp4_scales_avx512(FMT, rows[p], base, nl), acc[p]);
}

template <int FMT, int HINT>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))) void qrun_fp4_bf16dp(const QBank& b, int64_t e, int64_t r0,
                                                                                   int nb, const uint16_t* xb, float* out) {
  const int C = int(b.C), pf = g_pf;
  const __m512i table = _mm512_load_si512(E2M1_BF16);
  const RunRows run(b, e, r0);
  for (int blk = 0; blk < nb; ++blk) {
    QRow rows[4];
    run.block<HINT>(blk, pf, rows);
    __m512 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
    int base = 0;
    for (; base + 128 <= C; base += 128) bf16dp_chunk<FMT, HINT, true>(rows, xb, base, 16, pf, table, acc);
    if (base < C) bf16dp_chunk<FMT, HINT, false>(rows, xb, base, (C - base) / 8, pf, table, acc);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[4 * blk + p] = _mm512_reduce_add_ps(acc[p]);
  }
}

// one 128-column chunk of four rows in qdot4_fp4_avx512_rs's arithmetic, added to acc
template <int FMT, int HINT, bool FULL>
__attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) inline void f32_chunk(const QRow* rows, const float* x, int base,
                                                                                   int nl, int pf, __m512 table, __m512* acc) {
  const __mmask16 m = __mmask16((1u << nl) - 1);
  __m512i v[4];
  __m512 t0[4], t1[4];
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    prefetch_hinted<HINT>(reinterpret_cast<const char*>(rows[p].v + base / 2 + pf));
    v[p] = FULL ? _mm512_loadu_si512(rows[p].v + base / 2) : _mm512_maskz_loadu_epi32(m, rows[p].v + base / 2);
    t0[p] = t1[p] = _mm512_setzero_ps();
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; j += 2) {
    const __m512 x0 = FULL ? _mm512_loadu_ps(x + base + 16 * j) : _mm512_maskz_loadu_ps(m, x + base + j * nl);
    const __m512 x1 = FULL ? _mm512_loadu_ps(x + base + 16 * j + 16) : _mm512_maskz_loadu_ps(m, x + base + (j + 1) * nl);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      t0[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v[p], 4 * j), table), x0, t0[p]);
      t1[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v[p], 4 * j + 4), table), x1, t1[p]);
    }
  }
  #pragma GCC unroll 4
  for (int p = 0; p < 4; ++p)
    acc[p] = _mm512_fmadd_ps(_mm512_add_ps(t0[p], t1[p]), fp4_scales_avx512(FMT, rows[p], base, nl), acc[p]);
}

template <int FMT, int HINT>
__attribute__((target("avx512f,avx2,fma,f16c"))) void qrun_fp4_avx512(const QBank& b, int64_t e, int64_t r0, int nb,
                                                                   const float* x, float* out) {
  const int C = int(b.C), pf = g_pf;
  const __m512 table = _mm512_load_ps(E2M1_F32);
  const RunRows run(b, e, r0);
  for (int blk = 0; blk < nb; ++blk) {
    QRow rows[4];
    run.block<HINT>(blk, pf, rows);
    __m512 acc[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) acc[p] = _mm512_setzero_ps();
    int base = 0;
    for (; base + 128 <= C; base += 128) f32_chunk<FMT, HINT, true>(rows, x, base, 16, pf, table, acc);
    if (base < C) f32_chunk<FMT, HINT, false>(rows, x, base, (C - base) / 8, pf, table, acc);
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) out[4 * blk + p] = _mm512_reduce_add_ps(acc[p]);
  }
}

// CPUs without AVX-512 (most consumer ones): the AVX2 one-token kernels themselves, float
// activations (qdot4_fp4_avx2, also a bf16 model's, widened) or int8 (qdot4_fp4_q8_avx2), called
// block by block with the hint fixed and the block scales decoded as g_row_scales says (RS, read
// once per run: decoded once per call is AVX2's default); the same functions, so the same bits.
template <int FMT, int HINT, bool RS, bool INT8>
__attribute__((target("avx2,fma,f16c"))) void qrun_fp4_avx2(const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a,
                                                         const float* x, float* out) {
  const int C = int(b.C);
  const RunRows run(b, e, r0);
  for (int blk = 0; blk < nb; ++blk) {
    QRow rows[4];
    run.block<HINT, false>(blk, 0, rows);
    if (INT8) qdot4_fp4_q8_avx2_rs<FMT, RS, HINT>(rows, a, C, out + 4 * blk);
    else qdot4_fp4_avx2_rs<FMT, RS, HINT>(rows, x, C, out + 4 * blk);
  }
}

// Which run kernel (Executor::run_q decides: int8 on VBMI or AVX2, bf16 activations on
// AVX512-BF16, float ones on AVX-512 or AVX2; fp4 banks) and the look-ahead hint chosen once per call.
enum RunKind { RUN_Q8_VBMI = 0, RUN_BF16DP = 1, RUN_F32 = 2, RUN_Q8_AVX2 = 3, RUN_F32_AVX2 = 4 };

template <int FMT, int HINT>
inline void qrun_hinted(int kind, const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, const float* x,
                        const uint16_t* xb, float* out) {
  if (kind == RUN_Q8_VBMI) return qrun_fp4_q8_vbmi<FMT, HINT>(b, e, r0, nb, a, out);
  if (kind == RUN_BF16DP) return qrun_fp4_bf16dp<FMT, HINT>(b, e, r0, nb, xb, out);
  if (kind == RUN_F32) return qrun_fp4_avx512<FMT, HINT>(b, e, r0, nb, x, out);
  const bool rs = g_row_scales.load(std::memory_order_relaxed) & ROW_SCALES_AVX2;
  if (kind == RUN_Q8_AVX2)
    return rs ? qrun_fp4_avx2<FMT, HINT, true, true>(b, e, r0, nb, a, x, out) : qrun_fp4_avx2<FMT, HINT, false, true>(b, e, r0, nb, a, x, out);
  rs ? qrun_fp4_avx2<FMT, HINT, true, false>(b, e, r0, nb, a, x, out) : qrun_fp4_avx2<FMT, HINT, false, false>(b, e, r0, nb, a, x, out);
}

template <int FMT>
inline void qrun_fmt(int kind, const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, const float* x,
                     const uint16_t* xb, float* out) {
  switch (g_pf_hint) {
    case 0: return qrun_hinted<FMT, 0>(kind, b, e, r0, nb, a, x, xb, out);
    case 1: return qrun_hinted<FMT, 1>(kind, b, e, r0, nb, a, x, xb, out);
    case 2: return qrun_hinted<FMT, 2>(kind, b, e, r0, nb, a, x, xb, out);
    case 3: return qrun_hinted<FMT, 3>(kind, b, e, r0, nb, a, x, xb, out);
    default: return qrun_hinted<FMT, -1>(kind, b, e, r0, nb, a, x, xb, out);
  }
}

// rows r0 .. r0 + 4 nb of expert e against one token's activations: a (int8), xb (bf16) or x
// (float), as kind says; out: [4 nb] row sums
inline void qrun(int kind, const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, const float* x,
                 const uint16_t* xb, float* out) {
  ++t_row_runs;
  b.fmt == FMT_MXFP4 ? qrun_fmt<FMT_MXFP4>(kind, b, e, r0, nb, a, x, xb, out)
                     : qrun_fmt<FMT_NVFP4>(kind, b, e, r0, nb, a, x, xb, out);
}
