"""The backward's per-tile liveness masks (kernels/fa2/fa2_backward.cuh `bounds_mask`,
`band_mask`), compiled for the host from the shipped template text and checked element by
element against their definition: element (nf, i) of lane L's tile is live iff its query
q0 + 8 nf + 2 (L % 4) + (i & 1) < q_len, its key kv_row0 + L / 4 + 8 (i / 2) < kv_len, and
(band_mask) lo <= key - query <= hi. Exhaustive over lanes, column counts and tile positions
around the sequence ends and the band's edges, for causal, a sliding window, a two-sided band
and one-sided bands, with the bounds as constants and as run-time values (a captured width). Needs a host C++ compiler (skipped without one)."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from attncc.kernels import read_template

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")

_UNBOUNDED = 1 << 62

# (name, lo, hi): lo <= kv - q <= hi, an unbounded side as the codegen writes it (-+2^62)
_BANDS = [("causal", -_UNBOUNDED, 0), ("sliding_window_64", -64, 0), ("band_m5_p3", -5, 3),
          ("kv_at_least_q_minus_7", -7, _UNBOUNDED), ("kv_beyond_q", 1, _UNBOUNDED),
          ("huge_window", -(1 << 35), 0)]


def _functions(src: str) -> str:
    """BwdTileView, nf_prefix, bounds_mask and band_mask out of the template, as host C++."""
    view = re.search(r"struct BwdTileView \{.*?\n\};\n", src, re.S)
    masks = re.search(r"// The bits 4 nf \+ i of every column block nf with 8 nf < cols.*?"
                      r"(?=template <typename Variant, bool kMask, int NF>)", src, re.S)
    assert view and masks, "the template no longer has BwdTileView / bounds_mask / band_mask"
    return view.group(0) + masks.group(0)


_HARNESS = r"""
#include <algorithm>
#include <cstdio>
using std::min;
using std::max;
typedef unsigned int u32;
#define __device__
#define __forceinline__ inline
struct P { long long lo, hi; };
%(functions)s
%(variants)s
template <typename V, int NF>
long check(long long lo, long long hi, int* bad) {
  long n = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int q0 = -16; q0 <= 160; q0 += 3)
      for (int kv0 = -16; kv0 <= 160; kv0 += 5)
        for (int q_len = 0; q_len <= 200; q_len += 37)
          for (int kv_len = 0; kv_len <= 200; kv_len += 41) {
            BwdTileView t{0, 0, q0, kv0, q_len, kv_len, lane};
            const u32 in = bounds_mask<NF>(t), band = band_mask<V, NF>(t, P{lo, hi});
            for (int nf = 0; nf < NF; ++nf)
              for (int i = 0; i < 4; ++i) {
                const int q = q0 + t.q_col(nf, i), kv = t.kv_at(i);
                const bool want_in = q < q_len && kv < kv_len;
                const bool want_band = (long long)kv - q >= lo && (long long)kv - q <= hi;
                const int bit = nf * 4 + i;
                if ((((in >> bit) & 1u) != 0) != want_in || (((band >> bit) & 1u) != 0) != want_band) {
                  if (*bad < 5) std::printf("lane %%d q0 %%d kv0 %%d q_len %%d kv_len %%d nf %%d i %%d\n",
                                            lane, q0, kv0, q_len, kv_len, nf, i);
                  ++*bad;
                }
                ++n;
              }
          }
  return n;
}
int main() {
  int bad = 0;
  long n = 0;
%(calls)s
  std::printf("checked %%ld bad %%d\n", n, bad);
  return bad != 0;
}
"""


def _variant(name: str, lo: int, hi: int, runtime: bool) -> str:
    """A stand-in Variant: the band as constants (has_kv_window), or (runtime) as bounds the
    Params carry, read at run time (has_runtime_kv_window: a captured window width)."""
    bounded = f"runtime_kv_window_lo_bounded = {str(runtime and lo != -_UNBOUNDED).lower()}; " \
              f"static constexpr bool runtime_kv_window_hi_bounded = " \
              f"{str(runtime and hi != _UNBOUNDED).lower()};"
    return (f"struct V_{name}{'_rt' if runtime else ''} {{ using Params = P; "
            f"static constexpr bool has_kv_window = {str(not runtime).lower()}; "
            f"static constexpr bool has_runtime_kv_window = {str(runtime).lower()}; "
            f"static constexpr long long kv_window_lo = {lo if not runtime else -_UNBOUNDED}LL; "
            f"static constexpr long long kv_window_hi = {hi if not runtime else _UNBOUNDED}LL; "
            f"static constexpr bool {bounded} "
            f"static long long runtime_kv_window_lo(const P& p) {{ return p.lo; }} "
            f"static long long runtime_kv_window_hi(const P& p) {{ return p.hi; }} }};")


def test_tile_masks_match_their_definition(tmp_path) -> None:
    src = read_template("fa2/fa2_backward.cuh")
    variants = "\n".join(_variant(name, lo, hi, runtime) for name, lo, hi in _BANDS
                         for runtime in (False, True))
    calls = "\n".join(f"  n += check<V_{name}{'_rt' if rt else ''}, {nf}>({lo}LL, {hi}LL, &bad);"
                      for name, lo, hi in _BANDS for rt in (False, True) for nf in (2, 4, 8))
    cpp = tmp_path / "masks.cpp"
    cpp.write_text(_HARNESS % {"functions": _functions(src), "variants": variants,
                               "calls": calls})
    exe = tmp_path / "masks"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(exe), str(cpp)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "bad 0" in run.stdout, run.stdout[-2000:]
