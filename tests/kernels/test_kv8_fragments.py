"""The register-widened fp8 decode path's fragment algebra (kernels/fa2/fa2_kv8.cuh, Kv8Frags,
permute_q_cols, unpermute_o), replayed lane by lane in numpy with the PTX ISA's layouts of
ldmatrix (.b16, with and without .trans), movmatrix.trans and mma.m16n8k16: S = Q K^T and
O = P V of one 16-row fragment against 16 keys come out as the plain products. Values stand in
for the fp8 bytes (widening is exact: it only changes their encoding), so this checks which
lane holds which element, not arithmetic; tests/gpu/test_fp8_kv_gpu.py checks the kernels."""
from __future__ import annotations

import numpy as np
import pytest

LANES = range(32)


def ldmatrix(rows_of: list[np.ndarray]) -> np.ndarray:
    """ldmatrix.m8n8.b16 of matrices given as [8 rows][8 b16 elements] (each element a pair of
    bytes here: [8][8][2]): out[lane][m] = the pair of b16 elements (row lane/4, columns
    2(lane%4), +1) of matrix m, as [2 elements][2 bytes]."""
    out = np.zeros((32, len(rows_of), 2, 2))
    for m, mat in enumerate(rows_of):
        for t in LANES:
            out[t, m] = mat[t // 4, 2 * (t % 4): 2 * (t % 4) + 2]
    return out


def movmatrix_t(frag: np.ndarray) -> np.ndarray:
    """movmatrix.m8n8.trans.b16 of one 8x8 16-bit matrix held as frag[lane] = (elements
    2(lane%4), +1 of row lane/4)."""
    mat = np.zeros((8, 8))
    for t in LANES:
        mat[t // 4, 2 * (t % 4): 2 * (t % 4) + 2] = frag[t]
    return np.array([mat.T[t // 4, 2 * (t % 4): 2 * (t % 4) + 2] for t in LANES])


def mma(c: np.ndarray, a: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray:
    """mma.m16n8k16.row.col per lane: a[lane] = (a0, a1, a2, a3) pairs, b0/b1[lane] pairs,
    c[lane] = (c0, c1, c2, c3); rebuilt as matrices from the ISA's fragment layouts."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for t in LANES:
        g, k = t // 4, 2 * (t % 4)
        A[g, k:k + 2], A[g + 8, k:k + 2] = a[t, 0], a[t, 1]
        A[g, k + 8:k + 10], A[g + 8, k + 8:k + 10] = a[t, 2], a[t, 3]
        B[k:k + 2, g], B[k + 8:k + 10, g] = b0[t], b1[t]
        C[g, k:k + 2], C[g + 8, k:k + 2] = c[t, 0:2], c[t, 2:4]
    C = C + A @ B
    return np.array([np.concatenate([C[t // 4, 2 * (t % 4): 2 * (t % 4) + 2],
                                     C[t // 4 + 8, 2 * (t % 4): 2 * (t % 4) + 2]])
                     for t in LANES])


def permute_q_cols(q: np.ndarray) -> np.ndarray:
    """permute_q_cols: in each 16-column block the column pairs w0..w7 -> w0 w2 w4 w6 w1 w3 w5 w7."""
    out = q.copy()
    for c0 in range(0, q.shape[1], 16):
        words = [q[:, c0 + 2 * i: c0 + 2 * i + 2] for i in range(8)]
        out[:, c0:c0 + 16] = np.concatenate([words[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)], axis=1)
    return out


def unpermute_o(o: np.ndarray) -> np.ndarray:
    """unpermute_o over o[lane][n-fragment][4]: lane c of a quad takes its columns from lanes
    c/2 and 2 + c/2 (the CUDA's shuffles)."""
    out = o.copy()
    for t in LANES:
        c = t % 4
        lo, hi = (t & ~3) + c // 2, (t & ~3) + c // 2 + 2
        for q in range(o.shape[1] // 2):
            out[t, 2 * q] = o[lo, 2 * q + (c & 1)]
            out[t, 2 * q + 1] = o[hi, 2 * q + (c & 1)]
    return out


def standard_o(mat: np.ndarray) -> np.ndarray:
    """FA2's accumulator layout of a 16 x D matrix: n-fragment f holds columns 8f + 2c, +1."""
    d = mat.shape[1]
    return np.array([[np.concatenate([mat[t // 4, 8 * f + 2 * (t % 4): 8 * f + 2 * (t % 4) + 2],
                                      mat[t // 4 + 8, 8 * f + 2 * (t % 4): 8 * f + 2 * (t % 4) + 2]])
                      for f in range(d // 8)] for t in LANES])


@pytest.mark.parametrize("d", [128, 256])
def test_register_widened_fragments_give_s_and_o(d: int) -> None:
    rng = np.random.default_rng(d)
    q, k, v = rng.standard_normal((16, d)), rng.standard_normal((16, d)), rng.standard_normal((16, d))
    qp = permute_q_cols(q)

    def pairs(mat: np.ndarray, r0: int, chunk: int) -> np.ndarray:
        """Rows r0..r0+7, 16-byte chunk `chunk` of an fp8 matrix, as [8][8 b16][2 bytes]."""
        return mat[r0:r0 + 8, 16 * chunk:16 * chunk + 16].reshape(8, 8, 2)

    def q_frag(ks: int) -> np.ndarray:
        """ldmatrix_x4 of Q's k-step ks (16-bit rows: a b16 element is one value)."""
        mats = [qp[r0:r0 + 8, 16 * ks + h:16 * ks + h + 8][:, :, None].repeat(2, 2)
                for h in (0, 8) for r0 in (0, 8)]
        return ldmatrix(mats)[:, :, :, 0]  # [lane][a0..a3][2 values]

    # S = Q K^T: k_frags' x4 load at chunks 2j, 2j+1 -> b[n][ks] = (lo, hi) = bytes 4c..4c+3
    s = np.zeros((32, 2, 4))
    for j in range(d // 32):
        frags = ldmatrix([pairs(k, r0, 2 * j + h) for h in (0, 1) for r0 in (0, 8)])
        for m in range(4):
            n, ks = m & 1, m >> 1
            lo, hi = frags[:, m, 0], frags[:, m, 1]  # widen4: (x0, x1), (x2, x3)
            s[:, n] = mma(s[:, n], q_frag(2 * j + ks), lo, hi)
    np.testing.assert_allclose(s, standard_o(q @ k.T), rtol=1e-12, atol=1e-12)

    # O = P V: P in FA2's A layout (the S accumulators of n-fragments 0, 1), V by v_frags
    p = rng.standard_normal((16, 16))
    pf = standard_o(p)  # [lane][n-frag 0, 1][4]
    pa = np.stack([pf[:, 0, 0:2], pf[:, 0, 2:4], pf[:, 1, 0:2], pf[:, 1, 2:4]], axis=1)
    o = np.zeros((32, d // 8, 4))
    for qb in range(d // 16):
        frags = ldmatrix([pairs(v, 0, qb), pairs(v, 8, qb)])  # x2: rows 0-7, 8-15
        for h in (0, 1):
            b0 = movmatrix_t(frags[:, 0, h])
            b1 = movmatrix_t(frags[:, 1, h])
            o[:, 2 * qb + h] = mma(o[:, 2 * qb + h], pa, b0, b1)
    np.testing.assert_allclose(unpermute_o(o), standard_o(p @ v), rtol=1e-12, atol=1e-12)
