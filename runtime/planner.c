/* attncc planner: the compiled twin of attncc.runtime.scheduler.plan (FlashInfer's Algorithm 1).
 *
 * Built on first use with the system C compiler (runtime/planner.py) and called through ctypes.
 * It must produce exactly what the numpy implementation produces -- same units, same slots, same
 * greedy order, same CTA queues -- so the two are interchangeable; tests compare them on random
 * batches. See the scheduler module docstring for the algorithm; the comments here only say how
 * each step is computed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef int32_t i32;

static i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

/* Phase 1: sizes. out[0] chunk, out[1] units, out[2] split items (merges), out[3] slots. */
void attncc_plan_sizes(i64 batch, const i64* qo, const i64* kv, i64 g, i64 hk, i64 tile_q,
                       i64 num_ctas, i64 align, i64 floor_, i64* out) {
  i64 work = 0;
  for (i64 i = 0; i < batch; ++i) work += ceil_div((qo[i + 1] - qo[i]) * g, tile_q) * kv[i];
  i64 raw = ceil_div(work, num_ctas);
  i64 chunk = ceil_div(raw > floor_ ? raw : floor_, align) * align;
  const i64 cap = (i64)2147483647 / align * align;
  if (chunk > cap) chunk = cap;
  i64 units = 0, merges = 0, slots = 0;
  for (i64 i = 0; i < batch; ++i) {
    const i64 nt = ceil_div((qo[i + 1] - qo[i]) * g, tile_q);
    if (nt == 0) continue;
    i64 nc = ceil_div(kv[i], chunk);
    if (nc < 1) nc = 1;
    units += hk * nt * nc;
    if (nc > 1) {
      merges += hk * nt;
      slots += hk * nt * nc;
    }
  }
  out[0] = chunk;
  out[1] = units;
  out[2] = merges;
  out[3] = slots;
}

static const i64* g_sort_ticks; /* qsort context: ticks of each group */

static int by_ticks_desc(const void* a, const void* b) {
  const i64 ga = *(const i64*)a, gb = *(const i64*)b;
  const i64 ta = g_sort_ticks[ga], tb = g_sort_ticks[gb];
  if (ta != tb) return ta > tb ? -1 : 1;
  return ga < gb ? -1 : (ga > gb); /* stable: group id ascending */
}

/* Min-heap (4-ary: half the depth of a binary heap, and the child minimum compiles to
 * conditional moves) of CTA keys (load << bits) | cta with 2^bits >= P: unique and ordered like
 * (load, cta), and the CTA is a mask away (no 64-bit division in the loop). The scheduler's tick
 * budget keeps sum(ticks) * P < 2^62, so the shifted loads stay below 2^63. A sorted array is a
 * valid heap. */
static void sift_down(i64* h, i64 n, i64 i) {
  const i64 x = h[i];
  for (;;) {
    const i64 c = 4 * i + 1;
    if (c >= n) break;
    i64 m = c;
    if (c + 3 < n) {
      const i64 a = h[c] <= h[c + 1] ? c : c + 1;
      const i64 b = h[c + 2] <= h[c + 3] ? c + 2 : c + 3;
      m = h[a] <= h[b] ? a : b;
    } else {
      for (i64 k = c + 1; k < n; ++k) m = h[k] < h[m] ? k : m;
    }
    if (h[m] >= x) break;
    h[i] = h[m];
    i = m;
  }
  h[i] = x;
}

static int cmp_i64(const void* a, const void* b) {
  const i64 x = *(const i64*)a, y = *(const i64*)b;
  return x < y ? -1 : (x > y);
}

/* Phase 2: fill the plan. units: [n][8] int32; cta_indptr [P+1]; cta_units [n];
 * merge_indptr [m+1]; merge_out [m][5]. scratch: int64 [4n + 12*batch + 2P]. Returns 0. */
