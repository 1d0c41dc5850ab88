"""The block masks a kernel with a mask_mod keeps (``Attention._block_mask``): made again exactly when the
call's sizes, the mask_mod's own values or its captured tensors (address, version) or the built-in mask's
diagonal and window (they weigh a forward's tile order) change, never for a new score_mod value (CPU: the
launcher's ``mask_blocks`` operator replaced by a recorder)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from flashgen import runtime  # noqa: E402
from flashgen.dsl.config import KernelConfig  # noqa: E402
from flashgen.mods import prepare_mods  # noqa: E402


def test_block_masks_are_made_once_per_mask_values(monkeypatch):
    made = []
    monkeypatch.setattr(runtime, "_mask_blocks", lambda q, k, handle, shape, words, tensors, offset, left, right:
                        made.append((words, offset, left, right)) or len(made))
    attn = runtime.Attention.__new__(runtime.Attention)
    attn.cfg, attn._handle, attn._block_masks = KernelConfig(dtype="bf16"), 0, {}
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    cap, edge = 30.0, 2  # captured numbers: run-time scalars of the mods

    def score(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    def mask(b, h, i, j):
        return (doc[i] == doc[j]) | (j < edge)

    q = k = torch.zeros(1, 6, 2, 8)

    def call(q=q, k=k, built_in=(0, -1, -1)):
        mods, (sa, ma) = prepare_mods(score, mask)
        words, tensors = mods.pack(sa, ma)
        return attn._block_mask(mods, q, k, words, tensors, built_in)

    first = call()
    cap = 50.0  # the score_mod's value: the same block mask
    assert call() == first and len(made) == 1
    edge = 3  # the mask_mod's value: a new one
    assert call() != first and len(made) == 2
    doc[5] = 1  # its captured tensor changed in place: a new one
    call()
    assert len(made) == 3
    call(k=torch.zeros(1, 5, 2, 8))  # another key length
    assert len(made) == 4
    call(built_in=(-1, 3, 0))  # another diagonal and window: made with them
    assert len(made) == 5 and made[-1][1:] == (-1, 3, 0)
    call(built_in=(-1, 3, 0))
    assert len(made) == 5
