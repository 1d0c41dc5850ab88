"""The backward's grid (flashgen.attention.backward_grid), both orders: every CTA launched once; the default
keeps a pair's key blocks together, longest first too but for the last pairs (about two waves of CTAs), which start
key block by key block (a causal mask's longest CTAs of the tail first); in both a pair's lower key blocks start first (what keeps the ordered dQ
adds free of deadlock); the grid's limits; the C++ both engines' kernels and launchers hold agreeing with the
Python the simulators run, the default's being the text the kernels had before the rule."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import pytest

from flashgen.attention.backward_grid import BATCH, MAX_X, MAX_YZ, SMS_CPP, BackwardGrid
from flashgen.attention.query_blocks import QueryBlocks
from flashgen.attention.score_mask import ScoreMask
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import make_backward_plan
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.emit.backward_kernel import emit_backward
from flashgen.emit.hopper_backward_kernel import emit_hopper_backward

DEFAULT, LONGEST = BackwardGrid(), BackwardGrid(longest_first=True)
GRIDS = [DEFAULT, LONGEST]
#: (key blocks, kv heads, batch entries): one CTA, one of each dimension, the shapes of the estimate (16 heads x
#: batch 8 of 16 to 64 key blocks), odd counts, more pairs than CTAs resident at once
SIZES = [(1, 1, 1), (5, 1, 1), (1, 7, 1), (1, 1, 3), (16, 16, 8), (64, 16, 8), (7, 3, 5), (33, 2, 1), (3, 40, 4)]
#: SM counts of the tests: a small GPU, an A100, an H100 / H200
SMS = (4, 108, 132)


def _id(grid: BackwardGrid) -> str:
    return "longest_first" if grid.longest_first else "default"


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("grid", GRIDS, ids=_id)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_every_cta_is_launched_once(grid, size, sms):
    order = grid.dispatch_order(*size, sms=sms)
    assert sorted(order) == sorted(itertools.product(*(range(n) for n in size)))


@pytest.mark.parametrize("size", SIZES, ids=str)
def test_the_default_starts_a_pairs_key_blocks_together(size):
    """Linear block (b * kv_heads + h) * key_blocks + kb: pair by pair, each pair's key blocks in a row, ascending."""
    n_kb = size[0]
    order = DEFAULT.dispatch_order(*size)
    assert [kb for kb, _, _ in order] == list(range(n_kb)) * (len(order) // n_kb)
    pairs = [(b, h) for _, h, b in order[::n_kb]]
    assert pairs == sorted(pairs) and all(order[i][1:] == order[i - i % n_kb][1:] for i in range(len(order)))


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_longest_first_reorders_only_the_last_pairs_key_block_by_key_block(size, sms):
    """The default's order up to the tail's pairs (the last ceil(2 sms / key blocks) of them, every pair where there
    are fewer); from there the key block never falls: every tail pair's key block 0, then every key block 1, ..., the
    pairs in the default's order within each."""
    n_kb, pairs = size[0], size[1] * size[2]
    tail = min(pairs, -(-2 * sms // n_kb))
    assert LONGEST.tail_pairs(n_kb, pairs, sms) == tail and DEFAULT.tail_pairs(n_kb, pairs, sms) == 0
    order, default = LONGEST.dispatch_order(*size, sms=sms), DEFAULT.dispatch_order(*size)
    head = (pairs - tail) * n_kb
    assert order[:head] == default[:head]
    assert [kb for kb, _, _ in order[head:]] == sorted(kb for kb, _, _ in order[head:])
    assert [(b, h) for _, h, b in order[head:head + tail]] == [(b, h) for _, h, b in default[head::n_kb]]


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("seq_q, seq_k", [(2048, 2048), (1000, 3000), (3000, 1000), (200, 200)])
def test_longest_first_starts_the_longest_ctas_first_under_a_causal_mask(seq_q, seq_k, align):
    """Each CTA's query blocks (QueryBlocks.block_range) never grow along longest first's tail; along the
    default's they grow again at every pair. On 1000 SMs the tail is every one of the 4 x 3 pairs."""
    blocks = QueryBlocks(ScoreMask("causal", 64, 128))
    offset = seq_k - seq_q if align == "bottom_right" else 0
    n_kb = -(-seq_k // 128)

    def work(grid):
        return [(lambda r: r[1] - r[0])(blocks.block_range(kb, seq_q, seq_k, offset, -1, 0)) for kb, _, _ in grid.dispatch_order(n_kb, 4, 3, sms=1000)]

    assert LONGEST.tail_pairs(n_kb, 12, 1000) == 12
    assert work(LONGEST) == sorted(work(LONGEST), reverse=True) and work(LONGEST)[0] > work(LONGEST)[-1]
    assert work(DEFAULT) != sorted(work(DEFAULT), reverse=True)


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


@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("grid", GRIDS, ids=_id)
@pytest.mark.parametrize("size", SIZES + [(9, 5, 3), (2, 70, 2)], ids=str)
def test_lower_key_blocks_of_a_pair_start_first(grid, size, sms):
    """deterministic: a key block's dQ adds wait for the lower key blocks of its pair. In either order each lower
    key block of the pair has a lower place in the dispatch order, so however few CTAs are resident (one
    included) the lowest unfinished one is resident and never waits: every CTA finishes."""
    order = grid.dispatch_order(*size, sms=sms)
    place = {c: i for i, c in enumerate(order)}
    assert all(place[(kb - 1, h, b)] < place[(kb, h, b)] for kb, h, b in order if kb)
    assert all(_resident_run(order, slots) for slots in (1, 2, 3, 8, 132))


def test_an_order_starting_high_key_blocks_first_would_hang_with_few_resident_ctas():
    """The residency model can fail: key blocks started highest first hang with one resident CTA."""
    order = sorted(DEFAULT.dispatch_order(4, 2, 1), key=lambda c: -c[0])
    assert not _resident_run(order, 1) and _resident_run(order, len(order))


@pytest.mark.parametrize("grid", GRIDS, ids=_id)
def test_the_grid_refuses_what_no_launch_holds(grid):
    """Both orders launch (key blocks, kv heads, batch): gridDim's limits on each."""
    assert grid.grid(MAX_X, MAX_YZ, MAX_YZ) == (MAX_X, MAX_YZ, MAX_YZ)
    over = [(MAX_X + 1, 1, 1), (1, MAX_YZ + 1, 1), (1, 1, MAX_YZ + 1)]
    assert all(grid.grid(*size) is None for size in over)
    with pytest.raises(ValueError, match="no grid holds them"):
        grid.dispatch_order(*over[0])


def test_the_default_renders_the_kernels_text_from_before_the_rule():
    """Off, the knob changes no kernel's text: the decode, the grid and the launcher's checks the kernels had."""
    assert DEFAULT.kernel_cpp() == "const int kb = int(blockIdx.x), kv_head = int(blockIdx.y), batch = int(blockIdx.z);"
    assert DEFAULT.block_index(BATCH) == "blockIdx.z" and DEFAULT.launch_check_cpp() == ""
    assert DEFAULT.launch_dims_cpp() == "dim3((a->seq_k + B_c - 1) / B_c, a->kv_heads, a->batch)"
    assert DEFAULT.described(64) == "(ceil(seq_k / 64), kv_heads, batch)"
    assert LONGEST.launch_dims_cpp() == DEFAULT.launch_dims_cpp() and LONGEST.launch_check_cpp() == ""


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++ rule")
#: the host test's key block rows (seq_k = key blocks x B_C, less B_C - 1: the launch's rounding up)
B_C = 16
#: host stand-ins for CUDA's block index and grid types, and a launcher's arguments
_HOST = """#include <stdint.h>
#include <stdio.h>
struct uint3 { uint32_t x, y, z; };
struct dim3 { uint32_t x, y, z; dim3(uint32_t x_, uint32_t y_, uint32_t z_) : x(x_), y(y_), z(z_) {} };
struct Args { int batch, kv_heads, seq_k; };
constexpr int B_c = %d;
""" % B_C


def _run_cpp(tmp_path, grid: BackwardGrid, body: str, sms: int = 132) -> list[list[int]]:
    """The rule's kernel and launcher lines compiled for the host (the SM count ``sms`` in place of %nsmid's
    read), ``body`` in main; the printed numbers, by line."""
    src = tmp_path / "grid.cpp"
    decode = grid.kernel_cpp().replace(SMS_CPP, f"sms = {sms};")
    assert (decode != grid.kernel_cpp()) == grid.longest_first
    src.write_text(_HOST + f"""static void decode(const uint3 blockIdx, const dim3 gridDim) {{
    {decode}
    printf("%d %d %d %lld ", kb, kv_head, batch, (long long)({grid.block_index(BATCH)}));
}}
static void launch(const Args* a) {{
    if (false{grid.launch_check_cpp()}) {{ printf("0 0 0 0\\n"); return; }}
    const dim3 g = {grid.launch_dims_cpp()};
    printf("1 %u %u %u\\n", g.x, g.y, g.z);
}}
int main() {{
{body}    return 0;
}}
""")
    exe = tmp_path / "grid"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


#: launches at every limit and past it (seq_k an int: up to 2^27 - 1 key blocks of 16 rows), beside the ordinary ones
LIMITS = [(MAX_YZ, 1, 1), (MAX_YZ + 1, 1, 1), (1, 1, MAX_YZ), (1, 1, MAX_YZ + 1), (1, MAX_YZ, 1), (1, MAX_YZ + 1, 1),
          (3, 2**31 - 1, 2), (2**26, 16, 8), (2**27 - 1, 1, 1)]


def _launchable(launched: list[int]) -> list[int]:
    """What a launch did: (0, 0, 0, 0) where the launcher refused it or the hardware refuses its grid (past
    gridDim's limits), else (1, grid)."""
    ok, x, y, z = launched
    return launched if ok and x <= MAX_X and max(y, z) <= MAX_YZ else [0, 0, 0, 0]


@needs_gxx
@pytest.mark.parametrize("grid, sms", [(DEFAULT, 132), (LONGEST, 132), (LONGEST, 4)], ids=["default", "longest_first", "longest_first_4_sms"])
def test_emitted_launch_and_decode_agree_with_python(tmp_path, grid, sms):
    """The launcher's check and grid launch what grid() says, at every size (the rest refused by the launcher or
    the launch); walking each small grid in the hardware's linear order (x fastest), the kernel's decode gives
    dispatch_order's list, its 64-bit batch index the batch entry."""
    body = "".join(f"    {{ const Args a{{{b}, {h}, {(kb - 1) * B_C + 1}}}; launch(&a); }}\n" for kb, h, b in SIZES + LIMITS)
    body += "".join(f"    for (uint32_t z = 0; z < {gz}; ++z) for (uint32_t y = 0; y < {gy}; ++y) for (uint32_t x = 0; x < {gx}; ++x)\n"
                    f"        decode(uint3{{x, y, z}}, dim3({gx}, {gy}, {gz}));\n    printf(\"\\n\");\n" for gx, gy, gz in (grid.grid(*s) for s in SIZES))
    got = _run_cpp(tmp_path, grid, body, sms)
    n = len(SIZES + LIMITS)
    assert [_launchable(g) for g in got[:n]] == [[1, *g] if (g := grid.grid(*s)) is not None else [0, 0, 0, 0] for s in SIZES + LIMITS]
    assert got[n:] == [[x for kb, h, b in grid.dispatch_order(*size, sms=sms) for x in (kb, h, b, b)] for size in SIZES]


ENGINES = [(make_backward_plan, emit_backward, BackwardConfig.default("fp16", 128, "causal").replace(deterministic=True)),
           (make_hopper_backward_plan, emit_hopper_backward, BackwardConfig.wgmma("bf16", 128, "causal").replace(deterministic=True))]


@pytest.mark.parametrize("longest_first", [False, True])
@pytest.mark.parametrize("make, emit, cfg", ENGINES, ids=["mma_sync", "wgmma"])
def test_both_engines_launch_and_decode_through_the_rule(make, emit, cfg, longest_first):
    """The plan's BackwardGrid is the config's order; the main kernel's block decode, the launch's check and
    grid, and the ordered adds' note come from it; no block index is read anywhere else in the main kernel."""
    plan = make(cfg.replace(longest_first=longest_first))
    grid = plan.grid
    src = emit(plan)
    text = src.text
    assert grid == BackwardGrid(longest_first=longest_first)
    assert f"!a->workspace{grid.launch_check_cpp()})\n" in text and f"kernel<<<{grid.launch_dims_cpp()}, THREADS, smem, s>>>(p);" in text
    assert text.count(grid.wait_note()[0]) == text.count("turn_wait(") - text.count("void turn_wait(") >= 1
    main = text[text.index("kernel(const __grid_constant__ Params p)"):]
    main = [line.strip() for line in main[:main.index("\n}\n")].split("\n")]
    decode = [line.strip() for line in grid.kernel_cpp().split("\n")]
    at = [i for i in range(len(main)) if main[i:i + len(decode)] == decode]
    assert len(at) == 1
    main = main[:at[0]] + main[at[0] + len(decode):]
    batch = grid.block_index(BATCH)  # mma.sync: widened to 64 bits (a comment names it)
    rule = {f"const int64_t batch64 = {batch};", *grid.wait_note()}
    rest = [line for line in main if line not in rule and f"widened from the unsigned {batch}:" not in line]
    assert not [line for line in rest if "blockIdx" in line or "gridDim" in line]
    assert src.meta["grid"] == grid.described(cfg.B_c) and f"// grid: {grid.described(cfg.B_c)}, block:" in text
    assert (plan.cfg.mangle().endswith("_lf") and "longest_first" in plan.cfg.short_form()) == longest_first
