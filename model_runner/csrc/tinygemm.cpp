// Small-M GEMMs for decode on the CPU: y = x @ W.T (+ bias), then silu(y), y * other or y + other, for x of a
// few rows. Built and loaded by model_runner/gemm.py as torch.ops.pdserve_gemm.linear.
//
// At decode sizes the weight is read once per step and each weight element meets only M rows of x, so the
// time is the time to stream the weight from memory. The weight comes packed (model_runner/gemm.py `pack`):
// outputs in blocks of 16, each block's rows interleaved so that one 64-byte line holds the 16 outputs'
// weights for one k (float32) or one pair of k (bfloat16, the pairs vdpbf16ps multiplies), a block's lines in
// order of k. A tile keeps M x NB vectors of 16 float32 sums in registers, one per row and block, and walks k
// once: every line loaded is used by all M rows. Then bias, post-op and one rounding to the output dtype.
//
// Batch invariance by construction: each output is one sum over k, in order of k, whatever M is, whichever
// tile or thread computes it. Rows past 16 are done 16 at a time over the same weights, in the same order.
//
// CPUs with AVX2 and FMA but no AVX-512 run 8-lane tiles of up to 6 rows by one block (group_avx2), x widened
// to float32 once per call: the same sums over k in the same order, so bfloat16 outputs have the same bits as
// on the other paths. Two float32 tiles (7-12 rows) take turns over 64-step pieces of a block (piece2).
//
// The vector code is compiled by function attribute and chosen at run time, so the one cached build runs on any
// x86-64 CPU: others (and other architectures) run the portable loops.
// Only the ATen headers this needs are included (torch/extension.h would add ~15 s to every first build).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using namespace pds;

constexpr int kBlock = 16;  // outputs per block: one vector of float32 sums
constexpr int kMaxRows = 16;  // rows per tile; more rows run as several tiles over the same weights
constexpr int kMaxNb = 4;  // most blocks per tile
constexpr int kGroup = 12;  // blocks whose weights every row tile passes over before the next group (L2-sized)
// Software prefetch, on top of the hardware's: each weight stream is fetched into L2 kFar lines ahead (running
// on into the next tile's streams) and into L1 kNear lines ahead. A core reads ~25 GB/s only with ~100 ns of
// lines in flight; the out-of-order window holds far fewer once every line feeds 8 or more multiply-adds, and
// the hardware prefetchers start each new stream (4 KB page) cold.
constexpr int kFar = 64;
constexpr int kNear = 8;

enum class Post { kNone, kSilu, kMul, kAdd };

// The two bfloat16 of a pair read as one 32-bit word: the first is the low half on little-endian machines
inline float word_half(uint32_t word, bool first) {
  constexpr bool little = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;
  const uint32_t bits = first == little ? word << 16 : word & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float pair_first(uint32_t word) { return word_half(word, true); }
inline float pair_second(uint32_t word) { return word_half(word, false); }

inline float load_f32(const void* p, bool bf16, int64_t i) {
  return bf16 ? to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

struct Problem {
  int64_t m, n, k;
  int64_t blocks;  // ceil(n / 16)
  int64_t steps;  // lines per block: k (float32) or ceil(k / 2) (bfloat16)
  bool bf16;  // x, w and out are bfloat16 (else float32)
  const void* x;  // (m, k), rows ldx elements apart; bfloat16 rows padded to an even length
  int64_t ldx;
  const void* w;  // (blocks, steps, 16 [, 2]): block b starts at element b * 16 * steps [* 2]
  const void* bias;  // (n,) or null
  bool bias_bf16;
  const void* other;  // (m, n), rows ldo elements apart, or null
  int64_t ldo;
  bool other_bf16;
  Post post;
  void* out;  // (m, n), contiguous
  const float* xs;  // the AVX2 path's x: each tile's rows interleaved (`interleave`), float32
};

// ---------------------------------------------------------------------------------------------------------
// Portable path: plain loops over the 16 lanes of a block, which the compiler may vectorise across lanes (each
// lane's sum keeps its order). The bfloat16 sums add the pair's second product first, as vdpbf16ps does, and
// products of two bfloat16 are exact in float32: the same bits as the AVX512-BF16 path on normal numbers.

void tile_portable(const Problem& pr, int64_t r0, int rows, int64_t b, float* acc /* (rows, 16) */) {
  const int64_t block = b * kBlock * pr.steps * (pr.bf16 ? 2 : 1);
  for (int r = 0; r < rows; ++r) {
    float* a = acc + r * kBlock;
    std::fill(a, a + kBlock, 0.f);
    if (pr.bf16) {
      // Pairs read as 32-bit words, as the vector code does. (Reading them as two uint16 each, GCC 12.2 -O3
      // vectorises this loop wrongly: sums of other steps land in lane 0.)
      const uint16_t* x = static_cast<const uint16_t*>(pr.x) + (r0 + r) * pr.ldx;
      const uint32_t* w = static_cast<const uint32_t*>(pr.w) + block / 2;
      for (int64_t s = 0; s < pr.steps; ++s, w += kBlock) {
        const float x0 = to_f32(x[2 * s]), x1 = to_f32(x[2 * s + 1]);
        for (int j = 0; j < kBlock; ++j) {
          a[j] += x1 * pair_second(w[j]);
          a[j] += x0 * pair_first(w[j]);
        }
      }
    } else {
      const float* x = static_cast<const float*>(pr.x) + (r0 + r) * pr.ldx;
      const float* w = static_cast<const float*>(pr.w) + block;
      for (int64_t s = 0; s < pr.steps; ++s, w += kBlock)
        for (int j = 0; j < kBlock; ++j) a[j] += x[s] * w[j];
    }
  }
}

// Bias, post-op and rounding for rows r0.. of block b, from sums acc (rows, 16).
void finish_portable(const Problem& pr, int64_t r0, int rows, int64_t b, const float* acc) {
  const int64_t n0 = b * kBlock;
  const int lanes = static_cast<int>(std::min<int64_t>(kBlock, pr.n - n0));
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < lanes; ++j) {
      float y = acc[r * kBlock + j];
      if (pr.bias) y += load_f32(pr.bias, pr.bias_bf16, n0 + j);
      const int64_t i = (r0 + r) * pr.n + n0 + j;
      switch (pr.post) {
        case Post::kSilu: y = y / (1.f + std::exp(-y)); break;
        case Post::kMul: y *= load_f32(pr.other, pr.other_bf16, (r0 + r) * pr.ldo + n0 + j); break;
        case Post::kAdd: y += load_f32(pr.other, pr.other_bf16, (r0 + r) * pr.ldo + n0 + j); break;
        case Post::kNone: break;
      }
      if (pr.bf16) static_cast<uint16_t*>(pr.out)[i] = f32_to_bf16(y);
      else static_cast<float*>(pr.out)[i] = y;
    }
  }
}

