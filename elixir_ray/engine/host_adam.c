/* The engine's CPU job for one host chunk in one pass over memory: AdamW (or Adam) from the
 * gradient, then the new master rounded into the upload copy.
 *
 * Through torch the same job is three passes: the bf16 gradient widened into an fp32 tile, torch's
 * fused Adam over the tile, and the master cast into the upload copy. Counted in host memory bytes
 * per parameter that is about 40 (2 + 4 + 4 read back, 16 read and 12 written by the update, 4 + 2
 * for the cast); here each element is read once and written once: 2 + 12 read, 12 + 2 written,
 * 28 bytes. The job is bound by host memory bandwidth, so bytes are time.
 *
 * The arithmetic is that of torch's fused CPU Adam, operation for operation, so the two give the
 * same bits (tests/test_host_kernel.py checks it against the torch installed): the engine's
 * Deep Optimizer States chunks, updated by torch, and its host chunks, updated here, stay exact
 * to each other. The bf16 rounding is torch's too: to nearest even, NaN to a quiet NaN. Compiled at first use by elixir_ray/engine/host_kernel.py (gcc -O3 -march=native, so
 * the loops are vectorised for the CPU that runs them); each call runs its range on `threads`
 * POSIX threads, and Python's ctypes drops the GIL for the whole call.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float *master, *exp_avg, *exp_avg_sq;
    const void *grad;      /* bf16 (grad_bf16 = 1) or fp32 */
    uint16_t *upload;      /* bf16 copy of the new master, or NULL */
    int64_t lo, hi;        /* the range `run` updates, in the shard's coordinates */
    int grad_bf16;
    /* as torch computes them: in double, then rounded to float once */
    float one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt, decay, coupled;
    float grad_factor;
} Job;

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

/* One loop per (gradient dtype, upload or not, Adam's coupled weight decay or not), each free of
 * branches so that the compiler vectorises it. Built with -ffp-contract=off: the fused
 * multiply-adds are written where torch's build contracts them (the lerp, the second moment,
 * Adam's weight decay), so that both give the same bits. */
#define ADAM_LOOP(LOAD_GRAD, COUPLED_DECAY, STORE_UPLOAD)                                   \
    for (int64_t i = lo; i < hi; i++) {                                                     \
        float p = master[i];                                                                \
        float g = (LOAD_GRAD) * factor;                                                     \
        COUPLED_DECAY;                                                                      \
        float a = fmaf(one_minus_beta1, g - m[i], m[i]); /* lerp, weight below 0.5 */       \
        float b = fmaf(one_minus_beta2 * g, g, v[i] * beta2);                               \
        float denom = sqrtf(b) / bc2_sqrt + eps;                                            \
        p = p * decay;                                                                      \
        p = p - step_size * a / denom;                                                      \
        m[i] = a;                                                                           \
        v[i] = b;                                                                           \
        master[i] = p;                                                                      \
        STORE_UPLOAD;                                                                       \
    }

#define BF16_GRAD bf16_to_float(g16[i])
#define FP32_GRAD g32[i]
#define COUPLED g = fmaf(p, coupled, g)
#define DECOUPLED (void)0
#define UPLOAD up[i] = float_to_bf16(p)
#define NO_UPLOAD (void)0

static void run(const Job *j) {
    const float one_minus_beta1 = j->one_minus_beta1, beta2 = j->beta2, one_minus_beta2 = j->one_minus_beta2;
    const float eps = j->eps, step_size = j->step_size, bc2_sqrt = j->bias_correction2_sqrt;
    const float decay = j->decay, coupled = j->coupled, factor = j->grad_factor;
    const int64_t lo = j->lo, hi = j->hi;
    float *restrict master = j->master, *restrict m = j->exp_avg, *restrict v = j->exp_avg_sq;
    const uint16_t *restrict g16 = (const uint16_t *)j->grad;
    const float *restrict g32 = (const float *)j->grad;
    uint16_t *restrict up = j->upload;
    const int low = j->grad_bf16, cast = up != NULL, adam = coupled != 0.0f;
    if (low && cast && adam) { ADAM_LOOP(BF16_GRAD, COUPLED, UPLOAD) }
    else if (low && cast) { ADAM_LOOP(BF16_GRAD, DECOUPLED, UPLOAD) }
    else if (low && adam) { ADAM_LOOP(BF16_GRAD, COUPLED, NO_UPLOAD) }
    else if (low) { ADAM_LOOP(BF16_GRAD, DECOUPLED, NO_UPLOAD) }
    else if (cast && adam) { ADAM_LOOP(FP32_GRAD, COUPLED, UPLOAD) }
    else if (cast) { ADAM_LOOP(FP32_GRAD, DECOUPLED, UPLOAD) }
    else if (adam) { ADAM_LOOP(FP32_GRAD, COUPLED, NO_UPLOAD) }
    else { ADAM_LOOP(FP32_GRAD, DECOUPLED, NO_UPLOAD) }
}

