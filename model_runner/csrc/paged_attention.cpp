// Decode attention over a paged KV cache, on the CPU. Built and loaded by model_runner/attention.py as the op
// torch.ops.pdserve_attention.paged_decode_attention.
//
// A task is a sequence and a range of its kv heads: all of them, unless there are fewer sequences than threads.
// For each kv head it scores the q heads of its GQA group against each key as the key is read (each key and
// value is read once per group, and never past the sequence's length), takes a max-subtracted softmax in
// float32, then sums the values with those weights in float32. A head's arithmetic is the same in any task,
// so a sequence's output is the same bits in any batch and at any thread count.
//
// CPUs with AVX2 and FMA but no AVX-512 run attend_avx2: the AVX-512 path's order of work and prefetching in
// 8-lane vectors.
//
// The vector code is compiled by function attribute and chosen at run time, so the one cached build runs on any
// x86-64 CPU: others (and other architectures) run the portable loops.
// Only the ATen headers this needs are included (torch/extension.h would add ~15 s to every first build).

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using namespace pds;

// Pointers to element 0 of each tensor; strides in elements. T is float or uint16_t (bfloat16's bits).
template <typename T>
struct Args {
  const T* q;  // (B, Hq, D), contiguous
  const T* key;  // (num_blocks, block_size, Hkv, D), last dim contiguous
  const T* value;
  int64_t k_block, k_token, k_head;
  int64_t v_block, v_token, v_head;
  const int32_t* block_tables;  // (B, max_blocks), contiguous
  int64_t max_blocks;
  const int32_t* context_lens;  // (B,)
  int64_t hq, hkv, group, d, block_size;
  float scale;
  T* out;  // (B, Hq, D), contiguous
};

// The keys (or values) of kv heads kv0..kv0+heads-1 of one sequence: the row of position pos and head kv0+h
// (its D elements) is token pos % block_size of block table[pos / block_size], h heads on. A pass of length 0
// has no blocks.
template <typename T>
struct Pass {
  const T* base = nullptr;  // head kv0's element 0 in block 0
  const int32_t* table = nullptr;
  int64_t block_stride = 0, token_stride = 0, head_stride = 0, block_size = 1, length = 0, heads = 0;

  int64_t blocks() const { return (length + block_size - 1) / block_size; }
  const T* block_rows(int64_t j) const { return base + table[j] * block_stride; }  // head kv0's first row
  int64_t count(int64_t j) const { return std::min(block_size, length - j * block_size); }  // tokens in block j
};

template <typename T>
Pass<T> key_pass(const Args<T>& a, int64_t b, int64_t kv0, int64_t kv1) {
  return {a.key + kv0 * a.k_head, a.block_tables + b * a.max_blocks, a.k_block, a.k_token, a.k_head,
          a.block_size, a.context_lens[b], kv1 - kv0};
}

template <typename T>
Pass<T> value_pass(const Args<T>& a, int64_t b, int64_t kv0, int64_t kv1) {
  return {a.value + kv0 * a.v_head, a.block_tables + b * a.max_blocks, a.v_block, a.v_token, a.v_head,
          a.block_size, a.context_lens[b], kv1 - kv0};
}

struct Scratch {
  std::vector<float> q, scores, stage, acc, inv_sum;

  // Sized for `rows` q heads of dim D over `padded` positions, with a stage of (rows, L) vectors of L floats;
  // returns the stage's first float, aligned to a vector (4 * L bytes).
  template <int L>
  float* prepare(int64_t rows, int64_t D, int64_t padded) {
    q.resize(rows * D);
    scores.resize(rows * padded);  // (rows, padded)
    stage.resize(rows * L * L + L);
    acc.assign(rows * D, 0.f);
    inv_sum.resize(rows);
    constexpr uintptr_t align = 4 * L;
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(stage.data()) + align - 1) & ~(align - 1));
  }
};

// ---------------------------------------------------------------------------------------------------------
// Portable path: plain loops the compiler vectorises for whatever ISA the build targets.

template <typename T>
void attend_portable(const Args<T>& a, int64_t b, int64_t kvh, Scratch& s) {
  const int64_t length = a.context_lens[b], G = a.group, D = a.d;
  T* out = a.out + (b * a.hq + kvh * G) * D;
  if (length == 0) {  // no keys: zeros, as flash-attention gives an empty sequence
    for (int64_t i = 0; i < G * D; ++i) store_f32(0.f, out + i);
    return;
  }
  s.q.resize(G * D);
  s.scores.resize(G * length);  // (G, length)
  s.acc.assign(G * D, 0.f);
  s.inv_sum.resize(G);
  const T* q = a.q + (b * a.hq + kvh * G) * D;
  for (int64_t i = 0; i < G * D; ++i) s.q[i] = to_f32(q[i]);
  const Pass<T> keys = key_pass(a, b, kvh, kvh + 1), values = value_pass(a, b, kvh, kvh + 1);
  for (int64_t j = 0; j < keys.blocks(); ++j) {
    for (int64_t t = 0; t < keys.count(j); ++t) {
      const T* k = keys.block_rows(j) + t * keys.token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = s.q.data() + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < D; ++i) dot += qg[i] * to_f32(k[i]);
        s.scores[g * length + j * keys.block_size + t] = dot * a.scale;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s.scores.data() + g * length;
    float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t i = 0; i < length; ++i) max = std::max(max, sg[i]);
    for (int64_t i = 0; i < length; ++i) {
      sg[i] = std::exp(sg[i] - max);
      sum += sg[i];
    }
    s.inv_sum[g] = 1.f / sum;
  }
  for (int64_t j = 0; j < values.blocks(); ++j) {
    for (int64_t t = 0; t < values.count(j); ++t) {
      const T* v = values.block_rows(j) + t * values.token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = s.scores[g * length + j * values.block_size + t];
        float* acc = s.acc.data() + g * D;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) acc[i] += p * to_f32(v[i]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) store_f32(s.acc[g * D + i] * s.inv_sum[g], out + g * D + i);
}

// ---------------------------------------------------------------------------------------------------------
// AVX-512 path, for D = 16 * NV (64 or 128). The loops go block by block, and within a block kv head by kv
// head, so a block's keys (all heads, contiguous) are fetched together: 6-20% faster here than a head's rows
// through all blocks, then the next head's. For each kv head, HC q heads at a time keep their q, dot products
// and accumulators in registers (about HC * NV + NV + HC of the 32 zmm registers).
//
// A row is held as NV float32 vectors. A bfloat16 row is widened two elements per 32-bit lane: the shifted
// lane gives the even elements and the masked lane the odd ones, so vector 2c holds elements 32c + 2i and
// vector 2c+1 elements 32c + 2i + 1 (lane i). Dot products don't care about the order (q is loaded the same
// way); the weighted values are put back in order once, at the end.

