/* tracefp4's CPU kernels, one translation unit (the library tracefp4.formats.clib builds and loads):
 * the grouped GEMM over packed FP4 weights described below (tiles.h, panels.h), and the one-pass
 * kernels of a rollout's other steps: the sites' NVFP4 quantization (site_quant.h), the other CPU
 * quantizers (cpu_quant.h: the per-tensor amax pass, dequantization, guided rounding, the low-bit
 * hint), the top-k combine (combine.h), the SiLU gate (silu_gate.h) and attention over a packed FP4
 * K/V cache (kv_attention.h). The headers hold the kernels as static functions; this file holds
 * every exported entry point (tfp4_*: argument checks, thread split, path choice) and the CPU
 * feature checks.
 *
 * The GEMM: bf16 activations times packed FP4 weights (NVFP4 or MXFP4), grouped by expert.
 *
 *   out[r, n] = bf16_rne( fl32( sum_k x[r, k] * w_e[n, k] ) / divisor[e] )   for rows r of expert e
 *
 * where w_e[n, k] = value(code) * scale(block) is the weight without its global scale: the E2M1
 * value of the 4-bit code times the block scale (E4M3 for NVFP4, E8M0 for MXFP4, as float32 values
 * through `lut`), and divisor[e] the expert's FP32 global encode scale S_enc (1 for MXFP4).
 *
 * Exactness (why the result is the GEMM of the exact dequantized operands up to accumulation
 * order): the product of a bf16 activation and an E2M1 value is exact in float32 (8 + 2 significant
 * bits), and so is its product with a block scale (+ 4 bits), so the only roundings are those of the
 * float32 additions, of the division and of the final bf16 rounding (round-to-nearest-even,
 * subnormals kept, NaN -> 0x7FC0, as torch's cast).
 *
 * Two layouts of the codes (tracefp4.formats.clib.layout.Layout), the same codes two per byte with the
 * bytes permuted; each has its kernels in a file of its own, included here (one translation unit):
 *
 * tiles.h, for CPUs without AMX (AVX-512 BF16 or portable C): the blocks of a weight row are taken
 * 16 at a time (a "super-group" q; the last one may have fewer, its missing lanes zero), each
 * super-group as G = block/4 groups p of 32 bytes, and byte 2l+i of group p holds elements 4p+2i and
 * 4p+2i+1 of block 16q+l (low nibble first), i.e. standard byte (block/2)(16q+l) + 2p + i.
 * Zero-extended to words, the low nibbles are 32 "even" and the high nibbles 32 "odd" code indices
 * whose word pairs 2l, 2l+1 both belong to block 16q+l: lane l of every vdpbf16ps of the super-group
 * sums products of block 16q+l only, so the block scales multiply the super-group's float32 partial
 * sums lane by lane, once, and the E2M1 table (vpermw) never changes. The rows of 4 consecutive
 * output columns (a tile) are interleaved group by group, so a tile's codes are read as one
 * sequential stream. The activation rows are permuted the same way once per call. codes
 * [E, N/4, S*G, 4, 32] bytes (S = ceil(K/block/16): tile, group, column, byte), scales [E, N, K/block].
 *
 * panels.h, for CPUs with AMX (and an AVX-512 BF16 kernel for experts with one or two rows): the output
 * columns in panels of 16 and, within a panel, the code bytes of each quad (4 elements, two bytes) of
 * the 16 columns together: codes [E, N/16, K/4, 32], byte (e, p, t, 2c+h) = standard byte 2t+h of
 * column 16p + c; scales [E, N/16, K/block, 16], (e, p, b, c) = block b of column 16p + c. Widened to
 * words, a quad's 32 bytes decode with two vpermw to the 16 columns' bf16 pairs (w[4t], w[4t+2]) and
 * (w[4t+1], w[4t+3]): two rows of an AMX B tile (VNNI order) once multiplied by the block scales, or
 * two vdpbf16ps per row for the AVX-512 path, with the activation rows permuted to match.
 *
 * Layout of the rest (row-major, contiguous): x [R, K] bf16 bits, rows grouped by expert, expert e
 * owning rows offsets[e] .. offsets[e+1]-1; divisor [E]; out [R, N] bf16 bits. The routed entry
 * (tfp4_routed_gemm) takes the (token, slot) pairs' expert ids instead of grouped rows and offsets:
 * it groups the pairs by expert itself, reads each pair's activation row where it is and writes its
 * output row in pair order (no gather or scatter around the call).
 *
 * Implementations, chosen at run time: portable C (float32 products and sums), AVX-512 BF16
 * (vdpbf16ps: DAZ/FTZ, so activations and products below 2^-126 count as zero) and, for the panels
 * layout, AMX (tdpbf16ps, the same DAZ/FTZ). They differ only in the order and grouping of the
 * float32 additions. Work is split over (expert, tile) or (expert, panel pair) items, contiguous
 * ranges per thread; each output is computed by one thread in a fixed order, so the result does not
 * depend on the thread count (it may depend on how many rows share the expert: that picks the path).

 */
