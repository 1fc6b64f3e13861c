// Causal attention for a prompt (prefill), on the CPU. Built and loaded by model_runner/prefill_attention.py as
// the op torch.ops.pdserve_prefill.causal_attention.
//
// Flash-attention style: keys go in tiles of kTile positions, the tiles starting at multiples of kTile from
// position 0 (not from the chunk's start). A query row keeps a running max and sum in float32 and rescales its
// float32 accumulator when the max moves, which it does only when a tile's scores pass it by 2^kLazy: most
// tiles need no max reduction and no rescale. Tiles wholly above a row's diagonal are never computed, nor,
// in a diagonal tile, the 16-key vectors and key pairs past a micro tile's last row.
//
// Chunk invariance: the arithmetic of query row t is a function of q_t, keys 0..start+t and nothing else. Its
// tiles are at fixed absolute positions; within a tile the keys past its diagonal are masked (max -inf, weight
// exactly 0, and a zero weight adds exactly nothing: an accumulator that starts at +0 never becomes -0); a
// tile wholly past a row that a neighbour in its micro tile needs is an exact no-op for it (max unchanged, so
// the rescale factor is exactly 1, weights exactly 0); every row of a micro tile, and micro tiles of any
// height, run the same instruction sequence per row (and -ffp-contract=off keeps the compiler from fusing
// differently in different copies). So a prompt computed whole, or in chunks with start > 0, gives the same
// bits, at any thread count. The portable path is chunk invariant too, with other bits.
//
// A task is one kv head and a block of query positions: the q heads of the kv head's GQA group are computed
// together (rows ordered position-major), so each key and value tile is loaded once for the whole group. The
// keys and values are first packed, tile by tile, into the layouts the dot products want:
//  - bfloat16 with AVX512-BF16 (vdpbf16ps: 32 bf16 products summed pairwise into 16 float32 lanes): keys as
//    (D/2, kTile) 32-bit words, word (p, n) = key n's dims 2p and 2p+1, so a vector is 16 keys' same pair of
//    dims; values as (kTile/2, D) words, word (i, d) = dim d of keys 2i and 2i+1. The softmax weights are
//    rounded to bfloat16 for the weighted sum of values (as torch's flash attention does).
//  - float32, or bfloat16 on CPUs without AVX512-BF16: keys as (D, kTile), values as (kTile, D), float32; FMAs.
// A micro tile is up to kRows query rows x kTile keys: kRows x 4 score vectors in registers for the dot
// products, the softmax on them, then the weighted values summed into kRows x 64 dims of accumulators in
// registers (D = 128 in two passes).
//
// CPUs with AVX2 and FMA but no AVX-512 run a float32 path of 8-lane vectors (block_avx2): one query row at a
// time over the same tiles and the same lazy online softmax, keys and values packed as for float32 above.
//
// The vector code is compiled by function attribute and chosen at run time, so one cached build runs on any
// x86-64 CPU; others (and other architectures, head dims that are not multiples of 64) run the portable loops.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "simd.h"