#if PDS_HAVE_AVX512
// ---------------------------------------------------------------------------------------------------------
// AVX-512 paths. A tile is M rows by NB blocks: M x NB sums in registers; each step loads NB weight lines (one
// per block, each from its own sequential stream) and broadcasts one k (or k pair) of each row.

inline int32_t load_pair(const uint16_t* p) {  // two bfloat16 as one 32-bit word, any alignment
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

constexpr int64_t kLine = 64;  // bytes per step of a block: 16 float32, or 16 pairs of bfloat16

// One tile's work: rows of x against NB consecutive blocks, the sums left in acc (M, NB * 16).
struct Tile {
  const char* x;  // the first row
  int64_t ldx;  // elements between rows
  const char* w;  // the first block
  int64_t block_bytes;  // between blocks
  int64_t steps;  // lines per block
  const char* next;  // the blocks read after this tile's, prefetched as its own streams run out
  int next_blocks;  // how many of them (0 at the end of a thread's share)
  float* acc;
};

// Prefetches for block j's stream at step s (line = its line s): kFar lines on into L2 (into the next tile's
// blocks once this one's run out, so the next tile starts warm) and kNear lines on into L1. These prefetch
// helpers carry no target attribute: the AVX-512 and the AVX2 tiles both inline them.
inline void prefetch_far(const Tile& t, int j, int64_t s, const char* line) {
  if (s + kFar < t.steps) _mm_prefetch(line + kFar * kLine, _MM_HINT_T1);
  else if (j < t.next_blocks) _mm_prefetch(t.next + j * t.block_bytes + (s + kFar - t.steps) * kLine, _MM_HINT_T1);
}
inline void prefetch(const Tile& t, int j, int64_t s, const char* line) {
  prefetch_far(t, j, s, line);
  _mm_prefetch(line + kNear * kLine, _MM_HINT_T0);
}

// The first lines of a thread's first tile, which no earlier tile has prefetched: requested all at once, so
// they arrive together rather than each stream waiting for its own.
inline void warm_up(const Tile& t, int nb) {
  for (int j = 0; j < nb; ++j)
    for (int64_t s = 0; s < std::min<int64_t>(kFar, t.steps); ++s)
      _mm_prefetch(t.w + j * t.block_bytes + s * kLine, _MM_HINT_T1);
}

template <int M, int NB>
PDS_AVX512 inline void store_sums(__m512 (&acc)[M][NB], float* out) {
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(out + (r * NB + j) * kBlock, acc[r][j]);
}

// float32 weights: one FMA per row and block per k.
template <int M, int NB>
PDS_AVX512 void tile_f32(const Tile& t) {
  const float* x = reinterpret_cast<const float*>(t.x);
  __m512 acc[M][NB];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < t.steps; ++s) {
    __m512 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const char* line = t.w + j * t.block_bytes + s * kLine;
      prefetch(t, j, s, line);
      wv[j] = _mm512_loadu_ps(line);
    }
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * t.ldx + s]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  store_sums<M, NB>(acc, t.acc);
}

