/*
 * Segment-KV attention (index-select SDPA) for beam search, CPU
 * ("Efficient LLM inference solution on Intel GPU", segment KV cache + fused index-select SDPA).
 *
 * Rows n = b*E + e (batch entry b, beam e of E). The keys/values of row n are, in logical order,
 *   the prompt of its batch entry:  prompt_key[b, j, kvh, :]              j < Np   (shared by all E beams)
 *   its response tokens:            resp_key[t, path[t, n], kvh, :]        t < Nr   (path: resolved beam table)
 * and the output is the softmax attention of query[n, h, l, :] over those Np + Nr positions, with one
 * online softmax over both segments, grouped-query heads (h -> kvh = h / G), an optional additive float
 * mask indexed by logical position, and an optional causal rule (query l sees positions <= L - Lq + l).
 *
 * One work item = (batch entry, tile of rows, chunk of positions), every kv head: it reads each prompt
 * key/value row ONCE for all E beams x G query heads x Lq queries (the rows of a tile), which is where
 * the segment cache saves bandwidth over a per-beam cache, and walks the cache in address order,
 * block by block with all heads of a block in a row. Long sequences are split into chunks
 * (flash-decoding) so that small batches still occupy every thread; the partial softmax states are
 * merged at the end. Up to RB rows are computed together (each key block loaded once for them).
 *
 * Layouts (elements): query strides (q_sn, q_sh, q_sl), last dim contiguous; prompt [B][Np][Hkv][D];
 * response [cap][N][Hkv][D]; path int32 [Nr][N]; mask float32 strides (m_sn, m_sh, m_sl), last dim
 * contiguous over the L = Np + Nr logical positions; out float32 [N][Lq][Hq][D]. Fully masked query
 * rows produce zeros. Plain C, no torch headers; the steps are the dispatch table's for the library's
 * ISA choice (dispatch.h: x86/segment_sdpa_avx512.c, x86/segment_sdpa_avx2.c, or the portable ones here,
 * as aipc_segment_isa reports); threads via OpenMP.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_float.h"
#include "dispatch.h"
#include "segment_sdpa.h"

#define ROW_TILE 64    /* query rows per tile (all beams x heads x queries of one kv head, tiled) */
#define MIN_CHUNK 256  /* fewest positions per chunk when splitting a sequence across threads */
/* Software prefetch of the K/V rows PF_AHEAD positions ahead (one block): a head's rows are D of
 * every Hkv * D elements, a strided walk the hardware prefetchers barely follow (A/B on 2 cores,
 * 12 heads of 64, 1024-token prompt, 4 beams, K/V from DRAM: bf16 520 vs 600 us a call, fp32 530 vs
 * 490 us: kept for the 16-bit caches decode uses). */
#ifndef PF_LOCALITY
#define PF_LOCALITY 3 /* _MM_HINT_T0 */
#endif
#ifndef PF_AHEAD
#define PF_AHEAD KB
#endif

/* ------------------------------------------------------------------ scalar helpers */

void cvt_scalar(float *dst, const void *src, int dt, int64_t D) {
    if (dt == AIPC_DT_F32) {
        memcpy(dst, src, (size_t)D * 4);
    } else if (dt == AIPC_DT_BF16) {
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(((const uint16_t *)src)[d]);
    } else {
        for (int64_t d = 0; d < D; d++) dst[d] = f16_to_f32(((const uint16_t *)src)[d]);
    }
}

/* sc[j] = q . k_j for the n keys of a block held transposed: kT[d][KB] */
static void dots_scalar(float *sc, const float *q, const float *kT, int n, int64_t D) {
    for (int j = 0; j < n; j++) sc[j] = 0.f;
    for (int64_t d = 0; d < D; d++)
        for (int j = 0; j < n; j++) sc[j] += q[d] * kT[d * KB + j];
}

/* p[j] = exp(sc[j] - m) (0 for -inf); returns the sum */
float softmax_scalar(float *p, const float *sc, float m, int n) {
    float sum = 0.f;
    for (int j = 0; j < n; j++) {
        p[j] = expf(sc[j] - m);
        sum += p[j];
    }
    return sum;
}

static void accum_scalar(float *acc, float alpha, const float *p, const float *const *v, int n, int64_t D) {
    for (int64_t d = 0; d < D; d++) {
        float a = acc[d] * alpha;
        for (int j = 0; j < n; j++) a += p[j] * v[j][d];
        acc[d] = a;
    }
}

