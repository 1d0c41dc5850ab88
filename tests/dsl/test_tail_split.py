"""The wave-tail split rule (flashgen.dsl.tail_split): parts, key ranges, workspace layout, and the
C++ the launcher is emitted with agreeing with the Python the simulator uses."""
from __future__ import annotations

import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.config import KernelConfig
from flashgen.dsl.hopper_plan import TAIL_MAX_PARTS, make_hopper_plan
from flashgen.dsl.tail_split import TailSplit

# the rules the shipped plans carry: persistent unmasked, and masked (fewer tiles than SMs only)
SPLIT = make_hopper_plan(KernelConfig.wgmma("fp16", persistent=True)).tail_split
FEW = make_hopper_plan(KernelConfig.wgmma("fp16", persistent=True, mask="causal")).tail_split


def test_only_persistent_unmasked_plans_split_partial_last_rounds():
    """Every wgmma plan splits a launch of fewer tiles than SMs; only persistent unmasked ones also
    split the partial last round after full rounds (masked rounds pair long and short tiles, and a
    grid of one CTA per tile has no rounds of its own)."""
    W = KernelConfig.wgmma
    assert make_hopper_plan(W("fp16", persistent=True)).tail_split == TailSplit(TAIL_MAX_PARTS, 2, 2, 128)
    assert make_hopper_plan(W("bf16", d_head=64, persistent=True)).tail_split.d_head == 64
    for cfg in (W("fp16", persistent=True, mask="causal"), W("fp16", persistent=True, mask="window"), W("fp16"),
                W("fp16", mask="causal"), W("bf16", d_head=256, B_c=64)):
        assert make_hopper_plan(cfg).tail_split == TailSplit(TAIL_MAX_PARTS, 2, 2, cfg.d_head, full_rounds=False)


@settings(max_examples=300, deadline=None)
@given(tiles=st.integers(1, 20000), sms=st.integers(1, 200), n_kv=st.integers(0, 200))
def test_masked_rule_splits_only_launches_of_fewer_tiles_than_sms(tiles, sms, n_kv):
    """Full rounds of a masked kernel pair long and short tiles: only a single, partial round splits,
    by the same rule as the unmasked kernels'."""
    want = SPLIT.parts(tiles, sms, n_kv) if tiles < sms else 1
    assert FEW.parts(tiles, sms, n_kv) == want


@settings(max_examples=300, deadline=None)
@given(tiles=st.integers(1, 20000), sms=st.integers(1, 200), n_kv=st.integers(0, 200))
def test_parts_keep_every_part_busy_and_within_the_idle_sms(tiles, sms, n_kv):
    parts = SPLIT.parts(tiles, sms, n_kv)
    tail = tiles % sms if tiles >= sms else tiles
    if tail == 0:
        assert parts == 1  # no partial last round
        return
    assert 1 <= parts <= SPLIT.max_parts
    if parts > 1:
        assert tail * parts <= sms and parts * SPLIT.min_blocks <= n_kv
    # as many as allowed: one more part would break a bound
    more = parts + 1
    assert parts == 1 or more > SPLIT.max_parts or tail * more > sms or more * SPLIT.min_blocks > n_kv
    # the launcher's grid: one CTA per SM, or tiles x parts when fewer tiles than SMs; the kernel finds
    # the tail as the tiles of its last round (the only one when fewer tiles than SMs)
    ctas = sms if tiles >= sms else tiles * parts
    assert ctas <= sms
    in_last_round = tiles % ctas if tiles >= ctas else tiles
    assert in_last_round == (tail if tiles >= sms or parts > 1 else 0)


def test_the_measured_cases():
    """seq 2048, batch 16, 16 heads, B_r 128 on 132 SMs: 4096 tiles leave 4 for the last round, whose
    13 key blocks (B_c 160) allow 6 parts of at least 2; 128 SMs: 32 full rounds, nothing to split."""
    assert (SPLIT.max_parts, SPLIT.min_blocks) == (8, 2)
    assert SPLIT.parts(16 * 16 * 16, 132, 2048 // 160 + 1) == 6
    assert SPLIT.parts(16 * 16 * 16, 128, 16) == 1
    assert SPLIT.parts(8, 132, 64) == 8  # few tiles, long keys: up to max_parts each (a grid of 64 CTAs)
    assert FEW.parts(16 * 16 * 16, 132, 16) == 1 and FEW.parts(8, 132, 5) == 2


@pytest.mark.parametrize("kw, word", [({"max_parts": 1}, "max_parts must be at least 2"), ({"min_blocks": 0}, "min_blocks must be at least 1"),
                                      ({"consumers": 0}, "consumers must be at least 1"), ({"d_head": 127}, "d_head must be even")])
def test_bad_rules_are_refused(kw, word):
    with pytest.raises(ValueError, match=word):
        TailSplit(**{"max_parts": 4, "min_blocks": 2, "consumers": 2, "d_head": 128, **kw})


@given(jb=st.integers(0, 50), n=st.integers(1, 60), parts=st.integers(1, 8))
def test_ranges_cover_the_blocks_in_order(jb, n, parts):
    rs = TailSplit.ranges(jb, jb + n, parts)
    assert rs[0][0] == jb and rs[-1][1] == jb + n
    assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))
    sizes = [e - b for b, e in rs]
    assert max(sizes) - min(sizes) <= 1 and (min(sizes) >= 1 or parts > n)