#define _DEFAULT_SOURCE /* syscall() */
#include "fp4_common.h"
#include "panels.h"
#include "site_quant.h"
#include "cpu_quant.h"
#include "combine.h"
#include "silu_gate.h"
#include "kv_attention.h"
#include "tiles.h"
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* This thread's items. */
static int run_items(const job_t *j, scratch_t *mem) { return j->layout ? panels_run(j, mem) : tiles_run(j, mem); }

/* The cost of one item of an expert with `rows` rows (the split over threads). */
static inline int64_t item_cost(const job_t *j, int64_t rows) { return j->layout ? panel_pair_cost(j, rows) : rows + 1; }

/* --- a persistent thread pool: started once, woken per call (a thread start per call would cost
 * more than a decode step's GEMM); calls are serialised; the pool is rebuilt after a fork. */

#define MAX_THREADS 64
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static scratch_t pool_scratch[MAX_THREADS];
#if !defined(_OPENMP)
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t start_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static int pool_size = 0, active = 0, remaining = 0, failed = 0, atfork_set = 0;
static long generation = 0;
static const job_t *pool_jobs = NULL;

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg;
    long seen = 0;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (generation == seen) pthread_cond_wait(&start_cv, &pool_mu);
        seen = generation;
        if (id >= active) continue;
        const job_t *job = &pool_jobs[id];
        pthread_mutex_unlock(&pool_mu);
        int rc = run_items(job, &pool_scratch[id]);
        pthread_mutex_lock(&pool_mu);
        if (rc) failed = rc;
        if (--remaining == 0) pthread_cond_signal(&done_cv);
    }
    return NULL;
}

static void after_fork_in_child(void) { /* the child has no pool threads: start afresh */
    pthread_mutex_init(&call_mu, NULL);
    pthread_mutex_init(&pool_mu, NULL);
    pthread_cond_init(&start_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    pool_size = 0;
    generation = 0;
}
#endif

/* Run jobs[0..threads) on the caller and the pool; returns the first error code. Built with OpenMP
 * (-fopenmp), the threads are those of the process's OpenMP runtime, which is PyTorch's own when
 * torch is loaded first (its libgomp.so.1 answers our dependency): the same threads run torch's ops
 * and ours, so neither spins on the cores while the other works. */
static int run_parallel(const job_t *jobs, int threads) {
#if defined(_OPENMP)
    int rc = 0;
    pthread_mutex_lock(&call_mu);
#pragma omp parallel num_threads(threads) reduction(min : rc)
    {
        int id = omp_get_thread_num();
        if (id < threads) rc = run_items(&jobs[id], &pool_scratch[id]);
    }
    pthread_mutex_unlock(&call_mu);
    return rc;
#else
    pthread_mutex_lock(&call_mu);
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_set = 1;
    }
    while (pool_size < threads - 1) { /* worker ids 1..: the caller is 0 */
        pthread_t tid;
        if (pthread_create(&tid, NULL, worker, (void *)(intptr_t)(pool_size + 1)) != 0) break;
        pthread_detach(tid);
        pool_size++;
    }
    if (threads > pool_size + 1) threads = pool_size + 1;
    pthread_mutex_lock(&pool_mu);
    pool_jobs = jobs;
    active = threads;
    remaining = threads - 1;
    failed = 0;
    generation++;
    pthread_cond_broadcast(&start_cv);
    pthread_mutex_unlock(&pool_mu);
    int rc = run_items(&jobs[0], &pool_scratch[0]);
    pthread_mutex_lock(&pool_mu);
    while (remaining > 0) pthread_cond_wait(&done_cv, &pool_mu);
    if (!rc) rc = failed;
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&call_mu);
    return rc;
#endif
}

/* 1 if this CPU runs the AVX-512 BF16 path. */
int tfp4_has_avx512bf16(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

/* The AVX-512 flag of the one-pass kernels (sites, combine, SiLU gate) for `impl` (0 the best this
 * CPU runs, 1 portable C, 2 AVX-512): 1 or 0, or -1 for an implementation unknown or not run here. */
static int one_pass_avx(int impl) {
    if (impl < 0 || impl > 2 || (impl == 2 && !tfp4_has_avx512bf16())) return -1;
    return impl == 2 || (impl == 0 && tfp4_has_avx512bf16());
}

/* 1 if this CPU and OS run the AMX path: CPUID's AMX-BF16 and AMX-TILE, and Linux's permission for
 * the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: Linux 5.16 and later;
 * asked once, granted for the whole process and its children). */
int tfp4_has_amx(void) {
#if defined(__x86_64__) && defined(__linux__) && defined(TFP4_AMX)
    static int state = -1;
    if (state < 0) {
        unsigned a, b, c, d;
        int ok = tfp4_has_avx512bf16() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1);
        if (ok) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        state = ok;
    }
    return state;
#else
    return 0;
#endif
}

