/* Top-k and top-p of each row of logits, without sorting the vocabulary (worker, stage 6: the
 * sampler calls this for its rows that filter; see engine/worker/sampler.py).
 *
 * The semantics are the sorted reference's (sampler.py, apply_top_k_top_p_sorted): row r's
 * scores are logits[r] / temperature[r]; sorted largest first, a token is kept while it is among
 * the first top_k (0: no limit) and the probability mass strictly before it, renormalized over
 * those top_k tokens (over the whole row when top_k is 0), is below top_p (1: no limit); the
 * first token always stays.
 *
 * A row takes a few passes over its scores, each a loop the compiler vectorizes, and one sort
 * of a few candidates:
 *   1. the maximum logit, so the maximum score m;
 *   2. e[t] = exp(score[t] - m) and their sum;
 *   3. a search for the shallowest depth d below the maximum (to a quarter of a natural-log
 *      unit) whose tokens, those with e >= exp(-d), must hold every kept token: at least top_k
 *      of them, or, with top_k 0, at least top_p of the row's mass. Each try is one pass that
 *      counts them and sums their mass; d doubles from 0.5, then halves the last interval;
 *   4. those tokens are gathered and sorted, and the rule above walks them. Should rounding
 *      leave them a token short, a threshold twice as deep is gathered, at last the whole row.
 * A real model at temperature 0.8 puts a top-p 0.9 nucleus in a few dozen tokens: the sort is
 * of those, not of 49,152.
 *
 * Rows are spread over OpenMP threads. Compiled with -ffp-contract=off (the division by the
 * temperature and the sums round as torch's do) and -fno-trapping-math (so that the
 * exponential's floor vectorizes).
 *
 * Layouts (contiguous): logits [rows, vocab] float32; temperature, top_p [rows] float32;
 * top_k [rows] int64; out_values [rows, capacity] float32 (kept scores, largest first, -inf
 * after them); out_ids [rows, capacity] int64 (their token ids, 0 after them); out_counts [rows]
 * int64 (how many each row keeps); scratch float32, num_threads * 4 * vocab entries.
 * Returns 0; 2 when a row keeps more than `capacity` tokens (out_counts says how many: call
 * again with a wider output); 1 for arguments it refuses.
 */
#include <math.h> /* INFINITY */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

/* The search for the threshold: depths below the maximum score in natural-log units (a token
 * e^-d as likely as the top one), doubled from FIRST_DEPTH until the threshold holds enough,
 * then halved between the last two down to DEPTH_STEP. Past LAST_DEPTH: the whole row. */
#define FIRST_DEPTH 0.5f
#define LAST_DEPTH 32.0f
#define DEPTH_STEP 0.25f

typedef struct {
    float score; /* logit / temperature */
    float e;     /* exp(score - max) */
    int32_t id;  /* token id */
} Candidate;

/* Largest first; equal scores by token id, so that the order never depends on the thread. */
static int largest_first(const void *a, const void *b) {
    const Candidate *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Walk the sorted candidates by the rule above. Returns how many are kept, or -1 when the
 * candidates run out before the rule decides (a token past them might still be kept). */
static int64_t walk(const Candidate *c, int64_t n, int64_t vocab, int64_t k, float top_p,
                    float row_sum) {
    const int filter_p = top_p < 1.0f;
    const int64_t limit = n < k ? n : k;
    float norm = row_sum; /* top_k 0: renormalized over the whole row */
    if (k < vocab) {
        if (n < k && n < vocab) return -1; /* the top_k tokens are not all here */
        norm = 0.0f;
        for (int64_t i = 0; i < limit; i++) norm += c[i].e;
    }
    if (!filter_p) return limit;
    float mass = 0.0f;
    for (int64_t i = 0; i < limit; i++) {
        const float p = c[i].e / norm;
        mass += p;
        if (i > 0 && mass - p >= top_p) return i;
    }
    /* Every candidate kept: decided if top_k stops here, if the row is exhausted, or if the
     * next token would find the mass before it at top_p already. */
    if (limit == k || n == vocab || mass >= top_p) return limit;
    return -1;
}

/* Whether the tokens at most `depth` below the maximum can hold every kept token: at least k
 * of them, or, with top_k off, at least top_p of the row's mass (the walk decides exactly). */
static int holds_enough(const float *e, int64_t vocab, float depth, int64_t k, float top_p,
                        float row_sum) {
    const float floor_e = exp_nonpositive(-depth);
    int64_t count = 0;
    float mass = 0.0f;
#pragma omp simd reduction(+ : count, mass)
    for (int64_t t = 0; t < vocab; t++) {
        const int in = e[t] >= floor_e;
        count += in;
        mass += in ? e[t] : 0.0f;
    }
    return count >= k || (k == vocab && top_p < 1.0f && mass >= top_p * row_sum);
}

/* The tokens with e >= floor_e into cand; how many. Sixteen at a time are tested together
 * (one vector compare), and only a group with a token above the floor is looked into. */
static int64_t gather(const float *x, float temp, const float *e, int64_t vocab, float floor_e,
                      Candidate *cand) {
    int64_t n = 0;
    for (int64_t t0 = 0; t0 < vocab; t0 += 16) {
        const int64_t t1 = t0 + 16 < vocab ? t0 + 16 : vocab;
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int64_t t = t0; t < t1; t++) any |= e[t] >= floor_e;
        if (!any) continue;
        for (int64_t t = t0; t < t1; t++)
            if (e[t] >= floor_e) cand[n++] = (Candidate){x[t] / temp, e[t], (int32_t)t};
    }
    return n;
}