namespace {

using namespace pds;

constexpr int64_t kTile = 64;  // keys per tile; tile j holds positions [kTile j, kTile (j + 1))
constexpr int kVecs = kTile / 16;  // float32 vectors of scores per row of a tile
constexpr int kRows = 6;  // query rows per micro tile: 4 * kRows score vectors fit in registers
constexpr int64_t kBlockRows = 96;  // query rows (positions x group) per task, about

// Pointers to element 0, strides in elements (the last dim is contiguous). T: float or uint16_t (bf16 bits).
template <typename T>
struct Problem {
  const T* q;  // (Hq, T, D)
  const T* k;  // (Hkv, start + T, D)
  const T* v;
  T* out;  // (Hq, T, D)
  int64_t q_head, q_token, k_head, k_token, v_head, v_token, o_head, o_token;
  int64_t hq, hkv, group, tokens, d, start, length;  // length = start + tokens
  float scale;
  int64_t positions_per_block, blocks;
};

inline uint32_t load_u32(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// Query rows of one task: row r is position block_start + r / group of q head kv_head * group + r % group, so
// the rows of a micro tile share few positions.
template <typename T>
struct Rows {
  std::vector<const T*> q;  // each row's q (D elements)
  std::vector<int64_t> pos;  // each row's absolute position
  std::vector<T*> out;
};

struct Scratch {
  std::vector<float> acc, max, sum, qf;  // acc (rows, D); max (rows,); sum (rows, 16); qf: q in float32
  std::vector<float> weights;  // (kRows, kTile): one micro tile's softmax weights, float32 or bf16 pairs
};

template <typename T>
void rows_of(const Problem<T>& p, int64_t kvh, int64_t block, Rows<T>& rows) {
  const int64_t t0 = block * p.positions_per_block, n = std::min(p.positions_per_block, p.tokens - t0) * p.group;
  rows.q.resize(n), rows.pos.resize(n), rows.out.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = t0 + r / p.group, h = kvh * p.group + r % p.group;
    rows.q[r] = p.q + h * p.q_head + t * p.q_token;
    rows.out[r] = p.out + h * p.o_head + t * p.o_token;
    rows.pos[r] = p.start + t;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Portable path: one row at a time, the same tiles and online softmax, plain loops (float32 throughout).

template <typename T>
void block_portable(const Problem<T>& p, int64_t kvh, const Rows<T>& rows, Scratch& s) {
  const int64_t D = p.d, n = static_cast<int64_t>(rows.q.size());
  s.acc.resize(D), s.qf.resize(D), s.weights.resize(kTile);
  const T* kh = p.k + kvh * p.k_head;
  const T* vh = p.v + kvh * p.v_head;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < D; ++i) s.qf[i] = to_f32(rows.q[r][i]), s.acc[i] = 0.f;
    float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
    const int64_t last = rows.pos[r];
    for (int64_t key0 = 0; key0 <= last; key0 += kTile) {
      const int64_t count = std::min(kTile, last + 1 - key0);
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < count; ++i) {
        const T* key = kh + (key0 + i) * p.k_token;
        float dot = 0.f;
        for (int64_t e = 0; e < D; ++e) dot += s.qf[e] * to_f32(key[e]);
        s.weights[i] = dot * p.scale;
        tile_max = std::max(tile_max, s.weights[i]);
      }
      const float new_max = std::max(max, tile_max), alpha = std::exp(max - new_max);
      float tile_sum = 0.f;
      for (int64_t e = 0; e < D; ++e) s.acc[e] *= alpha;
      for (int64_t i = 0; i < count; ++i) {
        const float w = std::exp(s.weights[i] - new_max);
        tile_sum += w;
        const T* value = vh + (key0 + i) * p.v_token;
        for (int64_t e = 0; e < D; ++e) s.acc[e] += w * to_f32(value[e]);
      }
      sum = sum * alpha + tile_sum, max = new_max;
    }
    const float inv = 1.f / sum;
    for (int64_t e = 0; e < D; ++e) store_f32(s.acc[e] * inv, rows.out[r] + e);
  }
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 paths

#if PDS_HAVE_AVX512

// The running max moves only when a tile's scores pass it by more than kLazy (log2 units): weights then reach
// 2^kLazy at most, harmless in float32 and bfloat16, and most tiles need no rescale (no max reduction, no
// rescale factors, no rescaled accumulators). Still a function of the row alone, so chunk invariance holds.
constexpr float kLazy = 8.f;

// 2^x for x <= kLazy (a score minus the running max, in log2 units): x = n + f with f in [-0.5, 0.5], 2^f by
// a polynomial of degree DEG with constant term exactly 1 (so 2^0 is exactly 1), times 2^n. Relative error:
// 1e-4 (DEG 3, for bf16 weights, rounded to 8 bits anyway), 2e-7 (DEG 5). x is clamped at -100: 2^-100 is no
// denormal, and where it matters (masked keys) the weight is zeroed by mask.
template <int DEG>
PDS_AVX512 PDS_INLINE __m512 fast_exp2(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p;
  if constexpr (DEG == 3) {
    p = _mm512_set1_ps(5.5008689983e-02f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4221063137e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9328291703e-01f));
  } else {
    static_assert(DEG == 5, "degree 3 or 5");
    p = _mm512_set1_ps(1.3264708791e-03f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6715114712e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507337765e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022242104e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314697759e-01f));
  }
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Key n's validity for a row at position pos: key0 + 16 b + lane <= pos.
PDS_AVX512 PDS_INLINE __mmask16 visible(int64_t key0, int b, int64_t pos) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int32_t limit = static_cast<int32_t>(std::min<int64_t>(pos - key0 - 16 * b, kTile));
  return _mm512_cmple_epi32_mask(lanes, _mm512_set1_epi32(std::max<int32_t>(limit, -1)));
}

// One micro tile's state: its rows' running max (in raw dot-product units), sums and accumulators.
struct TileState {
  float* max;  // (MR,)
  float* sum;  // (MR, 16): lane sums, added up at the end
  float* acc;  // (MR, D)
  float* weights;  // (MR, kTile) float32, or (MR, kTile / 2) bf16 pairs
};

