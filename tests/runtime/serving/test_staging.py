"""runtime/serving/staging.py: the workspace's int32 word map, the page tables' staging and the
two staging halves plans take in turn (CPU, pure; the CUDA copies are pinned by
tests/test_batch.py's Uploader tests and tests/gpu/test_batch.py)."""
from __future__ import annotations

import numpy as np
import pytest

from attncc.runtime.serving.plan.checks import check_batch
from attncc.runtime.serving.plan.scheduler import PlanLayout
from attncc.runtime.serving.staging import Staging, int_words, stage_tables, table_offsets

TABLES = ("qo_indptr", "kv_page_indptr", "kv_lens", "kv_pos", "q_pos", "pages")


@pytest.mark.parametrize("max_batch,max_q,max_pages", [(1, 1, 1), (4, 64, 10), (255, 16384, 1 << 20),
                                                       (256, 17, 3)])
def test_tables_fit_disjoint_and_aligned(max_batch: int, max_q: int, max_pages: int) -> None:
    """After the plan's room, each table starts 16-byte aligned, holds its maximum (batch + 1
    indptr entries, batch lengths and offsets, max_qo_tokens positions, max_pages ids) without
    reaching the next, and the last ends within int_words."""
    lay = PlanLayout(max_batch, max_q, 8, 4, 2, 16)
    o = table_offsets(lay, max_batch, max_q)
    assert list(o) == list(TABLES) and o["qo_indptr"] == lay.size
    room = {"qo_indptr": max_batch + 1, "kv_page_indptr": max_batch + 1, "kv_lens": max_batch,
            "kv_pos": max_batch, "q_pos": max_q, "pages": max_pages}
    ends = [o[t] + room[t] for t in TABLES]
    assert all(o[t] % 4 == 0 for t in TABLES)
    assert all(ends[i] <= o[TABLES[i + 1]] for i in range(len(TABLES) - 1))
    assert ends[-1] <= int_words(lay, max_batch, max_q, max_pages) < ends[-1] + 4


@pytest.mark.parametrize("layout", ["NHD", "ragged"])
@pytest.mark.parametrize("positions", [False, True])
def test_stage_tables_writes_only_the_tables(layout: str, positions: bool) -> None:
    """A poisoned buffer gets each table's entries at its offset and nothing else: every other
    word keeps its poison."""
    ragged = layout == "ragged"
    kw = dict(q_positions=[0, 3, 4, 6, 7, 8] if positions else None,
              kv_position_offset=[2, 0, 5] if positions else None)
    if ragged:
        b = check_batch([0, 1, 4, 6], [0, 5, 9, 30], None, None, kv_layout="ragged",
                        num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=1, **kw)
    else:
        b = check_batch([0, 1, 4, 6], [0, 1, 3, 5], [9, 4, 2, 7, 7], [5, 16, 3],
                        kv_layout="NHD", num_qo_heads=4, num_kv_heads=2, head_dim=64,
                        page_size=16, **kw)
    lay = PlanLayout(8, 32, 4, 4, 2, 16)
    o = table_offsets(lay, 8, 32)
    buf = np.full(int_words(lay, 8, 32, 16), -99, dtype=np.int32)
    stage_tables(buf, b, o)
    want = np.full_like(buf, -99)
    written = {"qo_indptr": b.qo, "kv_page_indptr": b.page_indptr, "kv_lens": b.kv_lens,
               "pages": b.pages[:int(b.page_indptr[-1])]}
    if positions:
        written.update(kv_pos=b.kvoff, q_pos=b.qpos)
    for name, values in written.items():
        want[o[name]:o[name] + len(values)] = values
    assert buf.tolist() == want.tolist()


class _Uploader:
    """Records the halves staging waits for."""

    def __init__(self) -> None:
        self.waits: list[int] = []

    def wait(self, half: int) -> None:
        self.waits.append(half)


def test_halves_alternate_and_the_buffer_grows_only_when_needed() -> None:
    """Plans take the halves in turn, each waiting for the copies out of its own half only; a
    layout that fits keeps the buffer (and its addresses), one that does not gets a new buffer
    after waiting for both halves' copies."""
    st, up = Staging(), _Uploader()
    small, big = PlanLayout(4, 64, 2, 1, 1, 16), PlanLayout(64, 4096, 32, 8, 2, 16)

    def take() -> tuple[int, np.ndarray]:
        half, buf, offsets = st.take(up)
        assert offsets is st.offsets
        st.commit(half, buf)
        return half, buf

    st.fit(small, 100, {"n": 100}, up, pinned=False)
    assert up.waits == [0, 1] and st.layout is small   # (a new buffer: both halves)
    (h0, b0), (h1, b1), (h2, b2) = take(), take(), take()
    assert (h0, h1, h2) == (0, 1, 0) and b2 is b0 and b1 is not b0 and st.current is b2
    assert up.waits[2:] == [0, 1, 0] and b0.size == 100 and not b0.any()
    buffer, at = st.buffer, st.halves_at
    st.fit(PlanLayout(4, 64, 2, 1, 1, 16), 80, {"n": 80}, up, pinned=False)  # fits
    assert st.buffer is buffer and st.halves_at == at and st.offsets == {"n": 80}
    assert take() == (1, b1) and up.waits[5:] == [1]
    st.fit(big, 5000, {"n": 5000}, up, pinned=False)    # does not fit: a new buffer
    assert st.buffer is not buffer and up.waits[6:] == [0, 1]
    half, buf = take()
    assert half == 0 and buf.size == 5000 and st.halves_at[1] - st.halves_at[0] == 4 * 5000
    assert st.halves[0].ctypes.data == st.halves_at[0]


def test_staging_without_copies_waits_for_nothing() -> None:
    st = Staging()
    st.fit(PlanLayout(4, 64, 2, 1, 1, 16), 10, {}, None, pinned=False)
    half, buf, _ = st.take(None)
    assert half == 0 and buf.size == 10 and not buf.any()
