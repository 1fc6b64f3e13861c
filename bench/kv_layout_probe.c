// How fast one core reads a paged KV cache's blocks, visited in random order, as decode attention would under two
// layouts (docs/benchmarks.md, "attention"). Not part of any build:
//   cc -O2 -mavx2 -o /tmp/kv_layout_probe bench/kv_layout_probe.c && /tmp/kv_layout_probe 2 12288 2048
// args: mode, bytes of one block's keys (12288: 16 float32 tokens of 3 kv heads x 64 dims), software prefetch
// distance in bytes (past a chunk's end it prefetches the next chunk's start). Modes:
//   2: today's two passes: every block's keys (one pool), then every block's values (another pool);
//   0: one pass, each block's keys then its values, from the two pools;
//   1: one pass, each block's keys and values adjacent, one run of twice the size.
// Prints the best of 5 passes over 256 MiB, in GB/s.
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

static __m256 s0, s1;

// Loads n bytes from p, prefetching `ahead` bytes on (into `next` past the end).
static inline void read_run(const char* p, size_t n, const char* next, size_t ahead) {
  for (size_t i = 0; i < n; i += 64) {
    const size_t k = i + ahead;
    _mm_prefetch(k < n ? p + k : next + (k - n), _MM_HINT_T0);
    s0 = _mm256_add_ps(s0, _mm256_load_ps((const float*)(p + i)));
    s1 = _mm256_add_ps(s1, _mm256_load_ps((const float*)(p + i + 32)));
  }
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s mode block_bytes prefetch_bytes\n", argv[0]);
    return 2;
  }
  const int mode = atoi(argv[1]);
  const size_t block = strtoul(argv[2], NULL, 10), ahead = strtoul(argv[3], NULL, 10);
  const size_t bytes = (size_t)256 << 20, blocks = bytes / (2 * block);
  char* buffer = aligned_alloc(4096, bytes);
  memset(buffer, 0, bytes);
  const char* values = buffer + bytes / 2;  // modes 0 and 2: the value pool, after the key pool
  size_t* order = malloc(sizeof(size_t) * blocks);
  for (size_t i = 0; i < blocks; ++i) order[i] = i;
  srand(1);
  for (size_t i = blocks - 1; i > 0; --i) {  // Fisher-Yates
    const size_t j = (size_t)rand() % (i + 1), t = order[i];
    order[i] = order[j], order[j] = t;
  }
  double best = 1e9;
  for (int pass = 0; pass < 5; ++pass) {
    const double start = now();
    for (size_t c = 0; c < blocks; ++c) {
      const size_t b = order[c], next = order[c + 1 < blocks ? c + 1 : c];
      if (mode == 1) {
        read_run(buffer + b * 2 * block, 2 * block, buffer + next * 2 * block, ahead);
      } else if (mode == 0) {
        read_run(buffer + b * block, block, values + b * block, ahead);
        read_run(values + b * block, block, buffer + next * block, ahead);
      } else {
        read_run(buffer + b * block, block, buffer + next * block, ahead);
      }
    }
    if (mode == 2)
      for (size_t c = 0; c < blocks; ++c) {
        const size_t b = order[c], next = order[c + 1 < blocks ? c + 1 : c];
        read_run(values + b * block, block, values + next * block, ahead);
      }
    const double took = now() - start;
    if (took < best) best = took;
  }
  float sum[8];
  _mm256_storeu_ps(sum, _mm256_add_ps(s0, s1));
  printf("mode %d, blocks of %zu B keys, prefetch %zu B ahead: %.1f GB/s (%g)\n", mode, block, ahead,
         bytes / best / 1e9, sum[0]);
  return 0;
}
