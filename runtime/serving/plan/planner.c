/* attncc planner: the compiled twin of attncc.runtime.serving.plan.scheduler.plan + Plan.pack
 * (FlashInfer's Algorithm 1), and of BatchAttention.plan's input checks.
 *
 * Built on first use with the system C compiler (runtime/serving/plan/planner.py) and called
 * through ctypes.
 * It must produce exactly what the numpy implementation produces -- same units, same slots, same
 * greedy order, same CTA queues, same packed bytes -- so the two are interchangeable; tests
 * compare them on random batches. See the scheduler module docstring for the algorithm; the
 * comments here only say how each step is computed.
 *
 * Entry points:
 *   attncc_plan_pack   the whole plan, written straight into a packed int32 buffer (PlanLayout);
 *   attncc_check_batch BatchAttention.plan's input checks and KV lengths in one pass;
 *   attncc_plan_batch  attncc_plan_pack for a checked batch, then its page tables staged after
 *                      the plan and the staging buffer's used word ranges listed;
 *   attncc_plan_staged both in one call (BatchAttention.plan's host work when its tiles are the
 *                      last plan's), the page ids checked and staged in one pass.
 * The structs below are mirrored field for field by planner.py's ctypes structures.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef int32_t i32;

/* Four int32 to dst in one 16-byte store where the compiler has vector types (half a unit). */
#if defined(__GNUC__)
typedef i32 quad __attribute__((vector_size(16)));
#define STORE4(dst, a, b, c, d)           \
  do {                                    \
    const quad q4_ = {(a), (b), (c), (d)}; \
    memcpy((dst), &q4_, sizeof q4_);      \
  } while (0)
#else
#define STORE4(dst, a, b, c, d) \
  do {                          \
    (dst)[0] = (a);             \
    (dst)[1] = (b);             \
    (dst)[2] = (c);             \
    (dst)[3] = (d);             \
  } while (0)
#endif

static i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }
static i64 min64(i64 a, i64 b) { return a < b ? a : b; }
static i64 max64(i64 a, i64 b) { return a > b ? a : b; }

/* ------------------------------------------------------------------------------ the plan */

typedef struct {
  /* in: the batch, already validated (the scheduler's checks) */
  i64 batch;
  const i64* qo; /* [batch + 1] query CSR */
  const i64* kv; /* [batch] KV lengths, 0 .. 2^31 - 1 */
  /* in: the problem (tile_q a power of two: scheduler.TILE_Q_CHOICES) */
  i64 num_qo_heads, num_kv_heads, tile_q, num_ctas, align, floor_;
  i64 head_span; /* nonzero: units of one-tile, unsplit requests may cover several KV heads */
  double alpha, beta;
  /* in: the PlanLayout (maxima, int32 size, the fixed offsets: cta_indptr and where the
   * sections packed back to back start) and the header's constants */
  i64 max_batch, max_qo_tokens, max_ctas, max_units, max_merges, max_slots, layout_size;
  i64 off_cta_indptr, off_dynamic;
  i64 magic, version;
  /* out */
  i64 chunk, num_units, num_merges, num_slots, scratch_bytes;
} plan_args;

/* Per-request numbers the steps share (scratch). */
typedef struct {
  i64* nt;    /* [batch] query tiles */
  i64* nc;    /* [batch] KV chunks (0 without a query tile) */
  i64* first; /* [batch] first unit */
  i64* span;  /* [batch] KV heads per unit (scheduler._head_spans) */
  i64* per;   /* [batch] units per (tile, chunk): num_kv_heads / span */
  double total; /* the plan's total cost (scheduler.plan's `total`) */
} requests;

/* The head spans a request may get: num_kv_heads' divisors above 1, descending, then 1
 * (d[nd] = 1, num_kv_heads / d in per[]), and for each d > 1 the largest one-head cost that
 * span fits (bound[]). Scratch: [hk + 1] each. */
typedef struct {
  i64 nd;
  i64* d;
  i64* per;
  double* bound;
} spans;

/* The largest c with (double)d * c <= limit (limit >= 0). The rounded product never decreases
 * as c grows, so for c >= 0, (double)d * c <= limit exactly when c <= span_bound(d, limit):
 * scheduler._head_spans' test as one compare. (limit / d is within an ulp or two of it.) */
static double span_bound(i64 d, double limit) {
  if (limit >= HUGE_VAL) return limit; /* every finite cost fits */
  const double dd = (double)d;
  double c = limit / dd;
  while (dd * c > limit) c = nextafter(c, -HUGE_VAL);
  for (double up = nextafter(c, HUGE_VAL); dd * up <= limit; up = nextafter(c, HUGE_VAL)) c = up;
  return c;
}

/* The spans of a plan with total cost `total` (scheduler._head_spans' limit total / (2 P)). */
static void span_table(const plan_args* a, double total, spans* sp) {
  const i64 hk = a->num_kv_heads;
  const double limit = total / (2.0 * (double)a->num_ctas);
  i64 nd = 0;
  for (i64 d = hk; d > 1 && a->head_span; --d)
    if ((uint32_t)hk % (uint32_t)d == 0) { /* (32 bits: a 64-bit division per d took ~0.4 us) */
      sp->d[nd] = d;
      sp->per[nd] = hk / d;
      sp->bound[nd++] = span_bound(d, limit);
    }
  sp->d[nd] = 1;
  sp->per[nd] = hk;
  sp->nd = nd;
}

/* The KV chunk (scheduler.kv_chunk_size, given the longest KV range), every request's tiles,
 * chunks, head span and first unit, the plan's total cost and its sizes (a->chunk, num_units,
 * num_merges, num_slots). Tiles are a shift (tile_q is a power of two), chunks one 32-bit division
 * where a request has more than one (lengths and chunk are below 2^31). A request's span
 * (scheduler._head_spans: the largest divisor s of num_kv_heads with s * c_i <= total / (2 P) for
 * a one-tile, one-chunk request, c_i = alpha * rows + beta * kv its one-head cost, the same float
 * operations; 1 otherwise) is the first divisor whose bound c_i does not exceed: the bounds ascend
 * as the divisors descend, so the divisors that fail are a prefix and their count, without a
 * branch, indexes the table (the span and hk / span: no 64-bit division per request, no loop exit
 * that mispredicts when spans vary). */