// The online softmax over a micro tile's scores s (raw dot products, MR rows x kTile keys), turned into
// weights in place; updates the running maxes and sums. Returns whether any row's max moved; then alpha holds
// each row's rescale factor for its accumulators (exactly 1 for the rows whose max stayed).
template <int MR, int DEG>
PDS_AVX512 PDS_INLINE bool online_softmax(__m512 (&s)[MR][kVecs], const int64_t* pos, int64_t key0, bool masked,
                                          float c, TileState st, float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const float lazy = kLazy / c;
  __m512 tile_max[MR];
  unsigned grow = 0;
  for (int r = 0; r < MR; ++r) {
    if (masked)
      for (int b = 0; b < kVecs; ++b) s[r][b] = _mm512_mask_mov_ps(neg_inf, visible(key0, b, pos[r]), s[r][b]);
    tile_max[r] = s[r][0];
    for (int b = 1; b < kVecs; ++b) tile_max[r] = _mm512_max_ps(tile_max[r], s[r][b]);
    if (_mm512_cmp_ps_mask(tile_max[r], _mm512_set1_ps(st.max[r] + lazy), _CMP_GT_OQ)) grow |= 1u << r;
  }
  if (grow) {  // alpha = 2^((old - new) c), exactly 1 where the max stayed; all rows at once
    float new_max[MR];
    for (int r = 0; r < MR; ++r)
      new_max[r] = grow >> r & 1u ? std::max(st.max[r], _mm512_reduce_max_ps(tile_max[r])) : st.max[r];
    const __mmask16 live = static_cast<__mmask16>((1u << MR) - 1u);
    const __m512 old_v = _mm512_mask_loadu_ps(_mm512_setzero_ps(), live, st.max);
    const __m512 new_v = _mm512_mask_loadu_ps(_mm512_setzero_ps(), live, new_max);
    __m512 a = fast_exp2<DEG>(_mm512_mul_ps(_mm512_sub_ps(old_v, new_v), _mm512_set1_ps(c)));
    a = _mm512_mask_mov_ps(a, _mm512_cmp_ps_mask(old_v, new_v, _CMP_EQ_OQ), _mm512_set1_ps(1.f));
    _mm512_mask_storeu_ps(alpha, live, a);
    _mm512_mask_storeu_ps(st.max, live, new_v);
  }
  const __m512 vc = _mm512_set1_ps(c);
  for (int r = 0; r < MR; ++r) {
    const __m512 mc = _mm512_set1_ps(st.max[r] * c);
    for (int b = 0; b < kVecs; ++b) {
      s[r][b] = fast_exp2<DEG>(_mm512_fmsub_ps(s[r][b], vc, mc));
      if (masked) s[r][b] = _mm512_maskz_mov_ps(visible(key0, b, pos[r]), s[r][b]);
    }
    __m512 sum = _mm512_loadu_ps(st.sum + 16 * r);
    if (grow) sum = _mm512_mul_ps(sum, _mm512_set1_ps(alpha[r]));
    __m512 tile_sum = s[r][0];
    for (int b = 1; b < kVecs; ++b) tile_sum = _mm512_add_ps(tile_sum, s[r][b]);
    _mm512_storeu_ps(st.sum + 16 * r, _mm512_add_ps(sum, tile_sum));
  }
  return grow != 0;
}

// How many of a tile's key vectors a micro tile whose last row is at position last needs: on the diagonal,
// the vectors wholly past its last row are skipped.
inline int vectors_needed(int64_t last, int64_t key0) {
  return static_cast<int>(std::min<int64_t>(kVecs, (last - key0) / 16 + 1));
}

// Raw scores of MR q rows (bf16) against NB vectors of keys (16 NB keys) from kt ((D/2, kTile) words, already
// offset to the first key): into s[r][0..NB) of rows kVecs vectors apart.
template <int MR, int NB>
PDS_AVX512_BF16 PDS_INLINE void scores_bf16(const uint16_t* const* q, const uint32_t* kt, int64_t D, __m512* s) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    const uint32_t* kp = kt + p * kTile;
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_loadu_si512(kp + 16 * b);
    for (int r = 0; r < MR; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(load_u32(q[r] + 2 * p)));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qb, k[b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) s[r * kVecs + b] = acc[r][b];
}

