"""The tile scheduler (flashgen.attention.scheduler): every tile computed once, the grid's bounds, and
the C++ the emitted launcher and kernel call agreeing with the Python the simulator runs."""
from __future__ import annotations

import itertools
import random
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.attention.scheduler import ORDER_ROUNDS, TileScheduler
from flashgen.dsl.config import KernelConfig
from flashgen.dsl.hopper_plan import make_hopper_plan
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.sim import block_mask

W = KernelConfig.wgmma
PREFIX_LM = prepare_mods(None, lambda b, h, q_idx, kv_idx: (kv_idx < 40) | (q_idx >= kv_idx))[0]
#: the shipped kinds: persistent unmasked, persistent masked (round pairs), persistent with a mask_mod (the block
#: mask's order) and with a mask_mod and the built-in causal mask, one CTA per tile (masked or not)
SCHEDULERS = {name: make_hopper_plan(cfg, mods).scheduler for name, cfg, mods in (
    ("persistent", W("fp16", persistent=True), None),
    ("persistent-masked", W("fp16", persistent=True, mask="causal"), None),
    ("persistent-mask-mod", W("fp16", persistent=True), PREFIX_LM),
    ("persistent-masked-mask-mod", W("bf16", persistent=True, mask="causal"), PREFIX_LM),
    ("grid", W("fp16"), None),
    ("grid-masked", W("bf16", d_head=64, mask="window"), None),
    ("grid-mask-mod", W("bf16"), PREFIX_LM),
)}


def test_the_plans_choose_the_scheduler():
    kinds = {name: (s.kind, s.rounds_pair, s.ordered) for name, s in SCHEDULERS.items()}
    assert kinds == {"persistent": ("static", False, False), "persistent-masked": ("static", True, False),
                     "persistent-mask-mod": ("static", False, True), "persistent-masked-mask-mod": ("static", True, True),
                     "grid": ("grid", False, False), "grid-masked": ("grid", False, False),
                     "grid-mask-mod": ("grid", False, False)}


def test_only_a_persistent_scheduler_takes_an_order():
    with pytest.raises(ValueError, match="persistent"):
        TileScheduler(128, False, False, SCHEDULERS["grid"].tail, ordered=True)


def test_an_ordered_launch_drops_the_round_pairs():
    """The masked persistent grid rounds 132 SMs down to 128 (16 query blocks); with its block mask's order the
    launch keeps every SM."""
    s = SCHEDULERS["persistent-masked-mask-mod"]
    assert s.grid(16 * 64, 132, 1, 16, False)[0] == 128
    assert s.grid(16 * 64, 132, 1, 16, False, ordered=True)[0] == 132
    assert SCHEDULERS["persistent-masked"].grid(16 * 64, 132, 1, 16, False, ordered=True)[0] == 128


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULERS)), n_q=st.integers(1, 40), hb=st.integers(1, 40), sms=st.integers(1, 140),
       lo=st.integers(0, 64), equal=st.booleans(), ordered=st.booleans())
def test_every_tile_is_computed_once(name, n_q, hb, sms, lo, equal, ordered):
    """Over all CTAs of the grid, each tile is taken once whole, or each of its ``parts`` parts once;
    a persistent grid has at most one CTA per SM (or, with fewer tiles than SMs, tiles x parts <= SMs)."""
    s = SCHEDULERS[name]
    tiles = n_q * hb
    ctas, parts = s.grid(tiles, sms, lo, n_q, equal, ordered)
    taken = [w for c in range(ctas) for w in s.work(c, ctas, tiles, parts)]
    whole = sorted(t for t, p in taken if p < 0)
    split = sorted((t, p) for t, p in taken if p >= 0)
    split_tiles = sorted({t for t, _ in split})
    assert split == [(t, p) for t in split_tiles for p in range(parts)]
    assert sorted(whole + split_tiles) == list(range(tiles))
    if s.persistent or tiles < sms:
        assert ctas <= sms
    else:
        assert ctas == tiles


