"""The backward CTA's walk of its work items (flashgen.attention.item_walk): every (query head, query block) item
once, from the key block's item where it rotates (item 0 where it does not), each next item cyclically; the emitted
cursor visits the items the Python walk does; the steps carry an offset from item to item."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashgen.attention.item_walk import ItemWalk

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ walk")
WALKS = (ItemWalk(rotates=True), ItemWalk(rotates=False))


def _host_run(tmp_path, code: str, body: str) -> str:
    """What ``main() { body }`` prints, compiled by g++ for the host after the emitted ``code``."""
    src, exe = tmp_path / "walk.cpp", tmp_path / "walk"
    src.write_text("#include <stdio.h>\n#include <stdint.h>\n#define __host__\n#define __device__\n#define __forceinline__ inline\n"
                   + code + "\nint main() {\n" + body + "}\n")
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


@given(rotates=st.booleans(), n_q=st.integers(0, 9), group=st.integers(1, 5), kb=st.integers(0, 60))
def test_the_walk_visits_every_item_once_from_its_first_in_cyclic_order(rotates, n_q, group, kb):
    walk = ItemWalk(rotates=rotates)
    order = walk.order(n_q, group, kb)
    work = n_q * group
    assert sorted(order) == sorted(itertools.product(range(group), range(n_q)))
    first = kb % work if rotates and work else 0
    assert [h * n_q + q for h, q in order] == [(first + w) % work for w in range(work)]


def test_a_key_block_without_visited_query_blocks_walks_nothing():
    assert all(walk.order(0, 4, 3) == [] == walk.order(-2, 4, 3) for walk in WALKS)


@needs_gxx
@pytest.mark.parametrize("walk", WALKS, ids=("rotates", "upwards"))
def test_the_emitted_cursor_walks_as_the_python_does(tmp_path, walk):
    cases = list(itertools.product((0, 1, 3, 7), (1, 2, 5), (0, 1, 4, 23)))
    body = "".join(f"    {{ ItemCursor c = first_item({n_q}, {group}, {kb});\n"
                   f"      for (int w = 0; w < {n_q * group}; ++w, next_item(c, {n_q}, {group})) printf(\"%d %d \", c.h, c.q);\n"
                   "      printf(\"\\n\"); }\n" for n_q, group, kb in cases)
    out = _host_run(tmp_path, walk.to_cpp(), body).splitlines()
    got = [[tuple(map(int, pair)) for pair in zip(*[iter(line.split())] * 2)] for line in out]
    assert got == [walk.order(n_q, group, kb) for n_q, group, kb in cases]


@given(rotates=st.booleans(), n_q=st.integers(1, 9), group=st.integers(1, 5), kb=st.integers(0, 60))
def test_the_steps_carry_an_offset_from_item_to_item_along_the_walk(rotates, n_q, group, kb):
    walk, block, head = ItemWalk(rotates=rotates), 1000, 1000 * 17  # a head's stride past its blocks' (padding)
    order = walk.order(n_q, group, kb)
    offset = order[0][0] * head + order[0][1] * block
    for h, q in order[1:]:
        offset += walk.step(h, q, n_q, group, block, head)
        assert offset == h * head + q * block


@needs_gxx
def test_the_emitted_step_is_the_python_one(tmp_path):
    cases = [(h, q, n_q, group) for n_q, group in itertools.product((1, 3, 7), (1, 2, 5)) for h in range(group) for q in range(n_q)]
    body = "".join(f'    printf("%lld\\n", (long long)item_step({h}, {q}, {n_q}, {group}, 4096, 3 * 4096 + 64));\n'
                   for h, q, n_q, group in cases)
    out = _host_run(tmp_path, ItemWalk.step_cpp(), body).split()
    assert [int(x) for x in out] == [ItemWalk.step(h, q, n_q, group, 4096, 3 * 4096 + 64) for h, q, n_q, group in cases]
