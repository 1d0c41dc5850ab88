"""benchmarks/tile_balance.py: a tile's work is what its block mask row makes the kernel visit, the persistent
rounds' balance is the plan's scheduler's, and the greedy bounds behave as list scheduling does."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tile_balance", REPO / "benchmarks" / "tile_balance.py")
tb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tb)


def _plan(seq: int, mask_mod):
    from flashgen.dsl.config import KernelConfig
    from flashgen.engines import make_plan
    from flashgen.mods.kernel_mods import prepare_mods

    mods, (_, args) = prepare_mods(None, mask_mod)
    return make_plan(KernelConfig.wgmma("bf16", persistent=True), mods), args


def test_a_tiles_work_counts_its_full_blocks_once_and_its_partial_ones_by_the_weight():
    """Two documents (300 + 212 tokens, 128-row blocks): against a count of the blocks straight from the scores."""
    from flashgen.sim.block_mask import block_mask

    seq, doc = 512, torch.tensor([0] * 300 + [1] * 212)
    plan, args = _plan(seq, lambda b, h, i, j: doc[i] == doc[j])
    blocks = block_mask(plan.score_mask, args.values(), 1, 2, seq, seq)
    work = tb.tile_work(plan, blocks, 1, 2, seq, partial=3.0)
    keep = (doc[:, None] == doc[None, :]).numpy().reshape(4, 128, 4, 128)
    full, some = keep.all(axis=(1, 3)), keep.any(axis=(1, 3))
    per_qb = full.sum(1) + 3.0 * (some & ~full).sum(1)  # query block 0..3
    # tile t is query block 3 - t % 4 (the last first), heads next
    assert work.tolist() == [float(per_qb[3 - t % 4]) for t in range(8)]


def test_even_work_is_balanced_and_one_heavy_tile_is_not():
    from flashgen.attention.scheduler import TileScheduler
    from flashgen.dsl.tail_split import TailSplit

    sched = TileScheduler(128, True, True, TailSplit(2, 10**6, 2, 128))
    even = np.ones(8 * 132)
    assert tb.static_balance(sched, even, 132, 1, 8, True) == (1.0, 132)
    assert tb.greedy_balance(even, 132) == 1.0
    heavy = np.ones(4 * 132)
    heavy[0] = 40.0  # one tile as long as 40 others: its CTA's rounds end last
    static, _ = tb.static_balance(sched, heavy, 132, 1, 4, True)
    assert static == pytest.approx((40 + 3) / (heavy.sum() / 132))
    # greedy list scheduling: the heavy tile first keeps the others off its SM
    assert tb.greedy_balance(sorted(heavy, reverse=True), 132) == pytest.approx(40 / (heavy.sum() / 132))
    assert tb.greedy_balance([10, 1, 1, 1], 2) == pytest.approx(10 / 6.5)


@pytest.mark.parametrize("argv", [["--sms", "0"], ["--seqs", "0"], ["--partial", "0"]])
def test_sizes_that_make_no_launch_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        tb.main(argv)
    assert exc.value.code == 2 and "must be positive" in capsys.readouterr().err


def test_the_block_mask_order_decides_which_cta_takes_which_tile():
    """Two rounds of tiles costing their index on 132 CTAs: the snake pairs tile c with tile 263 - c (even); an
    order that reverses the second round pairs c with 132 + c instead."""
    from flashgen.attention.scheduler import TileScheduler
    from flashgen.dsl.tail_split import TailSplit

    sched = TileScheduler(128, True, False, TailSplit(2, 10**6, 2, 128), ordered=True)
    work = np.arange(264.0)
    assert tb.static_balance(sched, work, 132, 1, 8, False) == (1.0, 132)
    reversed_second = lambda ctas: list(range(ctas)) + list(range(2 * ctas - 1, ctas - 1, -1))
    static, _ = tb.static_balance(sched, work, 132, 1, 8, False, order=reversed_second)
    assert static == pytest.approx((131 + 263) / (work.sum() / 132))