/* Code bytes per weight row in the tiles layout. */
int64_t tfp4_code_bytes(int64_t k, int block) { return (k / block + 15) / 16 * (block / 4) * 32; }

/* `impl`: 0 best available, 1 portable, 2 AVX-512 BF16, 3 AMX (panels; every expert, whatever its rows). */
static int check_shapes(int64_t rows, int64_t experts, int64_t n, int64_t k, int block, int layout, int impl) {
    if (rows < 0 || experts < 1 || (block != 16 && block != 32) || k < block || k % block) return -1;
    if (layout == 0 ? (n < NT || n % NT) : layout == 1 ? (n < NC || n % NC) : 1) return -1;
    if (impl < 0 || impl > 3 || (impl == 2 && !tfp4_has_avx512bf16()) || (impl == 3 && (layout != 1 || !tfp4_has_amx())))
        return -1;
    return 0;
}

static int grouped(const uint16_t *x, const int64_t *offsets, const int64_t *rowmap, int64_t fanout,
                   const uint8_t *codes, const uint8_t *scales, const float *lut, int block, const float *divisor,
                   uint16_t *out, int64_t rows, int64_t experts, int64_t n, int64_t k, int layout, int threads, int impl) {
    if (offsets[0] != 0 || offsets[experts] != rows) return -2;
    int64_t used = 0;
    for (int64_t e = 0; e < experts; e++) {
        if (offsets[e + 1] < offsets[e]) return -2;
        used += offsets[e + 1] > offsets[e];
    }
    if (rows == 0) return 0;
    int64_t *ex = malloc(sizeof(int64_t) * 3 * (size_t)used);
    if (!ex) return -3;
    int64_t *lo = ex + used, *hi = lo + used, g = 0;
    for (int64_t e = 0; e < experts; e++)
        if (offsets[e + 1] > offsets[e]) {
            ex[g] = e;
            lo[g] = offsets[e];
            hi[g] = offsets[e + 1];
            g++;
        }
    const int avx = impl == 2 || (impl != 1 && tfp4_has_avx512bf16());
    const int amx = layout == 1 && (impl == 3 || (impl == 0 && tfp4_has_amx()));
    const int64_t panels = n / NC, cols = layout ? 2 * NC : NT; /* output columns per item */
    job_t base = {.x = x, .codes = codes, .scales = scales, .lut = lut, .divisor = divisor, .out = out, .n = n,
                  .k = k, .block = block, .layout = layout, .supers = (k / block + 15) / 16,
                  .cbytes = tfp4_code_bytes(k, block), .panels = panels, .ex = ex, .ex_lo = lo, .ex_hi = hi,
                  .items_per_expert = layout ? (panels + 1) / 2 : n / NT, .avx = avx, .amx = amx,
                  .amx_min_rows = impl == 3 ? 1 : AMX_MIN_ROWS, .rowmap = rowmap, .fanout = fanout};
    const int64_t items = used * base.items_per_expert;
    /* a woken thread costs about as much as 128 output columns of one row: less work stays on one */
    if (threads > items * cols / 128) threads = (int)(items * cols / 128);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* split the items by their cost, so that experts with many rows do not leave the other threads
     * waiting (a tile costs about one row's work to decode plus its rows; panel pairs: panel_pair_cost) */
    job_t jobs[MAX_THREADS];
    int64_t total = 0;
    for (int64_t q = 0; q < used; q++) total += base.items_per_expert * item_cost(&base, hi[q] - lo[q]);
    int64_t item = 0, cost = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = base;
        jobs[t].item_lo = item;
        const int64_t target = total * (t + 1) / threads;
        while (item < items && (t == threads - 1 || cost < target)) {
            const int64_t g = item / base.items_per_expert;
            cost += item_cost(&base, hi[g] - lo[g]);
            item++;
        }
        jobs[t].item_hi = item;
    }
    int rc;
    if (threads == 1) {
        pthread_mutex_lock(&call_mu);
        rc = run_items(&jobs[0], &pool_scratch[0]);
        pthread_mutex_unlock(&call_mu);
    } else {
        rc = run_parallel(jobs, threads);
    }
    free(ex);
    return rc;
}

/* Returns 0, or a negative code: -1 bad shapes, -2 bad offsets, -3 out of memory, -4 thread error.
 * `layout`: 0 tiles, 1 panels; `impl`: see check_shapes (refused with -1 where unavailable). */