// The same in float32: q rows (float32), kt (D, kTile) floats.
template <int MR, int NB>
PDS_AVX512 PDS_INLINE void scores_f32(const float* const* q, const float* kt, int64_t D, __m512* s) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t e = 0; e < D; ++e) {
    const float* kp = kt + e * kTile;
    __m512 k[NB];
    for (int b = 0; b < NB; ++b) k[b] = _mm512_loadu_ps(kp + 16 * b);
    for (int r = 0; r < MR; ++r) {
      const __m512 qb = _mm512_set1_ps(q[r][e]);
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(qb, k[b], acc[r][b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) s[r * kVecs + b] = acc[r][b];
}

// Scores past the last row's vectors: -inf, as if masked.
template <int MR>
PDS_AVX512 PDS_INLINE void past_the_diagonal(__m512 (&s)[MR][kVecs], int needed) {
  for (int r = 0; r < MR; ++r)
    for (int b = needed; b < kVecs; ++b) s[r][b] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
}

// A tile's scores 4 vectors (64 keys) at a time, as many as the registers hold, only the first `needed`
// vectors. Switches, not a lambda: a lambda loses the function's target attribute.
template <int MR>
PDS_AVX512_BF16 PDS_INLINE void tile_scores_bf16(const uint16_t* const* q, const uint32_t* kt, int64_t D,
                                                 int needed, __m512 (&s)[MR][kVecs]) {
  for (int h = 0; h < needed; h += 4) {
    switch (std::min(needed - h, 4)) {
      case 1: scores_bf16<MR, 1>(q, kt + 16 * h, D, &s[0][h]); break;
      case 2: scores_bf16<MR, 2>(q, kt + 16 * h, D, &s[0][h]); break;
      case 3: scores_bf16<MR, 3>(q, kt + 16 * h, D, &s[0][h]); break;
      default: scores_bf16<MR, 4>(q, kt + 16 * h, D, &s[0][h]); break;
    }
  }
  past_the_diagonal<MR>(s, needed);
}

template <int MR>
PDS_AVX512 PDS_INLINE void tile_scores_f32(const float* const* q, const float* kt, int64_t D, int needed,
                                           __m512 (&s)[MR][kVecs]) {
  for (int h = 0; h < needed; h += 4) {
    switch (std::min(needed - h, 4)) {
      case 1: scores_f32<MR, 1>(q, kt + 16 * h, D, &s[0][h]); break;
      case 2: scores_f32<MR, 2>(q, kt + 16 * h, D, &s[0][h]); break;
      case 3: scores_f32<MR, 3>(q, kt + 16 * h, D, &s[0][h]); break;
      default: scores_f32<MR, 4>(q, kt + 16 * h, D, &s[0][h]); break;
    }
  }
  past_the_diagonal<MR>(s, needed);
}

// One micro tile, bfloat16 with vdpbf16ps: q rows (bf16, D), keys kt ((D/2, kTile) words), values vt
// ((kTile/2, D) words) of the tile starting at key0.
template <int MR>
PDS_AVX512_BF16 void tile_bf16(const uint16_t* const* q, const int64_t* pos, const uint32_t* kt,
                               const uint32_t* vt, int64_t key0, int64_t D, bool masked, float c,
                               TileState st) {
  __m512 s[MR][kVecs];
  tile_scores_bf16<MR>(q, kt, D, masked ? vectors_needed(pos[MR - 1], key0) : kVecs, s);
  float alpha[MR];
  const bool rescale = online_softmax<MR, 3>(s, pos, key0, masked, c, st, alpha);
  uint32_t* w = reinterpret_cast<uint32_t*>(st.weights);
  for (int r = 0; r < MR; ++r)  // word i of a row: the weights of keys 2i and 2i+1, as vdpbf16ps pairs them
    for (int b = 0; b < kVecs; b += 2)
      _mm512_storeu_si512(w + r * (kTile / 2) + 8 * b, (__m512i)_mm512_cvtne2ps_pbh(s[r][b + 1], s[r][b]));
  // past the last row's position the weights are all 0: those key pairs add nothing
  const int64_t pairs = masked ? std::min<int64_t>(kTile / 2, (pos[MR - 1] - key0 + 2) / 2) : kTile / 2;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_loadu_ps(st.acc + r * D + d0 + 16 * b);
    if (rescale)
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_mul_ps(acc[r][b], _mm512_set1_ps(alpha[r]));
    for (int64_t i = 0; i < pairs; ++i) {
      const uint32_t* vp = vt + i * D + d0;
      __m512bh v[4];
      for (int b = 0; b < 4; ++b) v[b] = (__m512bh)_mm512_loadu_si512(vp + 16 * b);
      for (int r = 0; r < MR; ++r) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[r * (kTile / 2) + i]));
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wb, v[b]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) _mm512_storeu_ps(st.acc + r * D + d0 + 16 * b, acc[r][b]);
  }
}

// One micro tile in float32 FMAs: q rows (float32, D), keys kt ((D, kTile)), values vt ((kTile, D)).
template <int MR>
PDS_AVX512 void tile_f32(const float* const* q, const int64_t* pos, const float* kt, const float* vt,
                         int64_t key0, int64_t D, bool masked, float c, TileState st) {
  __m512 s[MR][kVecs];
  tile_scores_f32<MR>(q, kt, D, masked ? vectors_needed(pos[MR - 1], key0) : kVecs, s);
  float alpha[MR];
  const bool rescale = online_softmax<MR, 5>(s, pos, key0, masked, c, st, alpha);
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < kVecs; ++b) _mm512_storeu_ps(st.weights + r * kTile + 16 * b, s[r][b]);
  const int64_t keys = masked ? std::min<int64_t>(kTile, pos[MR - 1] - key0 + 1) : kTile;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_loadu_ps(st.acc + r * D + d0 + 16 * b);
    if (rescale)
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_mul_ps(acc[r][b], _mm512_set1_ps(alpha[r]));
    for (int64_t i = 0; i < keys; ++i) {
      const float* vp = vt + i * D + d0;
      __m512 v[4];
      for (int b = 0; b < 4; ++b) v[b] = _mm512_loadu_ps(vp + 16 * b);
      for (int r = 0; r < MR; ++r) {
        const __m512 wb = _mm512_set1_ps(st.weights[r * kTile + i]);
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_fmadd_ps(wb, v[b], acc[r][b]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < 4; ++b) _mm512_storeu_ps(st.acc + r * D + d0 + 16 * b, acc[r][b]);
  }
}