// bfloat16 weights on AVX512-BF16: one vdpbf16ps per row and block per pair of k. It adds the pair's second
// product, then its first, each exact, to the sum.
template <int M, int NB>
PDS_AVX512_BF16 void tile_bf16_dp(const Tile& t) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(t.x);
  __m512 acc[M][NB];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < t.steps; ++s) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const char* line = t.w + j * t.block_bytes + s * kLine;
      prefetch(t, j, s, line);
      wv[j] = (__m512bh)_mm512_loadu_si512(line);
    }
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(load_pair(x + r * t.ldx + 2 * s));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  store_sums<M, NB>(acc, t.acc);
}

// bfloat16 weights on AVX-512 without BF16: each pair widened to two float32 vectors and two FMAs, second
// product first. Each product is exact, so the sums are those of vdpbf16ps (on normal numbers).
template <int M, int NB>
PDS_AVX512 void tile_bf16_fma(const Tile& t) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(t.x);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m512 acc[M][NB];
#pragma GCC unroll 16
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t s = 0; s < t.steps; ++s) {
    __m512 w0[NB], w1[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const char* line = t.w + j * t.block_bytes + s * kLine;
      prefetch(t, j, s, line);
      const __m512i v = _mm512_loadu_si512(line);
      w0[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      w1[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
#pragma GCC unroll 16
    for (int r = 0; r < M; ++r) {
      const __m512i xp = _mm512_set1_epi32(load_pair(x + r * t.ldx + 2 * s));
      const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(xp, 16));
      const __m512 x1 = _mm512_castsi512_ps(_mm512_and_si512(xp, high));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        acc[r][j] = _mm512_fmadd_ps(x1, w1[j], acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(x0, w0[j], acc[r][j]);
      }
    }
  }
  store_sums<M, NB>(acc, t.acc);
}

// Blocks per tile for M rows: as many as the 32 vector registers hold beside the weights.
constexpr int nb_for(int m) { return m <= 5 ? 4 : m <= 8 ? 3 : m <= 12 ? 2 : 1; }

using TileFn = void (*)(const Tile&);

template <Path P, bool BF16, int M, int NB>
void tile_entry(const Tile& t) {
  if constexpr (!BF16) tile_f32<M, NB>(t);
  else if constexpr (P == Path::kAvx512Bf16) tile_bf16_dp<M, NB>(t);
  else tile_bf16_fma<M, NB>(t);
}

// Tile functions for M = 1..16 rows: [M - 1][0] takes nb_for(M) blocks, [M - 1][1] one block.
template <Path P, bool BF16, int... I>
constexpr auto make_table(std::integer_sequence<int, I...>) {
  struct Table {
    TileFn fn[sizeof...(I)][2];
  };
  return Table{{{&tile_entry<P, BF16, I + 1, nb_for(I + 1)>, &tile_entry<P, BF16, I + 1, 1>}...}};
}

template <Path P, bool BF16>
const auto& table() {
  static constexpr auto t = make_table<P, BF16>(std::make_integer_sequence<int, kMaxRows>{});
  return t.fn;
}

// 16 float32 from p (float32 or bfloat16), lanes past `lanes` zero
PDS_AVX512 inline __m512 load16(const void* p, bool bf16, int lanes) {
  const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
  if (!bf16) return _mm512_maskz_loadu_ps(mask, p);
  __m256i h;
  if (lanes == kBlock) {
    h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  } else {
    alignas(32) uint16_t tmp[kBlock] = {};
    std::memcpy(tmp, p, lanes * sizeof(uint16_t));
    h = _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
  }
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Bias, post-op and rounding for rows r0.. of blocks b.., from sums acc (rows, nb * 16).
PDS_AVX512 void finish_avx512(const Problem& pr, int64_t r0, int rows, int64_t b, int nb, const float* acc) {
  for (int j = 0; j < nb; ++j) {
    const int64_t n0 = (b + j) * kBlock;
    const int lanes = static_cast<int>(std::min<int64_t>(kBlock, pr.n - n0));
    const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
    const __m512 bias = pr.bias ? load16(static_cast<const char*>(pr.bias) + n0 * (pr.bias_bf16 ? 2 : 4),
                                         pr.bias_bf16, lanes)
                                : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      __m512 y = _mm512_add_ps(_mm512_loadu_ps(acc + (r * nb + j) * kBlock), bias);
      const int64_t row = r0 + r;
      if (pr.post == Post::kSilu) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), y));
        y = _mm512_div_ps(y, _mm512_add_ps(_mm512_set1_ps(1.f), e));
      } else if (pr.post != Post::kNone) {
        const __m512 o = load16(static_cast<const char*>(pr.other) + (row * pr.ldo + n0) * (pr.other_bf16 ? 2 : 4),
                                pr.other_bf16, lanes);
        y = pr.post == Post::kMul ? _mm512_mul_ps(y, o) : _mm512_add_ps(y, o);
      }
      if (pr.bf16) {  // as f32_to_bf16
        const __m512i bits = _mm512_castps_si512(y);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
        _mm512_mask_cvtepi32_storeu_epi16(static_cast<uint16_t*>(pr.out) + row * pr.n + n0, mask, h);
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(pr.out) + row * pr.n + n0, mask, y);
      }
    }
  }
}