static void request_sizes(plan_args* a, i64 g, requests* rq, spans* sp) {
  const i64 batch = a->batch, hk = a->num_kv_heads, tile_q = a->tile_q, align = a->align;
  int shift = 0;
  while (((i64)1 << shift) < tile_q) ++shift;
  i64 work = 0, kmax = 0;
  for (i64 i = 0; i < batch; ++i) {
    rq->nt[i] = ((a->qo[i + 1] - a->qo[i]) * g + tile_q - 1) >> shift;
    work += rq->nt[i] * a->kv[i];
    kmax = max64(kmax, rq->nt[i] > 0 ? a->kv[i] : 0);
  }
  const i64 raw = ceil_div(work * hk, a->num_ctas); /* all KV heads share the CTAs */
  i64 chunk = ceil_div(max64(raw, a->floor_), align) * align;
  if (kmax > 0 && kmax <= 2 * chunk) /* at most two pieces: not worth a merge */
    chunk = max64(chunk, ceil_div(kmax, align) * align);
  chunk = min64(chunk, (i64)2147483647 / align * align);
  const uint32_t c32 = (uint32_t)chunk;
  i64 rows_nc = 0;
  for (i64 i = 0; i < batch; ++i) {
    const i64 nt = rq->nt[i];
    const uint32_t kv = (uint32_t)a->kv[i];
    const i64 nc = nt > 0 ? (kv <= c32 ? 1 : (kv + c32 - 1) / c32) : 0;
    rq->nc[i] = nc;
    rows_nc += (a->qo[i + 1] - a->qo[i]) * g * nc;
  }
  rq->total = (double)hk * (a->alpha * (double)rows_nc + a->beta * (double)work);
  span_table(a, rq->total, sp);
  const i64 nd = sp->nd; /* (locals: the stores below could alias the table's fields) */
  const double* bound = sp->bound;
  i64 units = 0, merges = 0, slots = 0;
  for (i64 i = 0; i < batch; ++i) {
    const i64 nt = rq->nt[i], nc = rq->nc[i];
    const double c = a->alpha * (double)((a->qo[i + 1] - a->qo[i]) * g) +
                     a->beta * (double)a->kv[i];
    i64 k = 0; /* divisors too large for request i */
    for (i64 j = 0; j < nd; ++j) k += c > bound[j];
    k = nt == 1 && nc == 1 ? k : nd;
    const i64 per = sp->per[k];
    rq->span[i] = sp->d[k];
    rq->per[i] = per;
    rq->first[i] = units;
    units += per * nt * nc;
    if (nc > 1) {
      merges += hk * nt;
      slots += hk * nt * nc;
    }
  }
  a->chunk = chunk;
  a->num_units = units;
  a->num_merges = merges;
  a->num_slots = slots;
}

/* The units of a one-tile request i that is not split (a decode request: most of a serving
 * batch), one per span of s heads: (i, h, s, 0 | rows, 0, kv, -1). The second half is the same
 * for every unit and the first steps by s in h, so where the compiler has vector types a unit
 * is two 16-byte stores and a vector add (built from scalars, the halves took ~1.7x as long:
 * 8192 units, decode at Hkv 32, ~13 -> ~7.5 us on the dev VM). Returns the next unit. */
static i32* write_heads(i32* w, i32 i, i64 hk, i32 s, i32 rows, i32 kv) {
#if defined(__GNUC__)
  quad first = {i, 0, s, 0};
  const quad step = {0, s, 0, 0}, second = {rows, 0, kv, -1};
  for (i64 h = 0; h < hk; h += s, w += 8, first += step) {
    memcpy(w, &first, sizeof first);
    memcpy(w + 4, &second, sizeof second);
  }
#else
  for (i64 h = 0; h < hk; h += s, w += 8) {
    STORE4(w, i, (i32)h, s, 0);
    STORE4(w + 4, rows, 0, kv, -1);
  }
#endif
  return w;
}

/* The units of request i when it is not split (one chunk per tile, writing through): per head,
 * its tiles; write_heads (span s) when it has one tile. Returns the next unit. */
static i32* write_whole(i32* w, i32 i, i64 hk, i32 s, i64 rows, i64 nt, i64 tile_q, i32 kv) {
  if (nt == 1) return write_heads(w, i, hk, s, (i32)rows, kv);
  for (i64 h = 0; h < hk; ++h)
    for (i64 t = 0; t < nt; ++t, w += 8) {
      STORE4(w, i, (i32)h, 1, (i32)(t * tile_q));
      STORE4(w + 4, (i32)min64(rows - t * tile_q, tile_q), 0, kv, -1);
    }
  return w;
}

/* Units in (request, kv_head, tile, chunk) order and the reduction map (merge_indptr,
 * merge_out); slots are numbered over the split requests' units in unit order (so one split
 * item's slots are consecutive). */