#if PDS_HAVE_AVX512

// ---- 8-lane score staging, shared by the AVX2 path and the AVX512-BF16 key scores ----

// The lane sums of v[0..7], v[i]'s in lane i: a transpose-and-add tree, 9 shuffles and adds where 8 separate
// horizontal sums take ~40.
PDS_AVX2 inline __m256 sum_each8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));  // v[0..3]'s halves
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Where a run of q heads' scores go, as ScoreSink with 8-lane vectors: stage (HC, 8) dot products not yet
// summed; scores (HC, padded), padded = length rounded up to 8 (to 16 on the AVX-512 path, whose softmax masks
// the lanes past length).
struct ScoreSink8 {
  __m256* stage;
  float* scores;
  int64_t padded, length;
  float scale;
};

// Stages the dot products of HC q heads with the key at pos; at every 8th key (and the last) sums the 8 keys'
// into scores, zeros standing in for keys past the length.
template <int HC>
PDS_AVX2 inline void stage_key(const ScoreSink8& sink, int64_t pos, const __m256* acc) {
  for (int g = 0; g < HC; ++g) sink.stage[g * 8 + (pos & 7)] = acc[g];
  if ((pos & 7) == 7 || pos + 1 == sink.length) {
    for (int64_t r = (pos & 7) + 1; r < 8; ++r)
      for (int g = 0; g < HC; ++g) sink.stage[g * 8 + r] = _mm256_setzero_ps();
    for (int g = 0; g < HC; ++g)
      _mm256_storeu_ps(sink.scores + g * sink.padded + (pos & ~int64_t{7}),
                       _mm256_mul_ps(sum_each8(sink.stage + g * 8), _mm256_set1_ps(sink.scale)));
  }
}

// ---- AVX-512 ----

constexpr int kAhead = 2;  // blocks between a row's prefetch and its use: enough to cover a DRAM miss
// Prefetch into L2, not L1: L1 tracks too few misses at once to keep a core's share of DRAM busy.
constexpr _mm_hint kHint = _MM_HINT_T2;

// The empty asm keeps a loaded row in registers: otherwise GCC folds the loads into each FMA that uses the
// row, reading it from L1 once per head, and the loop is bound by loads rather than FMAs.
template <int NV>
PDS_AVX512 inline void load_row(const float* p, __m512 (&v)[NV]) {
  for (int i = 0; i < NV; ++i) {
    v[i] = _mm512_loadu_ps(p + 16 * i);
    asm("" : "+v"(v[i]));
  }
}

template <int NV>
PDS_AVX512 inline void load_row(const uint16_t* p, __m512 (&v)[NV]) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int c = 0; c < NV / 2; ++c) {
    const __m512i pairs = _mm512_loadu_si512(p + 32 * c);
    v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
  }
}

// rows rows of D = 16 * NV elements -> float32 in load_row's order.
template <typename T, int NV>
PDS_AVX512 void widen_rows(const T* src, int64_t rows, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v[NV];
    load_row<NV>(src + r * 16 * NV, v);
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(dst + (r * NV + i) * 16, v[i]);
  }
}

// Where load_row put element d of a row, as an index into its NV vectors laid end to end.
template <typename T>
inline int64_t lane_of(int64_t d) {
  if constexpr (sizeof(T) == 4) return d;
  const int64_t c = d / 32, r = d % 32;
  return 16 * (2 * c + (r & 1)) + r / 2;
}

template <typename T, int NV>
PDS_AVX512 inline void prefetch_row(const T* p) {
  constexpr int lines = 16 * NV * static_cast<int>(sizeof(T)) / 64;
  for (int i = 0; i < lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p) + 64 * i, kHint);
}

// Slot for token t (0..15) among the 16 vectors given to sum_each: sum_each leaves slot 4j+q's sum in lane
// 4q+j, so staging token t at kSlot[t] puts its sum in lane t.
constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// The lane sums of v[0..15], slot s's in lane kSlot[s]: a transpose-and-add tree, 45 shuffles and adds where
// 16 separate horizontal sums take ~130.
PDS_AVX512 inline __m512 sum_each(const __m512* v) {
  __m512 s[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // quarters 0-1: v[2k]'s half sums; 2-3: v[2k+1]'s
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));
  for (int k = 0; k < 4; ++k)  // quarter q: slot 4k+q's quarter sums
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * k], s[2 * k + 1], 0xdd));
  for (int k = 0; k < 2; ++k)  // quarter q: two partial sums of slot 8k+q, then two of slot 8k+4+q
    w[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], 0xee));
  // quarter q: the sums of slots q, 4+q, 8+q, 12+q
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
}

// One kv head's rows in one block, and the rows to prefetch meanwhile (none once ahead_count is 0).
template <typename T>
struct Span {
  const T* rows;
  int64_t stride, pos0, count;  // elements between tokens, first position, tokens
  const T* ahead;
  int64_t ahead_stride, ahead_count;
};

// Where a run of q heads' scores go. stage: (HC, 16) vectors of dot products not yet summed, kept from one
// block to the next; scores: (HC, padded), padded = length rounded up to 16.
struct ScoreSink {
  __m512* stage;
  float* scores;
  int64_t padded, length;
  float scale;
};

// Sums the staged dot products of the 16 positions up to pos (zeros past it) into scores, times scale.
template <int HC>
PDS_AVX512 inline void flush_stage(const ScoreSink& sink, int64_t pos) {
  for (int t = static_cast<int>(pos & 15) + 1; t < 16; ++t)
    for (int g = 0; g < HC; ++g) sink.stage[g * 16 + kSlot[t]] = _mm512_setzero_ps();
  for (int g = 0; g < HC; ++g)
    _mm512_storeu_ps(sink.scores + g * sink.padded + (pos & ~int64_t{15}),
                     _mm512_mul_ps(sum_each(sink.stage + g * 16), _mm512_set1_ps(sink.scale)));
}