// acc * (1 / the sum of the 16 lane sums) -> out, D elements (a multiple of 16); bf16 rounded to nearest even,
// NaN kept.
PDS_AVX512 void store_row(const float* acc, const float* sums, float* out, int64_t D) {
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(sums)));
  for (int64_t e = 0; e < D; e += 16) _mm512_storeu_ps(out + e, _mm512_mul_ps(_mm512_loadu_ps(acc + e), inv));
}

PDS_AVX512 void store_row(const float* acc, const float* sums, uint16_t* out, int64_t D) {
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(sums)));
  for (int64_t e = 0; e < D; e += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(acc + e), inv);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + e), _mm512_cvtepi32_epi16(r));
  }
}

#endif  // PDS_HAVE_AVX512

// ---------------------------------------------------------------------------------------------------------
// Packing: each kv head's keys and values, tile by tile, zero past the sequence (the buffers start zeroed; those
// keys are always masked, and their zero values keep 0 * value exactly 0).

struct Packed {
  Path path;
  int64_t tiles, tile_elems;  // tile_elems: 32-bit words (bf16 pairs) or floats per tile of keys (or values)
  std::vector<uint32_t> keys, values;  // (Hkv, tiles, tile_elems); floats stored as their bits

  const uint32_t* key_tile(int64_t h, int64_t j) const { return keys.data() + (h * tiles + j) * tile_elems; }
  const uint32_t* value_tile(int64_t h, int64_t j) const { return values.data() + (h * tiles + j) * tile_elems; }
};

template <typename T>
void pack_tile(const Problem<T>& p, Packed& pk, int64_t h, int64_t j) {
  const int64_t D = p.d, key0 = j * kTile, count = std::min(kTile, p.length - key0);
  uint32_t* kt = pk.keys.data() + (h * pk.tiles + j) * pk.tile_elems;
  uint32_t* vt = pk.values.data() + (h * pk.tiles + j) * pk.tile_elems;
  const T* kh = p.k + h * p.k_head + key0 * p.k_token;
  const T* vh = p.v + h * p.v_head + key0 * p.v_token;
  if constexpr (sizeof(T) == 2) {
    if (pk.path == Path::kAvx512Bf16) {
      for (int64_t n = 0; n < count; ++n)
        for (int64_t w = 0; w < D / 2; ++w) kt[w * kTile + n] = load_u32(kh + n * p.k_token + 2 * w);
      for (int64_t n = 0; n < count; ++n) {
        const T* row = vh + n * p.v_token;
        uint16_t* dst = reinterpret_cast<uint16_t*>(vt + (n / 2) * D) + (n & 1);
        for (int64_t e = 0; e < D; ++e) dst[2 * e] = row[e];
      }
      return;
    }
  }
  float* ktf = reinterpret_cast<float*>(kt);
  float* vtf = reinterpret_cast<float*>(vt);
  for (int64_t n = 0; n < count; ++n)
    for (int64_t e = 0; e < D; ++e) ktf[e * kTile + n] = to_f32(kh[n * p.k_token + e]);
  for (int64_t n = 0; n < count; ++n)
    for (int64_t e = 0; e < D; ++e) vtf[n * D + e] = to_f32(vh[n * p.v_token + e]);
}

#if PDS_HAVE_AVX512

template <typename F>
void with_rows(int n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: TORCH_CHECK(false, "unreachable: ", n, " rows in a micro tile");
  }
}