int tfp4_grouped_gemm(const uint16_t *x, const int64_t *offsets, const uint8_t *codes, const uint8_t *scales,
                      const float *lut, int block, const float *divisor, uint16_t *out, int64_t rows,
                      int64_t experts, int64_t n, int64_t k, int layout, int threads, int impl) {
    int rc = check_shapes(rows, experts, n, k, block, layout, impl);
    return rc ? rc
              : grouped(x, offsets, NULL, 1, codes, scales, lut, block, divisor, out, rows, experts, n, k, layout,
                        threads, impl);
}

/* The routed form: `ids` [pairs] is the expert of each (token, slot) pair f = token * fanout + slot, in
 * pair order; pair f reads x row f / fanout (fanout = top-k: one row per token, the gate-up GEMM; 1: one
 * row per pair, the down GEMM) and writes out row f ([pairs, n]). The pairs are grouped by expert
 * here (a stable counting sort), so the caller neither sorts nor gathers nor scatters rows.
 * Returns what tfp4_grouped_gemm returns, or -5 when an id is outside [0, experts) (`bad`: the first
 * such pair). */
int tfp4_routed_gemm(const uint16_t *x, const int64_t *ids, int64_t fanout, const uint8_t *codes,
                     const uint8_t *scales, const float *lut, int block, const float *divisor, uint16_t *out,
                     int64_t pairs, int64_t experts, int64_t n, int64_t k, int layout, int threads, int impl,
                     int64_t *bad) {
    int rc = check_shapes(pairs, experts, n, k, block, layout, impl);
    if (rc) return rc;
    if (fanout < 1 || pairs % fanout) return -1;
    for (int64_t f = 0; f < pairs; f++)
        if (ids[f] < 0 || ids[f] >= experts) {
            *bad = f;
            return -5;
        }
    int64_t *offsets = calloc((size_t)(experts + 1) + (size_t)pairs, sizeof(int64_t));
    if (!offsets) return -3;
    int64_t *order = offsets + experts + 1;
    for (int64_t f = 0; f < pairs; f++) offsets[ids[f] + 1]++;
    for (int64_t e = 0; e < experts; e++) offsets[e + 1] += offsets[e];
    int64_t *next = malloc(sizeof(int64_t) * (size_t)experts);
    if (!next) {
        free(offsets);
        return -3;
    }
    memcpy(next, offsets, sizeof(int64_t) * (size_t)experts);
    for (int64_t f = 0; f < pairs; f++) order[next[ids[f]]++] = f;
    free(next);
    rc = grouped(x, offsets, order, fanout, codes, scales, lut, block, divisor, out, pairs, experts, n, k, layout,
                 threads, impl);
    free(offsets);
    return rc;
}

/* The thread count of a call over `items` independent items: at least 1, at most one an item. */
static int cq_threads(int threads, int64_t items) {
    if (threads < 1 || items < 2) return 1;
    if (threads > items) threads = (int)items;
    return threads > MAX_THREADS ? MAX_THREADS : threads;
}

/* NVFP4 quantization of bf16 (or, f32, float32) rows x [rows, k] (site_quant.h): codes [rows, k/2], E4M3 scale bytes
 * [rows, k/16], the row amaxes (own_amax: found and written; else read) and, unless values is NULL,
 * the dequantized rows in bf16 [rows, k] (bf16 input only). impl: 0 the best this CPU runs, 1 portable C, 2 AVX-512.
 * Rows are split in contiguous ranges over `threads` OpenMP threads (one where built without
 * OpenMP); each row is computed the same way whatever the split. *bad: the first row holding a NaN
 * or Inf, or -1. Returns 0, -1 (k not a multiple of 16, or an implementation this CPU lacks) or -3
 * (out of memory). */
static int nvfp4_quantize(const void *x, int f32, int64_t rows, int64_t k, float *amax, int own_amax,
                          const uint32_t *bm_in, uint8_t *codes, uint8_t *scales, uint16_t *values, int threads,
                          int impl, int64_t *bad) {
    *bad = -1;
    const int avx = one_pass_avx(impl);
    if (k <= 0 || k % 16 || rows < 0 || avx < 0 || (f32 && values)) return -1;
    if (threads < 1) threads = 1;
    if (threads > rows) threads = rows > 0 ? (int)rows : 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
#if !defined(_OPENMP)
    threads = 1;
#endif
    sq_job_t jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++)
        jobs[t] = (sq_job_t){x, f32, k, rows * t / threads, rows * (t + 1) / threads, amax, own_amax, avx,
                             bm_in, codes, scales, values, -1};
    int rc = 0;
    if (threads == 1) {
        rc = sq_run(&jobs[0]);
    } else {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) reduction(min : rc)
        {
            int id = omp_get_thread_num();
            if (id < threads) rc = sq_run(&jobs[id]);
        }