// Dot products of HC q heads (qf: (HC, D) in load_row's order) with the keys of one span.
template <typename T, int NV, int HC>
PDS_AVX512 void score_span(const float* qf, const Span<T>& sp, const ScoreSink& sink) {
  __m512 q[HC][NV];
  for (int g = 0; g < HC; ++g)
    for (int i = 0; i < NV; ++i) q[g][i] = _mm512_loadu_ps(qf + (g * NV + i) * 16);
  for (int64_t t = 0; t < sp.count; ++t) {
    if (t < sp.ahead_count) prefetch_row<T, NV>(sp.ahead + t * sp.ahead_stride);
    __m512 k[NV];
    load_row<NV>(sp.rows + t * sp.stride, k);
    const int64_t pos = sp.pos0 + t;
    for (int g = 0; g < HC; ++g) {
      __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
      for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(q[g][i], k[i], acc);
      sink.stage[g * 16 + kSlot[pos & 15]] = acc;
    }
    if ((pos & 15) == 15 || pos + 1 == sink.length) flush_stage<HC>(sink, pos);
  }
}

// score_span for bfloat16 on CPUs with AVX512-BF16 (q: (HC, D) as given): vdpbf16ps multiplies pairs of
// bfloat16 (exactly, in float32) and adds them to float32 sums, half the instructions of widening and FMAs. In
// 8-lane vectors: a q head's dot product with a key is NV `vdpbf16ps` of 16 pairs into 8 sums, and stage_key
// sums 8 keys' at once. On Zen 4, where a 16-lane instruction costs two 8-lane ones, that is ~1/3 fewer
// instructions than 16 lanes of sums and sum_each's tree: decode attention 15.3 -> 14.4 ns a token and kv head,
// a batch-8 step 17.75 -> 17.3 ms (docs/kernels.md).
template <int NV, int HC>
PDS_AVX512_BF16 void score_span_bf16(const uint16_t* q_rows, const Span<uint16_t>& sp, const ScoreSink8& sink) {
  constexpr int NQ = NV;  // 16-element vectors per row
  __m256bh q[HC][NQ];
  for (int g = 0; g < HC; ++g)
    for (int c = 0; c < NQ; ++c)
      q[g][c] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q_rows + (g * NQ + c) * 16));
  for (int64_t t = 0; t < sp.count; ++t) {
    if (t < sp.ahead_count) prefetch_row<uint16_t, NV>(sp.ahead + t * sp.ahead_stride);
    const uint16_t* k = sp.rows + t * sp.stride;
    __m256 acc[HC];
    for (int g = 0; g < HC; ++g) acc[g] = _mm256_setzero_ps();
    for (int c = 0; c < NQ; ++c) {
      const __m256bh kc = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 16 * c));
      for (int g = 0; g < HC; ++g) acc[g] = _mm256_dpbf16_ps(acc[g], q[g][c], kc);
    }
    stage_key<HC>(sink, sp.pos0 + t, acc);
  }
}

// Scores to softmax weights in place, max-subtracted; returns 1 / their sum. The lanes past length are dropped.
PDS_AVX512 float softmax(float* scores, int64_t length, int64_t padded) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (length - (padded - 16))) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 max = _mm512_mask_loadu_ps(neg_inf, tail, scores + padded - 16);
  for (int64_t i = 0; i + 16 < padded; i += 16) max = _mm512_max_ps(max, _mm512_loadu_ps(scores + i));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(max));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < padded; i += 16) {
    __m512 p = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + i), m));
    if (i + 16 == padded) p = _mm512_maskz_mov_ps(tail, p);
    _mm512_storeu_ps(scores + i, p);
    sum = _mm512_add_ps(sum, p);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// acc (HC, D) in load_row's order += weights (HC, padded) * the values of one span.
template <typename T, int NV, int HC>
PDS_AVX512 void weigh_span(const Span<T>& sp, const float* weights, int64_t padded, float* acc_out) {
  __m512 acc[HC][NV];
  for (int g = 0; g < HC; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_loadu_ps(acc_out + (g * NV + i) * 16);
  for (int64_t t = 0; t < sp.count; ++t) {
    if (t < sp.ahead_count) prefetch_row<T, NV>(sp.ahead + t * sp.ahead_stride);
    __m512 v[NV];
    load_row<NV>(sp.rows + t * sp.stride, v);
    for (int g = 0; g < HC; ++g) {
      const __m512 p = _mm512_set1_ps(weights[g * padded + sp.pos0 + t]);
      for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);
    }
  }
  for (int g = 0; g < HC; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc_out + (g * NV + i) * 16, acc[g][i]);
}

// Head h's span of block j of a pass, prefetching the block kAhead on or, past the end, the next pass's
// blocks: the value pass's first while the key pass ends, the next task's first keys while the value pass
// ends, so the stream of misses does not stop between passes.
//
// With in_order, head h prefetches the h-th share of the target block's bytes rather than its own rows: where
// the pass covers whole rows of the cache (all its kv heads), the block's tokens are one contiguous run, fetched
// front to back. On the AVX2 EPYC that took decode attention from 2.4x to 1.8x its floor (float32) against
// prefetching head h's own rows, 4 lines of every 12 (docs/benchmarks.md, "attention").
template <typename T>
Span<T> span_of(const Pass<T>& pass, const Pass<T>& next, int64_t j, int64_t h, int64_t blocks_ahead = kAhead,
                bool in_order = false) {
  Span<T> sp{pass.block_rows(j) + h * pass.head_stride, pass.token_stride, j * pass.block_size, pass.count(j),
             nullptr, 0, 0};
  const int64_t ahead = j + blocks_ahead, own = pass.blocks();
  const Pass<T>& target = ahead < own ? pass : next;
  const int64_t k = ahead < own ? ahead : ahead - own;
  if (k < target.blocks() && h < target.heads) {
    sp.ahead = target.block_rows(k) + h * target.head_stride;
    sp.ahead_stride = target.token_stride, sp.ahead_count = target.count(k);
    if (in_order && target.token_stride == target.heads * target.head_stride) {  // (count, heads, D) in a run
      sp.ahead = target.block_rows(k) + h * target.count(k) * target.head_stride;
      sp.ahead_stride = target.head_stride;
    }
  }
  return sp;
}

// Most q heads one call keeps in registers.
template <int NV>
constexpr int max_heads() { return NV == 4 ? 5 : 2; }

// f(std::integral_constant<int, n>) for n in 1..max_heads<NV>().
template <int NV, typename F>
void with_heads(int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (max_heads<NV>() >= 3) f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (max_heads<NV>() >= 4) f(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (max_heads<NV>() >= 5) f(std::integral_constant<int, 5>{}); break;
    default: TORCH_CHECK(false, "unreachable: ", n, " heads in one call");
  }
}