def test_the_order_walks_query_blocks_fastest_last_first():
    s = SCHEDULERS["persistent"]
    assert [s.coords(t, 3, 2) for t in range(7)] == [(2, 0, 0), (1, 0, 0), (0, 0, 0), (2, 1, 0), (1, 1, 0), (0, 1, 0), (2, 0, 1)]


def test_odd_rounds_mirror_even_ones():
    """A persistent CTA walks the tiles in a snake: CTA 0 of 4 takes tiles 0, 7, 8, 15."""
    s = SCHEDULERS["persistent"]
    assert s.work(0, 4, 16, 1) == [(0, -1), (7, -1), (8, -1), (15, -1)]
    assert s.work(3, 4, 14, 1) == [(3, -1), (4, -1), (11, -1), (12, -1)]


def _run_cpp(tmp_path, sched, body: str) -> list[list[int]]:
    """Compile the tail rule and the scheduler's C++ for the host with ``body`` in main; the printed numbers."""
    src = tmp_path / "sched.cpp"
    host = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"  # the kernel's qualifiers, for g++
    src.write_text("#include <stdint.h>\n#include <stddef.h>\n#include <stdio.h>\n" + host + sched.tail.to_cpp() + "\n"
                   + sched.to_cpp() + "\nint main() {\n    int c, n, t, p, q, h, b;\n" + body + "}\n")
    exe = tmp_path / "sched"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unused-variable", "-o", str(exe), str(src)],
                   check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")

LAUNCHES = [(n_q, hb, sms, lo, equal, ordered) for n_q, hb in ((1, 1), (3, 1), (4, 5), (16, 8), (7, 33), (2, 64))
            for sms in (1, 8, 66, 132) for lo, equal in ((1, True), (13, True), (4, False), (24, False)) for ordered in (False, True)]


@needs_gxx
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_emitted_grid_and_rounds_agree_with_python(tmp_path, name):
    """For many launches: the same (CTAs, parts) from sched_grid, and for every CTA the same sequence of
    (tile, part) from sched_work, round by round, as TileScheduler.grid / work."""
    s = SCHEDULERS[name]
    want, rows = [], []
    for n_q, hb, sms, lo, equal, ordered in LAUNCHES:
        tiles = n_q * hb
        ctas, parts = s.grid(tiles, sms, lo, n_q, equal, ordered)
        want.append([ctas, parts])
        want += [[x for w in s.work(cta, ctas, tiles, parts) for x in w] for cta in range(ctas)]
        rows.append(f"{{{tiles}, {sms}, {lo}, {n_q}, {int(equal)}, {int(ordered)}}}")
    # the launches as data and the CTAs walked by a loop: one short program whatever the count of CTAs
    body = ("    const int launches[][6] = {" + ", ".join(rows) + "};\n"
            "    for (const auto& l : launches) {\n"
            "        sched_grid(l[0], l[1], l[2], l[3], l[4] != 0, l[5] != 0, &c, &n); printf(\"%d %d\\n\", c, n);\n"
            "        for (int cta = 0; cta < c; ++cta) {\n"
            "            for (int r = 0; sched_work(r, cta, c, l[0], n, &t, &p); ++r) printf(\"%d %d \", t, p);\n"
            "            printf(\"\\n\");\n"
            "        }\n"
            "    }\n")
    got = _run_cpp(tmp_path, s, body)
    assert got == want