// Blocks g0..g1 of a thread's share, which ends at block end (first: they are the first of it).
template <Path P, bool BF16>
void group_avx512(const Problem& pr, int64_t g0, int64_t g1, int64_t end, bool first) {
  const auto& fns = table<P, BF16>();
  const int64_t block_bytes = pr.steps * kLine, elem = BF16 ? 2 : 4;
  alignas(64) float acc[kMaxRows * kMaxNb * kBlock];
  for (int64_t r0 = 0; r0 < pr.m; r0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, pr.m - r0));
    for (int64_t b = g0; b < g1;) {
      const int nb = g1 - b >= nb_for(rows) ? nb_for(rows) : 1;
      const char* w = static_cast<const char*>(pr.w) + b * block_bytes;
      const Tile t{static_cast<const char*>(pr.x) + r0 * pr.ldx * elem, pr.ldx, w, block_bytes, pr.steps,
                   w + nb * block_bytes, static_cast<int>(std::min<int64_t>(nb, end - b - nb)), acc};
      if (first && r0 == 0 && b == g0) warm_up(t, nb);
      fns[rows - 1][nb == 1](t);
      finish_avx512(pr, r0, rows, b, nb, acc);
      b += nb;
    }
  }
}
#endif

#if PDS_HAVE_AVX512
// ---------------------------------------------------------------------------------------------------------
// AVX2 path: a block's 16 outputs are two 8-lane vectors. A tile is R rows by NB blocks with 2 x R x NB <= 12
// sums in registers (6 x 1, 3 x 2, 2 x 3, 1 x 4; 4 and 5 rows by one block), beside the weight vectors and one
// broadcast row value: enough independent chains of FMAs to keep both FMA pipes busy (each sum is one chain),
// which 4 rows by one block (8 sums, each taking two dependent FMAs per bfloat16 pair) did not. bfloat16 rows
// of x are widened to float32 once per row tile (exact), so a step broadcasts float32 scalars straight from
// memory rather than widening a pair per row; a bfloat16 step adds every row's second products, then its first
// products: each sum still takes its pair's second product first. Rows past a tile pass over the same blocks
// again; when they do, the blocks are taken in spans small enough to stay in L2 between passes.

constexpr int kRows2 = 6;
// Blocks per tile for R rows: 2 x R x NB sums in the 16 vector registers, beside the weights and a broadcast
constexpr int nb2_for(int rows) { return rows == 1 ? 4 : 1; }

// Row tiles: M rows in ceil(M / 6) tiles of as even a size as can be (8 rows: 4 + 4, not 6 + 2)
struct RowTiles {
  int64_t count, base, extra;
  explicit RowTiles(int64_t m) : count((m + kRows2 - 1) / kRows2), base(m / count), extra(m % count) {}
  int64_t start(int64_t i) const { return i * base + std::min(i, extra); }
  int rows(int64_t i) const { return static_cast<int>(base + (i < extra)); }
};
constexpr int64_t kSpanBytes2 = 320 << 10;  // weights per span when rows take several passes (L2: 512 KB+)
constexpr int64_t kPiece2 = 64;  // steps per piece when two row tiles take turns (4 KB of a float32 block)

alignas(32) const uint32_t kHigh[8] = {0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u,
                                       0xffff0000u, 0xffff0000u, 0xffff0000u, 0xffff0000u};

// One step of tile2: line s of each of NB blocks (w: block 0's line) against the step's x (xp).
template <int R, int NB, bool BF16>
PDS_AVX2 PDS_INLINE void step2(__m256 (&acc)[R][NB][2], const char* w, int64_t block_bytes, const float* xp) {
  if constexpr (BF16) {
    // The mask read from memory by vpand rather than held in a register the sums need
    const __m256i* high = reinterpret_cast<const __m256i*>(kHigh);
    asm("" : "+r"(high));
    // each pair's second product (the high halves), then its first (the low halves)
#pragma GCC unroll 2
    for (int half = 1; half >= 0; --half) {
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) {
        const char* line = w + j * block_bytes;
        __m256 wv[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
          wv[h] = _mm256_castsi256_ps(half ? _mm256_and_si256(v, _mm256_load_si256(high)) : _mm256_slli_epi32(v, 16));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xp + (1 - half) * R + r);
          acc[r][j][0] = _mm256_fmadd_ps(xv, wv[0], acc[r][j][0]);
          acc[r][j][1] = _mm256_fmadd_ps(xv, wv[1], acc[r][j][1]);
        }
      }
      // More than 8 sums: no loads of the next half before this half's FMAs (GCC would hoist them and spill sums)
      if constexpr (2 * R * NB > 8) asm volatile("" ::: "memory");
    }
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const float* line = reinterpret_cast<const float*>(w + j * block_bytes);
      const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xp + r);
        acc[r][j][0] = _mm256_fmadd_ps(xv, w0, acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(xv, w1, acc[r][j][1]);
      }
    }
  }
}