// Attention for kv heads kv0..kv1-1 of sequence b; next is the key pass the thread runs after this task's.
template <typename T, int NV, bool BF16_DOT>
void attend_avx512(const Args<T>& a, int64_t b, int64_t kv0, int64_t kv1, const Pass<T>& next, Scratch& s) {
  constexpr int64_t D = 16 * NV;
  const int64_t length = a.context_lens[b], G = a.group, heads = kv1 - kv0, rows = heads * G;
  T* out = a.out + (b * a.hq + kv0 * G) * D;  // (rows, D)
  if (length == 0) {
    for (int64_t i = 0; i < rows * D; ++i) store_f32(0.f, out + i);
    return;
  }
  const int64_t padded = (length + 15) / 16 * 16;
  __m512* stage = reinterpret_cast<__m512*>(s.prepare<16>(rows, D, padded));
  const T* q = a.q + (b * a.hq + kv0 * G) * D;
  widen_rows<T, NV>(q, rows, s.q.data());

  // A group's q heads in as few calls as the registers allow, of even sizes (4 with D=128 go as 2 + 2).
  const int64_t calls = (G + max_heads<NV>() - 1) / max_heads<NV>(), per_call = (G + calls - 1) / calls;
  const Pass<T> keys = key_pass(a, b, kv0, kv1), values = value_pass(a, b, kv0, kv1);
  for (int64_t j = 0; j < keys.blocks(); ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      Span<T> sp = span_of(keys, values, j, h);
      for (int64_t g0 = 0; g0 < G; g0 += per_call) {
        const int64_t r = h * G + g0;
        float* scores = s.scores.data() + r * padded;
        with_heads<NV>(std::min(per_call, G - g0), [&](auto hc) {
          if constexpr (BF16_DOT) {
            const ScoreSink8 sink{reinterpret_cast<__m256*>(stage) + r * 8, scores, padded, length, a.scale};
            score_span_bf16<NV, decltype(hc)::value>(q + r * D, sp, sink);
          } else {
            const ScoreSink sink{stage + r * 16, scores, padded, length, a.scale};
            score_span<T, NV, decltype(hc)::value>(s.q.data() + r * D, sp, sink);
          }
        });
        sp.ahead_count = 0;  // the group's first call has prefetched
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) s.inv_sum[r] = softmax(s.scores.data() + r * padded, length, padded);
  for (int64_t j = 0; j < values.blocks(); ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      Span<T> sp = span_of(values, next, j, h);
      for (int64_t g0 = 0; g0 < G; g0 += per_call) {
        const int64_t r = h * G + g0;
        with_heads<NV>(std::min(per_call, G - g0), [&](auto hc) {
          weigh_span<T, NV, decltype(hc)::value>(sp, s.scores.data() + r * padded, padded, s.acc.data() + r * D);
        });
        sp.ahead_count = 0;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) store_f32(s.acc[r * D + lane_of<T>(d)] * s.inv_sum[r], out + r * D + d);
}

#endif  // PDS_HAVE_AVX512

#if PDS_HAVE_AVX512
// ---------------------------------------------------------------------------------------------------------
// AVX2 path, for D a multiple of 8: attend_avx512's order of work (block by block, kv head by kv head, with the
// same prefetching) in 8-lane float32 vectors, 16 ymm registers. The dot products of each q head with 8 keys
// are summed at once by sum_each8; the values are summed a token at a time for up to 3 q heads and 32 dims,
// so a bfloat16 value row is widened once per 3 heads rather than once per head.

constexpr int kAhead2 = 2;  // attend_avx2's blocks between a row's prefetch and its use (1 to 8 measure alike)

template <typename T>
PDS_AVX2 __attribute__((always_inline)) inline void prefetch_row8(const T* p, int64_t d) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < d * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(bytes + i, kHint);
}

// Dot products of HC q heads (qf: (HC, D) float32) with the keys of one span, two keys at a time so that each
// load of q serves both (a key's arithmetic is the same alone or paired): 2 HC sums, two keys' vectors and q's
// in registers.
// Not inlined (nor weigh_span8): inlined into attend_avx2, every variant at once, GCC spilled their registers
// and the step took 1.6x as long.
template <typename T, int HC>
PDS_AVX2 __attribute__((noinline)) void score_span8(const float* qf, int64_t D, const Span<T>& sp,
                                                    const ScoreSink8& sink) {
  int64_t t = 0;
  for (; t + 1 < sp.count; t += 2) {
    if (t < sp.ahead_count) prefetch_row8(sp.ahead + t * sp.ahead_stride, D);
    if (t + 1 < sp.ahead_count) prefetch_row8(sp.ahead + (t + 1) * sp.ahead_stride, D);
    const T* k0 = sp.rows + t * sp.stride;
    const T* k1 = k0 + sp.stride;
    __m256 acc0[HC], acc1[HC];
    for (int g = 0; g < HC; ++g) acc0[g] = acc1[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 kv0 = load8(k0 + i), kv1 = load8(k1 + i);
      for (int g = 0; g < HC; ++g) {
        const __m256 qv = _mm256_loadu_ps(qf + g * D + i);
        acc0[g] = _mm256_fmadd_ps(qv, kv0, acc0[g]);
        acc1[g] = _mm256_fmadd_ps(qv, kv1, acc1[g]);
      }
    }
    stage_key<HC>(sink, sp.pos0 + t, acc0);
    stage_key<HC>(sink, sp.pos0 + t + 1, acc1);
  }
  if (t < sp.count) {
    if (t < sp.ahead_count) prefetch_row8(sp.ahead + t * sp.ahead_stride, D);
    const T* k = sp.rows + t * sp.stride;
    __m256 acc[HC];
    for (int g = 0; g < HC; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 kv = load8(k + i);
      for (int g = 0; g < HC; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + i), kv, acc[g]);
    }
    stage_key<HC>(sink, sp.pos0 + t, acc);
  }
}