// One task's block of rows: key tile by key tile (so a tile's keys and values stay in L1 for all the block's
// micro tiles), micro tile by micro tile, skipping what lies wholly above the diagonal.
template <typename T>
void block_avx512(const Problem<T>& p, const Packed& pk, int64_t kvh, const Rows<T>& rows, Scratch& s) {
  const int64_t D = p.d, n = static_cast<int64_t>(rows.q.size());
  const float c = p.scale * 1.4426950408889634f;  // exponents in log2 units
  s.acc.assign(n * D, 0.f);
  s.max.assign(n, -std::numeric_limits<float>::infinity());
  s.sum.assign(n * 16, 0.f);
  s.weights.resize(kRows * kTile);
  std::vector<const float*> qf;  // the rows' q in float32 (the float32 kernel's input)
  if (pk.path == Path::kAvx512) {
    qf.resize(n);
    if constexpr (sizeof(T) == 2) {
      s.qf.resize(n * D);
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t e = 0; e < D; ++e) s.qf[r * D + e] = to_f32(rows.q[r][e]);
        qf[r] = s.qf.data() + r * D;
      }
    } else {
      for (int64_t r = 0; r < n; ++r) qf[r] = reinterpret_cast<const float*>(rows.q[r]);
    }
  }
  const int64_t last_tile = rows.pos[n - 1] / kTile;
  for (int64_t j = 0; j <= last_tile; ++j) {
    const int64_t key0 = j * kTile;
    for (int64_t r0 = 0; r0 < n; r0 += kRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kRows, n - r0));
      if (key0 > rows.pos[r0 + mr - 1]) continue;  // wholly above this micro tile's diagonal
      const bool masked = key0 + kTile - 1 > rows.pos[r0];
      const TileState st{s.max.data() + r0, s.sum.data() + r0 * 16, s.acc.data() + r0 * D, s.weights.data()};
      with_rows(mr, [&](auto rows_c) {
        constexpr int MR = decltype(rows_c)::value;
        if constexpr (sizeof(T) == 2) {
          if (pk.path == Path::kAvx512Bf16) {
            tile_bf16<MR>(reinterpret_cast<const uint16_t* const*>(rows.q.data() + r0), rows.pos.data() + r0,
                          pk.key_tile(kvh, j), pk.value_tile(kvh, j), key0, D, masked, c, st);
            return;
          }
        }
        tile_f32<MR>(qf.data() + r0, rows.pos.data() + r0, reinterpret_cast<const float*>(pk.key_tile(kvh, j)),
                     reinterpret_cast<const float*>(pk.value_tile(kvh, j)), key0, D, masked, c, st);
      });
    }
  }
  for (int64_t r = 0; r < n; ++r) store_row(s.acc.data() + r * D, s.sum.data() + r * 16, rows.out[r], D);
}

#endif  // PDS_HAVE_AVX512

#if PDS_HAVE_AVX512  // x86-64 with GCC or Clang: the AVX2 code too

// 2^x on 8 lanes for x <= kLazy, as fast_exp2<5>: the same polynomial, then times 2^n built in the exponent
// bits (n >= -100 after the clamp: no denormal).
PDS_AVX2 PDS_INLINE __m256 exp2_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-100.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.3264708791e-03f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6715114712e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5507337765e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022242104e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314697759e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// All ones in the lanes of keys key0 + 8 b + lane <= pos.
PDS_AVX2 PDS_INLINE __m256 visible_avx2(int64_t key0, int b, int64_t pos) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t limit = static_cast<int32_t>(std::min<int64_t>(pos - key0 - 8 * b, kTile));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(std::max<int32_t>(limit, -1) + 1), lanes));
}

constexpr int kVecs8 = kTile / 8;  // 8-lane vectors of scores per tile

// One query row against one tile (float32 keys (D, kTile), values (kTile, D)): its scores, the lazy online
// softmax (as online_softmax does for a row), and the weighted values into acc (D floats). max: the row's
// running max in raw dot-product units; sum: 8 lane sums.
PDS_AVX2 void row_tile_avx2(const float* q, int64_t pos, const float* kt, const float* vt, int64_t key0, int64_t D,
                            float c, float* weights, float& max, float* sum, float* acc) {
  const bool masked = key0 + kTile - 1 > pos;
  const int needed = masked ? static_cast<int>(std::min<int64_t>(kVecs8, (pos - key0) / 8 + 1)) : kVecs8;
  __m256 s[kVecs8];
  for (int b = 0; b < kVecs8; ++b) s[b] = _mm256_setzero_ps();
  for (int64_t e = 0; e < D; ++e) {  // switch-free: `needed` vectors of 8 keys, the rest stay 0 (masked below)
    const __m256 qb = _mm256_set1_ps(q[e]);
    const float* kp = kt + e * kTile;
    for (int b = 0; b < kVecs8; ++b)
      if (b < needed) s[b] = _mm256_fmadd_ps(qb, _mm256_loadu_ps(kp + 8 * b), s[b]);
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 tile_max = neg_inf;
  for (int b = 0; b < kVecs8; ++b) {
    if (masked) s[b] = _mm256_blendv_ps(neg_inf, s[b], visible_avx2(key0, b, pos));
    tile_max = _mm256_max_ps(tile_max, s[b]);
  }
  __m256 lane_sum = _mm256_loadu_ps(sum);
  const float top = hmax8(tile_max);
  if (top > max + kLazy / c) {  // the max moves: rescale what was summed so far (exactly 1 where it stays)
    const float new_max = std::max(max, top);
    const __m256 alpha = exp2_avx2(_mm256_set1_ps((max - new_max) * c));
    lane_sum = _mm256_mul_ps(lane_sum, alpha);
    for (int64_t e = 0; e < D; e += 8) _mm256_storeu_ps(acc + e, _mm256_mul_ps(_mm256_loadu_ps(acc + e), alpha));
    max = new_max;
  }
  const __m256 vc = _mm256_set1_ps(c), mc = _mm256_set1_ps(max * c);
  for (int b = 0; b < kVecs8; ++b) {
    __m256 w = exp2_avx2(_mm256_fmsub_ps(s[b], vc, mc));
    if (masked) w = _mm256_and_ps(w, visible_avx2(key0, b, pos));
    lane_sum = _mm256_add_ps(lane_sum, w);
    _mm256_storeu_ps(weights + 8 * b, w);
  }
  _mm256_storeu_ps(sum, lane_sum);
  const int64_t keys = masked ? std::min<int64_t>(kTile, pos - key0 + 1) : kTile;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m256 a[8];
    for (int b = 0; b < 8; ++b) a[b] = _mm256_loadu_ps(acc + d0 + 8 * b);
    for (int64_t i = 0; i < keys; ++i) {
      const __m256 wb = _mm256_set1_ps(weights[i]);
      const float* vp = vt + i * D + d0;
      for (int b = 0; b < 8; ++b) a[b] = _mm256_fmadd_ps(wb, _mm256_loadu_ps(vp + 8 * b), a[b]);
    }
    for (int b = 0; b < 8; ++b) _mm256_storeu_ps(acc + d0 + 8 * b, a[b]);
  }
}

