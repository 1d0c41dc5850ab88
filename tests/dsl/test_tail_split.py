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

SPLIT = TailSplit(max_parts=4, min_blocks=2, consumers=2, d_head=128)
FEW = TailSplit(max_parts=4, min_blocks=2, consumers=2, d_head=128, full_rounds=False)  # masked kernels' rule


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
    ctas = TailSplit.ctas(tiles, sms, parts)
    assert ctas <= sms and (tiles < sms or ctas == sms)
    # the kernel's view: the last round (the only one when fewer tiles than SMs) holds the tail
    in_last_round = tiles % ctas if tiles >= ctas else tiles
    assert in_last_round == (tail if tiles >= sms or parts > 1 else 0)


def test_the_measured_case_splits_in_four():
    """seq 2048, batch 16, 16 heads, B_r 128 on 132 SMs: 4096 tiles leave 4 for the last round."""
    assert SPLIT.parts(16 * 16 * 16, 132, 2048 // 160 + 1) == 4
    assert SPLIT.parts(16 * 16 * 16, 128, 16) == 1  # 32 full rounds
    assert SPLIT.parts(8, 132, 64) == 4 and TailSplit.ctas(8, 132, 4) == 32  # few tiles, long keys: a wider grid


@given(jb=st.integers(0, 50), n=st.integers(1, 60), parts=st.integers(1, 8))
def test_ranges_cover_the_blocks_in_order(jb, n, parts):
    rs = TailSplit.ranges(jb, jb + n, parts)
    assert rs[0][0] == jb and rs[-1][1] == jb + n
    assert all(a[1] == b[0] for a, b in zip(rs, rs[1:]))
    sizes = [e - b for b, e in rs]
    assert max(sizes) - min(sizes) <= 1 and (min(sizes) >= 1 or parts > n)


def test_workspace_layout_is_disjoint_and_sized_for_every_part():
    lay = SPLIT.layout(tail=4, parts=4)
    (c0, cn), (m0, mn), (o0, on) = lay["count"], lay["ml"], lay["o"]
    assert c0 == 0 and cn == 4 * 8 * 4 and m0 >= cn and m0 % 256 == 0 and o0 == m0 + mn
    assert mn == 16 * 8 * 4 * 32 * 4  # 16 units x 8 warps x (2 maxima + 2 sums) x 32 lanes, fp32
    assert on == 16 * 8 * 64 * 32 * 4  # ... x 64 accumulator values


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")
@pytest.mark.parametrize("rule", [SPLIT, FEW], ids=["full-rounds", "few-tiles-only"])
def test_emitted_rule_agrees_with_python(tmp_path, rule):
    cases = [(t, c, n) for t in (1, 5, 131, 133, 160, 198, 268, 4096, 8192, 4100) for c in (1, 3, 66, 114, 132) for n in (0, 1, 3, 7, 13, 16)]
    src = tmp_path / "rule.cpp"
    src.write_text("#include <stdint.h>\n#include <stddef.h>\n#include <stdio.h>\n" + rule.to_cpp() + "\nint main() {\n"
                   + "".join(f'    printf("%d %zu %zu %zu\\n", tail_parts({t}, {c}, {n}), tail_count_bytes({t % c}), '
                             f'tail_ml_bytes({t % c} * 3), tail_o_bytes({t % c} * 3));\n' for t, c, n in cases)
                   + "}\n")
    exe = tmp_path / "rule"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-o", str(exe), str(src)], check=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    for (t, c, n), line in zip(cases, got):
        lay = rule.layout(t % c, 3)
        want = [rule.parts(t, c, n), lay["ml"][0], lay["ml"][1], lay["o"][1]]
        assert [int(x) for x in line.split()] == want, (t, c, n)