#endif
    }
    for (int t = 0; t < threads && *bad < 0; t++) *bad = jobs[t].bad;
    return rc;
}

int tfp4_nvfp4_quantize(const uint16_t *x, int64_t rows, int64_t k, float *amax, int own_amax, uint8_t *codes,
                        uint8_t *scales, uint16_t *values, int threads, int impl, int64_t *bad) {
    return nvfp4_quantize(x, 0, rows, k, amax, own_amax, NULL, codes, scales, values, threads, impl, bad);
}

/* tfp4_nvfp4_quantize of float32 rows: codes and scales only. */
int tfp4_nvfp4_quantize_f32(const float *x, int64_t rows, int64_t k, float *amax, int own_amax, uint8_t *codes,
                            uint8_t *scales, int threads, int impl, int64_t *bad) {
    return nvfp4_quantize(x, 1, rows, k, amax, own_amax, NULL, codes, scales, NULL, threads, impl, bad);
}

/* The two passes of a per-tensor NVFP4 quantize of bf16 (f32 = 0) or float32 rows x [rows, k].
 * tfp4_block_amax: every block's amax pattern into block_amax [rows, k/16] and the largest into *top
 * (above the format's largest finite pattern: a NaN or Inf; the caller refuses it before pass two).
 * tfp4_nvfp4_quantize_blocks: tfp4_nvfp4_quantize on the given row amaxes, the blocks' amaxes read
 * from block_amax instead of found again. Rows split over `threads` OpenMP threads; impl as
 * tfp4_nvfp4_quantize's. Return 0, -1 or -3. */
int tfp4_block_amax(const void *x, int f32, int64_t rows, int64_t k, uint32_t *block_amax, int threads, int impl,
                    uint32_t *top) {
    const int avx = one_pass_avx(impl);
    if (k <= 0 || k % 16 || rows < 0 || avx < 0) return -1;
    threads = cq_threads(threads, rows);
    const int64_t nb = k / 16;
    uint32_t m = 0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : m) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x16 = (const uint16_t *)x + r * k;
        const uint32_t *x32 = (const uint32_t *)x + r * k;
        uint32_t v;
#if defined(__x86_64__)
        if (avx) v = f32 ? sq_block_amax_avx32(x32, nb, block_amax + r * nb) : sq_block_amax_avx(x16, nb, block_amax + r * nb);
        else
#endif
            v = f32 ? sq_block_amax_portable32(x32, nb, block_amax + r * nb)
                    : sq_block_amax_portable(x16, nb, block_amax + r * nb);
        m = v > m ? v : m;
    }
    *top = m;
    return 0;
}

int tfp4_nvfp4_quantize_blocks(const void *x, int f32, int64_t rows, int64_t k, float *amax, const uint32_t *block_amax,
                               uint8_t *codes, uint8_t *scales, uint16_t *values, int threads, int impl) {
    int64_t bad;
    return nvfp4_quantize(x, f32, rows, k, amax, 0, block_amax, codes, scales, values, threads, impl, &bad);
}

/* The per-tensor amax pass (cpu_quant.h): the largest abs pattern of n bf16 (f32 = 0) or float32
 * (f32 = 1) elements into *top (above the format's largest finite pattern: a NaN or Inf). The
 * elements are split in contiguous ranges over `threads` OpenMP threads; a max does not depend on
 * the split. impl as tfp4_nvfp4_quantize's. Returns 0 or -1. */
int tfp4_abs_max(const void *x, int64_t n, int f32, int threads, int impl, uint32_t *top) {
    const int avx = one_pass_avx(impl);
    if (n < 0 || avx < 0) return -1;
    threads = cq_threads(threads, n / 4096);
    const int64_t size = f32 ? 4 : 2;
    uint32_t m = 0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) reduction(max : m) if (threads > 1)
#endif
    for (int t = 0; t < threads; t++) {
        const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
        const char *p = (const char *)x + lo * size;
        uint32_t v;
#if defined(__x86_64__)
        if (avx) v = cq_abs_max_avx(p, hi - lo, f32);
        else
#endif
            v = cq_abs_max_portable(p, hi - lo, f32);
        m = v > m ? v : m;
    }
    *top = m;
    return 0;
}

/* Dequantization (cpu_quant.h): code rows [rows, k/2], scale bytes [rows, k/block] (block 16 or 32)
 * with their float32 values `lut` [256], row divisors [rows] -> float32 [rows, k], or with bf16 set
 * those values rounded to bf16 [rows, k] (half the bytes written). Rows are split over `threads`
 * OpenMP threads. impl as tfp4_nvfp4_quantize's. Returns 0 or -1. */
