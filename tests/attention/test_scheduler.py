"""The tile scheduler (flashgen.attention.scheduler): every tile computed once, the grid's bounds, and
the C++ the emitted launcher and kernel call agreeing with the Python the simulator runs."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.config import KernelConfig
from flashgen.dsl.hopper_plan import make_hopper_plan

W = KernelConfig.wgmma
#: the shipped kinds: persistent unmasked, persistent masked (round pairs), one CTA per tile (masked or not)
SCHEDULERS = {name: make_hopper_plan(cfg).scheduler for name, cfg in (
    ("persistent", W("fp16", persistent=True)),
    ("persistent-masked", W("fp16", persistent=True, mask="causal")),
    ("grid", W("fp16")),
    ("grid-masked", W("bf16", d_head=64, mask="window")),
)}


def test_the_plans_choose_the_scheduler():
    kinds = {name: (s.kind, s.rounds_pair) for name, s in SCHEDULERS.items()}
    assert kinds == {"persistent": ("static", False), "persistent-masked": ("static", True),
                     "grid": ("grid", False), "grid-masked": ("grid", False)}


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(SCHEDULERS)), n_q=st.integers(1, 40), hb=st.integers(1, 40), sms=st.integers(1, 140),
       lo=st.integers(0, 64), equal=st.booleans())
def test_every_tile_is_computed_once(name, n_q, hb, sms, lo, equal):
    """Over all CTAs of the grid, each tile is taken once whole, or each of its ``parts`` parts once;
    a persistent grid has at most one CTA per SM (or, with fewer tiles than SMs, tiles x parts <= SMs)."""
    s = SCHEDULERS[name]
    tiles = n_q * hb
    ctas, parts = s.grid(tiles, sms, lo, n_q, equal)
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

LAUNCHES = [(n_q, hb, sms, lo, equal) for n_q, hb in ((1, 1), (3, 1), (4, 5), (16, 8), (7, 33), (2, 64))
            for sms in (1, 8, 66, 132) for lo, equal in ((1, True), (13, True), (4, False), (24, False))]


@needs_gxx
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_emitted_grid_and_rounds_agree_with_python(tmp_path, name):
    """For many launches: the same (CTAs, parts) from sched_grid, and for every CTA the same sequence of
    (tile, part) from sched_work, round by round, as TileScheduler.grid / work."""
    s = SCHEDULERS[name]
    want, rows = [], []
    for n_q, hb, sms, lo, equal in LAUNCHES:
        tiles = n_q * hb
        ctas, parts = s.grid(tiles, sms, lo, n_q, equal)
        want.append([ctas, parts])
        want += [[x for w in s.work(cta, ctas, tiles, parts) for x in w] for cta in range(ctas)]
        rows.append(f"{{{tiles}, {sms}, {lo}, {n_q}, {int(equal)}}}")
    # the launches as data and the CTAs walked by a loop: one short program whatever the count of CTAs
    body = ("    const int launches[][5] = {" + ", ".join(rows) + "};\n"
            "    for (const auto& l : launches) {\n"
            "        sched_grid(l[0], l[1], l[2], l[3], l[4] != 0, &c, &n); printf(\"%d %d\\n\", c, n);\n"
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