static void write_units(const plan_args* a, i64 g, const requests* rq, i32* units,
                        i32* merge_indptr, i32* merge_out) {
  const i64 hk = a->num_kv_heads, tile_q = a->tile_q;
  const i32 chunk = (i32)a->chunk;
  i32 slot = 0;
  i64 m = 0;
  i32* w = units;
  merge_indptr[0] = 0;
  for (i64 i = 0; i < a->batch; ++i) {
    const i64 rows = (a->qo[i + 1] - a->qo[i]) * g;
    const i32 kv = (i32)a->kv[i], qo = (i32)a->qo[i];
    const i64 nt = rq->nt[i], nc = rq->nc[i];
    if (nc <= 1) {
      w = write_whole(w, (i32)i, hk, (i32)rq->span[i], rows, nt, tile_q, kv);
      continue;
    }
    for (i64 h = 0; h < hk; ++h)
      for (i64 t = 0; t < nt; ++t) {
        const i32 q_start = (i32)(t * tile_q), q_rows = (i32)min64(rows - t * tile_q, tile_q);
        const i64 item = m++;
        i32* mo = merge_out + 5 * item;
        mo[0] = (i32)i; mo[1] = (i32)h; mo[2] = qo; mo[3] = q_start; mo[4] = q_rows;
        merge_indptr[item + 1] = merge_indptr[item] + (i32)nc;
        i64 ks = 0; /* 64 bits: one past the last chunk may pass 2^31 */
        for (i64 c = 0; c < nc; ++c, w += 8, ks += chunk) {
          STORE4(w, (i32)i, (i32)h, 1, q_start);
          STORE4(w + 4, q_rows, (i32)ks, c + 1 < nc ? (i32)(ks + chunk) : kv, /* min(., kv) */
                 slot++);
        }
      }
  }
}

/* x >= 0 rounded half to even, as np.rint does (llrint without a libm call): below 2^52 adding
 * and subtracting 2^52 rounds in the default mode; above, doubles are integers already. */
static i64 round_even(double x) {
  const double two52 = 4503599627370496.0;
  return (i64)(x < two52 ? (x + two52) - two52 : x);
}

/* A cost group in the greedy order. */
typedef struct {
  i64 tick, id;
} group;

/* Cost groups 4*i + 2*last_tile + last_chunk: every group's unit count (count[4 i + k]) and
 * the groups with units, in id order, with their ticks = rint(cost * 2^61 / (P * total)), as
 * scheduler._group_ticks / cost_ticks compute them, in groups[] (what the greedy sorts: the
 * empty groups' ticks are never computed). Returns the number of groups written. */
static i64 group_ticks(const plan_args* a, i64 g, const requests* rq, i64* count,
                       group* groups) {
  const i64 hk = a->num_kv_heads, tile_q = a->tile_q, chunk = a->chunk;
  const double alpha = a->alpha, beta = a->beta, total = rq->total;
  const double scale = total > 0.0 ? 2305843009213693952.0 / ((double)a->num_ctas * total) : 0.0;
  i64 ng = 0;
  for (i64 i = 0; i < a->batch; ++i) {
    const i64 rows = (a->qo[i + 1] - a->qo[i]) * g, nt = rq->nt[i], nc = rq->nc[i];
    const i64 full_t = nt - 1, full_c = nc - 1, heads = nt > 0 ? hk : 0;
    i64* cnt = count + 4 * i;
    cnt[0] = full_t * full_c * heads;
    cnt[1] = full_t * heads;
    cnt[2] = full_c * heads;
    cnt[3] = nt > 0 ? rq->per[i] : 0; /* a span of s heads: hk / s units of s heads' cost */
    const double last_rows = alpha * (double)(rows - full_t * tile_q);
    const double last_len = beta * (double)(a->kv[i] - full_c * chunk);
    double cost[4];
    cost[0] = alpha * (double)tile_q + beta * (double)chunk;
    cost[1] = alpha * (double)tile_q + last_len;
    cost[2] = last_rows + beta * (double)chunk;
    cost[3] = last_rows + last_len;
    if (rq->span[i] > 1) cost[3] *= (double)rq->span[i];
    for (int k = 0; k < 4; ++k)
      if (cnt[k] > 0) {
        groups[ng].tick = total > 0.0 ? round_even(cost[k] * scale) : 0;
        groups[ng++].id = 4 * i + k;
      }
  }
  return ng;
}

/* Sort groups (ids ascending on entry) by ticks descending, stably, so that equal ticks keep
 * id order: insertion sorts of runs of 16, then bottom-up merges. (GCC compiles the merge's
 * choice of front to a branch; forced branch-free, through a mask, the step is bound by its
 * load-compare-advance chain and the sort took twice as long on 256 random ticks.) tmp: [n]. */
static void sort_groups(group* g, i64 n, group* tmp) {
  const i64 run = 16;
  for (i64 lo = 0; lo < n; lo += run) {
    const i64 hi = min64(lo + run, n);
    for (i64 i = lo + 1; i < hi; ++i) {
      const group x = g[i];
      i64 j = i;
      for (; j > lo && g[j - 1].tick < x.tick; --j) g[j] = g[j - 1];
      g[j] = x;
    }
  }
  group *src = g, *dst = tmp;
  for (i64 w = run; w < n; w *= 2) {
    for (i64 lo = 0; lo < n; lo += 2 * w) {
      const group *a = src + lo, *b = src + min64(lo + w, n);
      const group *a_end = b, *b_end = src + min64(lo + 2 * w, n);
      group* o = dst + lo;
      while (a < a_end && b < b_end) {
        const int take_b = b->tick > a->tick;
        *o++ = take_b ? *b : *a;
        b += take_b;
        a += !take_b;
      }
      while (a < a_end) *o++ = *a++;
      while (b < b_end) *o++ = *b++;
    }
    group* t = src;
    src = dst;
    dst = t;
  }
  if (src != g) memcpy(g, src, (size_t)n * sizeof(group));
}

/* Append the units of cost group k, in unit order, to their CTAs' queues: the CTA of the unit
 * at greedy position pos is assign[pos]. Returns the next position. The group's units are
 * tiles [t0, t1) x chunks [c0, c1) of each head; one loop walks them, its counters wrapping
 * without branches (a short inner loop per (head, tile) would mispredict its exit: chunk counts
 * change from group to group). */