int tfp4_dequantize(const uint8_t *codes, const uint8_t *scales, const float *lut, const float *row_div, int64_t rows,
                    int64_t k, int block, void *out, int bf16, int threads, int impl) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || k <= 0 || (block != 16 && block != 32) || k % block || avx < 0) return -1;
    threads = cq_threads(threads, rows);
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#if defined(__x86_64__)
        cq_tables_t tables; /* this thread's: its rows' divisors */
        tables.valid = 0;
#endif
#if defined(_OPENMP)
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < rows; r++) {
            const uint8_t *c = codes + r * (k / 2), *s = scales + r * (k / block);
            void *o = (char *)out + r * k * (bf16 ? 2 : 4);
#if defined(__x86_64__)
            if (avx) {
                if (bf16) cq_dequant_row_bf16_avx(c, s, lut, row_div[r], k, block, o, &tables);
                else cq_dequant_row_avx(c, s, lut, row_div[r], k, block, o);
                continue;
            }
#endif
            cq_dequant_row_portable(c, s, lut, row_div[r], k, block, o, bf16);
        }
    }
    return 0;
}

/* Guided rounding (cpu_quant.h) of bf16 rows x [rows, k] on the grid of scale bytes [rows, k/block]
 * (values `lut` [256]) and s_dec [rows]; hint: low-bit rows [rows, k/8] (full = 0) or the rollout's
 * code rows [rows, k/2] (full = 1) -> code rows [rows, k/2], and bad [rows] (1 where the row holds a
 * NaN or Inf: its codes are garbage, the caller refuses it). Rows in contiguous ranges over `threads`
 * OpenMP threads. impl as tfp4_nvfp4_quantize's. Returns 0, -1 or -3 (out of memory). */
int tfp4_guided(const uint16_t *x, const uint8_t *scales, const float *lut, const float *s_dec, const uint8_t *hint,
                int full, int64_t rows, int64_t k, int block, uint8_t *codes, uint8_t *bad, int threads, int impl) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || k <= 0 || (block != 16 && block != 32) || k % block || avx < 0) return -1;
    threads = cq_threads(threads, rows);
    const int64_t nb = k / block, hint_bytes = full ? k / 2 : k / 8;
    int rc = 0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) reduction(min : rc) if (threads > 1)
#endif
    for (int t = 0; t < threads; t++) {
        float *enc = malloc((size_t)nb * sizeof(float));
        if (!enc) {
            rc = -3;
            continue;
        }
        for (int64_t r = rows * t / threads; r < rows * (t + 1) / threads; r++) {
            uint32_t top;
#if defined(__x86_64__)
            if (avx) cq_encode_factors_avx(scales + r * nb, lut, s_dec[r], nb, enc);
            else
#endif
                cq_encode_factors(scales + r * nb, lut, s_dec[r], nb, enc);
#if defined(__x86_64__)
            if (avx) top = cq_guided_row_avx(x + r * k, enc, k, block, hint + r * hint_bytes, full, codes + r * (k / 2));
            else
#endif
                top = cq_guided_row_portable(x + r * k, enc, k, block, hint + r * hint_bytes, full, codes + r * (k / 2));
            bad[r] = top > SQ_LIMIT;
        }
        free(enc);
    }
    return rc;
}

/* MXFP4 quantization (cpu_quant.h) of bf16 (f32 = 0) or float32 rows x [rows, k] (k a multiple of 32):
 * codes [rows, k/2], biased E8M0 exponents [rows, k/32] (rceil: the RCEIL rule, else floor) and
 * bad [rows] (1 where the row holds a NaN or Inf: its outputs are garbage, the caller refuses it).
 * Rows in contiguous ranges over `threads` OpenMP threads. impl as tfp4_nvfp4_quantize's.
 * Returns 0, -1 or -3 (out of memory). */
int tfp4_mxfp4_quantize(const void *x, int f32, int64_t rows, int64_t k, int rceil, uint8_t *codes, uint8_t *scales,
                        uint8_t *bad, int threads, int impl) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || k <= 0 || k % 32 || avx < 0) return -1;
    threads = cq_threads(threads, rows);
    const uint32_t limit = f32 ? SQ_LIMIT32 : SQ_LIMIT;
    const int64_t size = f32 ? 4 : 2;
    int rc = 0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) reduction(min : rc) if (threads > 1)
