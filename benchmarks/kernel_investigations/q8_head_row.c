// A one-row Q8_0 product over Gemma 3's output head (262144 x 640 codes,
// 178 MB), on 2 threads, in two AVX2 forms of the inner step, beside a
// plain read of the same bytes by the same loop:
//   A: |w| and x * sign(w) (`dot_s8s8`, what pagedkv runs): 5 vector ALU
//      operations per 32 bytes with the products and the add;
//   B: w * sign(x) and |x| kept beside x: 4, but only exact for weight
//      codes in [-127, 127].
// Codes asked for on 2 MiB pages (madvise), each block's 256 bytes
// prefetched 8 KiB ahead, as pagedkv's tile does.
//
// From the repository root:
//     gcc -O2 -mavx2 -mfma -o /tmp/q8_head_row benchmarks/kernel_investigations/q8_head_row.c -lpthread
//     /tmp/q8_head_row
//
// On a 2-vCPU AMD EPYC guest (Zen 4), 2026-11-29, best of 7 in each of
// three rounds: A 30.6, 32.9, 36.2 GB/s; B 22.5, 34.2, 36.0; the plain read
// 33.8, 36.7, 36.6. Both forms read at the plain read's rate: the one-row
// head is the memory's, and one ALU operation less per 32 bytes buys
// nothing there (docs/performance.md, "The shared prefix's step, phase by
// phase").
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#define N 262144
#define K 640
#define G (K / 4)
static int8_t *W; static __m256i XB[G], XA[G]; static float SC[N / 8 * (K / 32)];
static volatile float sink;
typedef struct { int variant, p0, p1; } job;
static void *run(void *arg) {
  job *j = arg; __m256 tot = _mm256_setzero_ps(); const __m256i ones = _mm256_set1_epi16(1);
  for (int p = j->p0; p < j->p1; p++) {
    const __m256i *v = (const __m256i *)(W + (size_t)p * 8 * K);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
      __m256i isum = _mm256_setzero_si256();
      for (int g = 0; g < 8; g++) {
        if (g == 0)
          for (int line = 0; line < 256; line += 64)
            _mm_prefetch((const char *)(v + b * 8) + 8192 + line, _MM_HINT_T0);
        __m256i w = _mm256_load_si256(v + b * 8 + g), s;
        if (j->variant == 0) {
          __m256i wa = _mm256_abs_epi8(w), xs = _mm256_sign_epi8(XB[b * 8 + g], w);
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones);
        } else if (j->variant == 1) {
          __m256i ws = _mm256_sign_epi8(w, XB[b * 8 + g]);
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(XA[b * 8 + g], ws), ones);
        } else {
          s = w;
        }
        isum = _mm256_add_epi32(isum, s);
      }
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(SC[p * (K / 32) + b]), acc);
    }
    tot = _mm256_add_ps(tot, acc);
  }
  float t[8]; _mm256_storeu_ps(t, tot); sink = t[0]; return NULL;
}
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(void) {
  W = aligned_alloc(1 << 21, (size_t)N * K); madvise(W, (size_t)N * K, MADV_HUGEPAGE);
  for (size_t i = 0; i < (size_t)N * K; i++) W[i] = (int8_t)((i * 2654435761u >> 13) % 255 - 127);
  int8_t x[K]; for (int i = 0; i < K; i++) x[i] = (int8_t)((i * 37) % 255 - 127);
  for (int g = 0; g < G; g++) { int32_t w; memcpy(&w, x + 4 * g, 4); XB[g] = _mm256_set1_epi32(w);
    int8_t a[4]; for (int i = 0; i < 4; i++) a[i] = (int8_t)abs(x[4 * g + i]); memcpy(&w, a, 4); XA[g] = _mm256_set1_epi32(w); }
  for (int i = 0; i < N / 8 * (K / 32); i++) SC[i] = 1e-3f;
  const char *names[3] = {"A: abs(w), sign(x,w)", "B: sign(w,x), |x| kept", "plain read"};
  for (int round = 0; round < 3; round++)
    for (int v = 0; v < 3; v++) {
      double best = 1e9;
      for (int r = 0; r < 7; r++) {
        job j[2] = {{v, 0, N / 16}, {v, N / 16, N / 8}}; pthread_t t[2];
        double t0 = now();
        for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, run, &j[i]);
        for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
        double dt = now() - t0; if (dt < best) best = dt;
      }
      printf("%-26s %.2f ms, %.1f GB/s\n", names[v], best * 1e3, (double)N * K / best / 1e9);
    }
  return 0;
}