/* The portable steps, one row at a time: the dispatch table's scalar entry. */
const seg_isa seg_isa_scalar = {cvt_scalar, dots_scalar, softmax_scalar, accum_scalar, NULL, NULL, NULL};

/* ------------------------------------------------------------------ kernel */


typedef struct {
    /* problem */
    const char *q;
    int64_t q_sn, q_sh, q_sl;
    const char *pk, *pv, *rk, *rv;
    const int32_t *path;
    const float *mask;
    int64_t m_sn, m_sh, m_sl;
    int dt;
    size_t esz;
    int64_t N, B, E, Hq, Hkv, G, Lq, D, Np, Nr, L;
    float scale;
    int causal;
    seg_isa isa;
} seg_args;

/* Per-thread scratch of one row tile. */
typedef struct {
    float *qf, *acc, *m, *s, *kT, *kbuf, *vbuf;
    const float *vp[KB];  /* value rows as fp32 (one-row path) */
    const void *vr[KB];   /* value rows as stored (accum_rows converts them itself) */
    float sc[RB * KB], p[RB * KB];
} seg_scratch;

/* Row r of a (b, kvh) work item -> (beam e, head group g, query l); rows ordered e-major. */
static inline void row_coords(const seg_args *a, int64_t r, int64_t *e, int64_t *g, int64_t *l) {
    *l = r % a->Lq;
    *g = (r / a->Lq) % a->G;
    *e = r / (a->Lq * a->G);
}

/* Prefetches the n rows of `bytes` each at p, p + stride, ... (all cache lines of each row). */
static inline void prefetch_rows(const char *p, int64_t stride, int64_t n, int64_t bytes) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + j * stride + o, 0, PF_LOCALITY);
}

/* Whether the ISA computes several rows of a tile at once (dots_rows + accum_rows, which read the value
 * rows as stored); else row by row (dots + accum, which read them as fp32). */
static inline int multi_row(const seg_isa *isa) { return isa->dots_rows && isa->accum_rows; }

/* Gather one block of KB positions: keys transposed to fp32 kT[D][KB] (read by every row of the tile),
 * values as stored (vr) for accum_rows, else as fp32 rows (in place when already fp32). Lanes past nk
 * are zero. */
static void load_block(const seg_args *a, seg_scratch *w, const char *const *krow, const char *const *vrow, int nk) {
    const int64_t D = a->D;
    if (a->isa.keys_transposed) a->isa.keys_transposed(w->kT, krow, nk, a->dt, D);
    for (int j = 0; j < nk; j++) {
        if (!a->isa.keys_transposed) {
            const float *k = (const float *)krow[j];
            if (a->dt != AIPC_DT_F32) {
                a->isa.cvt(w->kbuf, krow[j], a->dt, D);
                k = w->kbuf;
            }
            for (int64_t d = 0; d < D; d++) w->kT[d * KB + j] = k[d];
        }
        if (multi_row(&a->isa)) {
            w->vr[j] = vrow[j];
        } else if (a->dt == AIPC_DT_F32) {
            w->vp[j] = (const float *)vrow[j];
        } else {
            a->isa.cvt(w->vbuf + (int64_t)j * D, vrow[j], a->dt, D);
            w->vp[j] = w->vbuf + (int64_t)j * D;
        }
    }
    if (nk < KB && !a->isa.keys_transposed)
        for (int64_t d = 0; d < D; d++)
            for (int j = nk; j < KB; j++) w->kT[d * KB + j] = 0.f;
}

/* The largest of the nk scores, NaN if one is NaN (the reference's max propagates NaN). Four independent
 * max chains and a separate NaN test: one chain of compare-selects (with the NaN test in it) made the
 * decode kernel 60% slower, this loop being on its critical path once per row and block. */
static inline float block_max(const float *sc, int nk) {
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int nan = 0, j = 0;
    for (; j + 4 <= nk; j += 4)
        for (int i = 0; i < 4; i++) {
            m[i] = sc[j + i] > m[i] ? sc[j + i] : m[i];
            nan |= sc[j + i] != sc[j + i];
        }
    for (; j < nk; j++) {
        m[0] = sc[j] > m[0] ? sc[j] : m[0];
        nan |= sc[j] != sc[j];
    }
    const float a = m[0] > m[1] ? m[0] : m[1], b = m[2] > m[3] ? m[2] : m[3];
    return nan ? NAN : a > b ? a : b;
}

