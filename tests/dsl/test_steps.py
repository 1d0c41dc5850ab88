"""Pipeline steps and guards (flashgen.dsl.steps): a guard's C++ agrees with its Python value, and the
plans' schedules are made of step classes both emitters and both simulators know."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from flashgen.dsl.config import KernelConfig, hopper_configs, tuning_space
from flashgen.dsl.steps import BEGIN, FIRST_BLOCK, HAS_NEXT, J, LAST, LAST_BLOCK, NEXT, PREV, Block, Guard, runs
from flashgen.engines import engine_of

GUARDS = [FIRST_BLOCK, HAS_NEXT, LAST_BLOCK, Guard(1, "==", "end"), Guard(0, "<", "end"), Guard(2, ">=", "begin")]
BLOCKS = [J, NEXT, PREV, BEGIN, LAST, Block("begin", 2)]
LOOPS = [(j, jb, je) for jb in range(0, 4) for je in range(jb, 7) for j in range(jb - 1, je + 1)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the rendered guards")
def test_rendered_guards_and_blocks_agree_with_python(tmp_path):
    fns = "".join(f"static bool g{i}(int j, int j_begin, int j_end) {{ return {g.to_cpp()}; }}\n" for i, g in enumerate(GUARDS))
    fns += "".join(f"static int b{i}(int j, int j_begin, int j_end) {{ return {b.to_cpp()}; }}\n" for i, b in enumerate(BLOCKS))
    calls = "".join(f'    printf("%d\\n", g{i}({j}, {jb}, {je}));\n' for i in range(len(GUARDS)) for j, jb, je in LOOPS)
    calls += "".join(f'    printf("%d\\n", b{i}({j}, {jb}, {je}));\n' for i in range(len(BLOCKS)) for j, jb, je in LOOPS)
    src = tmp_path / "guards.cpp"
    src.write_text("#include <stdio.h>\n" + fns + "int main() {\n" + calls + "}\n")
    exe = tmp_path / "guards"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-Wno-unused-parameter", "-o", str(exe), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    assert got == ([int(g.holds(j, jb, je)) for g in GUARDS for j, jb, je in LOOPS]
                   + [b.index(j, jb, je) for b in BLOCKS for j, jb, je in LOOPS])


def test_blocks_print_their_short_names():
    assert [str(b) for b in BLOCKS] == ["j", "j+1", "j-1", "j_begin", "last", "j_begin+2"]
    with pytest.raises(ValueError, match="base j, begin or end"):
        Block("k")


def test_guard_names_its_loop_variables():
    assert HAS_NEXT.to_cpp(end="n_blocks") == "j + 1 < n_blocks"
    assert Guard(0, "<", "end").to_cpp(end="n_blocks", j="j_begin") == "j_begin < n_blocks"
    assert runs(None, 9, 0, 1) and not runs(FIRST_BLOCK, 1, 0, 3)
    with pytest.raises(ValueError, match="cmp one of"):
        Guard(0, "!=", "end")


@pytest.mark.parametrize("cfg", tuning_space()[:8] + hopper_configs(), ids=KernelConfig.mangle)
def test_every_planned_step_is_emitted(cfg):
    """Every step of the plan's schedule is one the engine's emitter renders (an unknown class is a
    KeyError) and appears in the text with its comment."""
    engine = engine_of(cfg)
    plan = engine.make_plan(cfg)
    text = engine.emit(plan).text
    steps = plan.schedule.body if hasattr(plan, "schedule") else plan.body + plan.prologue + plan.epilogue + plan.tile_start
    for s in steps:
        if s.why:
            assert s.why in text, s
