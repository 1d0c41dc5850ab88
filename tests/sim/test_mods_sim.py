"""Both simulators run plans built with a score_mod / mask_mod (examples/mods.py) and match float64
attention of the same functions, computed by torch from the functions themselves, on odd lengths,
several (batch, head) pairs, with and without the built-in causal mask.

With the numpy block mask (:mod:`flashgen.sim.block_mask`) a tile skips the key blocks the mask_mod
empties and the mask math of full ones; without it (row None) every block is partial. Both must pass,
and agree closely: not bit for bit, since every visited block (without the block mask an empty one too) multiplies the row
sum by ``ex2(fma(m, k, -m k))``, 2 to the rounding error of ``m k``, within an ulp of 1. Tolerance: :func:`flashgen.sim.cta.compare_with_reference` (the simulators' rule).
"""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest
import torch

from flashgen.dsl.config import KernelConfig
from flashgen.dsl.notation import parse_config
from flashgen.engines import make_plan
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.sim import block_mask as bm
from flashgen.sim import cta, hopper
from flashgen.sim import hardware as hw
from flashgen.sim.copies import trace_plan

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

HEADS = 4
MMA = parse_config("(BF16, 128, 64, 32, 4): swizzled+load_2_2_2_tiles+opt_softmax")
WGMMA = KernelConfig.wgmma("fp16", d_head=64, B_c=64, stages=2)

#: (score_mod, mask_mod, built-in mask, seq_q, seq_k): every example, most with the key and query tails
CASES = {
    "softcap": (EX.softcap(20.0), None, "none", 100, 77),
    "alibi+causal": (EX.alibi(HEADS), None, "causal", 100, 90),
    "relative_bias+document": (EX.relative_bias(128, seed=3), EX.document_mask((30, 41, 13, 29)), "none", 100, 100),
    "prefix_lm": (None, EX.prefix_lm(20), "none", 100, 91),
    "sliding_window_sinks+causal": (None, EX.sliding_window_sinks(24, 3), "causal", 130, 130),
    "block_local+softcap": (EX.softcap(5.0), EX.block_local(37), "none", 100, 140),
}


def _setup(cfg, name):
    score_fn, mask_fn, kind, seq_q, seq_k = CASES[name]
    mods, (sa, ma) = prepare_mods(score_fn, mask_fn)
    plan = make_plan(cfg.replace(mask=kind), mods)
    values = (sa.values() if sa is not None else None, ma.values() if ma is not None else None)
    rng = np.random.default_rng(len(name))
    q, k, v = (hw.encode(2.0 * rng.standard_normal((n, cfg.d_head)), cfg.dtype) for n in (seq_q, seq_k, seq_k))
    return plan, values, (q, k, v), CASES[name]


def _reference_terms(case, rows: np.ndarray, seq_k: int, b: int, h: int):
    """(keep, score function) from the torch functions themselves: the causal rule and the mask_mod,
    the score_mod on float64 scores."""
    score_fn, mask_fn, kind, _, _ = case
    i = torch.as_tensor(rows)[:, None]
    j = torch.arange(seq_k)[None, :]
    bt, ht = torch.tensor(b), torch.tensor(h)
    keep = np.ones((len(rows), seq_k), bool) if kind == "none" else (j <= i).numpy()
    if mask_fn is not None:
        keep = keep & np.broadcast_to(mask_fn(bt, ht, i, j).numpy(), keep.shape)
    score = None if score_fn is None else (lambda s: score_fn(torch.from_numpy(s), bt, ht, i, j).double().numpy())
    return keep, score


def _check(cfg, case, q, k, v, row0, o, lse, b, h):
    rows = o.shape[0]
    keep, score = _reference_terms(case, row0 + np.arange(rows), k.shape[0], b, h)
    res = cta.compare_with_reference(cfg, q[row0: row0 + rows], k, v, o, keep=keep, lse=lse, score=score)
    assert res["ok"], res