/* Mask, causal rule and online-softmax update of row r (state index rt) given its scores sc against the
 * block of nk positions from logical position pos0: writes p = exp(sc - m_new) and *alpha, the factor
 * for the row's old accumulator. Returns 0, leaving the state and p alone, when no position of the
 * block is visible to the row. NaN propagates as in the reference: a NaN score (from q, k, the scale or
 * the mask) makes the block max, and so the row's sum and accumulator, NaN; NaN stays in them through
 * every later rescale (NaN * alpha), so the output is NaN. */
static int softmax_step(const seg_args *a, seg_scratch *w, int64_t b, int64_t kvh, int64_t r, int64_t rt, int64_t pos0,
                        int nk, float *sc, float *p, float *alpha) {
    int64_t e, g, l;
    row_coords(a, r, &e, &g, &l);
    if (a->mask) {
        const int64_t n = b * a->E + e, h = kvh * a->G + g;
        const float *mr = a->mask + n * a->m_sn + h * a->m_sh + l * a->m_sl + pos0;
        for (int j = 0; j < nk; j++) sc[j] += mr[j];
    }
    if (a->causal) {
        const int64_t limit = a->L - a->Lq + l;
        for (int j = 0; j < nk; j++)
            if (pos0 + j > limit) sc[j] = -INFINITY;
    }
    const float bmax = block_max(sc, nk);
    if (bmax == -INFINITY) return 0;
    const float mold = w->m[rt], mnew = mold > bmax ? mold : bmax;
    *alpha = mold == -INFINITY ? 0.f : expf(mold - mnew);
    const float sum = a->isa.softmax(p, sc, mnew, nk);
    w->s[rt] = w->s[rt] * *alpha + sum;
    w->m[rt] = mnew;
    return 1;
}

/* One row against a block of nk positions starting at logical position pos0 (online softmax update).
 * A block the row cannot see is still accumulated with weights 0, as the reference's p @ v does: a NaN
 * value anywhere gives NaN (0 * NaN), whatever the block boundaries (only masked inputs pay for it). */
static void row_block(const seg_args *a, seg_scratch *w, int64_t b, int64_t kvh, int64_t r, int64_t rt, int64_t pos0, int nk) {
    float alpha;
    a->isa.dots(w->sc, w->qf + rt * a->D, w->kT, nk, a->D);
    if (!softmax_step(a, w, b, kvh, r, rt, pos0, nk, w->sc, w->p, &alpha)) {
        alpha = 1.f;
        memset(w->p, 0, (size_t)nk * sizeof(float));
    }
    a->isa.accum(w->acc + rt * a->D, alpha, w->p, w->vp, nk, a->D);
}

/* Rows r .. r + nr - 1 (tile rows rt ..) against a block: row_block for nr rows at once. */
static void rows_block(const seg_args *a, seg_scratch *w, int64_t b, int64_t kvh, int64_t r, int64_t rt, int nr,
                       int64_t pos0, int nk) {
    if (!multi_row(&a->isa)) {
        for (int i = 0; i < nr; i++) row_block(a, w, b, kvh, r + i, rt + i, pos0, nk);
        return;
    }
    a->isa.dots_rows(w->sc, w->qf + rt * a->D, w->kT, nr, a->D);
    float alpha[RB];
    for (int i = 0; i < nr; i++) {
        float *p = w->p + i * KB;
        if (!softmax_step(a, w, b, kvh, r + i, rt + i, pos0, nk, w->sc + i * KB, p, &alpha[i])) {
            alpha[i] = 1.f; /* nothing visible: weights 0 (a NaN value still propagates, as in row_block) */
            memset(p, 0, (size_t)nk * sizeof(float));
        }
    }
    a->isa.accum_rows(w->acc + rt * a->D, alpha, w->p, w->vr, a->dt, nk, nr, a->D);
}

/* Work item (b, rows [r0, r1) of every kv head, positions [j0, j1)): leaves m, s, acc of the tile in w,
 * row rt of kv head kvh at state index kvh * (r1 - r0) + rt. Every kv head of a block is done before
 * the next block, so the item walks the cache position by position, [positions][Hkv][D] contiguous:
 * one stream the hardware prefetchers follow (one head at a time reads D of every Hkv * D elements,
 * a strided walk they barely follow), each key/value row read once for all rows of the tile. */
