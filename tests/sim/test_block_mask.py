"""The numpy block mask (flashgen.sim.block_mask) against brute force over the torch functions.

Per (batch, head, query block): the range [lo, hi) of key blocks holding a kept score ([0, 0) when
none does), then per key block 0 empty / 1 partial / 2 full over the scores inside both sequences;
batch and head extents 1 where the mask_mod ignores them. The GPU's builder is checked against the
mask_mods on a device (tests/gpu/test_mods.py).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from flashgen.attention.score_mask import ScoreMask
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.sim import block_mask as bm


def doc_mask(b, h, q_idx, kv_idx):
    return (q_idx // 7 == kv_idx // 7) | (kv_idx < 2)


def per_head(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx - 3 * h) & (kv_idx + b >= 2)


def nothing(b, h, q_idx, kv_idx):
    return kv_idx < 0


def _brute(fn, batch, heads, seq_q, seq_k, B_r, B_c):
    n_qb, n_kb = -(-seq_q // B_r), -(-seq_k // B_c)
    out = np.zeros((batch, heads, n_qb, 2 + n_kb), np.int32)
    for b, h in itertools.product(range(batch), range(heads)):
        keep = fn(torch.tensor(b), torch.tensor(h), torch.arange(seq_q)[:, None], torch.arange(seq_k)[None, :])
        keep = np.broadcast_to(keep.numpy(), (seq_q, seq_k))
        for qb in range(n_qb):
            classes = []
            for kb in range(n_kb):
                blk = keep[qb * B_r: (qb + 1) * B_r, kb * B_c: (kb + 1) * B_c]
                classes.append(2 if blk.all() else (1 if blk.any() else 0))
            kept = [kb for kb, c in enumerate(classes) if c]
            out[b, h, qb] = [kept[0] if kept else 0, kept[-1] + 1 if kept else 0] + classes
    return out


@pytest.mark.parametrize("fn, uses", [(doc_mask, ""), (per_head, "bh"), (nothing, "")], ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("seq_q, seq_k, B_r, B_c", [(37, 45, 16, 8), (64, 64, 16, 16), (5, 70, 64, 32)])
def test_block_mask_equals_brute_force(fn, uses, seq_q, seq_k, B_r, B_c):
    mods, (_, args) = prepare_mods(mask_mod=fn)
    sm = ScoreMask("none", B_r, B_c, mods)
    batch, heads = 2, 3
    got = bm.block_mask(sm, args.values(), batch, heads, seq_q, seq_k)
    want = _brute(fn, batch, heads, seq_q, seq_k, B_r, B_c)
    assert got.shape == mods.block_mask_shape(batch, heads, seq_q, seq_k, B_r, B_c)
    assert got.shape[:2] == (batch if "b" in uses else 1, heads if "h" in uses else 1)
    np.testing.assert_array_equal(got, want[: got.shape[0], : got.shape[1]])
    for b, h in itertools.product(range(batch), range(heads)):  # the row a tile of (b, h) reads
        for qb in range(got.shape[2]):
            np.testing.assert_array_equal(bm.row(sm, got, b, h, qb), want[b, h, qb])


def test_clip_narrows_to_the_row_and_never_reverses():
    r = np.array([2, 5, 0, 0, 1, 2, 1, 0], np.int32)
    assert bm.clip(r, 0, 6) == (2, 5)
    assert bm.clip(r, 3, 4) == (3, 4)
    assert bm.clip(r, 5, 6) == (5, 5)
    assert bm.clip(np.array([0, 0, 0], np.int32), 0, 1) == (0, 0)
    assert bm.clip(None, 1, 3) == (1, 3)


def test_block_mask_refuses_bad_sizes():
    mods, (_, args) = prepare_mods(mask_mod=doc_mask)
    with pytest.raises(ValueError, match="sizes must be positive"):
        bm.block_mask(ScoreMask("none", 16, 16, mods), args.values(), 1, 1, 0, 4)


@pytest.mark.parametrize("fn, uses", [(doc_mask, ""), (per_head, "bh"), (nothing, "")], ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("seq_q, seq_k, B_r, B_c", [(37, 45, 16, 8), (45, 37, 8, 16), (70, 5, 32, 64)])
def test_the_backwards_block_mask_is_the_transposed_brute_force(fn, uses, seq_q, seq_k, B_r, B_c):
    """A row per key block: [lo, hi) of the query blocks holding a kept score, then a class per query block."""
    mods, (_, args) = prepare_mods(mask_mod=fn)
    batch, heads = 2, 3
    got = bm.block_mask(ScoreMask("none", B_r, B_c, mods), args.values(), batch, heads, seq_q, seq_k, transposed=True)
    assert got.shape == mods.block_mask_shape(batch, heads, seq_q, seq_k, B_r, B_c, transposed=True)
    assert got.shape[:2] == (batch if "b" in uses else 1, heads if "h" in uses else 1)
    forward = _brute(fn, batch, heads, seq_q, seq_k, B_r, B_c)[: got.shape[0], : got.shape[1]]
    classes = forward[..., 2:].swapaxes(2, 3)  # [b, h, key block, query block]
    np.testing.assert_array_equal(got[..., 2:], classes)
    for b, h, kb in np.ndindex(*classes.shape[:3]):
        kept = np.flatnonzero(classes[b, h, kb])
        assert tuple(got[b, h, kb, :2]) == ((kept[0], kept[-1] + 1) if kept.size else (0, 0))


def _view(fn, batch, heads, seq_q, seq_k, B_r, B_c, b, group_heads):
    mods, (_, args) = prepare_mods(mask_mod=fn)
    sm = ScoreMask("none", B_r, B_c, mods)
    return bm.BackwardView(sm, bm.block_mask(sm, args.values(), batch, heads, seq_q, seq_k, transposed=True), b, group_heads)


@pytest.mark.parametrize("fn", [doc_mask, per_head, nothing], ids=lambda f: f.__name__)
def test_a_backward_cta_keeps_every_query_block_any_head_of_its_group_keeps_a_score_in(fn):
    """BackwardView.clip: the query blocks of [begin, end) from the first to the last one in which a score of key
    block kb is kept for some head of the group (brute force; an empty range where there is none); the deterministic
    variant's range stays whole.
    masked: exactly the blocks that are not full for that head, or that the built-in rule masks."""
    seq_q, seq_k, B_r, B_c, heads = 53, 40, 8, 16, 4
    n_qb = -(-seq_q // B_r)
    for b, group in ((0, (0, 1)), (1, (2, 3))):
        view = _view(fn, 2, heads, seq_q, seq_k, B_r, B_c, b, group)
        for kb in range(-(-seq_k // B_c)):
            keep = [[fn(torch.tensor(b), torch.tensor(h), torch.arange(qb * B_r, min(seq_q, (qb + 1) * B_r))[:, None],
                        torch.arange(kb * B_c, min(seq_k, (kb + 1) * B_c))[None, :]) for qb in range(n_qb)] for h in group]
            kept = [qb for qb in range(n_qb) if any(bool(keep[g][qb].any()) for g in range(len(group)))]
            for begin, end in ((0, n_qb), (2, n_qb - 1), (3, 3)):
                inside = [qb for qb in kept if begin <= qb < end]
                got = view.clip(kb, begin, end, deterministic=False)
                assert got == (inside[0], inside[-1] + 1) if inside else got[0] == got[1], (kb, begin, end, got)
                assert view.clip(kb, begin, end, deterministic=True) == (begin, end)
            for g, qb in itertools.product(range(len(group)), range(n_qb)):
                full = bool(torch.broadcast_to(keep[g][qb], (min(seq_q, (qb + 1) * B_r) - qb * B_r, min(seq_k, (kb + 1) * B_c) - kb * B_c)).all())
                assert view.masked(g, kb, qb, needs=False) == (not full)
                assert view.masked(g, kb, qb, needs=True)
    none = bm.BackwardView(ScoreMask("none", B_r, B_c, prepare_mods(mask_mod=fn)[0]), None, 0, (0,))
    assert none.clip(1, 2, 5, deterministic=False) == (2, 5) and none.masked(0, 1, 2, needs=False)


def _band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx >= 40 * h) & (q_idx - kv_idx < 100)


@pytest.mark.parametrize("engine", ["mma_sync", "wgmma"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_simulators_walk_the_block_masks_query_blocks(engine, deterministic):
    """A simulated backward CTA given the block mask walks the query blocks of its range that any head of its group
    keeps a score in (the built-in range whole where deterministic: key_rank counts every key block of it)."""
    from flashgen.dsl.backward_config import BackwardConfig
    from flashgen.dsl.backward_plan import make_backward_plan
    from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
    from flashgen.sim.backward_cta import BwdHeadData, BwdProblem, _BwdCta, trace_backward
    from flashgen.sim.hopper_backward_cta import HopperBwdCta

    mods, (_, args) = prepare_mods(mask_mod=_band)
    cfg = (BackwardConfig("fp16", d_head=64) if engine == "mma_sync" else BackwardConfig.wgmma("fp16", 64)).replace(deterministic=deterministic)
    plan = (make_backward_plan if engine == "mma_sync" else make_hopper_backward_plan)(cfg, mods)
    seq_q, seq_k, d = 300, 260, 64
    mask = bm.block_mask(plan.score_mask, args.values(), 1, 4, seq_q, seq_k, transposed=True)
    n_qb = -(-seq_q // cfg.B_r)
    heads = [BwdHeadData(np.zeros((seq_q, d), np.uint16), np.zeros((seq_q, d), np.uint16), np.zeros(seq_q, np.float32),
                         np.zeros(seq_q, np.float32)) for _ in range(2)]
    kv = np.zeros((seq_k, d), np.uint16)
    dq = [np.zeros((seq_q, d), np.float32) for _ in heads]
    walked = set()
    for kb, h0 in itertools.product(range(-(-seq_k // cfg.B_c)), (0, 2)):
        view = bm.BackwardView(plan.score_mask, mask, 0, (h0, h0 + 1))
        prob = BwdProblem(seq_q, seq_k, kb)
        if engine == "mma_sync":
            cta = _BwdCta(plan, prob, trace_backward(plan), kv, kv, heads, dq, 1.0, block_mask=view)
        else:
            stats = [(np.zeros(n_qb * cfg.B_r, np.float32),) * 2 for _ in heads]
            cta = HopperBwdCta(plan, prob, kv, kv, heads, stats, dq, 1.0, block_mask=view)
        kept = [qb for qb in range(n_qb) if any(mask[0, h, kb, 2 + qb] for h in (h0, h0 + 1))]
        blocks = range(n_qb) if deterministic else range(kept[0], kept[-1] + 1) if kept else range(0)
        assert sorted(cta.work) == [(g, qb) for g in range(2) for qb in blocks], (kb, h0)
        walked.add(len(blocks))
    assert walked == {n_qb} if deterministic else len(walked) > 2 and 0 in walked  # ranges of several lengths, an empty one