static i64 enqueue_group(i64 k, i64 count, const requests* rq, const i32* assign, i64 pos,
                         i64* fill, i32* cta_units) {
  const i64 i = k >> 2, nt = rq->nt[i], nc = rq->nc[i];
  const i64 t0 = (k & 2) ? nt - 1 : 0, t1 = (k & 2) ? nt : nt - 1;
  const i64 c0 = (k & 1) ? nc - 1 : 0, c1 = (k & 1) ? nc : nc - 1;
  const i64 head_skip = (nt - (t1 - t0)) * nc; /* from (h, t1, 0) to (h + 1, t0, 0) */
  i64 row = rq->first[i] + t0 * nc, t = t0, c = c0;
  if (head_skip == 0 && c1 - c0 == nc) { /* all of the request's units (decode): consecutive */
    for (i64 j = 0; j < count; ++j) cta_units[fill[assign[pos + j]]++] = (i32)(row + j);
    return pos + count;
  }
  for (i64 j = 0; j < count; ++j) {
    cta_units[fill[assign[pos + j]]++] = (i32)(row + c);
    const int next_t = ++c == c1, next_h = (t + next_t) == t1;
    c = next_t ? c0 : c;
    row += (next_t ? nc : 0) + (next_h ? head_skip : 0);
    t = next_h ? t0 : t + next_t;
  }
  return pos + count;
}

/* The CTAs' loads for the greedy. A CTA's key is (load << bits) | cta with 2^bits >= P: unique
 * and ordered like (load, cta), the CTA a mask away. The scheduler's tick budget keeps
 * sum(ticks) * P < 2^62, so the shifted loads stay below 2^63.
 *
 * The keys are kept sorted: buf[head .. head + P) ascending, in a buffer of 2P with room to
 * move right. A run of k units of equal cost st (k <= P at a time) is an exact simulation of
 * the min-heap with two sorted queues: the keys not yet taken (the front of the sorted keys)
 * and the keys just loaded (taken key + st, ascending because the taken keys ascend); each unit
 * takes the lesser front. The loaded keys are then merged back, moving whichever side of them
 * is shorter (memmove). When max - min < st a run is dealt round robin instead (every CTA gets
 * one unit before any gets two, exactly as the heap would do): O(1) per unit.
 *
 * Idle CTAs (load 0) are kept out of the sorted keys until a run needs more of them than are
 * left: the first units of a plan go to CTAs 0, 1, 2, ... in order (the least keys), and since
 * runs come in descending cost their new keys are below every loaded key, so they are
 * prepended (buf[head .. head + idle) holds the keys of CTAs 0 .. idle-1, head = P - idle).
 * A decode batch with about as many units as CTAs is mostly this phase: O(1) per unit instead
 * of two binary searches and a memmove per run. Its keys join the sorted ones (at the front,
 * making head 0) once a run outgrows them. */
typedef struct {
  i64 P, mask;
  i64* buf;   /* [2P] */
  i64 head;
  i64 idle;   /* CTAs idle .. P-1 are idle and not in buf; P once they have joined */
  i64* fresh; /* [P]: keys loaded by the current run, ascending */
  i64* count; /* [P] units per CTA */
} ctas;

/* Index of the first of keys[0 .. n) not below x (keys ascending); branch-free halving. */
static i64 lower_bound(const i64* keys, i64 n, i64 x) {
  const i64* base = keys;
  while (n > 1) {
    const i64 half = n / 2;
    base = base[half - 1] < x ? base + half : base;
    n -= half;
  }
  return (base - keys) + (n == 1 && base[0] < x);
}

/* Make room for the sorted keys to move `shift` places right. */
static void room_right(ctas* s, i64 shift) {
  if (s->head + shift > s->P) {
    memmove(s->buf, s->buf + s->head, (size_t)s->P * sizeof(i64));
    s->head = 0;
  }
}

/* Deal k units of st round robin from the least key (max - min < st). */
static void deal(ctas* s, i64 st, i64 k, i32* assign) {
  const i64 P = s->P, q = k / P, r = k % P;
  i64* key = s->buf + s->head;
  for (i64 round = 0, o = 0; round <= q; ++round) {
    const i64 n = round < q ? P : r;
    for (i64 j = 0; j < n; ++j) assign[o++] = (i32)(key[j] & s->mask);
  }
  if (q)
    for (i64 j = 0; j < P; ++j) {
      key[j] += q * st;
      s->count[key[j] & s->mask] += q;
    }
  /* the first r moved past every other key: they go to the end */
  room_right(s, r);
  key = s->buf + s->head;
  for (i64 j = 0; j < r; ++j) {
    key[P + j] = key[j] + st;
    s->count[key[j] & s->mask] += 1;
  }
  s->head += r;
}

/* Merge the m loaded keys s->fresh[0 .. m) back into the m keys taken from the front. (The
 * merge steps branch: a branch-free step, bound by its load-compare-advance chain, measured
 * slower on decode batches, whose loaded keys mostly come in long stretches.) */
static void merge_back(ctas* s, i64 m) {
  const i64 P = s->P, n = P - m; /* the untaken keys: rest[0 .. n) */
  const i64* f = s->fresh;
  i64* rest = s->buf + s->head + m;
  const i64 lo = lower_bound(rest, n, f[0]);
  i64 hi = lo; /* (a scan, not a second search: the merge below walks rest[lo .. hi) anyway,
                * and the loaded keys mostly land together, hi - lo a few keys) */
  while (hi < n && rest[hi] < f[m - 1]) ++hi;
  if (lo <= n - hi) { /* keys below the loaded ones move m left; merge forward */
    i64* out = s->buf + s->head;
    memmove(out, rest, (size_t)lo * sizeof(i64));
    i64 o = lo, x = lo, y = 0;
    while (y < m) out[o++] = (x < hi && rest[x] < f[y]) ? rest[x++] : f[y++];
  } else { /* keys above the loaded ones move m right; merge backward */
    room_right(s, m);
    rest = s->buf + s->head + m;
    memmove(rest + hi + m, rest + hi, (size_t)(n - hi) * sizeof(i64));
    i64 o = hi + m, x = hi, y = m;
    while (y > 0) rest[--o] = (x > lo && rest[x - 1] > f[y - 1]) ? rest[--x] : f[--y];
    s->head += m;
  }
}