def _agree(cfg, a, b):
    """Two runs of one CTA within one 16-bit ulp (O) and fp32 rounding (lse) of each other."""
    oa, ob = (hw.decode(x[0], cfg.dtype).astype(np.float64) for x in (a, b))
    ulp = np.abs(oa) * 2.0 ** -(8 if cfg.dtype == "bf16" else 11) + 1e-7
    assert np.all(np.abs(oa - ob) <= ulp)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6, atol=0)


@pytest.fixture(scope="module")
def mma_traces():
    return {}


@pytest.mark.parametrize("name", list(CASES))
def test_mma_sync_simulator_with_mods(name, mma_traces):
    plan, values, (q, k, v), case = _setup(MMA, name)
    traces = mma_traces.setdefault(plan.cfg.mask, trace_plan(plan))
    seq_q, seq_k = q.shape[0], k.shape[0]
    blocks = bm.block_mask(plan.score_mask, values[1], 2, HEADS, seq_q, seq_k) if case[1] is not None else None
    for q_row0, b, h in ((0, 0, 1), (MMA.B_r, 1, 3)):
        runs = [cta.simulate_cta(plan, q[q_row0: q_row0 + MMA.B_r], k, v, traces=traces, q_row0=q_row0, seq_q=seq_q,
                                 b=b, h=h, mod_values=values, block_mask=mask) for mask in ([None, blocks] if blocks is not None else [None])]
        for r in runs:
            assert r.ok, r.hazards[:3]
            _check(MMA, case, q, k, v, q_row0, r.o, r.lse, b, h)
        if len(runs) == 2:
            _agree(MMA, (runs[0].o, runs[0].lse), (runs[1].o, runs[1].lse))
            visited = [r.n_blocks - r.j_begin for r in runs]
            assert visited[1] <= visited[0]


@pytest.mark.parametrize("name", ["softcap", "alibi+causal", "relative_bias+document", "sliding_window_sinks+causal"])
def test_wgmma_simulator_with_mods(name):
    plan, values, (q, k, v), case = _setup(WGMMA, name)
    seq_q, seq_k = q.shape[0], k.shape[0]
    blocks = bm.block_mask(plan.score_mask, values[1], 2, HEADS, seq_q, seq_k) if case[1] is not None else None
    b, h = 1, 2
    outs = []
    for mask in [None, blocks] if blocks is not None else [None]:
        o, lse, rep = hopper.simulate_cta(plan, q, k, v, 0, b=b, h=h, mod_values=values, block_mask=mask)
        assert rep.ok, rep.hazards[:3]
        _check(WGMMA, case, q, k, v, 0, o, lse, b, h)
        outs.append((o, lse))
    if len(outs) == 2:
        _agree(WGMMA, *outs)


