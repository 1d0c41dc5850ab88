"""The backward's grid (flashgen.attention.backward_grid): every CTA launched once, key blocks slowest (a
causal mask's longest CTAs first), lower key blocks of a (kv head, batch) pair started first (what keeps
the ordered dQ adds free of deadlock), the grid's limits, and the C++ both engines' launchers and kernels
call agreeing with the Python the simulators run."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest

from flashgen.attention.backward_grid import MAX_X, MAX_YZ, BackwardGrid
from flashgen.attention.query_blocks import QueryBlocks
from flashgen.attention.score_mask import ScoreMask
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import make_backward_plan
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.emit.backward_kernel import emit_backward
from flashgen.emit.hopper_backward_kernel import emit_hopper_backward

GRID = BackwardGrid()
#: (key blocks, kv heads, batch entries): one CTA, one of each dimension, the shapes of the estimate (16 heads x
#: batch 8 of 16 to 64 key blocks), odd counts, more pairs than CTAs resident at once
SIZES = [(1, 1, 1), (5, 1, 1), (1, 7, 1), (1, 1, 3), (16, 16, 8), (64, 16, 8), (7, 3, 5), (33, 2, 1), (3, 40, 4)]


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_every_cta_is_launched_once(size):
    order = GRID.dispatch_order(*size)
    assert sorted(order) == sorted(itertools.product(*(range(n) for n in size)))


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_every_pairs_key_block_starts_before_any_pairs_next_one(size):
    """The key block never falls along the order: all key blocks 0, then all key blocks 1, ..."""
    kbs = [kb for kb, _, _ in GRID.dispatch_order(*size)]
    assert kbs == sorted(kbs)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("seq_q, seq_k", [(2048, 2048), (1000, 3000), (3000, 1000), (200, 200)])
def test_the_longest_ctas_start_first_under_a_causal_mask(seq_q, seq_k, align):
    """Each CTA's query blocks (QueryBlocks.block_range) never grow along the dispatch order."""
    blocks = QueryBlocks(ScoreMask("causal", 64, 128))
    offset = seq_k - seq_q if align == "bottom_right" else 0
    n_kb = -(-seq_k // 128)
    work = [(lambda r: r[1] - r[0])(blocks.block_range(kb, seq_q, seq_k, offset, -1, 0)) for kb, _, _ in GRID.dispatch_order(n_kb, 4, 3)]
    assert work == sorted(work, reverse=True) and work[0] > work[-1]


def _resident_run(order: list[tuple[int, int, int]], slots: int) -> bool:
    """The hardware's dispatch, with a CTA holding its slot until the lower key blocks of its (kv head, batch)
    pair have finished (what an ordered dQ add may wait for): CTAs start in ``order`` whenever a slot is
    free; True when every CTA finishes."""
    done: set = set()
    resident: list = []
    waiting = list(order)
    while waiting or resident:
        while waiting and len(resident) < slots:
            resident.append(waiting.pop(0))
        finishing = [c for c in resident if all((kb, c[1], c[2]) in done for kb in range(c[0]))]
        if not finishing:
            return False
        done.update(finishing)
        resident = [c for c in resident if c not in finishing]
    return True


@pytest.mark.parametrize("size", SIZES + [(9, 5, 3), (2, 70, 2)], ids=str)
def test_lower_key_blocks_of_a_pair_start_first(size):
    """deterministic: a key block's dQ adds wait for the lower key blocks of its pair. Each lower key block of
    the pair has a lower place in the dispatch order, so however few CTAs are resident (one included) the
    lowest unfinished one is resident and never waits: every CTA finishes."""
    order = GRID.dispatch_order(*size)
    place = {c: i for i, c in enumerate(order)}
    assert all(place[(kb - 1, h, b)] < place[(kb, h, b)] for kb, h, b in order if kb)
    assert all(_resident_run(order, slots) for slots in (1, 2, 3, 8, 132))


def test_the_old_order_would_hang_with_few_resident_ctas():
    """The residency model can fail: key blocks started highest first hang with one resident CTA."""
    order = sorted(GRID.dispatch_order(4, 2, 1), key=lambda c: -c[0])
    assert not _resident_run(order, 1) and _resident_run(order, len(order))


def test_the_grid_refuses_what_no_launch_holds():
    assert GRID.grid(MAX_YZ, MAX_X, MAX_YZ) == (MAX_X, MAX_YZ, MAX_YZ)
    assert GRID.grid(MAX_YZ + 1, 1, 1) is None and GRID.grid(1, 1, MAX_YZ + 1) is None and GRID.grid(1, MAX_X + 1, 1) is None
    with pytest.raises(ValueError, match="no grid holds them"):
        GRID.dispatch_order(MAX_YZ + 1, 1, 1)


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")


def _run_cpp(tmp_path, body: str) -> list[list[int]]:
    """Compile the rule's C++ for the host with ``body`` in main; the printed numbers, line by line."""
    src = tmp_path / "grid.cpp"
    host = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"  # the kernel's qualifiers, for g++
    src.write_text("#include <stdint.h>\n#include <stdio.h>\n" + host + GRID.to_cpp() + "\nint main() {\n    uint32_t g[3];\n"
                   + body + "    return 0;\n}\n")
    exe = tmp_path / "grid"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


#: launches past every limit and at it, beside the ordinary ones
LIMITS = [(MAX_YZ, 1, 1), (MAX_YZ + 1, 1, 1), (1, 1, MAX_YZ), (1, 1, MAX_YZ + 1), (3, MAX_X, 2), (1, MAX_X + 1, 1),
          (2**26, 16, 8), (1, 2**20, 2**12)]


@needs_gxx
def test_emitted_grid_and_decode_agree_with_python(tmp_path):
    """bwd_grid's (fits, x, y, z) equals grid()'s for every size; walking each small grid in the hardware's
    linear order (x fastest), bwd_cta's blocks are dispatch_order's list."""
    body = "".join(f"    {{ const bool ok = bwd_grid({kb}, {h}, {b}, g); printf(\"%d %u %u %u\\n\", int(ok), ok ? g[0] : 0u, "
                   f"ok ? g[1] : 0u, ok ? g[2] : 0u); }}\n" for kb, h, b in SIZES + LIMITS)
    body += "".join(f"    bwd_grid({kb}, {h}, {b}, g);\n"
                    "    for (uint32_t z = 0; z < g[2]; ++z) for (uint32_t y = 0; y < g[1]; ++y) for (uint32_t x = 0; x < g[0]; ++x) {\n"
                    "        const BwdCta c = bwd_cta(x, y, z); printf(\"%u %u %u \", c.kb, c.kv_head, c.batch);\n"
                    "    }\n    printf(\"\\n\");\n" for kb, h, b in SIZES)
    got = _run_cpp(tmp_path, body)
    grids = [[1, *g] if (g := GRID.grid(*size)) is not None else [0, 0, 0, 0] for size in SIZES + LIMITS]
    orders = [[x for c in GRID.dispatch_order(*size) for x in c] for size in SIZES]
    assert got == grids + orders


ENGINES = [(make_backward_plan, emit_backward, BackwardConfig.default("fp16", 128, "causal").replace(deterministic=True)),
           (make_hopper_backward_plan, emit_hopper_backward, BackwardConfig.wgmma("bf16", 128, "causal").replace(deterministic=True))]


@pytest.mark.parametrize("make, emit, cfg", ENGINES, ids=["mma_sync", "wgmma"])
def test_both_engines_launch_and_decode_through_the_rule(make, emit, cfg):
    """The main kernel's block decode, the launch's size check and grid, and the ordered adds' note come from
    the plan's BackwardGrid; no block index is read as a key block, kv head or batch entry anywhere else."""
    plan = make(cfg)
    src = emit(plan)
    text = src.text
    assert plan.grid == GRID and text.count(GRID.to_cpp()) == 1
    assert all(text.count(line) == 1 for line in GRID.kernel_cpp())
    assert f"|| {GRID.launch_check_cpp()})" in text and f"kernel<<<{GRID.LAUNCH_DIMS}, THREADS, smem, s>>>(p);" in text
    assert text.count(GRID.WAIT_NOTE[0]) == text.count("turn_wait(") - text.count("void turn_wait(") >= 1
    main = text[text.index("kernel(const __grid_constant__ Params p)"):]
    main = main[:main.index("\n}\n")]
    assert main.count("blockIdx") == 3 and "gridDim" not in main
    assert src.meta["grid"] == GRID.described(cfg.B_c)