// R rows of x by NB blocks, sums to t.acc (R, NB * 16). t.x: the rows as float32 in order of step, R values (a
// float32 k) or 2 x R (a bfloat16 pair: every row's second, then every row's first) per step (`interleave`).
// Tiles of up to 8 sums take two steps a turn while the far prefetches stay in their blocks (fewer instructions
// per FMA).
template <int R, int NB, bool BF16>
PDS_AVX2 void tile2(const Tile& t) {
  constexpr int kX = (BF16 ? 2 : 1) * R;  // floats of x per step
  constexpr int kU = 2 * R * NB <= 8 ? 2 : 1;  // steps per turn of the main loop (12 sums leave no registers)
  const float* xp = reinterpret_cast<const float*>(t.x);
  __m256 acc[R][NB][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  int64_t s = 0;
  // (12 sums: one loop, which GCC compiles without spilling them)
  for (; kU > 1 && s + kU <= t.steps - kFar; s += kU, xp += kU * kX) {
    const char* w = t.w + s * kLine;
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const char* line = w + j * t.block_bytes;
#pragma GCC unroll 2
      for (int u = 0; u < kU; ++u) {
        _mm_prefetch(line + (kFar + u) * kLine, _MM_HINT_T1);
        _mm_prefetch(line + (kNear + u) * kLine, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 2
    for (int u = 0; u < kU; ++u) step2<R, NB, BF16>(acc, w + u * kLine, t.block_bytes, xp + u * kX);
  }
  for (; s < t.steps; ++s, xp += kX) {
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) prefetch(t, j, s, t.w + j * t.block_bytes + s * kLine);
    step2<R, NB, BF16>(acc, t.w + s * kLine, t.block_bytes, xp);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      _mm256_storeu_ps(t.acc + (r * NB + j) * kBlock, acc[r][j][0]);
      _mm256_storeu_ps(t.acc + (r * NB + j) * kBlock + 8, acc[r][j][1]);
    }
}

// Steps s0..s1 of one block for R rows, the sums carried in t.acc (R, 16) from the steps before (zeroed at s0 = 0):
// tile2's work cut into pieces, so that two row tiles can take turns over a piece of the block while it is in L1.
// The sums go over k in the same order as tile2's. kLead: this tile reads the piece first and prefetches into L1.
// Two steps a turn, without a branch on the step's parity: from L3, 8 rows of float32 ran 1.17x faster than one
// step a turn (`bench gemm`-like shapes; the decode step 2-3% faster, docs/benchmarks.md "decode").
template <int R, bool BF16, bool kLead>
PDS_AVX2 void piece2(const Tile& t, int64_t s0, int64_t s1) {
  constexpr int kX = (BF16 ? 2 : 1) * R;
  __m256 acc[R][1][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0][0] = s0 ? _mm256_loadu_ps(t.acc + r * kBlock) : _mm256_setzero_ps();
    acc[r][0][1] = s0 ? _mm256_loadu_ps(t.acc + r * kBlock + 8) : _mm256_setzero_ps();
  }
  const float* xp = reinterpret_cast<const float*>(t.x) + s0 * kX;
  int64_t s = s0;
  // two steps a turn: the far prefetches shared by the two tiles (the lead's the first line of a pair, the
  // other's the second), so the stream from memory runs while either computes
  for (; s + 2 <= s1; s += 2, xp += 2 * kX) {
    const char* line = t.w + s * kLine;
    prefetch_far(t, 0, s + (kLead ? 0 : 1), line + (kLead ? 0 : kLine));
    if constexpr (kLead) {
      _mm_prefetch(line + kNear * kLine, _MM_HINT_T0);
      _mm_prefetch(line + (kNear + 1) * kLine, _MM_HINT_T0);
    }
    step2<R, 1, BF16>(acc, line, t.block_bytes, xp);
    step2<R, 1, BF16>(acc, line + kLine, t.block_bytes, xp + kX);
  }
  if (s < s1) {
    const char* line = t.w + s * kLine;
    if constexpr (kLead) {
      prefetch_far(t, 0, s, line);
      _mm_prefetch(line + kNear * kLine, _MM_HINT_T0);
    }
    step2<R, 1, BF16>(acc, line, t.block_bytes, xp);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(t.acc + r * kBlock, acc[r][0][0]);
    _mm256_storeu_ps(t.acc + r * kBlock + 8, acc[r][0][1]);
  }
}

template <bool BF16, bool kLead>
void piece2_rows(const Tile& t, int rows, int64_t s0, int64_t s1) {
  switch (rows) {  // two tiles of 7-12 rows: 3 to 6 rows each
    case 3: return piece2<3, BF16, kLead>(t, s0, s1);
    case 4: return piece2<4, BF16, kLead>(t, s0, s1);
    case 5: return piece2<5, BF16, kLead>(t, s0, s1);
    default: return piece2<6, BF16, kLead>(t, s0, s1);
  }
}

template <bool BF16>
void tile2_rows(const Tile& t, int rows, bool one_block) {
  switch (rows) {
    case 1: return one_block ? tile2<1, 1, BF16>(t) : tile2<1, nb2_for(1), BF16>(t);
    case 2: return tile2<2, 1, BF16>(t);
    case 3: return tile2<3, 1, BF16>(t);
    case 4: return tile2<4, 1, BF16>(t);
    case 5: return tile2<5, 1, BF16>(t);
    default: return tile2<6, 1, BF16>(t);
  }
}

// Rows r0.. of x as tile2 reads them (float32, bfloat16 widened: exact), into out from out + r0 * width.
void interleave(const Problem& pr, int64_t r0, int rows, float* out) {
  if (pr.bf16) {
    const uint16_t* x = static_cast<const uint16_t*>(pr.x) + r0 * pr.ldx;
    for (int64_t s = 0; s < pr.steps; ++s, out += 2 * rows)
      for (int r = 0; r < rows; ++r) {
        out[r] = to_f32(x[r * pr.ldx + 2 * s + 1]);
        out[rows + r] = to_f32(x[r * pr.ldx + 2 * s]);
      }
  } else {
    const float* x = static_cast<const float*>(pr.x) + r0 * pr.ldx;
    for (int64_t s = 0; s < pr.steps; ++s, out += rows)
      for (int r = 0; r < rows; ++r) out[r] = x[r * pr.ldx + s];
  }
}

PDS_AVX2 inline __m256 load8(const void* p, bool bf16) {
  return bf16 ? pds::load8(static_cast<const uint16_t*>(p)) : pds::load8(static_cast<const float*>(p));
}

// Bias, post-op and rounding for rows r0.. of blocks b.. from sums acc (rows, nb * 16); a block cut short by N
// (the last one) goes through the portable loops.
PDS_AVX2 void finish_avx2(const Problem& pr, int64_t r0, int rows, int64_t b, int nb, const float* acc) {
  for (int j = 0; j < nb; ++j) {
    const int64_t n0 = (b + j) * kBlock;
    if (pr.n - n0 < kBlock) {
      float part[kRows2 * kBlock];
      for (int r = 0; r < rows; ++r) std::memcpy(part + r * kBlock, acc + (r * nb + j) * kBlock, sizeof(float) * kBlock);
      finish_portable(pr, r0, rows, b + j, part);
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      const int64_t c0 = n0 + 8 * h;
      const __m256 bias = pr.bias ? load8(static_cast<const char*>(pr.bias) + c0 * (pr.bias_bf16 ? 2 : 4),
                                          pr.bias_bf16)
                                  : _mm256_setzero_ps();
      for (int r = 0; r < rows; ++r) {
        __m256 y = _mm256_add_ps(_mm256_loadu_ps(acc + (r * nb + j) * kBlock + 8 * h), bias);
        const int64_t row = r0 + r;
        if (pr.post == Post::kSilu) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), y));
          y = _mm256_div_ps(y, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        } else if (pr.post != Post::kNone) {
          const __m256 o = load8(static_cast<const char*>(pr.other) + (row * pr.ldo + c0) * (pr.other_bf16 ? 2 : 4),
                                 pr.other_bf16);
          y = pr.post == Post::kMul ? _mm256_mul_ps(y, o) : _mm256_add_ps(y, o);
        }
        if (pr.bf16) {  // as f32_to_bf16
          const __m256i bits = _mm256_castps_si256(y);
          const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
          __m256i v = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
          v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
          const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(pr.out) + row * pr.n + c0),
                           _mm256_castsi256_si128(packed));
        } else {
          _mm256_storeu_ps(static_cast<float*>(pr.out) + row * pr.n + c0, y);
        }
      }
    }
  }
}

