// How fast one core reads memory in chunks visited in random order, as decode attention reads a sequence's
// scattered KV blocks (docs/benchmarks.md, "attention"). Not part of any build:
//   cc -O2 -mavx2 -o /tmp/stream_probe bench/stream_probe.c && /tmp/stream_probe 12288 2048
// args: chunk bytes (0: the whole 256 MiB buffer front to back), software prefetch distance in bytes (0: none;
// past a chunk's end it prefetches the next chunk's start), and optionally a KV layout, the chunk then being one
// block's keys:
//   two-pass:    every block's keys (one pool, the buffer's first half), then every block's values (the second
//                half), as today's kernel reads them;
//   interleaved: one pass, each block's keys then its values, from the two pools;
//   adjacent:    one pass, each block's keys and values adjacent, one run of twice the chunk.
// Prints the best of 5 passes, in GB/s.
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
    if (ahead) {
      const size_t k = i + ahead;
      _mm_prefetch(k < n ? p + k : next + (k - n), _MM_HINT_T0);
    }
    s0 = _mm256_add_ps(s0, _mm256_load_ps((const float*)(p + i)));
    s1 = _mm256_add_ps(s1, _mm256_load_ps((const float*)(p + i + 32)));
  }
}

enum Layout { kChunks, kTwoPass, kInterleaved, kAdjacent };

int main(int argc, char** argv) {
  const size_t bytes = (size_t)256 << 20;
  const size_t chunk = argc > 1 ? strtoul(argv[1], NULL, 10) : 0;
  const size_t ahead = argc > 2 ? strtoul(argv[2], NULL, 10) : 0;
  const char* name = argc > 3 ? argv[3] : "chunks";
  const enum Layout layout = !strcmp(name, "two-pass") ? kTwoPass : !strcmp(name, "interleaved") ? kInterleaved
                           : !strcmp(name, "adjacent") ? kAdjacent : kChunks;
  if (layout != kChunks && chunk == 0) {
    fprintf(stderr, "a KV layout needs a chunk size (one block's keys)\n");
    return 2;
  }
  const size_t size = chunk ? chunk : bytes;
  // chunks: the whole buffer in chunks; KV layouts: blocks, each a chunk of keys and a chunk of values
  const size_t count = layout == kChunks ? bytes / size : bytes / (2 * size);
  char* buffer = aligned_alloc(4096, bytes);
  memset(buffer, 1, bytes);
  const char* values = buffer + bytes / 2;  // two-pass and interleaved: the value pool
  size_t* order = malloc(sizeof(size_t) * count);
  for (size_t i = 0; i < count; ++i) order[i] = i;
  srand(1);
  for (size_t i = count - 1; i > 0; --i) {  // Fisher-Yates
    const size_t j = (size_t)rand() % (i + 1), t = order[i];
    order[i] = order[j], order[j] = t;
  }
  double best = 1e9;
  for (int pass = 0; pass < 5; ++pass) {
    const double start = now();
    for (size_t c = 0; c < count; ++c) {
      const size_t b = order[c], next = order[c + 1 < count ? c + 1 : c];
      switch (layout) {
        case kChunks:
        case kTwoPass: read_run(buffer + b * size, size, buffer + next * size, ahead); break;
        case kInterleaved:
          read_run(buffer + b * size, size, values + b * size, ahead);
          read_run(values + b * size, size, buffer + next * size, ahead);
          break;
        case kAdjacent: read_run(buffer + b * 2 * size, 2 * size, buffer + next * 2 * size, ahead); break;
      }
    }
    if (layout == kTwoPass)
      for (size_t c = 0; c < count; ++c) {
        const size_t b = order[c], next = order[c + 1 < count ? c + 1 : c];
        read_run(values + b * size, size, values + next * size, ahead);
      }
    const double took = now() - start;
    if (took < best) best = took;
  }
  float sum[8];
  _mm256_storeu_ps(sum, _mm256_add_ps(s0, s1));
  printf("%s: chunk %zu B, prefetch %zu B ahead: %.1f GB/s (%g)\n", name, chunk, ahead, bytes / best / 1e9, sum[0]);
  return 0;
}
