// Greedy picks on the CPU: each row's largest logit and the first index that holds it, in one pass over the
// row. Built and loaded by model_runner/sampling.py as torch.ops.pdserve_greedy.best.
//
// torch takes four passes for the same answer (a float32 copy of a bfloat16 row, max, isfinite, argmax), and
// its argmax reduces one element at a time: ~1 ns an element, 0.4 ms of a 18 ms batch-8 step over SmolLM2's
// 49,152-token vocabulary. Here a row of bfloat16 or float32 is read once, 16 lanes at a time.
//
// The answer is torch's: the value is NaN when any logit is (so a caller can tell a row it must not pick
// from), and the index is the first one holding the largest value; a row of nothing but -inf gives -inf and 0.
// Exact comparisons only, so every path and any batch give the same index.
//
// Only the ATen headers this needs are included (torch/extension.h would add ~15 s to every first build).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "simd.h"

namespace {

using pds::Path;

struct Best {
  float value;
  int64_t index;
};

template <typename T>
Best best_portable(const T* row, int64_t n) {
  Best best{-std::numeric_limits<float>::infinity(), 0};
  for (int64_t i = 0; i < n; ++i) {
    const float x = pds::to_f32(row[i]);
    if (std::isnan(x)) return {x, i};
    if (x > best.value) best = {x, i};
  }
  return best;
}

#if PDS_HAVE_AVX512

PDS_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
PDS_AVX512 inline __m512 load16(const uint16_t* p) {  // 16 bfloat16s, widened in order
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane i keeps the largest of elements i, i + 16, ... and the first index holding it (a later element replaces
// it only when strictly larger); then the largest lane wins, the smallest index among equals.
template <typename T>
PDS_AVX512 Best best_avx512(const T* row, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 value = neg_inf;
  __m512i index = _mm512_setzero_si512(), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(row + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 larger = _mm512_cmp_ps_mask(x, value, _CMP_GT_OQ);
    value = _mm512_mask_mov_ps(value, larger, x);
    index = _mm512_mask_mov_epi32(index, larger, at);
    at = _mm512_add_epi32(at, step);
  }
  if (nan) return best_portable(row, n);  // the first NaN's index, as the portable loop gives
  Best best{-std::numeric_limits<float>::infinity(), 0};
  alignas(64) float values[16];
  alignas(64) int32_t indices[16];
  _mm512_store_ps(values, value);
  _mm512_store_si512(indices, index);
  for (int lane = 0; lane < 16; ++lane)
    if (values[lane] > best.value || (values[lane] == best.value && indices[lane] < best.index))
      best = {values[lane], indices[lane]};
  const Best tail = best_portable(row + i, n - i);
  if (std::isnan(tail.value) || tail.value > best.value) best = {tail.value, i + tail.index};
  return best;
}

#endif  // PDS_HAVE_AVX512

Path choose_path(const std::string& want) {
  TORCH_CHECK(want == "auto" || want == "avx512" || want == "portable", "path must be auto, avx512 or portable");
  return want != "portable" && pds::cpu_has_avx512() ? Path::kAvx512 : Path::kPortable;
}

template <typename T>
Best best_of(const T* row, int64_t n, Path path) {
#if PDS_HAVE_AVX512
  // 2^31 elements would overflow the 32-bit lane indices: such rows take the portable loop
  if (path == Path::kAvx512 && n < (int64_t{1} << 31)) return best_avx512(row, n);
#endif
  (void)path;
  return best_portable(row, n);
}

// logits (rows, n), float32 or bfloat16 -> (each row's largest value as float32, the first index holding it).
std::tuple<at::Tensor, at::Tensor> best(const at::Tensor& logits, const std::string& want) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "logits must be a 2-D CPU tensor");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16, got ", logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0, "logits must have at least one column");
  const at::Tensor rows = logits.contiguous();
  const int64_t m = rows.size(0), n = rows.size(1);
  at::Tensor values = at::empty({m}, logits.options().dtype(at::kFloat));
  at::Tensor indices = at::empty({m}, logits.options().dtype(at::kLong));
  const Path path = choose_path(want);
  for (int64_t r = 0; r < m; ++r) {
    const Best b = rows.scalar_type() == at::kFloat
                       ? best_of(rows.data_ptr<float>() + r * n, n, path)
                       : best_of(reinterpret_cast<const uint16_t*>(rows.data_ptr<at::BFloat16>()) + r * n, n, path);
    values.data_ptr<float>()[r] = b.value;
    indices.data_ptr<int64_t>()[r] = b.index;
  }
  return {values, indices};
}

std::string path_for(const std::string& want) { return pds::path_name(choose_path(want)); }

}  // namespace

TORCH_LIBRARY(pdserve_greedy, m) {
  m.def("best(Tensor logits, str path=\"auto\") -> (Tensor, Tensor)");
  m.def("path_for(str path=\"auto\") -> str", &path_for);
}

TORCH_LIBRARY_IMPL(pdserve_greedy, CPU, m) {
  m.impl("best", &best);
}
