// One token's int8 dots with a run of consecutive rows of one expert (included by moe_cpu.cpp,
// inside its namespace, after the VBMI kernel: it uses QBank, Q8Act, Q8Chunk and vbmi_step).
//
// Why: at batch 1 (decode) each 4-row block was one call of qdot4_fp4_q8_vbmi through the
// kernel dispatch (two atomic switch loads), four qrow() computations, the call's prologue
// (constants, the scale prefetch loop) and a look-ahead whose hint was a runtime switch of three
// branches per 64-byte load. On the down projection (512 columns: 4 chunks a call) that was
// about as many instructions as the dots: in one process on the 2-core dev machine (Zen 4), one
// thread, experts in L2, the down rows ran at 14 GB/s against the gate/up rows' 24.
// qrun_fp4_q8_vbmi takes nb consecutive 4-row blocks of one expert in one call: row pointers
// advance by the bank's strides, the hint is a template argument (chosen once per call), whole
// chunks need no mask. Each row's integers, scaling and the order of its sums are
// vbmi_step's and half_sums4's, so out[i] is, bit for bit, what qdot4_fp4_q8_vbmi gives for
// that row (test_q8_runs_give_the_per_block_bits). FREETOKEN_CPU_Q8_RUNS=0 / set_q8_runs(0)
// goes back to a call per block (A/B runs).
#pragma once

static std::atomic<int> g_q8_runs{[] {
  const char* v = std::getenv("FREETOKEN_CPU_Q8_RUNS");
  return v != nullptr && std::strcmp(v, "0") == 0 ? 0 : 1;
}()};

template <int HINT>
inline void prefetch_hinted(const char* p) {
  if (HINT == 0) prefetch_t0(p);
  else if (HINT == 1) prefetch_t1(p);
  else if (HINT == 2) prefetch_t2(p);
  else if (HINT == 3) prefetch_nta(p);
}

// rows r0 .. r0 + 4 nb of expert e in bank b (one NVFP4 half: the caller keeps a run inside it),
// against one quantized activation row of b.C columns; out: [4 nb] row sums
template <int FMT, int HINT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))) void qrun_fp4_q8_vbmi_h(
    const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, float* out) {
  const int C = int(b.C), full = C / Q8_CHUNK;  // whole 128-column chunks; a shorter last one after them
  const __m512i lut = _mm512_load_si512(E2M1_X2_PLUS12_64);
  const int64_t vrow = b.vrow, srow = b.srow;
  const int pf = g_pf, sbytes = FMT == FMT_MXFP4 ? C / 32 : C / 16;
  const float s2 = FMT == FMT_NVFP4 ? b.s2[e * b.halves + (b.halves == 2 && r0 >= b.R / 2 ? 1 : 0)] : 1.f;
  const uint8_t* v = b.v + (e * b.R + r0) * vrow;
  const uint8_t* s = b.s + (e * b.R + r0) * srow;
  for (int blk = 0; blk < nb; ++blk, v += 4 * vrow, s += 4 * srow) {
    QRow rows[4];
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      rows[p] = QRow{v + p * vrow, s + p * srow, s2};
      for (int o = 0; o < sbytes; o += 64) prefetch_hinted<HINT>(reinterpret_cast<const char*>(rows[p].s + o + pf / 16));
    }
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

// qrun_fp4_q8_vbmi_h with the look-ahead's hint (g_pf_hint) chosen once
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c"))) inline void qrun_fp4_q8_vbmi(
    const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, float* out) {
  switch (g_pf_hint) {
    case 0: return qrun_fp4_q8_vbmi_h<FMT, 0>(b, e, r0, nb, a, out);
    case 1: return qrun_fp4_q8_vbmi_h<FMT, 1>(b, e, r0, nb, a, out);
    case 2: return qrun_fp4_q8_vbmi_h<FMT, 2>(b, e, r0, nb, a, out);
    case 3: return qrun_fp4_q8_vbmi_h<FMT, 3>(b, e, r0, nb, a, out);
    default: return qrun_fp4_q8_vbmi_h<FMT, -1>(b, e, r0, nb, a, out);
  }
}

inline void qrun_q8(int fmt, const QBank& b, int64_t e, int64_t r0, int nb, const Q8Act& a, float* out) {
  fmt == FMT_MXFP4 ? qrun_fp4_q8_vbmi<FMT_MXFP4>(b, e, r0, nb, a, out) : qrun_fp4_q8_vbmi<FMT_NVFP4>(b, e, r0, nb, a, out);
}