/* k <= P units of st: each takes the least key, untaken or just loaded. */
static void take(ctas* s, i64 st, i64 k, i32* assign) {
  const i64* key = s->buf + s->head;
  i64* f = s->fresh;
  if (key[k - 1] - key[0] < st) { /* every loaded key is above key[k - 1]: they take key[0 .. k) */
    for (i64 j = 0; j < k; ++j) {
      const i64 cta = key[j] & s->mask;
      assign[j] = (i32)cta;
      s->count[cta] += 1;
      f[j] = key[j] + st;
    }
    merge_back(s, k);
    return;
  }
  i64 x = 0, y = 0, nf = 0; /* next untaken key (x <= j < k <= P); live loaded keys [y, nf) */
  for (i64 j = 0; j < k; ++j) {
    const i64 least = (y < nf && f[y] < key[x]) ? f[y++] : key[x++];
    const i64 cta = least & s->mask;
    assign[j] = (i32)cta;
    s->count[cta] += 1;
    f[nf++] = least + st;
  }
  if (y) memmove(f, f + y, (size_t)x * sizeof(i64)); /* x keys taken, x loaded keys live */
  merge_back(s, x);
}

/* k units of st > 0 to the next k idle CTAs (k <= P - idle): their keys, ascending and below
 * every loaded key (loaded by a costlier run), are prepended. */
static void wake(ctas* s, i64 st, i64 k, i32* assign) {
  s->head -= k;
  i64* key = s->buf + s->head;
  for (i64 j = 0, cta = s->idle; j < k; ++j, ++cta) {
    assign[j] = (i32)cta;
    s->count[cta] += 1;
    key[j] = st + cta; /* (0 + st) << bits | cta */
  }
  s->idle += k;
}

/* The idle CTAs' keys (load 0, below every other) join the sorted keys at the front. */
static void join_idle(ctas* s) {
  const i64 n = s->P - s->idle;
  s->head -= n; /* = 0: idle + n keys were prepended from head = P */
  for (i64 j = 0; j < n; ++j) s->buf[s->head + j] = s->idle + j;
  s->idle = s->P;
}

/* Assign a run of k units of equal ticks (assign[0..k) gets their CTAs). */
static void assign_run(ctas* s, i64 st, i64 k, i32* assign) {
  if (st == 0) { /* they cost nothing: the least loaded CTA takes them all */
    const i64 cta = s->idle < s->P ? s->idle : s->buf[s->head] & s->mask;
    for (i64 j = 0; j < k; ++j) assign[j] = (i32)cta;
    s->count[cta] += k;
    return;
  }
  if (s->idle < s->P) {
    if (k <= s->P - s->idle) {
      wake(s, st, k, assign);
      return;
    }
    join_idle(s);
  }
  while (k > 0) {
    const i64* key = s->buf + s->head;
    if (key[s->P - 1] - key[0] < st) {
      deal(s, st, k, assign);
      return;
    }
    const i64 m = k < s->P ? k : s->P;
    take(s, st, m, assign);
    assign += m;
    k -= m;
  }
}

/* Greedy order and LPT: the ng groups with units (group_ticks) by ticks descending (then id),
 * units of a group by index; runs of equal ticks are assigned together. assign: [n] the CTA
 * of each greedy position. */
static void schedule(const i64* g_count, group* groups, i64 ng, group* tmp, i32* assign,
                     ctas* s) {
  sort_groups(groups, ng, tmp);
  i64 bits = 0;
  while (((i64)1 << bits) < s->P) ++bits;
  s->mask = ((i64)1 << bits) - 1;
  s->head = s->P; /* every CTA idle: no keys yet, room for P in front */
  s->idle = 0;
  memset(s->count, 0, (size_t)s->P * sizeof(i64));
  i64 pos = 0;
  for (i64 r = 0; r < ng;) {
    const i64 tick = groups[r].tick, start = pos;
    for (; r < ng && groups[r].tick == tick; ++r) pos += g_count[groups[r].id];
    assign_run(s, tick << bits, pos - start, assign + start);
  }
}

/* Per-CTA queues in assignment order (a stable counting sort by CTA). fill: [P]. */
static void queues(const requests* rq, const i64* g_count, const group* groups, i64 ng,
                   const i32* assign, const ctas* s, i64* fill, i32* cta_indptr,
                   i32* cta_units) {
  i64 at = 0; /* (a register, not cta_indptr[c] read back: that chained every step) */
  cta_indptr[0] = 0;
  for (i64 c = 0; c < s->P; ++c) {
    fill[c] = at;
    at += s->count[c];
    cta_indptr[c + 1] = (i32)at;
  }
  for (i64 r = 0, pos = 0; r < ng; ++r)
    pos = enqueue_group(groups[r].id, g_count[groups[r].id], rq, assign, pos, fill, cta_units);
}

/* The packed plan's header: HEADER_WORDS int32 at word 0 (format.HEADER_FIELDS), then
 * cta_indptr at a->off_cta_indptr; the word offsets of the sections whose sizes vary (units,
 * cta_units, merge_indptr, merge_out: format.DYNAMIC_SECTIONS) are its words
 * AT_UNITS .. AT_UNITS + 3. (Tests compare the packed words with Plan.pack's one by one.) */
enum { HEADER_WORDS = 24, AT_UNITS = 14, NUM_AT = 4 };

/* Where a plan with n units and m merges puts its sections (format.packed_offsets):
 * at[0 .. 4) the DYNAMIC_SECTIONS back to back from start, each at a multiple of 4 words, and
 * at[4] one past the last used word (the plan is [0, at[4])). */
