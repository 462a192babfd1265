// The CPU decode kernel's algorithm, written independently in C: whether the
// Mojo kernel's shortfall from the memory's rate on an AVX2 machine is its
// compiler's or the algorithm's on that machine.
//
//     gcc -O3 -march=native -o /tmp/decode_cpu_in_c \
//         benchmarks/kernel_investigations/decode_cpu_in_c.c -lpthread -lm
//     /tmp/decode_cpu_in_c
//
// bfloat16 K/V, GQA group 4, 8 KV heads a task (one request), head_dim 128,
// NHD pages of 16 tokens in random order, chunks of 32 tokens, each chunk's
// K then V read in blocks of 8 tokens (all heads of a block's tokens) with
// the next block prefetched (T1), as in mojo_ops/attention/cpu/: scoring
// in tiles of 4 rows x 2 tokens (8 FMA chains, reductions deferred to the
// chunk's end), a base-2 online softmax in vectors, V in passes of 16
// elements x 4 rows (8 chains), K/V widened in paired order (shift, and).
// Checks one request against a double-precision reference, then prints, five
// times: GB/s from memory on both cores (32 requests x 2048 tokens, 256 MiB)
// beside a plain read of the same pool on both cores, GB/s on one core, and
// ns per (token, KV head) on one core with the pool in L2 (4 pages).
//
// On the 2-core Zen 3 VM (AVX2), three runs alternated with a build of
// benchmarks/kernel_investigations/decode_cpu_chunk.mojo (bfloat16 at group
// 4, the same heads and pages; its batch is 64 requests): over its 15 rounds
// this kernel read 10.9-14.5 GB/s from memory on both cores (median 12.8),
// 0.36-0.66 of the plain read of the same round (median 0.51), and took 44-68
// ns per (token, KV head) in L2 (median 62). The Mojo kernel, in the runs
// between (each a median of its rounds): 13.8-14.6 GB/s, 0.43-0.55 of its
// plain read, 42-62 ns. The same algorithm compiled by gcc is no faster: what
// keeps decode short of the memory's rate there is the algorithm on that core
// (AVX2's 16 registers, see the README), not Mojo's code for it.
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define HEAD_DIM 128
#define KV_HEADS 8
#define GROUP 4
#define ROWS (KV_HEADS * GROUP)       /* query rows of a task */
#define PAGE_SIZE 16
#define CHUNK 32
#define BLOCK 8                       /* tokens a block */
#define TOKEN (KV_HEADS * HEAD_DIM)   /* elements of a token's row, all heads */
#define HALF (PAGE_SIZE * TOKEN)      /* a page's K (or V): [PAGE_SIZE, KV_HEADS, HEAD_DIM] */
#define PAGE (2 * HALF)
#define BLOCK_LINES (BLOCK * TOKEN * 2 / 64)
#define UNROLL _Pragma("GCC unroll 8")
typedef uint16_t bf16;
typedef __m256 vec;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

/* A task's scratch. q and acc rows are in paired order: of each 16
   elements, the 8 even ones, then the 8 odd ones (as `widen` splits K/V). */
typedef struct {
  float q[ROWS * HEAD_DIM] __attribute__((aligned(64)));
  float acc[ROWS * HEAD_DIM] __attribute__((aligned(64)));
  float p[ROWS * CHUNK] __attribute__((aligned(64)));
  vec dots[ROWS * CHUNK];            /* lane-wise dot products, [row, token] */
  float m[ROWS], l[ROWS];
} State;

/* 16 bfloat16 as float32: the even elements, then the odd ones */
static inline void widen(const bf16 *src, vec *even, vec *odd) {
  __m256i w = _mm256_loadu_si256((const __m256i *)src);
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(0xffff0000)));
}

static inline float sum_lanes(vec v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

static inline float max_lanes(vec v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}

/* lane i: the sum of v[i]'s lanes */
static inline vec sum_lanes8(const vec *v) {
  vec t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  vec t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  t0 = _mm256_hadd_ps(t0, t1);
  t2 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t2, 0x20),
                       _mm256_permute2f128_ps(t0, t2, 0x31));
}

static inline vec exp2_vec(vec x) {
  static const float c[] = {1.535336188e-4f, 1.339887440e-3f, 9.618437357e-3f,
                            5.550332471e-2f, 2.402264791e-1f, 6.931472028e-1f, 1.f};
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  vec whole = _mm256_floor_ps(x), frac = _mm256_sub_ps(x, whole);
  vec p = _mm256_set1_ps(c[0]);
  for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, frac, _mm256_set1_ps(c[i]));
  __m256i bits = _mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(bits, 23)));
}

