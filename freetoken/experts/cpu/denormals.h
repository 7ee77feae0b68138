// Flush-to-zero and denormals-are-zero (MXCSR bits 15 and 6) on the calling thread and on every
// thread of the process's GNU OpenMP team, which runs torch's intra-op work and MKL's GEMMs.
//
// Why: the gated DeltaNet chunk rule (model/deltanet.py chunk_gated_delta_rule) multiplies decays
// spanning e^0 to e^-100 within a chunk; their products are fp32 denormals, on which x86 takes a
// microcode assist per operation. A 512-token chunk of a fast-decaying Qwen3.6 layer took 866 ms
// on the 2-core dev machine against 81 ms with these bits set on every thread. torch's
// set_flush_denormal sets them on the calling thread only, not on its OpenMP workers.
//
// The team: GOMP_parallel from the libgomp.so.1 already loaded (torch's), found without loading
// anything (RTLD_NOLOAD), with the caller's default team size (torch.set_num_threads). Where torch
// runs another OpenMP runtime, only the calling thread is set, and the result says so.
// A header that moe_cpu.cpp includes.
#pragma once
#include <dlfcn.h>
#include <xmmintrin.h>

#include <cstdint>

namespace ft_denormals {

constexpr unsigned kFtzDaz = 0x8040u;

inline void set_here(void* on) {
  unsigned m = _mm_getcsr();
  _mm_setcsr(*static_cast<bool*>(on) ? (m | kFtzDaz) : (m & ~kFtzDaz));
}

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

inline GompParallel gomp_parallel() {
  static GompParallel fn = [] {
    void* lib = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);
    return lib ? reinterpret_cast<GompParallel>(dlsym(lib, "GOMP_parallel")) : nullptr;
  }();
  return fn;
}

}  // namespace ft_denormals

// caller / team: set (true) or clear the bits on the calling thread / on the other threads of its
// OpenMP team (the team's region runs on the caller too: the caller's setting is applied after).
// -> 2: the team was reached; 1: the caller only (no GNU OpenMP loaded); plus 4 if the caller had
// the bits set before.
int64_t flush_denormals(bool caller, bool team) {
  int64_t was = (_mm_getcsr() & ft_denormals::kFtzDaz) == ft_denormals::kFtzDaz ? 4 : 0;
  int64_t reached = 1;
  if (auto par = ft_denormals::gomp_parallel()) {
    par(ft_denormals::set_here, &team, 0, 0);  // 0 threads: the team size of the caller's next parallel region
    reached = 2;
  }
  ft_denormals::set_here(&caller);
  return was | reached;
}