static void run_item(const seg_args *a, seg_scratch *w, int64_t b, int64_t r0, int64_t r1, int64_t j0, int64_t j1) {
    const int64_t D = a->D, R = r1 - r0, H = a->Hkv, esz = (int64_t)a->esz;
    for (int64_t kvh = 0; kvh < H; kvh++)
        for (int64_t rt = 0; rt < R; rt++) {
            int64_t e, g, l;
            row_coords(a, r0 + rt, &e, &g, &l);
            const int64_t n = b * a->E + e, h = kvh * a->G + g, st = kvh * R + rt;
            a->isa.cvt(w->qf + st * D, a->q + (n * a->q_sn + h * a->q_sh + l * a->q_sl) * esz, a->dt, D);
            for (int64_t d = 0; d < D; d++) w->qf[st * D + d] *= a->scale;
            w->m[st] = -INFINITY;
            w->s[st] = 0.f;
        }
    memset(w->acc, 0, (size_t)(H * R * D) * sizeof(float));
    const char *krow[KB], *vrow[KB];
    const int64_t rowb = H * D * esz; /* bytes between positions of one head */

    /* prompt segment: each key/value row read once for every row of the tile */
    const int64_t pend = j1 < a->Np ? j1 : a->Np;
    for (int64_t jb = j0; jb < pend; jb += KB) {
        const int nk = (int)(pend - jb < KB ? pend - jb : KB);
        const char *kb = a->pk + (b * a->Np + jb) * rowb, *vb = a->pv + (b * a->Np + jb) * rowb;
        const int64_t npf = jb + PF_AHEAD < pend ? (pend - jb - PF_AHEAD < KB ? pend - jb - PF_AHEAD : KB) : 0;
        for (int64_t kvh = 0; kvh < H; kvh++) {
            /* this head's rows of the block PF_AHEAD positions on, spread over the heads: one burst
             * for the whole slab fills the load buffers and stalls the arithmetic behind it */
            prefetch_rows(kb + PF_AHEAD * rowb + kvh * D * esz, rowb, npf, D * esz);
            prefetch_rows(vb + PF_AHEAD * rowb + kvh * D * esz, rowb, npf, D * esz);
            for (int j = 0; j < nk; j++) {
                krow[j] = kb + j * rowb + kvh * D * esz;
                vrow[j] = vb + j * rowb + kvh * D * esz;
            }
            load_block(a, w, krow, vrow, nk);
            for (int64_t rt = 0; rt < R; rt += RB)
                rows_block(a, w, b, kvh, r0 + rt, kvh * R + rt, (int)(R - rt < RB ? R - rt : RB), jb, nk);
        }
    }

    /* response segment: per beam, rows chosen through the path table */
    const int64_t t0 = (j0 > a->Np ? j0 : a->Np) - a->Np, t1 = j1 - a->Np;
    if (t1 <= t0) return;
    const int64_t rows_per_beam = a->G * a->Lq;
    for (int64_t e = r0 / rows_per_beam; e * rows_per_beam < r1; e++) {
        const int64_t n = b * a->E + e;
        const int64_t ra = e * rows_per_beam > r0 ? e * rows_per_beam : r0;
        const int64_t rb = (e + 1) * rows_per_beam < r1 ? (e + 1) * rows_per_beam : r1;
        for (int64_t tb = t0; tb < t1; tb += KB) {
            const int nk = (int)(t1 - tb < KB ? t1 - tb : KB);
            for (int64_t kvh = 0; kvh < H; kvh++) {
                for (int j = 0; j < nk; j++) {
                    const int64_t t = tb + j, phys = a->path[t * a->N + n];
                    const int64_t off = ((t * a->N + phys) * H + kvh) * D * esz;
                    krow[j] = a->rk + off;
                    vrow[j] = a->rv + off;
                }
                load_block(a, w, krow, vrow, nk);
                for (int64_t r = ra; r < rb; r += RB)
                    rows_block(a, w, b, kvh, r, kvh * R + r - r0, (int)(rb - r < RB ? rb - r : RB), a->Np + tb, nk);
            }
        }
    }
}