PDS_AVX2 void store_row_avx2(const float* acc, const float* sums, float* out, int64_t D) {
  const __m256 inv = _mm256_set1_ps(1.f / hsum8(_mm256_loadu_ps(sums)));
  for (int64_t e = 0; e < D; e += 8) _mm256_storeu_ps(out + e, _mm256_mul_ps(_mm256_loadu_ps(acc + e), inv));
}

PDS_AVX2 void store_row_avx2(const float* acc, const float* sums, uint16_t* out, int64_t D) {
  const float inv = 1.f / hsum8(_mm256_loadu_ps(sums));
  for (int64_t e = 0; e < D; ++e) store_f32(acc[e] * inv, out + e);
}

// One task's block of rows, key tile by key tile (a tile's keys and values stay in cache for all the rows).
template <typename T>
PDS_AVX2 void block_avx2(const Problem<T>& p, const Packed& pk, int64_t kvh, const Rows<T>& rows, Scratch& s) {
  const int64_t D = p.d, n = static_cast<int64_t>(rows.q.size());
  const float c = p.scale * 1.4426950408889634f;
  s.acc.assign(n * D, 0.f);
  s.max.assign(n, -std::numeric_limits<float>::infinity());
  s.sum.assign(n * 8, 0.f);
  s.weights.resize(kTile);
  s.qf.resize(n * D);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t e = 0; e < D; ++e) s.qf[r * D + e] = to_f32(rows.q[r][e]);
  const int64_t last_tile = rows.pos[n - 1] / kTile;
  for (int64_t j = 0; j <= last_tile; ++j) {
    const float* kt = reinterpret_cast<const float*>(pk.key_tile(kvh, j));
    const float* vt = reinterpret_cast<const float*>(pk.value_tile(kvh, j));
    for (int64_t r = 0; r < n; ++r) {
      if (j * kTile > rows.pos[r]) continue;  // wholly past this row
      row_tile_avx2(s.qf.data() + r * D, rows.pos[r], kt, vt, j * kTile, D, c, s.weights.data(), s.max[r],
                    s.sum.data() + r * 8, s.acc.data() + r * D);
    }
  }
  for (int64_t r = 0; r < n; ++r) store_row_avx2(s.acc.data() + r * D, s.sum.data() + r * 8, rows.out[r], D);
}

#endif  // PDS_HAVE_AVX512

// The fastest path this CPU has for head dim d, or a slower one asked for: want is "auto", "avx512" (no
// AVX512-BF16 instructions) or "portable".
Path choose_path(int64_t d, bool bf16, const std::string& want) {
  TORCH_CHECK(want == "auto" || want == "avx512" || want == "avx2" || want == "portable", "unknown path ", want);
#if PDS_HAVE_AVX512
  if (want != "portable" && d > 0 && d % 64 == 0) {
    if (want != "avx2" && cpu_has_avx512())
      return bf16 && want == "auto" && cpu_has_avx512_bf16() ? Path::kAvx512Bf16 : Path::kAvx512;
    if (cpu_has_avx2()) return Path::kAvx2;
  }
#endif
  return Path::kPortable;
}