static void packed_offsets(i64 start, i64 n, i64 m, i64 at[NUM_AT + 1]) {
  const i64 words[NUM_AT] = {8 * n, n, m + 1, 5 * m};
  i64 pos = start;
  for (int k = 0; k < NUM_AT; ++k) {
    at[k] = pos;
    pos += (words[k] + 3) / 4 * 4;
  }
  at[NUM_AT] = at[NUM_AT - 1] + words[NUM_AT - 1];
}

/* The plan of a->batch, packed into buf as Plan.pack(layout, out=buf) writes it: the header,
 * cta_indptr (padded to the layout's maximum with its last value), then the sections back to
 * back from a->off_dynamic (packed_offsets, their offsets in the header). Returns 0; 1 when
 * the plan exceeds a layout maximum (its sizes are in a->chunk, num_units, num_merges,
 * num_slots), 2 when scratch is smaller than a->scratch_bytes (call again with that much).
 * Nothing is written to buf unless it returns 0. */
int attncc_plan_pack(plan_args* a, i32* buf, void* scratch, i64 scratch_bytes) {
  const i64 batch = a->batch, P = a->num_ctas, hk = a->num_kv_heads;
  const i64 g = a->num_qo_heads / hk;
  /* scratch: int64 [5 batch] requests, [4 batch] group counts, [16 batch] groups and their
   * sort buffer, [5P] CTAs, [3 (hk + 1)] spans; then int32 [n] the CTA of each greedy
   * position */
  a->scratch_bytes = 8 * (25 * batch + 5 * P + 3 * (hk + 1));
  if (a->scratch_bytes > scratch_bytes) return 2;
  i64* w = (i64*)scratch;
  requests rq = {w, w + batch, w + 2 * batch, w + 3 * batch, w + 4 * batch, 0.0};
  i64* g_count = w + 5 * batch;
  group* groups = (group*)(g_count + 4 * batch);
  group* tmp = groups + 4 * batch;
  i64* keys = (i64*)(tmp + 4 * batch);
  i64* fresh = keys + 2 * P;
  i64* count = fresh + P;
  i64* fill = count + P;
  i64* const sw = fill + P; /* the span table: d, per, bound ([hk + 1] each) */
  spans sp = {.d = sw, .per = sw + hk + 1, .bound = (double*)(sw + 2 * (hk + 1))};
  i32* assign = (i32*)(sw + 3 * (hk + 1));
  request_sizes(a, g, &rq, &sp);
  const i64 n = a->num_units, m = a->num_merges, slots = a->num_slots;
  if (batch > a->max_batch || a->qo[batch] > a->max_qo_tokens || P > a->max_ctas ||
      n > a->max_units || m > a->max_merges || slots > a->max_slots)
    return 1;
  a->scratch_bytes += 4 * n;
  if (a->scratch_bytes > scratch_bytes) return 2;
  ctas s = {.P = P, .buf = keys, .fresh = fresh, .count = count};

  i64 at[NUM_AT + 1];
  packed_offsets(a->off_dynamic, n, m, at);
  i32 header[HEADER_WORDS] = {(i32)a->magic, (i32)a->version, (i32)batch, (i32)n, (i32)P,
                              (i32)m, (i32)slots, (i32)a->chunk, (i32)a->tile_q, (i32)g,
                              (i32)a->num_qo_heads, (i32)hk, (i32)a->qo[batch],
                              (i32)a->layout_size}; /* format.HEADER_FIELDS order */
  for (int k = 0; k < NUM_AT; ++k) header[AT_UNITS + k] = (i32)at[k];
  memcpy(buf, header, sizeof header);
  write_units(a, g, &rq, buf + at[0], buf + at[2], buf + at[3]);
  const i64 ng = group_ticks(a, g, &rq, g_count, groups);
  schedule(g_count, groups, ng, tmp, assign, &s);
  i32* cta_indptr = buf + a->off_cta_indptr;
  queues(&rq, g_count, groups, ng, assign, &s, fill, cta_indptr, buf + at[1]);
  for (i64 c = P + 1; c <= a->max_ctas; ++c) cta_indptr[c] = (i32)n;
  return 0;
}

/* ------------------------------------------------------------------------------ input checks */

typedef struct {
  /* in: the arrays as BatchAttention.plan converted them (int64; pages int64 or int32) */
  const i64* qo;
  i64 qo_size;
  const i64* kvp;
  i64 kvp_size;
  const void* pages; /* paged layouts: kv_indices */
  i64 num_pages, pages_int32;
  const i64* last; /* paged layouts: kv_last_page_len */
  i64 last_size;
  i64 ragged, page_size, max_batch, max_qo_tokens, max_pages;
  i64 expect_max_q; /* attncc_plan_staged: the longest query its problem's tiles are for */
  /* out */
  i64* kv_lens; /* [qo_size - 1] */
  i64 max_q_len, max_page;
} batch_args;

static int is_indptr(const i64* a, i64 size) {
  if (size < 1 || a[0] != 0) return 0;
  for (i64 i = 1; i < size; ++i)
    if (a[i] < a[i - 1]) return 0;
  return 1;
}

/* Every check of attncc_check_batch but the page ids', and the KV lengths and the longest
 * query. Returns 0 when all pass. */
static int check_lengths(batch_args* b) {
  const i64 batch = b->qo_size - 1;
  if (!is_indptr(b->qo, b->qo_size) || !is_indptr(b->kvp, b->kvp_size)) return 1;
  if (b->kvp_size != b->qo_size || batch > b->max_batch || b->qo[batch] > b->max_qo_tokens)
    return 2;
  const i64 i32_max = 2147483647;
  if (b->qo[batch] > i32_max) return 3;
  if (b->ragged) {
    if (batch > b->max_pages) return 4; /* one page-table entry per request */
    for (i64 i = 0; i < batch; ++i) b->kv_lens[i] = b->kvp[i + 1] - b->kvp[i];
  } else {
    const i64 ps = b->page_size;
    if (b->num_pages < b->kvp[batch] || b->num_pages > b->max_pages || b->last_size != batch)
      return 4;
    if (ps < 1 || ps > i32_max) return 5;
    for (i64 i = 0; i < batch; ++i) {
      const i64 np = b->kvp[i + 1] - b->kvp[i], last = b->last[i];
      if (last < 0 || last > ps || (np > 0 && last == 0) || np > i32_max) return 6;
      b->kv_lens[i] = np > 0 ? (np - 1) * ps + last : 0;
    }
  }
  i64 max_q = 0;
  for (i64 i = 0; i < batch; ++i) {
    const i64 q = b->qo[i + 1] - b->qo[i];
    if (q > b->kv_lens[i] || b->kv_lens[i] > i32_max) return 7;
    max_q = max64(max_q, q);
  }
  b->max_q_len = max_q;
  return 0;
}