int top_k_top_p_f32(const float *logits, const float *temperature, const int64_t *top_k,
                    const float *top_p, int64_t rows, int64_t vocab, float *out_values,
                    int64_t *out_ids, int64_t *out_counts, int64_t capacity, float *scratch,
                    int64_t num_threads) {
    if (rows < 0 || vocab < 1 || vocab > INT32_MAX || capacity < 1 || num_threads < 1) return 1;
    for (int64_t r = 0; r < rows; r++)
        if (!(temperature[r] > 0.0f) || top_k[r] < 0 || !(top_p[r] > 0.0f)) return 1;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (rows > 1) \
    reduction(max : status)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * vocab;
        const float temp = temperature[r];
        float *e = scratch + (int64_t)omp_get_thread_num() * 4 * vocab;
        Candidate *cand = (Candidate *)(e + vocab);
        const int64_t k = top_k[r] > 0 && top_k[r] < vocab ? top_k[r] : vocab;

        /* Division by a positive number keeps the order, even rounded: the largest score is
         * the largest logit divided. */
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < vocab; t++) m = x[t] > m ? x[t] : m;
        m /= temp;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < vocab; t++) {
            const float s = x[t] / temp;
            const float v = s > -INFINITY ? exp_nonpositive(s - m) : 0.0f;
            e[t] = v;
            sum += v;
        }

        /* The shallowest depth that can hold every kept token. */
        float lo = 0.0f, hi = -1.0f; /* hi < 0: none found yet */
        for (float d = FIRST_DEPTH; d <= LAST_DEPTH; d *= 2.0f) {
            if (holds_enough(e, vocab, d, k, top_p[r], sum)) {
                hi = d;
                break;
            }
            lo = d;
        }
        while (hi > 0.0f && hi - lo > DEPTH_STEP) {
            const float mid = 0.5f * (lo + hi);
            if (holds_enough(e, vocab, mid, k, top_p[r], sum))
                hi = mid;
            else
                lo = mid;
        }

        int64_t kept = -1;
        while (kept < 0) {
            int64_t n;
            n = gather(x, temp, e, vocab, hi > 0.0f ? exp_nonpositive(-hi) : -1.0f, cand);
            qsort(cand, (size_t)n, sizeof *cand, largest_first);
            kept = walk(cand, n, vocab, k, top_p[r], sum);
            /* Rounding left the threshold a token short: deeper, at last the whole row. */
            hi = hi > 0.0f && hi < LAST_DEPTH ? 2.0f * hi : -1.0f;
        }

        out_counts[r] = kept;
        if (kept > capacity) {
            status = 2;
            continue;
        }
        float *values = out_values + r * capacity;
        int64_t *ids = out_ids + r * capacity;
        for (int64_t i = 0; i < kept; i++) {
            values[i] = cand[i].score;
            ids[i] = cand[i].id;
        }
        for (int64_t i = kept; i < capacity; i++) {
            values[i] = -INFINITY;
            ids[i] = 0;
        }
    }
    return status;
}