// Scores to softmax weights in place, max-subtracted; returns 1 / their sum. The lanes past length get 0.
PDS_AVX2 float softmax8(float* scores, int64_t length, int64_t padded) {
  for (int64_t i = length; i < padded; ++i) scores[i] = -std::numeric_limits<float>::infinity();
  __m256 max = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < padded; i += 8) max = _mm256_max_ps(max, _mm256_loadu_ps(scores + i));
  const __m256 m = _mm256_set1_ps(hmax8(max));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    __m256 p = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), m));
    if (i + 8 == padded)  // lanes past length: weight 0
      p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                               _mm256_set1_epi32(static_cast<int32_t>(length - i)),
                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
    _mm256_storeu_ps(scores + i, p);
    sum = _mm256_add_ps(sum, p);
  }
  return 1.f / hsum8(sum);
}

// acc (HC, D) += weights (HC, padded) * the values of one span, W vectors of dims at a time (HC * W sums, HC
// weights and the widened chunk in registers). Only the first pass over the span prefetches.
template <typename T, int HC, int W>
PDS_AVX2 __attribute__((noinline)) void weigh_span8(int64_t D, const Span<T>& sp, const float* weights,
                                                    int64_t padded, float* acc_out) {
  for (int64_t d0 = 0; d0 < D; d0 += 8 * W) {
    const int nv = static_cast<int>(std::min<int64_t>(W, (D - d0) / 8));
    __m256 acc[HC][W];
    for (int g = 0; g < HC; ++g)
      for (int c = 0; c < W; ++c)
        if (c < nv) acc[g][c] = _mm256_loadu_ps(acc_out + g * D + d0 + 8 * c);
    for (int64_t t = 0; t < sp.count; ++t) {
      if (d0 == 0 && t < sp.ahead_count) prefetch_row8(sp.ahead + t * sp.ahead_stride, D);
      const T* v = sp.rows + t * sp.stride + d0;
      __m256 p[HC];
      for (int g = 0; g < HC; ++g) p[g] = _mm256_broadcast_ss(weights + g * padded + sp.pos0 + t);
      for (int c = 0; c < W; ++c) {
        if (c >= nv) break;
        const __m256 vc = load8(v + 8 * c);
        for (int g = 0; g < HC; ++g) acc[g][c] = _mm256_fmadd_ps(p[g], vc, acc[g][c]);
      }
    }
    for (int g = 0; g < HC; ++g)
      for (int c = 0; c < W; ++c)
        if (c < nv) _mm256_storeu_ps(acc_out + g * D + d0 + 8 * c, acc[g][c]);
  }
}