/* The page-id pass over T ids (see scan_pages): branch-free, four independent maxima (the loop
 * is bound by the compare-and-move chain, not by memory). */
#define SCAN_PAGES(T)                                                        \
  do {                                                                       \
    const T* p = (const T*)b->pages;                                         \
    i64 any = 0, h0 = -1, h1 = -1, h2 = -1, h3 = -1, j = 0;                  \
    for (; j + 4 <= used; j += 4) {                                          \
      const i64 v0 = p[j], v1 = p[j + 1], v2 = p[j + 2], v3 = p[j + 3];      \
      any |= v0 | v1 | v2 | v3;                                              \
      h0 = max64(h0, v0);                                                    \
      h1 = max64(h1, v1);                                                    \
      h2 = max64(h2, v2);                                                    \
      h3 = max64(h3, v3);                                                    \
      if (out) STORE4(out + j, (i32)v0, (i32)v1, (i32)v2, (i32)v3);          \
    }                                                                        \
    for (; j < used; ++j) {                                                  \
      any |= p[j];                                                           \
      h0 = max64(h0, p[j]);                                                  \
      if (out) out[j] = (i32)p[j];                                           \
    }                                                                        \
    for (; j < b->num_pages; ++j) any |= p[j];                               \
    const i64 top = max64(max64(h0, h1), max64(h2, h3));                     \
    if (any < 0 || top == INT64_MAX) return 0; /* (Python counts INT64_MAX + 1) */ \
    b->max_page = top + 1;                                                   \
    return 1;                                                                \
  } while (0)

/* int64 page ids staged with AVX2 where the CPU has it (x86-64, GCC or Clang: the function
 * alone is compiled for AVX2 and called only after the CPU says it runs it; planner.py builds
 * without it, -DATTNCC_NO_AVX2, if the compiler refuses). Vectorised, the pass over the ids
 * takes about 60% of the scalar one's time (16K ids on the dev VM: ~6 -> ~3.5 us); with
 * SSE2 alone, what the file is compiled for, the vectorised pass was no faster. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(ATTNCC_NO_AVX2)
#define SCAN_AVX2 1
/* SCAN_PAGES(i64) for ids that all lie in [0, 2^31) (as a sane batch's do): their largest low
 * 32 bits is then the largest id, and that maximum vectorises. Returns 0, having set nothing
 * (but maybe copied the used ids), when some id lies outside: the caller's scalar pass then
 * decides (a negative id fails; larger ones need the 64-bit maximum). */
__attribute__((target("avx2"))) static int scan_pages_avx2(const i64* p, i64 used, i64 total,
                                                          i32* out, i64* max_page) {
  uint64_t bits = 0;
  i32 top = -1;
  if (out)
    for (i64 j = 0; j < used; ++j) {
      const i32 u = (i32)p[j];
      bits |= (uint64_t)p[j];
      top = u > top ? u : top;
      out[j] = u;
    }
  else
    for (i64 j = 0; j < used; ++j) {
      const i32 u = (i32)p[j];
      bits |= (uint64_t)p[j];
      top = u > top ? u : top;
    }
  for (i64 j = used; j < total; ++j) bits |= (uint64_t)p[j];
  if (bits >> 31) return 0;
  *max_page = (i64)top + 1;
  return 1;
}
#else
#define SCAN_AVX2 0
#endif

/* The page ids (paged layouts): 1 when every one is >= 0 (an OR of all: the sign bit), with
 * b->max_page = 1 + the largest of the used ones (the first kvp[batch]; 0 if none); the used
 * ones are copied to `out` as int32 (their low 32 bits, as numpy casts) in the same pass unless
 * out is NULL. Ragged: b->max_page is the tokens the cache must hold. */
static int scan_pages(batch_args* b, i32* out) {
  const i64 used = b->kvp[b->qo_size - 1];
  if (b->ragged) {
    b->max_page = used;
    return 1;
  }
  if (b->pages_int32) SCAN_PAGES(i32);
#if SCAN_AVX2
  if (__builtin_cpu_supports("avx2") &&
      scan_pages_avx2((const i64*)b->pages, used, b->num_pages, out, &b->max_page))
    return 1;
#endif
  SCAN_PAGES(i64);
}

/* Every check BatchAttention.plan makes on these arrays (index pointers, sizes, maxima, page
 * ids, last-page lengths, query tokens <= KV tokens, the packed plan's int32 range, the ragged
 * page table's room), and the KV lengths. Returns 0 when all pass; else a nonzero code, and the
 * caller runs the Python checks, which raise the exact error (this function holds no
 * messages). */
int attncc_check_batch(batch_args* b) {
  const int code = check_lengths(b);
  return code ? code : scan_pages(b, NULL) ? 0 : 8;
}

/* ------------------------------------------------------------------ BatchAttention.plan */

/* Where BatchAttention.plan stages a batch's tables after its packed plan: int32 word offsets in
 * the staging buffer (BatchAttention._offsets), and the buffer's size in words; and the word
 * ranges of the staging buffer a staged plan uses (what batch.used_ranges computes). */
