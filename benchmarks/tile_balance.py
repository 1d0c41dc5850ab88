"""How evenly the forward's tiles spread a mask_mod's work over the SMs: a model, on the CPU.

    python benchmarks/tile_balance.py --seqs 2048 8192 --sms 132

For each mask_mod of ``benchmarks/mods_bench.py`` (bf16, d_head 128, 16 heads, 16k tokens) the kernel
``compile("auto")`` runs for it on an H100 or H200 (the wgmma engine's persistent kernel), its block mask made
by the numpy twin of the kernels' (:mod:`flashgen.sim.block_mask`) and the key blocks each tile visits, then
the plan's own tile scheduler (:class:`flashgen.attention.scheduler.TileScheduler`): the grid the launcher
sizes and the tiles each CTA takes round by round. A tile's work counts a full key block 1 and a partial one
``--partial`` (2: on an H100 a key block the mask_mod keeps in part cost about twice a full one). Printed per
mask: the busiest CTA's work over the mean (1.00: perfect balance; the launch lasts as long as its busiest
CTA) in the persistent rounds as launched (with the tile order the block mask holds,
:meth:`~flashgen.attention.scheduler.TileScheduler.order`) and in the scheduler's own order, and the same for
one CTA per tile taken greedily by whichever SM frees first, in the scheduler's order and heaviest first. A
model of load balance only: no memory system, every SM equally fast.
"""
from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKENS, HEADS, D_HEAD = 16384, 16, 128


def key_spans(plan, seq: int) -> list[tuple[int, int]]:
    """Per query block, the key blocks ``[begin, end)`` of the built-in mask (the kernels' ``kv_block_range``)."""
    sched = plan.scheduler
    return [plan.score_mask.block_range(qb * sched.B_r, seq, seq) for qb in range(sched.n_q_blocks(seq))]


def tile_work(plan, block_mask, batch: int, heads: int, seq: int, partial: float) -> np.ndarray:
    """Work of every tile in the scheduler's order (tile t: :meth:`TileScheduler.coords`): its visited key blocks,
    a partial one counting ``partial`` (the kernels' tile costs with that weight); without a block mask, every key
    block of the built-in mask's span alike."""
    from flashgen.sim import block_mask as bm

    sched = plan.scheduler
    if block_mask is not None:
        return np.asarray(bm.tile_costs(sched, plan.score_mask, block_mask, batch, heads, seq, seq, partial=partial), float)
    spans = key_spans(plan, seq)
    return np.array([partial * len(range(*spans[sched.coords(t, len(spans), heads)[0]])) for t in range(len(spans) * heads * batch)])


def static_balance(sched, work: np.ndarray, sms: int, lo: int, n_q: int, equal: bool, order=None) -> tuple[float, int]:
    """(busiest CTA's work / the mean over the SMs, CTAs) of the persistent rounds the launcher sizes (a grid of
    fewer CTAs than SMs, as sized for round pairs, leaves the others idle); ``order``: a function of the CTAs giving
    the block mask's tile order (position -> tile), or None: the scheduler's own."""
    ctas, parts = sched.grid(len(work), sms, lo, n_q, equal, ordered=order is not None)
    at = order(ctas) if order is not None else range(len(work))
    loads = [sum(work[at[t]] / (parts if p >= 0 else 1) for t, p in sched.work(c, ctas, len(work), parts)) for c in range(ctas)]
    return max(loads) / (work.sum() / min(sms, len(work))), ctas


def greedy_balance(work, sms: int) -> float:
    """Busiest SM over the mean when each tile goes, in the given order, to the SM that frees first."""
    free = [0.0] * sms
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free) / (sum(work) / sms)


def balance(mask_mod, seq: int, sms: int, partial: float) -> dict:
    from flashgen.dsl.dtypes import DType
    from flashgen.engines import make_plan
    from flashgen.mods.kernel_mods import prepare_mods
    from flashgen.policy import lookup
    from flashgen.sim import block_mask as bm
    from flashgen.sim.block_mask import block_mask

    batch = TOKENS // seq
    # a diagonal conjunct runs as the built-in causal mask, the rest (if any) as the kernel's mask_mod
    split = prepare_mods(None, mask_mod)[0].mask.diagonal is not None
    mods, (_, mask_args) = prepare_mods(None, mask_mod, diagonal=True)
    cfg = lookup("NVIDIA H100 80GB HBM3", DType.BF16, D_HEAD, seq, cache={}, capability=(9, 0), masked=True)
    cfg = cfg.replace(mask="causal" if split else "none")
    plan = make_plan(cfg, mods)
    blocks = block_mask(plan.score_mask, mask_args.values(), batch, HEADS, seq, seq) if mods is not None else None
    work = tile_work(plan, blocks, batch, HEADS, seq, partial)
    lengths = [e - b for b, e in key_spans(plan, seq)]  # the launcher's tile_blocks: shortest and longest tile
    grid = (plan.scheduler, work, sms, min(lengths), len(lengths), min(lengths) == max(lengths))
    unordered, _ = static_balance(*grid)
    order = None
    if plan.scheduler.ordered and blocks is not None:  # the block mask's order, as the kernels make it
        order = lambda ctas: bm.tile_order(plan.scheduler, plan.score_mask, blocks, batch, HEADS, seq, seq, ctas)
    static, ctas = static_balance(*grid, order=order)
    return {"config": cfg.short_form(), "tiles": len(work), "ctas": ctas, "static": static, "unordered": unordered,
            "greedy": greedy_balance(work, sms), "greedy_heaviest_first": greedy_balance(sorted(work, reverse=True), sms)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192], help="sequence lengths (default: 2048 8192)")
    p.add_argument("--sms", type=int, default=132, help="SMs of the GPU (default: 132, an H100 SXM or H200)")
    p.add_argument("--partial", type=float, default=2.0, help="work of a key block kept in part, a full one 1 (default: 2)")
    args = p.parse_args(argv)
    if args.sms < 1 or min(args.seqs) < 1 or args.partial <= 0:
        p.error(f"--sms ({args.sms}) and --seqs ({min(args.seqs)} at the least) must be positive, and --partial "
                f"({args.partial}) above 0")
    from mods_bench import cases

    print(f"{'mask':15s} {'seq':>5s} {'tiles':>6s} {'CTAs':>5s} {'rounds':>7s} {'unordered':>10s} {'greedy':>7s} "
          f"{'heaviest first':>15s}  (busiest / mean)")
    for seq in args.seqs:
        for name, (score_mod, mask_mod) in cases(seq, HEADS, "cpu").items():
            if mask_mod is None or score_mod is not None:
                continue
            r = balance(mask_mod, seq, args.sms, args.partial)
            print(f"{name:15s} {seq:5d} {r['tiles']:6d} {r['ctas']:5d} {r['static']:7.3f} {r['unordered']:10.3f} {r['greedy']:7.3f} "
                  f"{r['greedy_heaviest_first']:15.3f}  {r['config']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