// Attention for kv heads kv0..kv1-1 of sequence b; next is the key pass the thread runs after this task's.
template <typename T>
PDS_AVX2 void attend_avx2(const Args<T>& a, int64_t b, int64_t kv0, int64_t kv1, const Pass<T>& next,
                          Scratch& s) {
  const int64_t length = a.context_lens[b], G = a.group, D = a.d, heads = kv1 - kv0, rows = heads * G;
  T* out = a.out + (b * a.hq + kv0 * G) * D;  // (rows, D)
  if (length == 0) {
    for (int64_t i = 0; i < rows * D; ++i) store_f32(0.f, out + i);
    return;
  }
  const int64_t padded = (length + 7) / 8 * 8;
  __m256* stage = reinterpret_cast<__m256*>(s.prepare<8>(rows, D, padded));
  const T* q = a.q + (b * a.hq + kv0 * G) * D;
  for (int64_t i = 0; i < rows * D; ++i) s.q[i] = to_f32(q[i]);

  // A group's q heads in as few calls as the registers allow, of even sizes: up to 6 per call for the dot
  // products, 3 for the values.
  const int64_t score_calls = (G + 5) / 6, score_per = (G + score_calls - 1) / score_calls;
  const int64_t value_calls = (G + 2) / 3, value_per = (G + value_calls - 1) / value_calls;
  const Pass<T> keys = key_pass(a, b, kv0, kv1), values = value_pass(a, b, kv0, kv1);
  for (int64_t j = 0; j < keys.blocks(); ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      Span<T> sp = span_of(keys, values, j, h, kAhead2, true);
      for (int64_t g0 = 0; g0 < G; g0 += score_per) {
        const int64_t r = h * G + g0;
        const ScoreSink8 sink{stage + r * 8, s.scores.data() + r * padded, padded, length, a.scale};
        const float* qf = s.q.data() + r * D;
        switch (std::min(score_per, G - g0)) {
          case 1: score_span8<T, 1>(qf, D, sp, sink); break;
          case 2: score_span8<T, 2>(qf, D, sp, sink); break;
          case 3: score_span8<T, 3>(qf, D, sp, sink); break;
          case 4: score_span8<T, 4>(qf, D, sp, sink); break;
          case 5: score_span8<T, 5>(qf, D, sp, sink); break;
          default: score_span8<T, 6>(qf, D, sp, sink); break;
        }
        sp.ahead_count = 0;  // the group's first call has prefetched
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) s.inv_sum[r] = softmax8(s.scores.data() + r * padded, length, padded);
  for (int64_t j = 0; j < values.blocks(); ++j) {
    for (int64_t h = 0; h < heads; ++h) {
      Span<T> sp = span_of(values, next, j, h, kAhead2, true);
      for (int64_t g0 = 0; g0 < G; g0 += value_per) {
        const int64_t r = h * G + g0;
        const float* w = s.scores.data() + r * padded;
        float* acc = s.acc.data() + r * D;
        switch (std::min(value_per, G - g0)) {
          case 1: weigh_span8<T, 1, 8>(D, sp, w, padded, acc); break;
          case 2: weigh_span8<T, 2, 4>(D, sp, w, padded, acc); break;
          default: weigh_span8<T, 3, 4>(D, sp, w, padded, acc); break;
        }
        sp.ahead_count = 0;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) store_f32(s.acc[r * D + d] * s.inv_sum[r], out + r * D + d);
}

#endif  // PDS_HAVE_AVX512

// The fastest path this CPU has for head dim d, or a slower one asked for: want is "auto", "avx512" (no
// AVX512-BF16 instructions) or "portable".
Path choose_path(int64_t d, bool bf16, const std::string& want) {
  TORCH_CHECK(want == "auto" || want == "avx512" || want == "avx2" || want == "portable", "unknown path ", want);
#if PDS_HAVE_AVX512
  if (want != "portable" && want != "avx2" && (d == 64 || d == 128) && cpu_has_avx512())
    return bf16 && want == "auto" && cpu_has_avx512_bf16() ? Path::kAvx512Bf16 : Path::kAvx512;
  if (want != "portable" && d > 0 && d % 8 == 0 && cpu_has_avx2()) return Path::kAvx2;
#endif
  return Path::kPortable;
}

// Which code serves head dim d at this dtype: "avx512_bf16", "avx512", "avx2" or "portable".
std::string path_for(int64_t d, bool bf16, const std::string& want) { return path_name(choose_path(d, bf16, want)); }

template <typename T>
void run(const Args<T>& a, int64_t batch, const std::string& want) {
  const Path path = choose_path(a.d, sizeof(T) == 2, want);
  // Whole sequences per task, unless there are fewer sequences than threads: then each sequence's kv heads
  // are shared out too.
  const int64_t splits = std::min<int64_t>(a.hkv, (at::get_num_threads() + batch - 1) / batch);
  const int64_t per_task = (a.hkv + splits - 1) / splits, tasks_per_seq = (a.hkv + per_task - 1) / per_task;
  const auto heads_of = [&](int64_t task) {
    const int64_t kv0 = task % tasks_per_seq * per_task;
    return std::make_pair(kv0, std::min(a.hkv, kv0 + per_task));
  };
  at::parallel_for(0, batch * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;  // reused across the thread's tasks
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / tasks_per_seq;
      const auto [kv0, kv1] = heads_of(task);
#if PDS_HAVE_AVX512
      if (path != Path::kPortable) {
        // The next task's keys are prefetched while this one's last values are summed.
        Pass<T> next;
        if (task + 1 < end) {
          const auto [next0, next1] = heads_of(task + 1);
          next = key_pass(a, (task + 1) / tasks_per_seq, next0, next1);
        }
        if (path == Path::kAvx2) {
          attend_avx2<T>(a, b, kv0, kv1, next, scratch);
          continue;
        }
        if constexpr (sizeof(T) == 2) {
          if (path == Path::kAvx512Bf16) {
            if (a.d == 64) attend_avx512<T, 4, true>(a, b, kv0, kv1, next, scratch);
            else attend_avx512<T, 8, true>(a, b, kv0, kv1, next, scratch);
            continue;
          }
        }
        if (a.d == 64) attend_avx512<T, 4, false>(a, b, kv0, kv1, next, scratch);
        else attend_avx512<T, 8, false>(a, b, kv0, kv1, next, scratch);
        continue;
      }
#endif
      for (int64_t kvh = kv0; kvh < kv1; ++kvh) attend_portable<T>(a, b, kvh, scratch);
    }
  });
}

template <typename T>
Args<T> args_of(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, at::Tensor& out) {
  Args<T> a;
  a.q = static_cast<const T*>(q.const_data_ptr());
  a.key = static_cast<const T*>(key_cache.const_data_ptr());
  a.value = static_cast<const T*>(value_cache.const_data_ptr());
  a.k_block = key_cache.stride(0), a.k_token = key_cache.stride(1), a.k_head = key_cache.stride(2);
  a.v_block = value_cache.stride(0), a.v_token = value_cache.stride(1), a.v_head = value_cache.stride(2);
  a.block_tables = block_tables.const_data_ptr<int32_t>();
  a.max_blocks = block_tables.size(1);
  a.context_lens = context_lens.const_data_ptr<int32_t>();
  a.hq = q.size(1), a.hkv = key_cache.size(2), a.group = a.hq / a.hkv, a.d = q.size(2);
  a.block_size = key_cache.size(1);
  a.scale = static_cast<float>(scale);
  a.out = static_cast<T*>(out.data_ptr());
  return a;
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables_in, const at::Tensor& context_lens_in, double scale,
                                  const std::string& want) {
  TORCH_CHECK(q_in.dim() == 3 && key_cache.dim() == 4,
              "q must be (B, Hq, D) and key_cache (num_blocks, block_size, Hkv, D)");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache differ in shape");
  TORCH_CHECK(q_in.scalar_type() == key_cache.scalar_type() && q_in.scalar_type() == value_cache.scalar_type(),
              "q, key_cache and value_cache must share a dtype");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "the caches' last dim must be contiguous");
  TORCH_CHECK(block_tables_in.scalar_type() == at::kInt && context_lens_in.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  const int64_t batch = q_in.size(0), hq = q_in.size(1), d = q_in.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), hkv = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == d, "q's head dim ", d, " differs from the cache's ", key_cache.size(3));
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "Hq (", hq, ") must be a multiple of Hkv (", hkv, ")");
  TORCH_CHECK(block_tables_in.dim() == 2 && block_tables_in.size(0) == batch, "block_tables must be (B, max_blocks)");
  TORCH_CHECK(context_lens_in.dim() == 1 && context_lens_in.size(0) == batch, "context_lens must be (B,)");
  const at::Tensor q = q_in.contiguous(), block_tables = block_tables_in.contiguous();
  const at::Tensor context_lens = context_lens_in.contiguous();

  // Every block a sequence reads must exist: checked here, once, so the tasks can trust the tables.
  const int32_t* lens = context_lens.const_data_ptr<int32_t>();
  const int32_t* tables = block_tables.const_data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= max_blocks * block_size, "sequence ", b, ": context length ", lens[b],
                " outside [0, ", max_blocks * block_size, "]");
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j) {
      const int32_t id = tables[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "sequence ", b, ": block ", id, " outside [0, ", num_blocks, ")");
    }
  }

  at::Tensor out = at::empty({batch, hq, d}, q.options());
  if (batch == 0) return out;
  if (q.scalar_type() == at::kFloat)
    run(args_of<float>(q, key_cache, value_cache, block_tables, context_lens, scale, out), batch, want);
  else
    run(args_of<uint16_t>(q, key_cache, value_cache, block_tables, context_lens, scale, out), batch, want);
  return out;
}

// ---- The rest of a decode layer's small ops, one call each instead of a dozen torch ops per layer. ----

// One head's rotation: out[i] = x[i] cos[i] + x[i +- D/2] sin[i], the product with sin fused into the sum.
// Inlined into both callers below: compiled for AVX2 and FMA the loops vectorise and std::fma is one instruction
// (the portable build calls libm's fma per element: 21 us of a batch-8 layer, 0.6 ms of a 50 ms step). Each
// element's arithmetic is the same either way, so are the bits.
template <typename T>
PDS_INLINE void rotate_head(const T* x, const T* c, const T* s, T* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i)
    store_f32(std::fma(to_f32(x[i + half]), to_f32(s[i]), to_f32(x[i]) * to_f32(c[i])), &out[i]);
  for (int64_t i = half; i < d; ++i)
    store_f32(std::fma(to_f32(x[i - half]), to_f32(s[i]), to_f32(x[i]) * to_f32(c[i])), &out[i]);
}