/* One thread's share: elements [from, to) of the segments laid end to end. */
typedef struct {
    Job job;
    const int64_t *bounds;  /* lo0, hi0, lo1, hi1, ... in the shard's coordinates */
    int segments;
    int64_t from, to;
    int64_t numel;  /* for the update's claims: all the elements, and the next block unclaimed */
    int64_t *next;
} Share;

static void run_share(Share *s) {
    int64_t at = 0;  /* where the current segment starts in the concatenation */
    for (int k = 0; k < s->segments && at < s->to; k++) {
        int64_t lo = s->bounds[2 * k], hi = s->bounds[2 * k + 1], len = hi - lo;
        int64_t a = s->from > at ? s->from - at : 0, b = s->to - at < len ? s->to - at : len;
        if (a < b) {
            s->job.lo = lo + a;
            s->job.hi = lo + b;
            run(&s->job);
        }
        at += len;
    }
}

static void *run_share_thread(void *arg) {
    run_share((Share *)arg);
    return NULL;
}

/* The update's threads claim blocks of `claim` elements (Share.from..to is the first one's size)
 * until none is left, rather than an even share each: the training thread, the CUDA driver's and
 * the copies' threads share the cores with them, and with even shares the whole update waits for
 * whichever thread lost the most time to them (on the H100 machine a host chunk's update ran 25%
 * slower during the forward, where the training thread is busiest, than in backward). Each
 * element's arithmetic is the same wherever it runs, so the result is too. */
static void *run_claims(void *arg) {
    Share *s = (Share *)arg;
    int64_t claim = s->to - s->from;
    for (;;) {
        int64_t from = __atomic_fetch_add(s->next, 1, __ATOMIC_RELAXED) * claim;
        if (from >= s->numel) return NULL;
        s->from = from;
        s->to = from + claim < s->numel ? from + claim : s->numel;
        run_share(s);
    }
}

#define MAX_THREADS 256
#define MIN_PER_THREAD 65536  /* below this a thread costs more than it saves */

/* How many threads `numel` elements get: `threads`, but no more than one per MIN_PER_THREAD. */
static int team_size(int64_t numel, int threads) {
    int64_t want = numel / MIN_PER_THREAD;
    int n = threads < 1 ? 1 : threads;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (want < n) n = want < 1 ? 1 : (int)want;
    return n;
}

/* Runs `fn` on each of `n` jobs laid `stride` bytes apart: jobs 1.. on threads of their own, job 0
 * on this one; a job whose thread could not start runs here afterwards. Returns how many could
 * not start. */
static int run_team(int n, void *(*fn)(void *), void *jobs, size_t stride) {
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int failed = 0;
    for (int t = 1; t < n; t++) {
        started[t] = pthread_create(&ids[t], NULL, fn, (char *)jobs + t * stride) == 0;
        failed += !started[t];
    }
    fn(jobs);
    for (int t = 1; t < n; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else fn((char *)jobs + t * stride);
    }
    return failed;
}

/* One Adam(W) step over `segments` ranges of one chunk's shard (bounds: lo, hi pairs), on up to
 * `threads` threads (this one included) claiming blocks of `claim` elements (`run_claims`; rounded
 * up to a multiple of 16, whole cache lines where segments allow), or with `claim` 0 an even share
 * each. `step` counts this update, 1 at the first. Returns 0, or the number of threads that could
 * not be started (this one claims, or runs the shares of, what they would have). */