@needs_gxx
def test_emitted_order_agrees_with_python(tmp_path):
    s = SCHEDULERS["persistent"]
    cases = list(itertools.product((1, 2, 7, 16), (1, 3, 16), range(40)))
    body = "".join(f'    sched_coords({t}, {n_q}, {heads}, &q, &h, &b); printf("%d %d %d\\n", q, h, b);\n' for n_q, heads, t in cases)
    assert _run_cpp(tmp_path, s, body) == [list(s.coords(t, n_q, heads)) for n_q, heads, t in cases]


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(0, 9), min_size=1, max_size=300), ctas=st.integers(1, 40))
def test_the_block_mask_order_deals_every_tile_once_section_by_section(costs, ctas):
    """A permutation of the tiles, each section of ORDER_ROUNDS rounds holding its own tiles (those running at once
    stay near each other in the scheduler's order), a round's heaviest tile to the CTA least loaded before it."""
    s = SCHEDULERS["persistent-mask-mod"]
    order = s.order(costs, ctas)
    assert sorted(order) == list(range(len(costs)))
    per = ORDER_ROUNDS * ctas
    for s0 in range(0, len(costs), per):
        assert sorted(order[s0:s0 + per]) == list(range(s0, min(len(costs), s0 + per)))
    load = [0] * ctas
    for r in range(len(costs) // per * ORDER_ROUNDS):  # the rounds of whole sections (a last one may hold fewer)
        taken = {c: order[t] for c in range(ctas) for t, p in s.work(c, ctas, len(costs), 1)[r:r + 1]}
        heaviest = max(taken.values(), key=lambda t: (costs[t], -t))
        least = min(range(ctas), key=lambda c: (load[c], c))
        assert costs[taken[least]] == costs[heaviest]
        for c, t in taken.items():
            load[c] += costs[t]


def test_the_block_mask_order_balances_what_the_rounds_do_not():
    """Three packed documents (475, 549 and 1024 tokens of 2048, 8 batch entries x 16 heads): the tiles' costs from
    the numpy twin of the block mask, on 132 CTAs. In the scheduler's own order the busiest CTA has about a third
    more than the mean; in the block mask's order it is within 5% of it."""
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([475, 549, 1024]))
    mods, (_, mask_args) = prepare_mods(None, lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx])
    plan = make_hopper_plan(W("bf16", persistent=True), mods)
    s, ctas, batch, heads, seq = plan.scheduler, 132, 8, 16, 2048
    mask = block_mask.block_mask(plan.score_mask, mask_args.values(), batch, heads, seq, seq)
    costs = block_mask.tile_costs(s, plan.score_mask, mask, batch, heads, seq, seq)

    def busiest(order):
        loads = [sum(costs[order[t]] for t, _ in s.work(c, ctas, len(costs), 1)) for c in range(ctas)]
        return max(loads) / (sum(costs) / ctas)

    assert busiest(list(range(len(costs)))) > 1.25
    assert busiest(block_mask.tile_order(s, plan.score_mask, mask, batch, heads, seq, seq, ctas)) < 1.05


@needs_gxx
def test_emitted_block_mask_order_agrees_with_python(tmp_path):
    """sched_order run by one host thread (its barriers are the device's only) equals TileScheduler.order."""
    s = SCHEDULERS["persistent-mask-mod"]
    rng = random.Random(7)
    cases = [(rng.choices(range(6), k=n), ctas) for n, ctas in ((1, 1), (5, 3), (40, 3), (100, 7), (333, 16), (1000, 132), (529, 132))]
    lines = []
    for costs, ctas in cases:
        lines += [f"    {{ const int costs[] = {{{', '.join(map(str, costs))}}};",
                  f"      int w[{ORDER_ROUNDS * ctas}], ranked[{ORDER_ROUNDS * ctas}], load[{ctas}], turn[{ctas}], order[{len(costs)}];",
                  f"      sched_order({len(costs)}, {ctas}, 0, 1, [&](int t) {{ return costs[t]; }}, w, ranked, load, turn, order);",
                  f'      for (int i = 0; i < {len(costs)}; ++i) printf("%d ", order[i]);', '      printf("\\n"); }']
    assert _run_cpp(tmp_path, s, "\n".join(lines) + "\n") == [s.order(costs, ctas) for costs, ctas in cases]