std::string path_for(int64_t d, bool bf16, const std::string& want) { return path_name(choose_path(d, bf16, want)); }

template <typename T>
void run(const Problem<T>& p, const std::string& want) {
  const Path path = choose_path(p.d, sizeof(T) == 2, want);
  Packed pk{path, 0, 0, {}, {}};
  if (path != Path::kPortable) {
    pk.tiles = (p.length + kTile - 1) / kTile;
    pk.tile_elems = path == Path::kAvx512Bf16 ? kTile * p.d / 2 : kTile * p.d;
    pk.keys.resize(p.hkv * pk.tiles * pk.tile_elems);
    pk.values.resize(p.hkv * pk.tiles * pk.tile_elems);
    at::parallel_for(0, p.hkv * pk.tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) pack_tile(p, pk, i / pk.tiles, i % pk.tiles);
    });
  }
  // Tasks are claimed one at a time, the costliest (latest blocks) first: at::parallel_for's static split
  // would leave a thread whose core is busy with something else holding up the rest.
  std::atomic<int64_t> next{0};
  const int64_t count = p.hkv * p.blocks;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch;  // reused across the thread's tasks
    Rows<T> rows;
    for (int64_t task = next++; task < count; task = next++) {
      const int64_t kvh = task % p.hkv, block = p.blocks - 1 - task / p.hkv;
      rows_of(p, kvh, block, rows);
#if PDS_HAVE_AVX512
      if (path == Path::kAvx2) {
        block_avx2(p, pk, kvh, rows, scratch);
        continue;
      }
      if (path != Path::kPortable) {
        block_avx512(p, pk, kvh, rows, scratch);
        continue;
      }
#endif
      block_portable(p, kvh, rows, scratch);
    }
  });
}

template <typename T>
Problem<T> problem_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                      double scale, int64_t start) {
  Problem<T> p;
  p.q = static_cast<const T*>(q.const_data_ptr());
  p.k = static_cast<const T*>(k.const_data_ptr());
  p.v = static_cast<const T*>(v.const_data_ptr());
  p.out = static_cast<T*>(out.data_ptr());
  p.q_head = q.stride(0), p.q_token = q.stride(1);
  p.k_head = k.stride(0), p.k_token = k.stride(1);
  p.v_head = v.stride(0), p.v_token = v.stride(1);
  p.o_head = out.stride(0), p.o_token = out.stride(1);
  p.hq = q.size(0), p.hkv = k.size(0), p.group = p.hq / p.hkv, p.tokens = q.size(1), p.d = q.size(2);
  p.start = start, p.length = start + p.tokens;
  p.scale = static_cast<float>(scale);
  p.positions_per_block = std::max<int64_t>(1, (kBlockRows + p.group - 1) / p.group);
  p.blocks = (p.tokens + p.positions_per_block - 1) / p.positions_per_block;
  return p;
}

// q (Hq, T, D), k/v (Hkv, start + T, D), each with its last dim contiguous. Returns (Hq, T, D) in q's dtype,
// a transposed view of a contiguous (T, Hq, D) tensor: out.transpose(0, 1).reshape(T, Hq * D) is free.
at::Tensor causal_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale,
                            int64_t start, const std::string& want) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.dim() == 3,
              "q must be (Hq, T, D) and k, v (Hkv, start + T, D)");
  TORCH_CHECK(q_in.scalar_type() == k_in.scalar_type() && q_in.scalar_type() == v_in.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(start >= 0, "start must be >= 0, got ", start);
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  const int64_t hq = q_in.size(0), tokens = q_in.size(1), d = q_in.size(2), hkv = k_in.size(0);
  TORCH_CHECK(k_in.sizes() == v_in.sizes(), "k and v differ in shape");
  TORCH_CHECK(k_in.size(1) == start + tokens, "k and v must hold start + T = ", start + tokens, " positions, not ",
              k_in.size(1));
  TORCH_CHECK(k_in.size(2) == d, "q's head dim ", d, " differs from k's ", k_in.size(2));
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "Hq (", hq, ") must be a multiple of Hkv (", hkv, ")");
  const auto last_dim_contiguous = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  at::Tensor out = at::empty({tokens, hq, d}, q.options()).transpose(0, 1);
  if (tokens == 0 || hq == 0 || d == 0) return out;
  if (q.scalar_type() == at::kFloat) run(problem_of<float>(q, k, v, out, scale, start), want);
  else run(problem_of<uint16_t>(q, k, v, out, scale, start), want);
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_prefill, m) {
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale, int start=0, str path=\"auto\") -> Tensor");
  m.def("path_for(int d, bool bf16, str path=\"auto\") -> str", &path_for);
}

TORCH_LIBRARY_IMPL(pdserve_prefill, CPU, m) {
  m.impl("causal_attention", &causal_attention);
}