int attncc_plan_fill(i64 batch, const i64* qo, const i64* kv, i64 g, i64 hk, i64 tile_q,
                     i64 num_ctas, double alpha, double beta, i64 chunk, i64 n, i32* units,
                     i32* cta_indptr, i32* cta_units, i32* merge_indptr, i32* merge_out,
                     i64* scratch) {
  const i64 P = num_ctas;
  i64* unit_group = scratch;          /* [n] */
  i64* order = scratch + n;           /* [n] */
  i64* assign = scratch + 2 * n;      /* [n] */
  i64* tick = scratch + 3 * n;        /* [n]: ticks of the units in greedy order */
  i64* g_count = scratch + 4 * n;     /* [4 batch] */
  i64* g_ticks = g_count + 4 * batch; /* [4 batch] */
  i64* gl = g_ticks + 4 * batch;      /* [4 batch]: groups in greedy order */
  i64* heap = gl + 4 * batch;         /* [P] */
  i64* fill = heap + P;               /* [P] */

  /* units in (request, kv_head, tile, chunk) order; slots numbered over split requests */
  i64 u = 0, slot = 0, m = 0;
  merge_indptr[0] = 0;
  double dot_rows = 0.0, dot_kv = 0.0;
  i64 rows_nc = 0, nt_kv = 0;
  for (i64 i = 0; i < batch; ++i) {
    const i64 rows = (qo[i + 1] - qo[i]) * g;
    const i64 nt = ceil_div(rows, tile_q);
    i64 nc = nt > 0 ? ceil_div(kv[i], chunk) : 0;
    if (nt > 0 && nc < 1) nc = 1;
    rows_nc += rows * nc;
    nt_kv += nt * kv[i];
    const int split = kv[i] > chunk;
    for (i64 h = 0; h < hk; ++h)
      for (i64 t = 0; t < nt; ++t) {
        const i64 q_start = t * tile_q;
        const i64 q_rows = rows - q_start < tile_q ? rows - q_start : tile_q;
        const int last_tile = q_start + tile_q >= rows;
        if (nc > 1) {
          i32* mo = merge_out + 5 * m;
          mo[0] = (i32)i; mo[1] = (i32)h; mo[2] = (i32)qo[i]; mo[3] = (i32)q_start;
          mo[4] = (i32)q_rows;
          merge_indptr[m + 1] = (i32)(merge_indptr[m] + nc);
          ++m;
        }
        for (i64 c = 0; c < nc; ++c, ++u) {
          const i64 ks = c * chunk, ke = ks + chunk;
          i32* w = units + 8 * u;
          w[0] = (i32)i; w[1] = (i32)h; w[2] = (i32)qo[i]; w[3] = (i32)q_start;
          w[4] = (i32)q_rows; w[5] = (i32)ks; w[6] = (i32)(ke < kv[i] ? ke : kv[i]);
          w[7] = split ? (i32)slot++ : -1;
          unit_group[u] = 4 * i + 2 * last_tile + (ke >= kv[i]);
        }
      }
  }
  dot_rows = (double)rows_nc;
  dot_kv = (double)nt_kv;

  /* cost groups: count and ticks = rint(cost * 2^61 / (P * total)), as cost_ticks does */
  const double total = (double)hk * (alpha * dot_rows + beta * dot_kv);
  const double scale = total > 0.0 ? 2305843009213693952.0 / ((double)P * total) : 0.0;
  for (i64 i = 0; i < batch; ++i) {
    const i64 rows = (qo[i + 1] - qo[i]) * g;
    const i64 nt = ceil_div(rows, tile_q);
    i64 nc = nt > 0 ? ceil_div(kv[i], chunk) : 0;
    if (nt > 0 && nc < 1) nc = 1;
    const i64 full_t = nt - 1, full_c = nc - 1, heads = nt > 0 ? hk : 0;
    i64* cnt = g_count + 4 * i;
    cnt[0] = full_t * full_c * heads;
    cnt[1] = full_t * heads;
    cnt[2] = full_c * heads;
    cnt[3] = heads;
    const double last_rows = alpha * (double)(rows - full_t * tile_q);
    const double last_len = beta * (double)(kv[i] - full_c * chunk);
    double cost[4];
    cost[0] = alpha * (double)tile_q + beta * (double)chunk;
    cost[1] = alpha * (double)tile_q + last_len;
    cost[2] = last_rows + beta * (double)chunk;
    cost[3] = last_rows + last_len;
    for (int k = 0; k < 4; ++k) {
      const double cst = cnt[k] == 0 ? 0.0 : cost[k];
      g_ticks[4 * i + k] = total > 0.0 ? (i64)llrint(cst * scale) : 0;
    }
  }

  /* greedy order: groups by ticks descending (then id), units of a group by index */
  i64 ng = 0;
  for (i64 k = 0; k < 4 * batch; ++k)
    if (g_count[k] > 0) gl[ng++] = k;
  g_sort_ticks = g_ticks;
  qsort(gl, (size_t)ng, sizeof(i64), by_ticks_desc);
  /* start offset of each group in the order (g_count becomes each group's write position) */
  i64 pos = 0;
  for (i64 r = 0; r < ng; ++r) {
    const i64 k = gl[r];
    const i64 c = g_count[k];
    g_count[k] = pos; /* now: next write position of group k */
    pos += c;
  }
  for (i64 v = 0; v < n; ++v) order[g_count[unit_group[v]]++] = v;
  for (i64 v = 0; v < n; ++v) tick[v] = g_ticks[unit_group[order[v]]];

  /* LPT: each unit to the least loaded CTA (ties: lowest index). A run of equal ticks is dealt
   * round robin in load order when all loads are within one unit of each other (then every
   * CTA gets one unit before any gets two, exactly as the heap would do). */
  int bits = 0;
  while (((i64)1 << bits) < P) ++bits;
  const i64 mask = ((i64)1 << bits) - 1;
  for (i64 c = 0; c < P; ++c) heap[c] = c;
  int sorted = 1; /* heap[] is also in ascending order (true at the start and after a deal) */
  i64 t = 0;
  while (t < n) {
    const i64 st = tick[t] << bits;
    if (st == 0) { /* the rest cost nothing: the least loaded CTA takes them all */
      const i64 cta = heap[0] & mask;
      for (; t < n; ++t) assign[t] = cta;
      break;
    }
    i64 e = t + 1;
    while (e < n && tick[e] == tick[t]) ++e;
    if (e - t >= P) {
      i64 mx = heap[0];
      for (i64 c = 1; c < P; ++c) mx = heap[c] > mx ? heap[c] : mx;
      if (mx - heap[0] < st) {
        if (!sorted) qsort(heap, (size_t)P, sizeof(i64), cmp_i64); /* load order */
        const i64 k = e - t, q = k / P, r = k % P;
        for (i64 j = 0, c = 0; j < k; ++j, c = c + 1 == P ? 0 : c + 1)
          assign[t + j] = heap[c] & mask;
        /* the first r CTAs got q + 1 units, the rest q; loads were within one unit, so the
         * new ascending order is the rest followed by the first r: rotate, stay sorted */
        for (i64 c = 0; c < P; ++c) heap[c] += (q + (c < r)) * st;
        if (r) {
          memcpy(fill, heap, (size_t)r * sizeof(i64));
          memmove(heap, heap + r, (size_t)(P - r) * sizeof(i64));
          memcpy(heap + (P - r), fill, (size_t)r * sizeof(i64));
        }
        sorted = 1;
        t = e;
        continue;
      }
    }
    sorted = 0;
    for (; t < e; ++t) {
      assign[t] = heap[0] & mask;
      heap[0] += st;
      sift_down(heap, P, 0);
    }
  }

  /* per-CTA queues in assignment order (a stable counting sort by CTA) */
  for (i64 c = 0; c <= P; ++c) cta_indptr[c] = 0;
  for (i64 v = 0; v < n; ++v) cta_indptr[assign[v] + 1]++;
  for (i64 c = 0; c < P; ++c) cta_indptr[c + 1] += cta_indptr[c];
  for (i64 c = 0; c < P; ++c) fill[c] = cta_indptr[c];
  for (i64 v = 0; v < n; ++v) cta_units[fill[assign[v]]++] = (i32)order[v];
  return 0;
}