#endif
    for (int t = 0; t < threads; t++) {
        uint32_t *bm = malloc((size_t)(k / 16) * sizeof(uint32_t));
        if (!bm) {
            rc = -3;
            continue;
        }
        for (int64_t r = rows * t / threads; r < rows * (t + 1) / threads; r++) {
            const char *xr = (const char *)x + r * k * size;
            uint32_t top;
#if defined(__x86_64__)
            if (avx) top = cq_mx_row_avx(xr, f32, k, rceil, bm, codes + r * (k / 2), scales + r * (k / 32));
            else
#endif
                top = cq_mx_row_portable(xr, f32, k, rceil, bm, codes + r * (k / 2), scales + r * (k / 32));
            bad[r] = top > limit;
        }
        free(bm);
    }
    return rc;
}

/* FP8 E4M3 (cpu_quant.h) of bf16 (f32 = 0) or float32 rows x [rows, k]: codes [rows, k], the row
 * scales [rows] and bad [rows] (1 where the row holds a NaN or Inf: its outputs are garbage, the
 * caller refuses it). Rows over `threads` OpenMP threads; impl as tfp4_nvfp4_quantize's. Returns 0 or -1. */
int tfp4_fp8_quantize(const void *x, int f32, int64_t rows, int64_t k, uint8_t *codes, float *scale, uint8_t *bad,
                      int threads, int impl) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || k <= 0 || avx < 0) return -1;
    threads = cq_threads(threads, rows);
    const uint32_t limit = f32 ? SQ_LIMIT32 : SQ_LIMIT;
    const int64_t size = f32 ? 4 : 2;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * k * size;
        uint32_t top;
#if defined(__x86_64__)
        if (avx) top = cq_fp8_row_avx(xr, f32, k, codes + r * k, scale + r);
        else
#endif
            top = cq_fp8_row_portable(xr, f32, k, codes + r * k, scale + r);
        bad[r] = top > limit;
    }
    return 0;
}

/* FP8 dequantize (cpu_quant.h): codes [rows, k] with the float32 value of each code `lut` [256] and
 * the row scales [rows] -> float32 [rows, k]. Rows over `threads` OpenMP threads. Returns 0 or -1. */
int tfp4_fp8_dequantize(const uint8_t *codes, const float *lut, const float *scale, int64_t rows, int64_t k, float *out,
                        int threads, int impl) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || k <= 0 || avx < 0) return -1;
    threads = cq_threads(threads, rows);
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (avx) {
            cq_fp8_dequant_row_avx(codes + r * k, lut, scale[r], k, out + r * k);
            continue;
        }
#endif
        cq_fp8_dequant_row_portable(codes + r * k, lut, scale[r], k, out + r * k);
    }
    return 0;
}

/* The low magnitude bits of packed codes (cpu_quant.h): n code bytes (a multiple of 4) -> n/4 bytes,
 * element 8j+i in bit i of byte j. Split in contiguous ranges over `threads` OpenMP threads.
 * impl as tfp4_nvfp4_quantize's. Returns 0 or -1. */
int tfp4_lsb_bits(const uint8_t *codes, int64_t n, uint8_t *bits, int threads, int impl) {
    const int avx = one_pass_avx(impl);
    if (n < 0 || n % 4 || avx < 0) return -1;
    const int64_t nout = n / 4;
    threads = cq_threads(threads, nout / 4096);
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int t = 0; t < threads; t++) {
        const int64_t lo = nout * t / threads, hi = nout * (t + 1) / threads;
#if defined(__x86_64__)
        if (avx) {
            cq_lsb_avx(codes + 4 * lo, hi - lo, bits + lo);
            continue;
        }
#endif
        cq_lsb_portable(codes + 4 * lo, hi - lo, bits + lo);
    }
    return 0;
}

/* The top-k combine (combine.h): out bf16 [n, k, h], w float32 [n, k] -> res bf16 [n, h]; impl as
 * tfp4_nvfp4_quantize's. Tokens are split over `threads` OpenMP threads. Returns 0 or -1. */
int tfp4_topk_combine(const uint16_t *out, const float *w, int64_t n, int64_t k, int64_t h, uint16_t *res, int threads,
                      int impl) {
    const int avx = one_pass_avx(impl);
    if (n < 0 || k < 1 || h < 1 || avx < 0) return -1;
    if (threads < 1 || n < 2) threads = 1;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int64_t t = 0; t < n; t++) {
#if defined(__x86_64__)
        if (avx) {
            combine_rows_avx(out + t * k * h, w + t * k, k, h, res + t * h);
            continue;
        }
#endif
        combine_rows_portable(out + t * k * h, w + t * k, k, h, 0, h, res + t * h);
    }
    return 0;
}

/* The SiLU-gated activation (silu_gate.h): x bf16 [rows, 2 * inter] -> res bf16 [rows, inter], with
 * `table` torch's bf16 SiLU of every bf16 pattern (65536 entries and one of padding); impl as
 * tfp4_nvfp4_quantize's. Rows are split over `threads` OpenMP threads. Returns 0 or -1. */