def test_workspace_layout_is_disjoint_and_sized_for_every_part():
    lay = TailSplit(max_parts=4, min_blocks=2, consumers=2, d_head=128).layout(tail=4, parts=4)
    (c0, cn), (m0, mn), (o0, on) = lay["count"], lay["ml"], lay["o"]
    assert c0 == 0 and cn == 4 * 8 * 4 and m0 >= cn and m0 % 256 == 0 and o0 == m0 + mn
    assert mn == 16 * 8 * 4 * 32 * 4  # 16 units x 8 warps x (2 maxima + 2 sums) x 32 lanes, fp32
    assert on == 16 * 8 * 64 * 32 * 4  # ... x 64 accumulator values


def _run_cpp(tmp_path, rule: TailSplit, body: str) -> list[list[int]]:
    """Compile the rule's C++ on the host with ``body`` in main and return the printed lines' numbers."""
    src = tmp_path / "rule.cpp"
    host = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"  # the kernel's qualifiers, for g++
    src.write_text("#include <stdint.h>\n#include <stddef.h>\n#include <stdio.h>\n" + host + rule.to_cpp()
                   + "\nint main() {\n" + body + "}\n")
    exe = tmp_path / "rule"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")


@needs_gxx
@pytest.mark.parametrize("rule", [SPLIT, FEW], ids=["full-rounds", "few-tiles-only"])
def test_emitted_rule_agrees_with_python(tmp_path, rule):
    cases = [(t, c, n) for t in (1, 5, 131, 133, 160, 198, 268, 4096, 8192, 4100) for c in (1, 3, 66, 114, 132) for n in (0, 1, 3, 7, 13, 16)]
    got = _run_cpp(tmp_path, rule, "".join(f'    printf("%d %zu %zu %zu\\n", tail_parts({t}, {c}, {n}), tail_count_bytes({t % c}), '
                                           f'tail_ml_bytes({t % c} * 3), tail_o_bytes({t % c} * 3));\n' for t, c, n in cases))
    for (t, c, n), line in zip(cases, got, strict=True):
        lay = rule.layout(t % c, 3)
        assert line == [rule.parts(t, c, n), lay["ml"][0], lay["ml"][1], lay["o"][1]], (t, c, n)


@needs_gxx
def test_emitted_ranges_and_indices_agree_with_python(tmp_path):
    """The kernel's part ranges are TailSplit.ranges; its workspace indices address layout()'s arrays
    ([tail tile][warp] counters, [unit][warp][4][lane] statistics, [unit][warp][d_head / 2][lane] O)."""
    import numpy as np

    rule = SPLIT
    ranges = [(jb, je, parts) for jb in (0, 3, 17) for je in (jb + 1, jb + 2, jb + 13, jb + 64) for parts in (2, 3, 8)]
    cells = [(u, w) for u in (0, 1, 5, 23) for w in range(rule.warps)]
    body = "".join(f'    {{ int b, e; tail_range({jb}, {je}, {k}, {parts}, &b, &e); printf("%d %d\\n", b, e); }}\n'
                   for jb, je, parts in ranges for k in range(parts))
    body += "".join(f'    printf("%zu %zu %zu\\n", tail_count_at({u}, {w}u), tail_ml_at({u}, {w}u), tail_o_at({u}, {w}u));\n' for u, w in cells)
    got = _run_cpp(tmp_path, rule, body)
    want = [list(r) for jb, je, parts in ranges for r in TailSplit.ranges(jb, je, parts)]
    assert got[:len(want)] == want
    units = 24
    lay = rule.layout(tail=units, parts=1)
    ml_shape, o_shape = (units, rule.warps, 4, 32), (units, rule.warps, rule.d_head // 2, 32)
    assert 4 * np.prod(ml_shape) == lay["ml"][1] and 4 * np.prod(o_shape) == lay["o"][1]
    for (u, w), line in zip(cells, got[len(want):], strict=True):
        assert line == [np.ravel_multi_index((u, w), (units, rule.warps)), np.ravel_multi_index((u, w, 0, 0), ml_shape),
                        np.ravel_multi_index((u, w, 0, 0), o_shape)]