// Blocks g0..g1 of a thread's share, which ends at block end (first: they are the first of it).
template <bool BF16>
void group_avx2(const Problem& pr, int64_t g0, int64_t g1, int64_t end, bool first) {
  const int64_t block_bytes = pr.steps * kLine, width = (BF16 ? 2 : 1) * pr.steps;
  alignas(64) float acc[kRows2 * kBlock];  // at most 6 row-blocks of sums: 6 x 1 ... 1 x 4
  const RowTiles tiles(pr.m);
  // 7-12 rows in float32: both tiles over each piece of a block, so the block streams from memory once and the
  // second tile's work overlaps the stream (in spans, the second pass ran from L2 while memory idled: 1.2x
  // slower at 8 rows). bfloat16 is bound by its widening arithmetic here, and spans measured a little faster.
  if (tiles.count == 2 && !BF16) {
    alignas(64) float acc_b[kRows2 * kBlock];
    const int rows_a = tiles.rows(0), rows_b = tiles.rows(1);
    const char* xa = reinterpret_cast<const char*>(pr.xs);
    const char* xb = reinterpret_cast<const char*>(pr.xs + tiles.start(1) * width);
    for (int64_t b = g0; b < g1; ++b) {
      const char* w = static_cast<const char*>(pr.w) + b * block_bytes;
      const int next = static_cast<int>(std::min<int64_t>(1, end - b - 1));
      const Tile ta{xa, rows_a, w, block_bytes, pr.steps, w + block_bytes, next, acc};
      const Tile tb{xb, rows_b, w, block_bytes, pr.steps, w + block_bytes, next, acc_b};
      if (first && b == g0) warm_up(ta, 1);
      for (int64_t s0 = 0; s0 < pr.steps; s0 += kPiece2) {
        const int64_t s1 = std::min(pr.steps, s0 + kPiece2);
        piece2_rows<BF16, true>(ta, rows_a, s0, s1);
        piece2_rows<BF16, false>(tb, rows_b, s0, s1);
      }
      finish_avx2(pr, tiles.start(0), rows_a, b, 1, acc);
      finish_avx2(pr, tiles.start(1), rows_b, b, 1, acc_b);
    }
    return;
  }
  // several passes over the blocks: spans of them that stay in L2 from one pass to the next
  const int64_t span = pr.m > kRows2 ? std::max<int64_t>(1, kSpanBytes2 / block_bytes) : g1 - g0;
  for (int64_t s0 = g0; s0 < g1; s0 += span) {
    const int64_t s1 = std::min(g1, s0 + span);
    for (int64_t i = 0; i < tiles.count; ++i) {
      const int64_t r0 = tiles.start(i);
      const int rows = tiles.rows(i);
      const char* x = reinterpret_cast<const char*>(pr.xs + r0 * width);
      for (int64_t b = s0; b < s1;) {
        const int nb = s1 - b >= nb2_for(rows) ? nb2_for(rows) : 1;
        const char* w = static_cast<const char*>(pr.w) + b * block_bytes;
        const Tile t{x, rows, w, block_bytes, pr.steps, w + nb * block_bytes,
                     static_cast<int>(std::min<int64_t>(nb, end - b - nb)), acc};
        if (first && r0 == 0 && b == g0) warm_up(t, nb);
        tile2_rows<BF16>(t, rows, nb == 1);
        finish_avx2(pr, r0, rows, b, nb, acc);
        b += nb;
      }
    }
  }
}
#endif