int tfp4_silu_gate(const uint16_t *x, int64_t rows, int64_t inter, const uint16_t *table, uint16_t *res, int threads,
                   int impl) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || inter < 1 || avx < 0) return -1;
    if (threads < 1 || rows < 2) threads = 1;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
#if defined(__x86_64__)
        if (avx) {
            silu_row_avx(x + r * 2 * inter, inter, table, res + r * inter);
            continue;
        }
#endif
        silu_row_portable(x + r * 2 * inter, inter, table, res + r * inter, 0);
    }
    return 0;
}

/* The rows the attention kernel reads, as it decodes them (kv_attention.h): `rows` packed rows (codes
 * [rows, d/2], scale bytes [rows, d/fblock] through `lut`, amaxes [rows] or NULL) -> bf16 bits
 * [rows, d]. `key` 1 decodes as K rows (the AVX-512 path's bf16 decoding), 0 as V rows (its float32
 * decoding); the portable path has one. For the tests: the decode stage is exact on both paths, the
 * arithmetic after it is not the same. Returns 0, -1 (shapes or implementation) or -3 (memory). */
int tfp4_kv_decode_rows(const uint8_t *codes, const uint8_t *scales, const float *amax, int64_t rows, int64_t d,
                        const float *lut, int fblock, int key, int impl, uint16_t *out) {
    const int avx = one_pass_avx(impl);
    if (rows < 0 || d < 16 || d > KV_MAX_DIM || d % 16 || (fblock != 16 && fblock != 32) || d % fblock || avx < 0)
        return -1;
    kv_job_t j = {.lut = lut, .d = d, .fblock = fblock, .avx = avx, .scale_bits = kv_scale_bits_match(lut, fblock)};
    float *row = malloc(sizeof(float) * (size_t)d);
    if (!row) return -3;
    for (int64_t r = 0; r < rows; r++)
        kv_decode_row(&j, codes + r * d / 2, scales + r * (d / fblock), amax ? amax + r : NULL, key, row, out + r * d);
    free(row);
    return 0;
}

/* Attention over a packed FP4 K/V cache (kv_attention.h): q bf16 [rows, hq, d]; per slot and KV head
 * the K and V rows' codes [slots, hkv, d/2], scale bytes [slots, hkv, d/fblock] (values through
 * `lut`) and amaxes [slots, hkv] (NULL: no divisor, MXFP4); table int32 [seqs, max_blocks],
 * seq_lens int32 [seqs]; query row r attends to keys 0 .. q_len[r]-1 of sequence q_seq[r]; out
 * float32 [rows, hq, d]. impl as tfp4_nvfp4_quantize's; (row, KV head) items split in contiguous
 * ranges over `threads` OpenMP threads. Returns 0, -1 (shapes or implementation), -3 (out of
 * memory), -5 (a block id or sequence length out of range: *bad the sequence) or -6 (a query row's
 * sequence or key count out of range: *bad the row). */
int tfp4_kv_attention(const uint16_t *q, int64_t rows, int64_t hq, int64_t hkv, int64_t d, const uint8_t *kc,
                      const uint8_t *ks, const float *ka, const uint8_t *vc, const uint8_t *vs, const float *va,
                      const float *lut, int fblock, int64_t num_blocks, int block_size, const int32_t *table,
                      int64_t seqs, int64_t max_blocks, const int32_t *seq_lens, const int32_t *q_seq,
                      const int32_t *q_len, float scale, float *out, int threads, int impl, int64_t *bad) {
    *bad = -1;
    const int avx = one_pass_avx(impl);
    if (rows < 0 || hkv < 1 || hq % hkv || hq / hkv > KV_MAX_GROUP || d < 16 || d > KV_MAX_DIM || d % 16 ||
        (fblock != 16 && fblock != 32) || d % fblock || block_size < 1 || seqs < 0 || max_blocks < 0 || avx < 0)
        return -1;
    kv_job_t j = {q, kc, ks, vc, vs, ka, va, lut, table, q_seq, q_len, out, hq, hkv, d, max_blocks, block_size, fblock,
                  avx, kv_scale_bits_match(lut, fblock), scale, 0};
#if defined(__x86_64__)
    j.vbmi = avx && kv_has_vbmi();
#endif
    int rc = kv_check(&j, rows, seqs, seq_lens, num_blocks, bad);
    if (rc) return rc;
    const int64_t items = rows * hkv;
    if (threads < 1 || items < 2) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) reduction(min : rc) if (threads > 1)
    {
        const int id = omp_get_thread_num(), nt = omp_get_num_threads();
        rc = kv_run(&j, items * id / nt, items * (id + 1) / nt);
    }
#else
    rc = kv_run(&j, 0, items);
#endif
    return rc;
}