/* The step-th of a block's prefetch steps: its share of the block's lines. */
static inline void prefetch_step(const bf16 *block, int step, int steps) {
  int per = (BLOCK_LINES + steps - 1) / steps, from = step * per;
  int to = from + per < BLOCK_LINES ? from + per : BLOCK_LINES;
  for (int i = from; i < to; i++) _mm_prefetch((const char *)block + i * 64, _MM_HINT_T1);
}

/* Scores of tokens j, j+1 for head h's 4 rows, into dots. */
static inline void score_pair(State *s, const bf16 *pool, const long *rows, int h, int j) {
  const float *q = s->q + h * GROUP * HEAD_DIM;
  const bf16 *k0 = pool + rows[j] + h * HEAD_DIM, *k1 = pool + rows[j + 1] + h * HEAD_DIM;
  vec a[GROUP][2];
  UNROLL for (int g = 0; g < GROUP; g++) a[g][0] = a[g][1] = _mm256_setzero_ps();
  for (int c = 0; c < HEAD_DIM; c += 16) {
    vec e0, o0, e1, o1;
    widen(k0 + c, &e0, &o0);
    widen(k1 + c, &e1, &o1);
    UNROLL for (int g = 0; g < GROUP; g++) {
      vec qe = _mm256_load_ps(q + g * HEAD_DIM + c), qo = _mm256_load_ps(q + g * HEAD_DIM + c + 8);
      a[g][0] = _mm256_fmadd_ps(qo, o0, _mm256_fmadd_ps(qe, e0, a[g][0]));
      a[g][1] = _mm256_fmadd_ps(qo, o1, _mm256_fmadd_ps(qe, e1, a[g][1]));
    }
  }
  UNROLL for (int g = 0; g < GROUP; g++) {
    s->dots[(h * GROUP + g) * CHUNK + j] = a[g][0];
    s->dots[(h * GROUP + g) * CHUNK + j + 1] = a[g][1];
  }
}

/* The chunk's dots become probabilities: a base-2 online softmax per row. */
static void softmax(State *s) {
  for (int r = 0; r < ROWS; r++) {
    float *p = s->p + r * CHUNK;
    vec top = _mm256_set1_ps(s->m[r]);
    for (int j = 0; j < CHUNK; j += 8) {
      vec v = sum_lanes8(s->dots + r * CHUNK + j);
      _mm256_store_ps(p + j, v);
      top = _mm256_max_ps(top, v);
    }
    float m = max_lanes(top), alpha = exp2f(s->m[r] - m);
    vec total = _mm256_setzero_ps();
    for (int j = 0; j < CHUNK; j += 8) {
      vec e = exp2_vec(_mm256_sub_ps(_mm256_load_ps(p + j), _mm256_set1_ps(m)));
      _mm256_store_ps(p + j, e);
      total = _mm256_add_ps(total, e);
    }
    s->l[r] = s->l[r] * alpha + sum_lanes(total);
    s->m[r] = m;
    if (alpha != 1.0f)
      for (int c = 0; c < HEAD_DIM; c += 8) {
        float *a = s->acc + r * HEAD_DIM + c;
        _mm256_store_ps(a, _mm256_mul_ps(_mm256_set1_ps(alpha), _mm256_load_ps(a)));
      }
  }
}

/* V of tokens jb..jb+BLOCK folded into head h's 4 rows, 16 elements a pass;
   the first pass takes its steps of the next block's prefetch. */
static inline void accumulate_block(State *s, const bf16 *pool, const long *rows, int h, int jb,
                                    const bf16 *next, int *step) {
  float *acc = s->acc + h * GROUP * HEAD_DIM;
  const float *p = s->p + h * GROUP * CHUNK;
  for (int c = 0; c < HEAD_DIM; c += 16) {
    vec o[GROUP][2];
    UNROLL for (int g = 0; g < GROUP; g++) {
      o[g][0] = _mm256_load_ps(acc + g * HEAD_DIM + c);
      o[g][1] = _mm256_load_ps(acc + g * HEAD_DIM + c + 8);
    }
    for (int j = jb; j < jb + BLOCK; j++) {
      if (c == 0 && next) prefetch_step(next, (*step)++, KV_HEADS * BLOCK);
      vec even, odd;
      widen(pool + rows[j] + HALF + h * HEAD_DIM + c, &even, &odd);
      UNROLL for (int g = 0; g < GROUP; g++) {
        vec b = _mm256_broadcast_ss(p + g * CHUNK + j);
        o[g][0] = _mm256_fmadd_ps(even, b, o[g][0]);
        o[g][1] = _mm256_fmadd_ps(odd, b, o[g][1]);
      }
    }
    UNROLL for (int g = 0; g < GROUP; g++) {
      _mm256_store_ps(acc + g * HEAD_DIM + c, o[g][0]);
      _mm256_store_ps(acc + g * HEAD_DIM + c + 8, o[g][1]);
    }
  }
}