int elixir_host_adam(float *master, const void *grad, int grad_bf16, float *exp_avg, float *exp_avg_sq,
                     uint16_t *upload, const int64_t *bounds, int segments, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, int decoupled, double grad_factor, int threads,
                     int64_t claim) {
    Job base = {master, exp_avg, exp_avg_sq, grad, upload, 0, 0, grad_bf16,
                (float)(1.0 - beta1), (float)beta2, (float)(1.0 - beta2), (float)eps,
                (float)(lr / (1.0 - pow(beta1, (double)step))), (float)sqrt(1.0 - pow(beta2, (double)step)),
                decoupled ? (float)(1.0 - lr * weight_decay) : 1.0f, decoupled ? 0.0f : (float)weight_decay,
                (float)grad_factor};
    int64_t numel = 0;
    for (int k = 0; k < segments; k++) numel += bounds[2 * k + 1] - bounds[2 * k];
    int n = team_size(numel, threads);
    Share shares[MAX_THREADS];
    int64_t next = 0;
    if (claim > 0) {
        if (claim > numel) claim = numel;  /* one block at most: no product below can overflow */
        claim = (claim + 15) & ~(int64_t)15;
        for (int t = 0; t < n; t++) {
            Share share = {base, bounds, segments, 0, claim, numel, &next};
            shares[t] = share;
        }
        return run_team(n, run_claims, shares, sizeof(Share));
    }
    int64_t per = (numel + n - 1) / n;
    per = (per + 15) & ~(int64_t)15;  /* whole cache lines of fp32 per thread, where segments allow */
    for (int t = 0; t < n; t++) {
        Share share = {base, bounds, segments, (int64_t)t * per < numel ? (int64_t)t * per : numel,
                       (int64_t)(t + 1) * per < numel ? (int64_t)(t + 1) * per : numel, numel, &next};
        shares[t] = share;
    }
    return run_team(n, run_share_thread, shares, sizeof(Share));
}

/* The sum of squares of a host gradient, for the global norm that clipping needs: done on the
 * training thread at step(), with every update waiting for it. Through torch (a tile widened to
 * fp64, then a dot product) it ran at about 0.1 G elements/s on the 2-core development VM; here
 * each element is read once and squared in double into eight running sums per thread (so that the
 * compiler can keep them in vector registers without reordering one sum). */
typedef struct {
    const void *x;
    int bf16;
    int64_t lo, hi;
    double sum;
} SquaresJob;

#define SQUARES_LOOP(LOAD)                                             \
    for (; i + 8 <= hi; i += 8) {                                      \
        for (int k = 0; k < 8; k++) {                                  \
            double v = (double)(LOAD(i + k));                          \
            acc[k] += v * v;                                           \
        }                                                              \
    }                                                                  \
    for (; i < hi; i++) {                                              \
        double v = (double)(LOAD(i));                                  \
        acc[0] += v * v;                                               \
    }

#define LOAD_BF16(at) bf16_to_float(x16[at])
#define LOAD_FP32(at) x32[at]

static void *sum_squares_range(void *arg) {
    SquaresJob *j = (SquaresJob *)arg;
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const uint16_t *restrict x16 = (const uint16_t *)j->x;
    const float *restrict x32 = (const float *)j->x;
    int64_t i = j->lo;
    const int64_t hi = j->hi;
    if (j->bf16) { SQUARES_LOOP(LOAD_BF16) }
    else { SQUARES_LOOP(LOAD_FP32) }
    j->sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    return NULL;
}

double elixir_sum_squares(const void *x, int bf16, int64_t numel, int threads) {
    int n = team_size(numel, threads);
    SquaresJob jobs[MAX_THREADS];
    int64_t per = (numel + n - 1) / n;
    for (int t = 0; t < n; t++) {
        SquaresJob job = {x, bf16, (int64_t)t * per < numel ? (int64_t)t * per : numel,
                          (int64_t)(t + 1) * per < numel ? (int64_t)(t + 1) * per : numel, 0.0};
        jobs[t] = job;
    }
    run_team(n, sum_squares_range, jobs, sizeof(SquaresJob));
    double total = 0.0;
    for (int t = 0; t < n; t++) total += jobs[t].sum;
    return total;
}
