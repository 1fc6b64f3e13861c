// How fast one core reads memory in chunks of a given size, visited in random order, as decode attention reads
// a sequence's scattered KV blocks (docs/benchmarks.md, "attention"). Not part of any build:
//   cc -O2 -mavx2 -o /tmp/stream_probe bench/stream_probe.c && /tmp/stream_probe 12288 2048
// args: chunk bytes (0: the whole 256 MiB buffer front to back), software prefetch distance in bytes (0: none;
// past a chunk's end it prefetches the next chunk's start). Prints the best of 5 passes, in GB/s.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t bytes = (size_t)256 << 20;
  const size_t chunk = argc > 1 ? strtoul(argv[1], NULL, 10) : 0;
  const size_t ahead = argc > 2 ? strtoul(argv[2], NULL, 10) : 0;
  const size_t size = chunk ? chunk : bytes, chunks = bytes / size, per = size / sizeof(float);
  float* buffer = aligned_alloc(4096, bytes);
  memset(buffer, 1, bytes);
  size_t* order = malloc(sizeof(size_t) * chunks);
  for (size_t i = 0; i < chunks; ++i) order[i] = i;
  srand(1);
  for (size_t i = chunks - 1; i > 0; --i) {  // Fisher-Yates
    const size_t j = (size_t)rand() % (i + 1), t = order[i];
    order[i] = order[j], order[j] = t;
  }
  double best = 1e9;
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  for (int pass = 0; pass < 5; ++pass) {
    const double start = now();
    for (size_t c = 0; c < chunks; ++c) {
      const float* p = buffer + order[c] * per;
      const float* next = c + 1 < chunks ? buffer + order[c + 1] * per : p;
      for (size_t i = 0; i < per; i += 16) {
        if (ahead) {
          const size_t k = i + ahead / sizeof(float);
          _mm_prefetch((const char*)(k < per ? p + k : next + (k - per)), _MM_HINT_T0);
        }
        s0 = _mm256_add_ps(s0, _mm256_load_ps(p + i));
        s1 = _mm256_add_ps(s1, _mm256_load_ps(p + i + 8));
      }
    }
    const double took = now() - start;
    if (took < best) best = took;
  }
  float sum[8];
  _mm256_storeu_ps(sum, _mm256_add_ps(s0, s1));
  printf("chunk %zu B, prefetch %zu B ahead: %.1f GB/s (%g)\n", chunk, ahead, bytes / best / 1e9, sum[0]);
  return 0;
}