/* One chunk of CHUNK tokens (rows[j]: where token j's K row starts; its V
   row is HALF further); next_k: the next chunk's first K block, or NULL. */
static void chunk(State *s, const bf16 *pool, const long *rows, const bf16 *next_k) {
  for (int jb = 0; jb < CHUNK; jb += BLOCK) {
    const bf16 *next = jb + BLOCK < CHUNK ? pool + rows[jb + BLOCK] : pool + rows[0] + HALF;
    int step = 0;
    for (int h = 0; h < KV_HEADS; h++)
      for (int j = jb; j < jb + BLOCK; j += 2) {
        prefetch_step(next, step++, KV_HEADS * BLOCK / 2);
        score_pair(s, pool, rows, h, j);
      }
  }
  softmax(s);
  for (int jb = 0; jb < CHUNK; jb += BLOCK) {
    const bf16 *next = jb + BLOCK < CHUNK ? pool + rows[jb + BLOCK] + HALF : next_k;
    int step = 0;
    for (int h = 0; h < KV_HEADS; h++) accumulate_block(s, pool, rows, h, jb, next, &step);
  }
}

/* One request over pages[npages]; out (if not NULL): o [ROWS, HEAD_DIM],
   rows in natural order. q: [ROWS, HEAD_DIM] in paired order. */
static void task(const bf16 *pool, const long *pages, int npages, const float *q, float *out) {
  State *s = aligned_alloc(64, sizeof(State));
  memcpy(s->q, q, sizeof(s->q));
  memset(s->acc, 0, sizeof(s->acc));
  for (int r = 0; r < ROWS; r++) s->m[r] = -INFINITY, s->l[r] = 0;
  long rows[CHUNK];
  int tokens = npages * PAGE_SIZE;
  for (int t0 = 0; t0 < tokens; t0 += CHUNK) {
    for (int j = 0; j < CHUNK; j++)
      rows[j] = pages[(t0 + j) / PAGE_SIZE] * PAGE + (t0 + j) % PAGE_SIZE * TOKEN;
    int next = t0 + CHUNK;
    chunk(s, pool, rows, next < tokens ? pool + pages[next / PAGE_SIZE] * PAGE : NULL);
  }
  if (out)
    for (int r = 0; r < ROWS; r++)
      for (int c = 0; c < HEAD_DIM; c += 16)
        for (int i = 0; i < 8; i++) {
          out[r * HEAD_DIM + c + 2 * i] = s->acc[r * HEAD_DIM + c + i] / s->l[r];
          out[r * HEAD_DIM + c + 2 * i + 1] = s->acc[r * HEAD_DIM + c + 8 + i] / s->l[r];
        }
  free(s);
}