// Rotary positions on q and k (rotate-half form, as Llama's), then k and v stored at each row's slot of the paged
// cache. qkv (B, (Hq + 2 Hkv) D); cos, sin (B, D), sin's first half negated; slots (B,) int64. Rows begin..end.
template <typename T>
PDS_INLINE void rope_and_store_range(const T* qkv, int64_t row_stride, const T* cos, const T* sin,
                                     int64_t trig_stride, const int64_t* slots, T* key, T* value,
                                     int64_t slot_stride, T* q_out, int64_t begin, int64_t end, int64_t hq,
                                     int64_t hkv, int64_t d) {
  for (int64_t b = begin; b < end; ++b) {
    const T* row = qkv + b * row_stride;
    const T* c = cos + b * trig_stride;
    const T* s = sin + b * trig_stride;
    for (int64_t h = 0; h < hq + hkv; ++h)
      rotate_head(row + h * d, c, s, h < hq ? q_out + (b * hq + h) * d : key + slots[b] * slot_stride + (h - hq) * d,
                  d);
    std::memcpy(value + slots[b] * slot_stride, row + (hq + hkv) * d, sizeof(T) * hkv * d);
  }
}

#if PDS_HAVE_AVX512
template <typename T>
PDS_AVX2 void rope_and_store_range_avx2(const T* qkv, int64_t row_stride, const T* cos, const T* sin,
                                        int64_t trig_stride, const int64_t* slots, T* key, T* value,
                                        int64_t slot_stride, T* q_out, int64_t begin, int64_t end, int64_t hq,
                                        int64_t hkv, int64_t d) {
  rope_and_store_range(qkv, row_stride, cos, sin, trig_stride, slots, key, value, slot_stride, q_out, begin, end,
                       hq, hkv, d);
}
#endif

// Returns q (B, Hq, D) through q_out.
template <typename T>
void rope_and_store_rows(const T* qkv, int64_t row_stride, const T* cos, const T* sin, int64_t trig_stride,
                         const int64_t* slots, T* key, T* value, int64_t slot_stride, T* q_out, int64_t batch,
                         int64_t hq, int64_t hkv, int64_t d) {
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
#if PDS_HAVE_AVX512
    if (cpu_has_avx2()) {  // (asked of the CPU once)
      rope_and_store_range_avx2(qkv, row_stride, cos, sin, trig_stride, slots, key, value, slot_stride, q_out,
                                begin, end, hq, hkv, d);
      return;
    }
#endif
    rope_and_store_range(qkv, row_stride, cos, sin, trig_stride, slots, key, value, slot_stride, q_out, begin, end,
                         hq, hkv, d);
  });
}

at::Tensor rope_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& slots,
                          int64_t hq, int64_t hkv) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be (B, (Hq + 2 Hkv) D), rows contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must be contiguous (num_blocks, block_size, Hkv, D)");
  const int64_t batch = qkv.size(0), d = key_cache.size(3);
  TORCH_CHECK(key_cache.size(2) == hkv && qkv.size(1) == (hq + 2 * hkv) * d && d % 2 == 0, "shapes disagree");
  TORCH_CHECK(qkv.scalar_type() == key_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
                  sin.scalar_type() == qkv.scalar_type(),
              "qkv, cos, sin and the caches must share a dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == batch && cos.size(1) == d && cos.stride(1) == 1 &&
                  sin.sizes() == cos.sizes() && sin.strides() == cos.strides(),
              "cos and sin must be (B, D)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == batch, "slots: (B,) int64");
  const at::Tensor slot = slots.contiguous();
  const int64_t capacity = key_cache.size(0) * key_cache.size(1);
  const int64_t* ids = slot.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(ids[b] >= 0 && ids[b] < capacity, "row ", b, ": slot ", ids[b], " outside [0, ", capacity, ")");
  at::Tensor q = at::empty({batch, hq, d}, qkv.options());
  const int64_t slot_stride = hkv * d;
  if (qkv.scalar_type() == at::kFloat)
    rope_and_store_rows<float>(qkv.const_data_ptr<float>(), qkv.stride(0), cos.const_data_ptr<float>(),
                               sin.const_data_ptr<float>(), cos.stride(0), ids, key_cache.data_ptr<float>(),
                               value_cache.data_ptr<float>(), slot_stride, q.data_ptr<float>(), batch, hq, hkv, d);
  else if (qkv.scalar_type() == at::kBFloat16)
    rope_and_store_rows<uint16_t>(
        static_cast<const uint16_t*>(qkv.const_data_ptr()), qkv.stride(0),
        static_cast<const uint16_t*>(cos.const_data_ptr()), static_cast<const uint16_t*>(sin.const_data_ptr()),
        cos.stride(0), ids, static_cast<uint16_t*>(key_cache.data_ptr()),
        static_cast<uint16_t*>(value_cache.data_ptr()), slot_stride, static_cast<uint16_t*>(q.data_ptr()), batch,
        hq, hkv, d);
  else
    TORCH_CHECK(false, "float32 or bfloat16 only");
  return q;
}

// RMSNorm of each row in float32, rounded once: x (R, H) rows contiguous, weight (H,).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* in = x + r * x_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < h; ++i) sum += to_f32(in[i]) * to_f32(in[i]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(h) + eps);
      for (int64_t i = 0; i < h; ++i) store_f32(to_f32(in[i]) * inv * to_f32(w[i]), &out[r * h + i]);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "x must be (R, H) with contiguous rows, weight (H,) of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows<float>(x.const_data_ptr<float>(), x.stride(0), weight.const_data_ptr<float>(),
                         out.data_ptr<float>(), x.size(0), x.size(1), static_cast<float>(eps));
  else if (x.scalar_type() == at::kBFloat16)
    rms_norm_rows<uint16_t>(static_cast<const uint16_t*>(x.const_data_ptr()), x.stride(0),
                            static_cast<const uint16_t*>(weight.const_data_ptr()),
                            static_cast<uint16_t*>(out.data_ptr()), x.size(0), x.size(1), static_cast<float>(eps));
  else
    TORCH_CHECK(false, "float32 or bfloat16 only");
  return out;
}

// ---------------------------------------------------------------------------------------------------------
// A Llama decode step's layers in one call: the same kernels, in the same order and with the same arguments as
// the fast runner's Python loop (model_runner/llama.py), without ~11 Python calls a layer (2.6-3.7 us each).
// The GEMMs are pdserve_gemm::linear, found through the dispatcher (its library must be loaded).

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&,
                          const std::string&, const std::optional<at::Tensor>&, const std::string&);