/* vbuf (fp32 copies of a block's value rows) only for the row-by-row path of non-fp32 values. */
static int scratch_alloc(seg_scratch *w, int64_t rows, int64_t D, int need_vbuf) {
    w->qf = malloc((size_t)(rows * D) * sizeof(float));
    w->acc = malloc((size_t)(rows * D) * sizeof(float));
    w->m = malloc((size_t)rows * sizeof(float));
    w->s = malloc((size_t)rows * sizeof(float));
    w->kT = malloc((size_t)(KB * D) * sizeof(float));
    w->kbuf = malloc((size_t)D * sizeof(float));
    w->vbuf = need_vbuf ? malloc((size_t)(KB * D) * sizeof(float)) : NULL;
    return w->qf && w->acc && w->m && w->s && w->kT && w->kbuf && (w->vbuf || !need_vbuf);
}

static void scratch_free(seg_scratch *w) {
    free(w->qf);
    free(w->acc);
    free(w->m);
    free(w->s);
    free(w->kT);
    free(w->kbuf);
    free(w->vbuf);
}

/* Final value of one row: acc / s, or zeros when every position was masked (s == 0); NaN when s is. */
static void write_row(const seg_args *a, float *out, int64_t b, int64_t kvh, int64_t r, const float *acc, float s) {
    int64_t e, g, l;
    row_coords(a, r, &e, &g, &l);
    const int64_t n = b * a->E + e, h = kvh * a->G + g;
    float *o = out + ((n * a->Lq + l) * a->Hq + h) * a->D;
    const float inv = s > 0.f ? 1.f / s : s == 0.f ? 0.f : s;
    for (int64_t d = 0; d < a->D; d++) o[d] = acc[d] * inv;
}

/* The ISA whose steps the kernel runs under the library's current choice (see aipc_native.h). */
AIPC_API int aipc_segment_isa(void) { return aipc_kernel_isa(AIPC_OP_SEGMENT); }