def test_persistent_wgmma_cta_walks_tiles_clipped_by_the_block_mask():
    """A persistent CTA walks every tile of a head; each tile visits only the key blocks its block-mask
    row keeps (document masking: the blocks of other documents are skipped)."""
    cfg = WGMMA.replace(persistent=True)
    case = (EX.relative_bias(300, seed=1), EX.document_mask((70, 100, 90, 40)), "none", 300, 300)
    mods, (sa, ma) = prepare_mods(case[0], case[1])
    plan = make_plan(cfg, mods)
    values = (sa.values(), ma.values())
    rng = np.random.default_rng(5)
    q, k, v = (hw.encode(2.0 * rng.standard_normal((300, cfg.d_head)), cfg.dtype) for _ in range(3))
    blocks = bm.block_mask(plan.score_mask, values[1], 1, HEADS, 300, 300)
    o, lse, rep = hopper.simulate_tiles(plan, q, k, v, sms=1, h=3, mod_values=values, block_mask=blocks)
    assert rep.ok, rep.hazards[:3]
    assert rep.j_end - rep.j_begin < -(-300 // cfg.B_c)  # tile 0 (rows 0-127) skips the last document's blocks
    for (qb, _), ot, lt in zip(rep.tiles, o, lse):
        _check(cfg, case, q, k, v, qb * cfg.B_r, ot, lt, 0, 3)


def test_simulators_refuse_values_that_do_not_fit_the_plan():
    plan, values, (q, k, v), _ = _setup(MMA, "relative_bias+document")
    with pytest.raises(ValueError, match="needs its values"):
        cta.simulate_cta(plan, q[:64], k, v, seq_q=q.shape[0])
    plain = make_plan(MMA)
    with pytest.raises(ValueError, match="without a score_mod"):
        cta.simulate_cta(plain, q[:64], k, v, seq_q=q.shape[0], mod_values=values)
    wplan, wvalues, (q, k, v), _ = _setup(WGMMA, "softcap")
    with pytest.raises(ValueError, match="without a mask_mod"):
        hopper.simulate_cta(wplan, q, k, v, mod_values=wvalues, block_mask=np.zeros((1, 1, 1, 3), np.int32))
    with pytest.raises(ValueError, match="block mask needs"):
        bm.block_mask(wplan.score_mask, {}, 1, 1, 8, 8)


# ---- key blocks the block mask calls empty are not walked -----------------------------------------------

#: attention sinks and a causal window: the key blocks between the sinks' block and the window are empty
#: for every later query block (odd lengths: query and key tails)
SINKS = (None, EX.sliding_window_sinks(40, 3), "none", 520, 515)
EAGER = parse_config("(BF16, 128, 64, 32, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax")


def _sinks_setup(cfg):
    mods, (_, ma) = prepare_mods(None, SINKS[1])
    plan = make_plan(cfg, mods)
    rng = np.random.default_rng(11)
    q, k, v = (hw.encode(2.0 * rng.standard_normal((n, cfg.d_head)), cfg.dtype) for n in (SINKS[3], SINKS[4], SINKS[4]))
    values = (None, ma.values())
    return plan, values, (q, k, v), bm.block_mask(plan.score_mask, values[1], 1, 1, SINKS[3], SINKS[4])


def _non_empty(plan, blocks, q_block: int, begin: int, end: int) -> list[int]:
    """The key blocks of ``[begin, end)`` that the block mask's row does not call empty."""
    row = bm.row(plan.score_mask, blocks, 0, 0, q_block)
    return [j for j in range(begin, end) if row[2 + j] != bm.EMPTY]



def test_mma_sync_walk_skips_empty_blocks():
    """The eager schedule (K_{j+1} prefetched during block j) on a sink + window mask: with the block mask
    the S GEMMs run on exactly the non-empty blocks (the prefetch fetches the walk's next block: a wrong
    one is a hazard), without it on every block of the range; both match float64 attention."""
    plan, values, (q, k, v), blocks = _sinks_setup(EAGER)
    seq_q, seq_k = SINKS[3], SINKS[4]
    traces = trace_plan(plan)
    skipped = 0
    for q_block in (0, 3, 8):
        row0 = q_block * EAGER.B_r
        runs = [cta.simulate_cta(plan, q[row0: row0 + EAGER.B_r], k, v, traces=traces, q_row0=row0, seq_q=seq_q,
                                 mod_values=values, block_mask=mask) for mask in (None, blocks)]
        for r in runs:
            assert r.ok, r.hazards[:3]
            _check(EAGER, SINKS, q, k, v, row0, r.o, r.lse, 0, 0)
        full = list(range(*plan.score_mask.block_range(row0, seq_q, seq_k)))
        assert runs[0].visited == full
        assert runs[1].visited == _non_empty(plan, blocks, q_block, full[0], full[-1] + 1)
        skipped += len(full) - len(runs[1].visited)
    assert skipped >= 10  # q block 8 alone skips blocks 1-10 (keys 32-351)


@pytest.mark.parametrize("persistent", [False, True], ids=["one_tile", "persistent"])
def test_wgmma_walk_skips_empty_blocks(persistent):
    """Producer and consumers (pingpong, intra-warpgroup overlap) walk only the non-empty blocks, each
    consumer's S GEMMs exactly those in order; persistent: one CTA walks every tile of the head, the K/V
    ring counted over the tiles' walks (the Q release on the walk's last block). Float64 reference."""
    cfg = WGMMA.replace(persistent=persistent)
    plan, values, (q, k, v), blocks = _sinks_setup(cfg)
    seq_q, seq_k = SINKS[3], SINKS[4]
    if persistent:
        o, lse, rep = hopper.simulate_tiles(plan, q, k, v, sms=1, mod_values=values, block_mask=blocks)
        q_blocks = [qb for qb, _ in rep.tiles]
        assert sorted(q_blocks) == list(range(-(-seq_q // cfg.B_r)))  # every tile of the head, in the scheduler's order
    else:
        q_blocks = [3]
        o1, lse1, rep = hopper.simulate_cta(plan, q, k, v, 3, mod_values=values, block_mask=blocks)
        o, lse = [o1], [lse1]
    assert rep.ok, rep.hazards[:3]
    want = [(ti, j) for ti, qb in enumerate(q_blocks) for j in _non_empty(plan, blocks, qb, 0, -(-seq_k // cfg.B_c))]
    assert all(rep.visited[w] == want for w in range(cfg.consumers)), (rep.visited, want)
    assert len(want) < len(q_blocks) * -(-seq_k // cfg.B_c) - 4  # q block 3 alone skips blocks 1-4
    for qb, ot, lt in zip(q_blocks, o, lse):
        _check(cfg, SINKS, q, k, v, qb * cfg.B_r, ot, lt, 0, 0)


def test_wgmma_split_tile_parts_walk_their_non_empty_blocks():
    """A wave-tail tile split in 4 parts of its 9 key blocks: each part is clipped again to its non-empty
    blocks (one part holds none: its rows merge as a part without keys); the merged rows match float64."""
    plan, values, (q, k, v), blocks = _sinks_setup(WGMMA)
    q_block = 3
    o, lse, rep = hopper.simulate_split_tile(plan, q, k, v, 4, q_block, mod_values=values, block_mask=blocks)
    assert rep.ok, rep.hazards[:3]
    want = _non_empty(plan, blocks, q_block, rep.j_begin, rep.j_end)
    parts = plan.tail_split.ranges(rep.j_begin, rep.j_end, 4)
    assert any(not _non_empty(plan, blocks, q_block, b, e) for b, e in parts)  # a part without a non-empty block
    assert all([j for _, j in rep.visited[w]] == want for w in range(WGMMA.consumers)), rep.visited
    _check(WGMMA, SINKS, q, k, v, q_block * WGMMA.B_r, o, lse, 0, 0)


@pytest.mark.parametrize("engine", ["mma_sync", "wgmma"])
def test_a_query_block_without_kept_keys_walks_no_block(engine):
    """A causal window without sinks, queries past the keys: the last query block keeps no key (its
    block-mask row is [0, 0)); it walks no block and gives o = 0, lse = -inf, as before the skipping."""
    cfg = EAGER if engine == "mma_sync" else WGMMA
    case = (None, EX.sliding_window_sinks(10, 0), "none", 200, 60)
    mods, (_, ma) = prepare_mods(None, case[1])
    plan = make_plan(cfg, mods)
    rng = np.random.default_rng(2)
    q, k, v = (hw.encode(rng.standard_normal((n, cfg.d_head)), cfg.dtype) for n in (200, 60, 60))
    blocks = bm.block_mask(plan.score_mask, ma.values(), 1, 1, 200, 60)
    q_block = 200 // cfg.B_r if 200 % cfg.B_r else 200 // cfg.B_r - 1
    assert bm.row(plan.score_mask, blocks, 0, 0, q_block)[:2].tolist() == [0, 0]
    row0 = q_block * cfg.B_r
    if engine == "mma_sync":
        r = cta.simulate_cta(plan, q[row0: row0 + cfg.B_r], k, v, q_row0=row0, seq_q=200, mod_values=(None, ma.values()),
                             block_mask=blocks)
        o, lse, ok, visited = r.o, r.lse, r.ok, r.visited
    else:
        o, lse, rep = hopper.simulate_cta(plan, q, k, v, q_block, mod_values=(None, ma.values()), block_mask=blocks)
        ok, visited = rep.ok, [j for w in rep.visited for _, j in rep.visited[w]]
    assert ok and visited == []
    assert np.all(hw.decode(o, cfg.dtype) == 0) and np.all(lse == -np.inf)
    _check(cfg, case, q, k, v, row0, o, lse, 0, 0)
