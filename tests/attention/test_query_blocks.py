"""The key-block view of the score mask (flashgen.attention.query_blocks): the query blocks a
backward CTA visits hold every kept score of its key block, no visited block is empty at either end,
blocks said not to need the mask keep every score, and the C++ agrees with the Python."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.attention.query_blocks import QueryBlocks
from flashgen.dsl.plan import ScoreMask

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")
KINDS = ("none", "causal", "window")


def _rule(kind, B_r=16, B_c=8):
    return QueryBlocks(ScoreMask(kind, B_r, B_c))


def _kept(rule, qb, kb, seq_q, seq_k, *args):
    rows = range(qb * rule.B_r, (qb + 1) * rule.B_r)
    cols = range(kb * rule.B_c, min((kb + 1) * rule.B_c, seq_k))
    return [[rule.keep(i, j, seq_q, seq_k, *args) for j in cols] for i in rows]


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(KINDS), seq_q=st.integers(1, 70), seq_k=st.integers(1, 70), offset=st.integers(-40, 40),
       left=st.integers(-1, 30), right=st.integers(-1, 30))
def test_visited_query_blocks_are_exactly_those_with_kept_scores(kind, seq_q, seq_k, offset, left, right):
    rule = _rule(kind)
    args = (offset, left, right)
    n_q = -(-seq_q // rule.B_r)
    for kb in range(-(-seq_k // rule.B_c)):
        begin, end = rule.block_range(kb, seq_q, seq_k, *args)
        assert 0 <= begin <= end <= n_q
        for qb in range(n_q):
            kept = _kept(rule, qb, kb, seq_q, seq_k, *args)
            if not begin <= qb < end:
                assert not any(map(any, kept)), f"key block {kb}: query block {qb} holds kept scores outside [{begin}, {end})"
            elif not rule.block_needs_mask(qb, kb, seq_q, seq_k, *args):
                assert all(map(all, kept))
        for qb in {begin, end - 1} if end > begin else ():
            assert any(map(any, _kept(rule, qb, kb, seq_q, seq_k, *args))), f"key block {kb}: visited query block {qb} is empty"


def _run_cpp(tmp_path, rule, body):
    src = tmp_path / "qb.cpp"
    host = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"
    consts = f"constexpr int B_r = {rule.B_r};\nconstexpr int B_c = {rule.B_c};\n"
    src.write_text("#include <stdio.h>\n" + host + consts + rule.mask.to_cpp() + "\n" + rule.to_cpp()
                   + "\nint main() {\n    int b, e;\n" + body + "}\n")
    exe = tmp_path / "qb"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unused-variable", "-o", str(exe), str(src)],
                   check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


@needs_gxx
@pytest.mark.parametrize("kind", KINDS)
def test_emitted_rule_agrees_with_python(tmp_path, kind):
    rule = _rule(kind)
    cases = list(itertools.product((1, 17, 40), (5, 24, 33), (-20, 0, 7), (-1, 0, 9), (-1, 0, 12)))
    want, body = [], []
    for seq_q, seq_k, offset, left, right in cases:
        args = f"{seq_q}, {seq_k}, {offset}, {left}, {right}"
        for kb in range(-(-seq_k // rule.B_c)):
            row = list(rule.block_range(kb, seq_q, seq_k, offset, left, right))
            row += [int(rule.block_needs_mask(qb, kb, seq_q, seq_k, offset, left, right)) for qb in range(-(-seq_q // rule.B_r))]
            want.append(row)
            body.append(f'    q_block_range({kb}, {args}, &b, &e); printf("%d %d", b, e);\n'
                        f'    for (int qb = 0; qb < (({seq_q}) + B_r - 1) / B_r; ++qb) printf(" %d", (int)bwd_block_needs_mask(qb, {kb}, {args}));\n'
                        '    printf("\\n");\n')
    assert _run_cpp(tmp_path, rule, "".join(body)) == want


def _visitors(rule, qb, seq_q, seq_k, *args):
    """The key blocks that visit query block ``qb`` (those whose query-block range holds it), ascending."""
    return [kb for kb in range(-(-seq_k // rule.B_c)) if qb in range(*rule.block_range(kb, seq_q, seq_k, *args))]


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(KINDS), seq_q=st.integers(1, 70), seq_k=st.integers(1, 70), offset=st.integers(-40, 40),
       left=st.integers(-1, 30), right=st.integers(-1, 30))
def test_a_key_blocks_rank_counts_the_key_blocks_below_it_that_visit_the_query_block(kind, seq_q, seq_k, offset, left, right):
    """The deterministic dQ order: each visitor waits for exactly the visitors below it, so the ranks of a
    query block's visitors are 0, 1, 2, ... (no wait for a count that a skipping key block never adds)."""
    rule = _rule(kind)
    args = (offset, left, right)
    for qb in range(-(-seq_q // rule.B_r)):
        visitors = _visitors(rule, qb, seq_q, seq_k, *args)
        assert [rule.key_rank(qb, kb, seq_q, seq_k, *args) for kb in visitors] == list(range(len(visitors)))


@needs_gxx
@pytest.mark.parametrize("kind", KINDS)
def test_emitted_key_rank_agrees_with_python_for_every_block_pair(tmp_path, kind):
    """For every (key block, query block): whether the C++ visits it, and the C++ rank of each visitor, equal
    the Python model's (visiting from QueryBlocks.block_range, rank = visitors below it)."""
    rule = _rule(kind)
    cases = list(itertools.product((1, 17, 40), (5, 24, 33), (-20, 0, 7), (-1, 0, 9), (-1, 0, 12)))
    want, body = [], []
    for seq_q, seq_k, offset, left, right in cases:
        args = f"{seq_q}, {seq_k}, {offset}, {left}, {right}"
        for qb in range(-(-seq_q // rule.B_r)):
            visitors = _visitors(rule, qb, seq_q, seq_k, offset, left, right)
            want.append([visitors.index(kb) if kb in visitors else -1 for kb in range(-(-seq_k // rule.B_c))])
            body.append(f'    for (int kb = 0; kb < ({seq_k} + B_c - 1) / B_c; ++kb) {{\n'
                        f'        q_block_range(kb, {args}, &b, &e);\n'
                        f'        printf(" %d", b <= {qb} && {qb} < e ? key_rank({qb}, kb, {args}) : -1);\n'
                        '    }\n    printf("\\n");\n')
    assert _run_cpp(tmp_path, rule, "".join(body)) == want