AIPC_API int aipc_segment_sdpa(const void *q, int64_t q_sn, int64_t q_sh, int64_t q_sl, const void *pk,
                               const void *pv, const void *rk, const void *rv, const int32_t *path,
                               const float *mask, int64_t m_sn, int64_t m_sh, int64_t m_sl, float *out, int dt,
                               int64_t N, int64_t B, int64_t Hq, int64_t Hkv, int64_t Lq, int64_t D, int64_t Np,
                               int64_t Nr, float scale, int causal, int nthreads) {
    if (dt < AIPC_DT_F32 || dt > AIPC_DT_F16) return AIPC_ERR_DTYPE;
    if (B <= 0 || N <= 0 || N % B || Hkv <= 0 || Hq <= 0 || Hq % Hkv || Lq <= 0 || D <= 0 || Np < 0 || Nr < 0 ||
        Np + Nr <= 0)
        return AIPC_ERR_SHAPE;
    if (!q || !out || (Np && (!pk || !pv)) || (Nr && (!rk || !rv || !path))) return AIPC_ERR_NULL;
    for (int64_t i = 0; i < Nr * N; i++)
        if (path[i] < 0 || path[i] >= N) return AIPC_ERR_PATH;
    seg_args a = {
        .q = q, .q_sn = q_sn, .q_sh = q_sh, .q_sl = q_sl, .pk = pk, .pv = pv, .rk = rk, .rv = rv, .path = path,
        .mask = mask, .m_sn = m_sn, .m_sh = m_sh, .m_sl = m_sl, .dt = dt, .esz = dt == AIPC_DT_F32 ? 4 : 2, .N = N,
        .B = B, .E = N / B, .Hq = Hq, .Hkv = Hkv, .G = Hq / Hkv, .Lq = Lq, .D = D, .Np = Np, .Nr = Nr,
        .L = Np + Nr, .scale = scale, .causal = causal,
        .isa = *aipc_kernels()->segment,
    };
    if (nthreads < 1) nthreads = 1;
    const int64_t R = a.E * a.G * Lq;                    /* rows per (b, kvh) */
    const int64_t ntiles = (R + ROW_TILE - 1) / ROW_TILE;
    const int64_t tile = (R + ntiles - 1) / ntiles;      /* balanced tiles */
    const int64_t units = B * Hkv * ntiles; /* (b, kvh, tile): one softmax state per row */
    const int64_t items = B * ntiles;         /* (b, tile) x chunk: a work item does every kv head */
    /* Split the positions into chunks (flash-decoding) until the items spread evenly over the threads
     * (or 4 per thread), chunks of MIN_CHUNK positions at least; the partial states merge at the end. */
    const int64_t most = (a.L + MIN_CHUNK - 1) / MIN_CHUNK;
    int64_t nchunks = 1;
    while (nchunks < most && (items * nchunks) % nthreads && items * nchunks < 4 * nthreads) nchunks++;
    const int64_t part_stride = tile * (D + 2); /* per (unit, chunk): m[tile], s[tile], acc[tile][D] */
    int64_t *bounds = malloc((size_t)(nchunks + 1) * sizeof(int64_t));
    float *part = nchunks > 1 ? malloc((size_t)(units * nchunks * part_stride) * sizeof(float)) : NULL;
    int status = AIPC_ERR_NOMEM;
    if (!bounds || (nchunks > 1 && !part)) goto cleanup;
    {   /* chunk boundaries at equal cost: a response position is gathered once per beam, E times */
        const int64_t total = Np + a.E * Nr;
        bounds[0] = 0;
        for (int64_t c = 1; c < nchunks; c++) {
            const int64_t cost = total * c / nchunks;
            int64_t pos = cost <= Np ? (cost + KB / 2) / KB * KB : Np + (cost - Np + a.E - 1) / a.E;
            if (pos > a.L) pos = a.L;
            bounds[c] = pos > bounds[c - 1] ? pos : bounds[c - 1];
        }
        bounds[nchunks] = a.L;
    }

    status = AIPC_OK;
#pragma omp parallel num_threads(nthreads)
    {
        seg_scratch w;
        if (!scratch_alloc(&w, Hkv * tile, D, !multi_row(&a.isa) && a.dt != AIPC_DT_F32)) {
#pragma omp atomic write
            status = AIPC_ERR_NOMEM;
        }
#pragma omp barrier
        if (status == AIPC_OK) {
            /* chunk-major, contiguous ranges per thread */
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items * nchunks; it++) {
                const int64_t c = it / items, ti = it % items % ntiles, b = it % items / ntiles;
                const int64_t r0 = ti * tile, r1 = r0 + tile < R ? r0 + tile : R, nr = r1 - r0;
                run_item(&a, &w, b, r0, r1, bounds[c], bounds[c + 1]);
                for (int64_t kvh = 0; kvh < Hkv; kvh++) {
                    const int64_t u = (b * Hkv + kvh) * ntiles + ti, st = kvh * nr;
                    if (nchunks == 1) {
                        for (int64_t r = r0; r < r1; r++)
                            write_row(&a, out, b, kvh, r, w.acc + (st + r - r0) * D, w.s[st + r - r0]);
                    } else {
                        float *pp = part + (u * nchunks + c) * part_stride;
                        memcpy(pp, w.m + st, (size_t)nr * sizeof(float));
                        memcpy(pp + tile, w.s + st, (size_t)nr * sizeof(float));
                        memcpy(pp + 2 * tile, w.acc + st * D, (size_t)(nr * D) * sizeof(float));
                    }
                }
            }
            if (nchunks > 1) {
                /* merge the chunks' softmax states: one (unit, row) per iteration */
#pragma omp for schedule(static)
                for (int64_t ur = 0; ur < units * tile; ur++) {
                    const int64_t u = ur / tile, rr = ur % tile;
                    const int64_t ti = u % ntiles, bk = u / ntiles, kvh = bk % Hkv, b = bk / Hkv;
                    const int64_t r = ti * tile + rr;
                    if (r >= R || rr >= (ti * tile + tile < R ? tile : R - ti * tile)) continue;
                    float M = -INFINITY;
                    for (int64_t c = 0; c < nchunks; c++) {
                        const float mc = part[(u * nchunks + c) * part_stride + rr];
                        M = mc > M || mc != mc ? mc : M; /* a NaN sticks */
                    }
                    float S = 0.f;
                    float *acc = w.acc; /* D floats of scratch */
                    memset(acc, 0, (size_t)D * sizeof(float));
                    for (int64_t c = 0; c < nchunks; c++) { /* a chunk that saw nothing: weight 0 (NaN stays) */
                        const float *pp = part + (u * nchunks + c) * part_stride;
                        const float f = pp[rr] == -INFINITY ? 0.f : expf(pp[rr] - M);
                        S += pp[tile + rr] * f;
                        const float *ac = pp + 2 * tile + rr * D;
                        for (int64_t d = 0; d < D; d++) acc[d] += ac[d] * f;
                    }
                    write_row(&a, out, b, kvh, r, acc, S);
                }
            }
        }
        scratch_free(&w);
    }
cleanup:
    free(part);
    free(bounds);
    return status;
}