const c10::TypedOperatorHandle<Linear>& gemm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pdserve_gemm::linear", "").typed<Linear>();
  return op;
}

// x (B, H) the embedded tokens; kv (layers, 2, num_blocks, block_size, Hkv, D); per layer, in `tensors`: input
// norm, qkv, o, post norm, gate, up, down (the five weights packed by gemm.pack, their rows in `out_features`,
// their biases in `biases`); gemm_path: the weights' PDSERVE_GEMM mode. Returns x after the last layer.
at::Tensor decode_layers(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv,
                         const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& context_lens,
                         at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& biases,
                         at::IntArrayRef out_features, double eps, double scale, int64_t hq, int64_t hkv,
                         const std::string& gemm_path, const std::string& attention_path) {
  const int64_t layers = kv.size(0);
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == 7 * layers &&
                  static_cast<int64_t>(biases.size()) == 5 * layers &&
                  static_cast<int64_t>(out_features.size()) == 5 * layers,
              "decode_layers: 7 tensors, 5 biases and 5 sizes a layer");
  const auto& gemm = gemm_op();
  const std::optional<at::Tensor> none;
  const std::string plain = "none", silu = "silu", mul = "mul", add = "add";
  at::Tensor x = x_in;
  const int64_t batch = x.size(0);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* t = tensors.data() + 7 * l;
    const at::Tensor &input_norm = t[0], &post_norm = t[3];
    // the layer's i-th linear (0 qkv, 1 o, 2 gate, 3 up, 4 down) of x, then `post` with `other`
    const auto linear = [&](int64_t i, const at::Tensor& in, const std::string& post,
                            const std::optional<at::Tensor>& other) {
      const at::Tensor& weight = t[i < 2 ? 1 + i : 2 + i];
      return gemm.call(in, weight, out_features[5 * l + i], biases.get(5 * l + i), post, other, gemm_path);
    };
    const at::Tensor qkv = linear(0, rms_norm(x, input_norm, eps), plain, none);
    const at::Tensor layer_kv = kv.select(0, l);
    const at::Tensor key_cache = layer_kv.select(0, 0), value_cache = layer_kv.select(0, 1);
    const at::Tensor q = rope_and_store(qkv, cos, sin, key_cache, value_cache, slots, hq, hkv);
    const at::Tensor attn =
        paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens, scale, attention_path);
    x = linear(1, attn.view({batch, -1}), add, x);
    const at::Tensor h = rms_norm(x, post_norm, eps);
    const at::Tensor gate = linear(2, h, silu, none);
    x = linear(4, linear(3, h, mul, gate), add, x);
  }
  return x;
}

}  // namespace

// A prompt's KV into its blocks of the pool kv (layers, 2, num_blocks, block_size, Hkv, D): sources are the
// 2 * layers tensors (keys, values of each layer in turn), each (Hkv, length, D) contiguous in kv's dtype. Block
// by block, each row a memcpy of D elements, so a block's 16 tokens x Hkv heads are written front to back.
// torch's index_copy_ into the same (slots, Hkv, D) view moves 4 GB/s here: 9-13 ms of a 1,500-token prompt's
// 35 MB (bfloat16) on the engine thread between two decode steps, against ~3 ms.
void store_prompt(const at::Tensor& kv, at::TensorList sources, const at::Tensor& blocks) {
  TORCH_CHECK(kv.device().is_cpu() && kv.is_contiguous() && kv.dim() == 6, "kv must be a contiguous CPU pool");
  TORCH_CHECK(static_cast<int64_t>(sources.size()) == 2 * kv.size(0), "expected keys and values for each layer");
  TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kLong, "blocks must be int64");
  const int64_t num_blocks = kv.size(2), bs = kv.size(3), H = kv.size(4), D = kv.size(5);
  const int64_t element = kv.element_size(), row = D * element;
  const at::Tensor table = blocks.contiguous();
  const int64_t* ids = table.data_ptr<int64_t>();
  for (const at::Tensor& src : sources) {
    TORCH_CHECK(src.scalar_type() == kv.scalar_type() && src.is_contiguous() && src.dim() == 3 && src.size(0) == H &&
                src.size(2) == D, "each source must be (Hkv, length, D) contiguous in the pool's dtype");
    TORCH_CHECK(src.size(1) == sources[0].size(1), "every source must hold the same tokens");
  }
  const int64_t length = sources.empty() ? 0 : sources[0].size(1);
  TORCH_CHECK(table.numel() * bs >= length, "too few blocks for ", length, " tokens");
  for (int64_t j = 0; j * bs < length; ++j)
    TORCH_CHECK(ids[j] >= 0 && ids[j] < num_blocks, "block ", ids[j], " is outside the pool");
  char* base = static_cast<char*>(kv.data_ptr());
  const int64_t per_block = bs * H * row;
  at::parallel_for(0, static_cast<int64_t>(sources.size()), 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const char* src = static_cast<const char*>(sources[s].data_ptr());
      char* pool = base + s * num_blocks * per_block;  // layer s / 2, kind s % 2
      for (int64_t t0 = 0; t0 < length; t0 += bs) {
        char* block = pool + ids[t0 / bs] * per_block;
        for (int64_t t = t0; t < std::min(length, t0 + bs); ++t)
          for (int64_t h = 0; h < H; ++h)
            std::memcpy(block + ((t - t0) * H + h) * row, src + (h * length + t) * row, row);
      }
    }
  });
}

TORCH_LIBRARY(pdserve_attention, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, str path=\"auto\") -> Tensor");
  m.def("path_for(int d, bool bf16, str path=\"auto\") -> str", &path_for);
  m.def("rope_and_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slots, int hq, int hkv) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("store_prompt(Tensor(a!) kv, Tensor[] sources, Tensor blocks) -> ()");
  m.def("decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!) kv, Tensor slots, Tensor block_tables, "
        "Tensor context_lens, Tensor[] tensors, Tensor?[] biases, int[] out_features, float eps, float scale, "
        "int hq, int hkv, str gemm_path, str attention_path) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_attention, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rope_and_store", &rope_and_store);
  m.impl("rms_norm", &rms_norm);
  m.impl("store_prompt", &store_prompt);
  m.impl("decode_layers", &decode_layers);
}
