// What the runner's kernels share: the bfloat16 <-> float32 conversions, the CPU feature checks, and the
// AVX2 helpers (8-lane loads, horizontal sums and maxima, e^x). Included by paged_attention.cpp,
// prefill_attention.cpp, tinygemm.cpp and greedy.cpp; model_runner/kernels.py names each build after this header
// too, so a change here rebuilds them all.
//
// The vector code is compiled by function attribute (PDS_AVX2, PDS_AVX512, PDS_AVX512_BF16) and chosen at run
// time, so one cached build runs on any x86-64 CPU. PDS_HAVE_AVX512 is 0 where the compiler cannot emit x86
// vector code at all (other architectures): the kernels then build their portable loops only.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PDS_HAVE_AVX512 1
#define PDS_AVX512 __attribute__((target("avx512f,fma")))
#define PDS_AVX512_BF16 __attribute__((target("avx512f,avx512vl,avx512bf16,fma")))
#define PDS_AVX2 __attribute__((target("avx2,fma")))
#else
#define PDS_HAVE_AVX512 0
#endif
#define PDS_INLINE inline __attribute__((always_inline))

namespace pds {

// ---- scalars: T is float or uint16_t (the bits of a bfloat16) ----

inline float to_f32(float x) { return x; }

inline float to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;  // bfloat16 is the top half of a float32
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float x) {  // round to nearest even (NaN to a quiet NaN), as torch's .to() does
  if (std::isnan(x)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void store_f32(float x, float* dst) { *dst = x; }
inline void store_f32(float x, uint16_t* dst) { *dst = f32_to_bf16(x); }

// ---- what this CPU runs; each answer is asked of the CPU once ----

// The code paths a kernel may take, fastest last; each kernel chooses one per call from what the CPU has and
// what PDSERVE_*_PATH asks for.
enum class Path { kPortable, kAvx2, kAvx512, kAvx512Bf16 };

inline const char* path_name(Path path) {
  switch (path) {
    case Path::kAvx512Bf16: return "avx512_bf16";
    case Path::kAvx512: return "avx512";
    case Path::kAvx2: return "avx2";
    default: return "portable";
  }
}

inline bool cpu_has_avx512() {
#if PDS_HAVE_AVX512
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
#else
  return false;
#endif
}

inline bool cpu_has_avx512_bf16() {
#if PDS_HAVE_AVX512
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

inline bool cpu_has_avx2() {
#if PDS_HAVE_AVX512
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

#if PDS_HAVE_AVX512
// ---- AVX-512: 16 float32 lanes ----

// e^x for x in [-104, 100], within 2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for exactness),
// e^r by Cephes' expf polynomial, then scaled by 2^n (scalef flushes what underflows to 0 and rounds what
// overflows to inf). Callers clamp as their inputs need.
PDS_AVX512 inline __m512 exp16_in_range(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// e^x for any x; a NaN stays a NaN (maxps and minps with x second return x when it is a NaN). e^100 and e^-100
// already round to inf and 0.
PDS_AVX512 inline __m512 exp16(__m512 x) {
  return exp16_in_range(_mm512_min_ps(_mm512_set1_ps(100.f), _mm512_max_ps(_mm512_set1_ps(-100.f), x)));
}

// e^x for a softmax's x - max <= 0 (e^-104 is 0 in float32; the clamp also keeps -inf out of r).
PDS_AVX512 inline __m512 exp16_nonpositive(__m512 x) {
  return exp16_in_range(_mm512_max_ps(x, _mm512_set1_ps(-104.f)));
}

// ---- AVX2: 8 float32 lanes ----

PDS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

PDS_AVX2 inline __m256 load8(const uint16_t* p) {  // 8 bfloat16s, widened
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

PDS_AVX2 inline float hsum8(__m256 x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

PDS_AVX2 inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// e^x for x already in [-87, 88], so that 2^n fits a float32's exponent bits (AVX2 has no scalef): x = n ln2 + r
// with |r| <= ln2 / 2 (ln2 split in two for exactness), then a degree-6 polynomial for e^r, within ~1 ulp.
// Callers clamp as their inputs need; see exp8 and exp_nonpositive8.
PDS_AVX2 inline __m256 exp8_in_range(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// e^x for any x, clamped to [-87, 88]; a NaN stays a NaN (maxps and minps return their second operand when
// either is a NaN), so a NaN activation shows in the output as it does in torch's.
PDS_AVX2 inline __m256 exp8(__m256 x) {
  return exp8_in_range(_mm256_min_ps(_mm256_set1_ps(88.f), _mm256_max_ps(_mm256_set1_ps(-87.f), x)));
}

// e^x for a softmax's x - max <= 0, clamped at -87 (e^-87 is 1.6e-38: a weight that small adds nothing a
// bfloat16 or float32 output can show).
PDS_AVX2 inline __m256 exp_nonpositive8(__m256 x) { return exp8_in_range(_mm256_max_ps(x, _mm256_set1_ps(-87.f))); }
#endif  // PDS_HAVE_AVX512

}  // namespace pds