void group_portable(const Problem& pr, int64_t g0, int64_t g1) {
  float acc[kMaxRows * kBlock];
  for (int64_t r0 = 0; r0 < pr.m; r0 += kMaxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, pr.m - r0));
    for (int64_t b = g0; b < g1; ++b) {
      tile_portable(pr, r0, rows, b, acc);
      finish_portable(pr, r0, rows, b, acc);
    }
  }
}

Path choose_path(bool bf16, const std::string& want) {
  TORCH_CHECK(want == "auto" || want == "avx512" || want == "avx2" || want == "portable",
              "path must be auto, avx512, avx2 or portable");
  if (want == "portable") return Path::kPortable;
  if (want != "avx2" && cpu_has_avx512())
    return bf16 && want == "auto" && cpu_has_avx512_bf16() ? Path::kAvx512Bf16 : Path::kAvx512;
  return cpu_has_avx2() ? Path::kAvx2 : Path::kPortable;
}

// Which code serves this dtype: "avx512_bf16", "avx512", "avx2" or "portable".
std::string path_for(bool bf16, const std::string& want) { return path_name(choose_path(bf16, want)); }

void run(const Problem& pr_in, Path path) {
  Problem pr = pr_in;
  std::vector<float> xs;
#if PDS_HAVE_AVX512
  if (path == Path::kAvx2) {  // x as the AVX2 tiles read it, once per call
    const int64_t width = (pr.bf16 ? 2 : 1) * pr.steps;
    const RowTiles tiles(pr.m);
    xs.resize(pr.m * width);
    at::parallel_for(0, tiles.count, std::max<int64_t>(1, (64 << 10) / (kRows2 * width)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) interleave(pr, tiles.start(i), tiles.rows(i), xs.data() + tiles.start(i) * width);
    });
    pr.xs = xs.data();
  }