typedef struct {
  i64 qo_indptr, kv_page_indptr, kv_lens, pages, size;
  i64 gap;        /* in: used ranges less than this many words apart are joined */
  i64 end;        /* out: one past the last used word (the last page id) */
  i64 num_ranges; /* out: ranges[2r] .. ranges[2r + 1], r < num_ranges, ascending */
  i64 ranges[4];  /* (the plan and the tables: two at most) */
} table_offsets;

/* The used words of a staged plan as batch.used_ranges lists them: the packed plan [0, its
 * end), then the tables [qo_indptr, end) unless empty, joined to the plan when they start less
 * than o->gap words after its end (coalesce_ranges; the same ranges for any qo_indptr >= 0). */
static void used_ranges(const plan_args* a, table_offsets* o) {
  i64 at[NUM_AT + 1];
  packed_offsets(a->off_dynamic, a->num_units, a->num_merges, at);
  const i64 plan_end = at[NUM_AT];
  o->ranges[0] = 0;
  o->ranges[1] = plan_end;
  o->num_ranges = 1;
  if (o->end <= o->qo_indptr) return;
  if (o->qo_indptr - plan_end < o->gap) {
    o->ranges[1] = max64(plan_end, o->end);
  } else {
    o->ranges[2] = o->qo_indptr;
    o->ranges[3] = o->end;
    o->num_ranges = 2;
  }
}

/* Whether the tables of batch b fit in the staging buffer at o's offsets. */
static int tables_fit(const batch_args* b, const table_offsets* o) {
  const i64 batch = b->qo_size - 1, pages = b->ragged ? batch : b->kvp[batch];
  return o->qo_indptr + batch + 1 <= o->size && o->kv_page_indptr + batch + 1 <= o->size &&
         o->kv_lens + batch <= o->size && o->pages + pages <= o->size;
}

/* The tables of a batch attncc_check_batch passed, as the int32 words BatchAttention._stage
 * writes: the query CSR, the page CSR and the used page ids (ragged: one "page" per request,
 * its first token; paged: unless scan_pages copied them, `pages_staged`), the KV lengths.
 * Values are cast as numpy casts them (the low 32 bits). */
static void stage_tables(const batch_args* b, const table_offsets* o, i32* buf,
                         int pages_staged) {
  const i64 batch = b->qo_size - 1;
  i32 *qo = buf + o->qo_indptr, *indptr = buf + o->kv_page_indptr;
  i32 *lens = buf + o->kv_lens, *pages = buf + o->pages;
  for (i64 i = 0; i <= batch; ++i) qo[i] = (i32)b->qo[i];
  for (i64 i = 0; i < batch; ++i) lens[i] = (i32)b->kv_lens[i];
  if (b->ragged) {
    for (i64 i = 0; i <= batch; ++i) indptr[i] = (i32)i;
    for (i64 i = 0; i < batch; ++i) pages[i] = (i32)b->kvp[i];
    return;
  }
  for (i64 i = 0; i <= batch; ++i) indptr[i] = (i32)b->kvp[i];
  if (pages_staged) return;
  const i64 used = b->kvp[batch];
  if (b->pages_int32) {
    memcpy(pages, b->pages, (size_t)used * sizeof(i32));
  } else {
    const i64* p = (const i64*)b->pages;
    for (i64 j = 0; j < used; ++j) pages[j] = (i32)p[j];
  }
}

/* The plan of checked batch b packed into buf (attncc_plan_pack), and when that succeeds b's
 * tables staged after it (o; they fit) and the used word ranges listed. */
static int plan_checked(plan_args* a, const batch_args* b, table_offsets* o, i32* buf,
                        void* scratch, i64 scratch_bytes, int pages_staged) {
  const i64 batch = b->qo_size - 1;
  a->batch = batch;
  a->qo = b->qo;
  a->kv = b->kv_lens;
  const int code = attncc_plan_pack(a, buf, scratch, scratch_bytes);
  if (code == 0) {
    stage_tables(b, o, buf, pages_staged);
    o->end = o->pages + (b->ragged ? batch : b->kvp[batch]);
    used_ranges(a, o);
  }
  return code;
}

/* BatchAttention.plan's host work for a batch attncc_check_batch passed (b, with the KV lengths
 * it computed), in one call: the plan packed into buf as attncc_plan_pack packs it (a: the
 * layout and the problem; the batch is b's), then b's tables staged after it and the used
 * word ranges listed (o). Returns attncc_plan_pack's code, or 3 when the tables would not fit
 * in the buffer (o->size words); nothing is written to buf unless it returns 0. */
int attncc_plan_batch(plan_args* a, const batch_args* b, table_offsets* o, i32* buf,
                      void* scratch, i64 scratch_bytes) {
  return tables_fit(b, o) ? plan_checked(a, b, o, buf, scratch, scratch_bytes, 0) : 3;
}

/* BatchAttention.plan's whole host work in one call, reading the inputs once where it can: the
 * checks of attncc_check_batch, then, when the batch's longest query is b->expect_max_q (the
 * one a's tiles were chosen for: a serving loop's every step), attncc_plan_batch's plan and
 * tables, the page ids copied to buf by the pass that checks them. Returns attncc_plan_batch's
 * codes (0: staged), 4 when the checks pass but the longest query is another (b->max_q_len:
 * choose the tiles, then attncc_plan_batch), 5 when a check fails (the caller's checks name
 * it). On a nonzero code buf holds no plan, though its page table words may have been
 * written. */
int attncc_plan_staged(plan_args* a, batch_args* b, table_offsets* o, i32* buf, void* scratch,
                       i64 scratch_bytes) {
  if (check_lengths(b) != 0) return 5;
  const int same_tiles = b->max_q_len == b->expect_max_q, fit = same_tiles && tables_fit(b, o);
  if (!scan_pages(b, fit ? buf + o->pages : NULL)) return 5;
  if (!same_tiles) return 4;
  return fit ? plan_checked(a, b, o, buf, scratch, scratch_bytes, 1) : 3;
}
