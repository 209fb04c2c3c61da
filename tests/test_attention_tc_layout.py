"""The fragment mapping of attention_gpu.mojo's tensor-core kernel, replayed in NumPy with
m16n8k16's lane layout (the one moe_gpu.mojo relies on, checked on the GPU there): permuted dim
pairs for Q K^T, the C -> A reuse of the scores as P, V's B fragments paired from four key rows,
the quad-wide online softmax and the un-permuted output. Catches index slips in the design; the
Mojo kernel itself is checked on a GPU by bench/attention.py."""

from __future__ import annotations

import numpy as np
import pytest

NEG = -1e30


def _tc_attention(Q, K, V, scale):
    heads, dim = Q.shape
    n_keys = K.shape[0]
    m = np.full(32, NEG)
    l_part = np.zeros(32)
    acc = np.zeros((8, 32, 2))  # n-tile j, lane, c0/c1
    kbase = 0
    while kbase < n_keys:
        sc = np.full((32, 4), NEG)
        for grp in range(2):
            S = np.zeros((16, 8))
            for ks in range(4):
                A, B = np.zeros((16, 16)), np.zeros((16, 8))
                for lane in range(32):
                    g, q4 = lane >> 2, lane & 3
                    pa, pb = 8 * q4 + 2 * ks, 8 * q4 + 2 * ks + 1
                    A[g, 2 * q4 : 2 * q4 + 2] = Q[g, 2 * pa : 2 * pa + 2]
                    A[g, 2 * q4 + 8 : 2 * q4 + 10] = Q[g, 2 * pb : 2 * pb + 2]
                    key = kbase + 8 * grp + g
                    row = K[key] if key < n_keys else np.zeros(dim)
                    B[2 * q4 : 2 * q4 + 2, g] = row[2 * pa : 2 * pa + 2]
                    B[2 * q4 + 8 : 2 * q4 + 10, g] = row[2 * pb : 2 * pb + 2]
                S = S + A @ B
            for lane in range(32):
                g, q4 = lane >> 2, lane & 3
                for i in range(2):
                    if kbase + 8 * grp + 2 * q4 + i < n_keys:
                        sc[lane, 2 * grp + i] = S[g, 2 * q4 + i] * scale
        quad_max = [max(sc[4 * (lane >> 2) + x].max() for x in range(4)) for lane in range(32)]
        p = np.zeros((32, 4))
        for lane in range(32):
            m_new = max(m[lane], quad_max[lane])
            corr = np.exp(m[lane] - m_new)
            m[lane] = m_new
            p[lane] = np.exp(sc[lane] - m_new)
            l_part[lane] = l_part[lane] * corr + p[lane].sum()
            acc[:, lane, :] *= corr
        A = np.zeros((16, 16))
        for lane in range(32):
            g, q4 = lane >> 2, lane & 3
            A[g, 2 * q4 : 2 * q4 + 2] = p[lane, 0:2]
            A[g, 2 * q4 + 8 : 2 * q4 + 10] = p[lane, 2:4]
        for j in range(8):
            B = np.zeros((16, 8))
            for lane in range(32):
                g, q4 = lane >> 2, lane & 3
                for i in range(4):
                    k_row = 2 * q4 + (i & 1) + 8 * (i >> 1)
                    key = kbase + k_row
                    B[k_row, g] = V[key, 8 * g + j] if key < n_keys else 0.0
            C = A @ B
            for lane in range(32):
                g, q4 = lane >> 2, lane & 3
                acc[j, lane] += C[g, 2 * q4 : 2 * q4 + 2]
        kbase += 16
    out, norm = np.zeros((heads, dim)), np.zeros(heads)
    for lane in range(32):
        g, q4 = lane >> 2, lane & 3
        norm[g] += l_part[lane]
        for j in range(8):
            for i in range(2):
                out[g, 8 * (2 * q4 + i) + j] = acc[j, lane, i]
    return out / norm[:, None]


@pytest.mark.parametrize("n_keys", [1, 8, 16, 17, 37, 100])
def test_tc_fragment_mapping_computes_attention(n_keys):
    rng = np.random.default_rng(n_keys)
    Q, K, V = (rng.standard_normal(shape) for shape in ((8, 64), (n_keys, 64), (n_keys, 64)))
    scale = 64**-0.5
    logits = scale * Q @ K.T
    w = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(_tc_attention(Q, K, V, scale), (w @ V) / w.sum(1, keepdims=True), atol=1e-12)