#endif
  // Chunks of whole groups, each at least ~256 KB of weights, so threads split big GEMMs and leave small ones
  const int64_t groups = (pr.blocks + kGroup - 1) / kGroup;
  const int64_t group_bytes = kGroup * kBlock * pr.k * (pr.bf16 ? 2 : 4);
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(1, group_bytes));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    const int64_t last = std::min(pr.blocks, end * kGroup);  // the end of this thread's blocks
    for (int64_t g = begin; g < end; ++g) {
      const int64_t g0 = g * kGroup, g1 = std::min(pr.blocks, g0 + kGroup);
#if PDS_HAVE_AVX512
      if (path == Path::kAvx512Bf16) {
        group_avx512<Path::kAvx512Bf16, true>(pr, g0, g1, last, g == begin);
        continue;
      }
      if (path == Path::kAvx512) {
        if (pr.bf16) group_avx512<Path::kAvx512, true>(pr, g0, g1, last, g == begin);
        else group_avx512<Path::kAvx512, false>(pr, g0, g1, last, g == begin);
        continue;
      }
      if (path == Path::kAvx2) {
        if (pr.bf16) group_avx2<true>(pr, g0, g1, last, g == begin);
        else group_avx2<false>(pr, g0, g1, last, g == begin);
        continue;
      }
#endif
      group_portable(pr, g0, g1);
    }
  });
}

Post post_of(const std::string& post) {
  if (post == "none") return Post::kNone;
  if (post == "silu") return Post::kSilu;
  if (post == "mul") return Post::kMul;
  if (post == "add") return Post::kAdd;
  TORCH_CHECK(false, "post must be none, silu, mul or add, not ", post);
}

// x (M, K), last dim contiguous; packed: (blocks, ceil(K / 2), 16, 2) bfloat16 or (blocks, K, 16) float32, from
// gemm.pack; n: the weight's rows (outputs); bias (n,); other (M, n), last dim contiguous, for mul and add.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                  const std::string& post, const std::optional<at::Tensor>& other, const std::string& want) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (M, K)");
  TORCH_CHECK(x_in.scalar_type() == packed.scalar_type(), "x and the packed weight must share a dtype");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x_in.scalar_type() == at::kFloat, "float32 or bfloat16 only");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == (bf16 ? 4 : 3) && packed.size(2) == kBlock,
              "the weight must come from gemm.pack");
  Problem pr{};
  pr.m = x_in.size(0), pr.k = x_in.size(1), pr.n = n, pr.bf16 = bf16;
  pr.blocks = packed.size(0), pr.steps = packed.size(1);
  TORCH_CHECK(pr.blocks == (n + kBlock - 1) / kBlock && pr.steps == (bf16 ? (pr.k + 1) / 2 : pr.k),
              "x's K or n does not match the packed weight");
  at::Tensor x = x_in;
  if (x.stride(1) != 1 || (bf16 && pr.k % 2 == 1)) {  // pairs need an even row: pad with a zero column
    x = at::empty({pr.m, bf16 ? 2 * pr.steps : pr.k}, x_in.options()).zero_();
    x.narrow(1, 0, pr.k).copy_(x_in);
  }
  pr.x = x.const_data_ptr(), pr.ldx = x.stride(0);
  pr.w = packed.const_data_ptr();
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "bias must be contiguous (n,)");
    TORCH_CHECK(bias->scalar_type() == at::kFloat || bias->scalar_type() == at::kBFloat16,
                "bias must be float32 or bfloat16");
    pr.bias = bias->const_data_ptr(), pr.bias_bf16 = bias->scalar_type() == at::kBFloat16;
  }
  pr.post = post_of(post);
  if (pr.post == Post::kMul || pr.post == Post::kAdd) {
    TORCH_CHECK(other && other->dim() == 2 && other->size(0) == pr.m && other->size(1) == n && other->stride(1) == 1,
                "post ", post, " needs other (M, n), last dim contiguous");
    TORCH_CHECK(other->scalar_type() == at::kFloat || other->scalar_type() == at::kBFloat16,
                "other must be float32 or bfloat16");
    pr.other = other->const_data_ptr(), pr.ldo = other->stride(0);
    pr.other_bf16 = other->scalar_type() == at::kBFloat16;
  }
  at::Tensor out = at::empty({pr.m, n}, x_in.options());
  pr.out = out.data_ptr();
  if (pr.m > 0 && n > 0) run(pr, choose_path(bf16, want));
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve_gemm, m) {
  m.def("linear(Tensor x, Tensor packed, int n, Tensor? bias, str post, Tensor? other, str path=\"auto\") -> Tensor");
  m.def("path_for(bool bf16, str path=\"auto\") -> str", &path_for);
}

TORCH_LIBRARY_IMPL(pdserve_gemm, CPU, m) {
  m.impl("linear", &linear);
}