static double bf16_value(bf16 x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* max |o - reference| of task()'s out, the reference in float64:
   o[r] = sum_t 2^(s_t - max) v_t / sum_t 2^(s_t - max), s_t = q[r] . k_t */
static double max_error(const bf16 *pool, const long *pages, int npages, const float *q,
                        const float *out) {
  int tokens = npages * PAGE_SIZE;
  double worst = 0, *w = malloc(tokens * sizeof(double));
  for (int r = 0; r < ROWS; r++) {
    int h = r / GROUP;
    double top = -INFINITY, total = 0;
    for (int t = 0; t < tokens; t++) {
      const bf16 *k = pool + pages[t / PAGE_SIZE] * PAGE + t % PAGE_SIZE * TOKEN + h * HEAD_DIM;
      w[t] = 0;
      for (int i = 0; i < HEAD_DIM; i++) w[t] += (double)q[r * HEAD_DIM + i] * bf16_value(k[i]);
      top = fmax(top, w[t]);
    }
    for (int t = 0; t < tokens; t++) total += w[t] = exp2(w[t] - top);
    for (int i = 0; i < HEAD_DIM; i++) {
      double o = 0;
      for (int t = 0; t < tokens; t++)
        o += w[t] * bf16_value(pool[pages[t / PAGE_SIZE] * PAGE + HALF + t % PAGE_SIZE * TOKEN +
                                    h * HEAD_DIM + i]);
      worst = fmax(worst, fabs(o / total - out[r * HEAD_DIM + i]));
    }
  }
  free(w);
  return worst;
}

typedef struct {
  const bf16 *pool;
  const long *table;
  int requests, pages_per_request, thread, threads;
  const float *q;
} Work;

static void *decode_requests(void *x) {
  Work *a = x;
  for (int b = a->thread; b < a->requests; b += a->threads)
    task(a->pool, a->table + (long)b * a->pages_per_request, a->pages_per_request, a->q, NULL);
  return NULL;
}

static volatile float sink;
static void *read_pool(void *x) {
  Work *a = x;
  long n = (long)a->requests * a->pages_per_request * PAGE;
  long lo = n * a->thread / a->threads, hi = n * (a->thread + 1) / a->threads;
  vec s[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (long i = lo; i < hi; i += 64)
    UNROLL for (int k = 0; k < 4; k++)
      s[k] = _mm256_add_ps(s[k], _mm256_loadu_ps((const float *)(a->pool + i + 16 * k)));
  sink = sum_lanes(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])));
  return NULL;
}

static double seconds(void *(*fn)(void *), Work w, int threads) {
  pthread_t th[8];
  Work a[8];
  double t0 = now();
  for (int t = 0; t < threads; t++) {
    a[t] = w;
    a[t].thread = t;
    a[t].threads = threads;
    pthread_create(&th[t], NULL, fn, &a[t]);
  }
  for (int t = 0; t < threads; t++) pthread_join(th[t], NULL);
  return now() - t0;
}

static uint32_t lcg = 12345;
static uint32_t next_random(void) { return lcg = lcg * 1664525u + 1013904223u; }

int main(void) {
  int requests = 32, pages_per_request = 2048 / PAGE_SIZE, num_pages = requests * pages_per_request;
  long bytes = (long)num_pages * PAGE * sizeof(bf16);
  bf16 *pool = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  /* bfloat16 of either sign, magnitudes 2^-7 to 2^-5 */
  for (long i = 0; i < bytes / 2; i++) {
    uint32_t x = next_random();
    pool[i] = 0x3c00 + (x >> 24) + ((x >> 8) & 0x8000);
  }
  /* pages in random order (Fisher-Yates), as a long-running server's pool ends up */
  long *table = malloc(num_pages * sizeof(long)), *hot = malloc(num_pages * sizeof(long));
  for (int i = 0; i < num_pages; i++) table[i] = i, hot[i] = i % 4;
  for (int i = num_pages - 1; i > 0; i--) {
    int j = next_random() % (i + 1);
    long t = table[i];
    table[i] = table[j];
    table[j] = t;
  }
  float *q = malloc(ROWS * HEAD_DIM * 4), *paired = aligned_alloc(64, ROWS * HEAD_DIM * 4);
  float *out = malloc(ROWS * HEAD_DIM * 4);
  for (int i = 0; i < ROWS * HEAD_DIM; i++) q[i] = ((int)(next_random() >> 16) - 32768) / 256.0f;
  for (int i = 0; i < ROWS * HEAD_DIM; i += 16)
    for (int k = 0; k < 8; k++) paired[i + k] = q[i + 2 * k], paired[i + 8 + k] = q[i + 2 * k + 1];
  task(pool, table, pages_per_request, paired, out);
  printf("request 0 against the float64 reference: max |error| %.2e\n",
         max_error(pool, table, pages_per_request, q, out));
  Work all = {pool, table, requests, pages_per_request, 0, 1, paired};
  Work some = all, in_l2 = all;
  some.requests = in_l2.requests = 8;
  in_l2.table = hot;
  for (int rep = 0; rep < 5; rep++) {
    double kernel = seconds(decode_requests, all, 2), read = seconds(read_pool, all, 2);
    double one = seconds(decode_requests, some, 1), l2 = seconds(decode_requests, in_l2, 1);
    printf("both cores %.1f GB/s, plain read %.1f: %.2f of it | one core %.1f GB/s | "
           "pool in L2, one core: %.1f ns per (token, KV head)\n",
           bytes / kernel * 1e-9, bytes / read * 1e-9, read / kernel, bytes / 4.0 / one * 1e-9,
           l2 / (8.0 * pages_per_request * PAGE_SIZE * KV_HEADS) * 1e9);
  }
  return 0;
}
