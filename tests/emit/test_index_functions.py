"""The emitted ``__host__ __device__`` index functions equal the simulator's evaluation of the plan.

For each config of a spread (swizzled or not, B_r 64/128, B_c 32/64/128, 4/8 warps,
d_head 64/128) the emitted .cu is compiled for the host with
``g++ -std=c++17 -x c++ -DFLASHGEN_INDEX_ONLY`` together with a generated ``main()``
that prints, for every thread (or lane), value, warp and loop index of every copy:
``<copy>_row``, ``<copy>_col``, ``<copy>_smem``, the split form
``(<copy>_smem(thread, 0, ...) ^ <copy>_xor[i]) + <copy>_add[i]`` and the split
coordinates ``<copy>_row(thread, 0, ...) + <copy>_drow[i]`` (and col); then every
``<tensor>_offset(row, col)`` of the shared-memory tiles.

The expected values come from the plan's own objects, not a re-derivation: the
coordinates from ``Partition.coord`` and the offsets from the tensors' layouts
evaluated over every coordinate by ``flashgen.sim.layout_eval.offsets``.
"""
from __future__ import annotations

import itertools
import shutil
import subprocess

import numpy as np
import pytest

from flashgen.dsl.notation import parse_config
from flashgen.dsl.plan import KernelPlan, TiledCopy, make_plan
from flashgen.dsl.swizzle import ComposedLayout
from flashgen.emit.kernel import index_functions, plan_splits
from flashgen.sim.layout_eval import offsets

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not found on PATH")

SPREAD = [
    "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles",
    "(BF16, 128, 128, 128, 8): async+eager+swizzled+load_0_2_2_tiles+opt_softmax",
    "(FP16, 64, 64, 32, 4): async+eager+load_2_2_2_tiles+buffer",
    "(FP16, 64, 128, 32, 8): async+eager+swizzled+load_0_2_0_tiles+buffer+opt_softmax",
    "(BF16, 128, 64, 128, 4): swizzled+load_2_2_2_tiles",
    "(FP16, 128, 128, 32, 8): load_0_0_0_tiles+opt_softmax",
    "(FP16, 64, 64, 128, 4): async+swizzled+load_2_2_4_tiles+buffer",
]

SMEM_TENSORS = ("sQ", "sK", "sV", "sO")


def _copies(plan: KernelPlan) -> dict[str, TiledCopy]:
    copies = [plan.g2s[o] for o in "QKV"] + [plan.s2r[o].copy for o in "QKV"] + [plan.r2s_O, plan.s2g_O]
    return {c.name: c for c in copies}


def _domain(copy: TiledCopy, params: list[str], n_warps: int) -> list[tuple[str, int]]:
    """(parameter, extent) of every index function parameter, in signature order."""
    part = copy.partition
    loops = {l.name: l.extent for l in part.loops}
    ext = {params[0]: part.tv.n_threads, "v": part.tv.n_values, "warp": n_warps, **loops}
    return [(p, ext[p]) for p in params]


def _tile_rows_cols(layout) -> tuple[int, int]:
    base = layout.layout if isinstance(layout, ComposedLayout) else layout
    return base[0].size, base[1].size


def _main_cpp(plan: KernelPlan, name: str, split_names: set[str], text: str) -> str:
    """A main() printing every index function over its whole domain (see the module docstring)."""
    copies = _copies(plan)
    fns = {}
    for fn, params in index_functions(plan):
        for suffix in ("_row", "_col", "_smem"):
            if fn.endswith(suffix) and fn[: -len(suffix)] in copies:
                fns[fn[: -len(suffix)]] = params
    body = []
    for cname, params in fns.items():
        dom = _domain(copies[cname], params, plan.cfg.n_warps)
        indent = "    "
        for p, n in dom:
            body.append(f"{indent}for (uint32_t {p} = 0; {p} < {n}u; ++{p})")
            indent += "    "
        args = ", ".join(params)
        if cname in split_names:
            zero = ", ".join("0" if p == "v" or p not in (params[0], "warp") else p for p in params)
            sub = "".join(f"[{p}]" for p in params if p not in (params[0], "warp"))
            # coordinate deltas are emitted only where the kernel uses them (g2s copies not walking
            # rows at a constant step); elsewhere the row/col columns repeat the direct functions
            has_deltas = f"uint32_t {cname}_drow[" in text
            split = (f"({cname}_smem({zero}) ^ {cname}_xor{sub}) + {cname}_add{sub}",
                     f"{cname}_row({zero}) + {cname}_drow{sub}" if has_deltas else f"{cname}_row({args})",
                     f"{cname}_col({zero}) + {cname}_dcol{sub}" if has_deltas else f"{cname}_col({args})")
        else:
            split = (f"{cname}_smem({args})", f"{cname}_row({args})", f"{cname}_col({args})")
        body.append(
            f'{indent}std::printf("%u %u %u %u %u %u\\n", {cname}_row({args}), {cname}_col({args}), '
            f"{cname}_smem({args}), {', '.join(split)});"
        )
    for t in SMEM_TENSORS:
        rows, cols = _tile_rows_cols(plan.tensors[t].layout)
        body.append(f"    for (uint32_t col = 0; col < {cols}u; ++col)")
        body.append(f"        for (uint32_t row = 0; row < {rows}u; ++row)")
        body.append(f'            std::printf("%u\\n", {t}_offset(row, col));')
    return (
        f'#include "{name}.cu"\n#include <cstdio>\n\nint main() {{\n    using namespace {name};\n'
        + "\n".join(body)
        + "\n    return 0;\n}\n"
    )


def _expected(plan: KernelPlan, split_names: set[str]) -> np.ndarray:
    """The same numbers, from Partition.coord and layout_eval.offsets of the tensors' layouts."""
    copies = _copies(plan)
    smem = {}
    for t in SMEM_TENSORS:
        layout = plan.tensors[t].layout
        rows, _ = _tile_rows_cols(layout)
        smem[t] = (offsets(layout), rows)  # 1-D colexicographic coordinate = row + rows * col
    out: list[int] = []
    seen = []
    for fn, params in index_functions(plan):
        cname = fn.rsplit("_", 1)[0]
        if cname not in copies or cname in seen:
            continue
        seen.append(cname)
        copy = copies[cname]
        part = copy.partition
        table, rows = smem[copy.smem.name]
        dom = _domain(copy, params, plan.cfg.n_warps)
        loop_names = [l.name for l in part.loops]
        for idx in itertools.product(*(range(n) for _, n in dom)):
            kw = dict(zip(params, idx))
            thread, v, w = idx[0], kw["v"], kw.get("warp", 0)
            r, c = part.coord(thread, v, w, **{n: kw[n] for n in loop_names})
            s = int(table[r + rows * c])
            out += [r, c, s, s, r, c]
    for t in SMEM_TENSORS:
        out += [int(x) for x in smem[t][0]]
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("cfg_text", SPREAD)
def test_index_functions_equal_the_simulator(cfg_text, source, tmp_path):
    cfg = parse_config(cfg_text)
    plan = make_plan(cfg)
    src = source(cfg)
    splits = set(plan_splits(plan))
    for n in splits:
        assert f"{n}_xor" in src.text
    (tmp_path / f"{src.name}.cu").write_text(src.text)
    (tmp_path / "main.cpp").write_text(_main_cpp(plan, src.name, splits, src.text))
    exe = tmp_path / "index_fns"
    cmd = [GXX, "-std=c++17", "-O1", "-x", "c++", "-DFLASHGEN_INDEX_ONLY", "main.cpp", "-o", str(exe)]
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    got = np.array(run.stdout.split(), dtype=np.int64)
    want = _expected(plan, splits)
    assert got.shape == want.shape
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        pytest.fail(f"{cfg.short_form()}: emitted index functions differ from the plan at value {bad}: "
                    f"emitted {got[bad]}, simulator {want[bad]}")


def test_spread_covers_the_knobs_that_shape_addresses():
    cfgs = [parse_config(s) for s in SPREAD]
    assert {c.swizzled for c in cfgs} == {True, False}
    assert {c.B_r for c in cfgs} == {64, 128}
    assert {c.B_c for c in cfgs} == {32, 64, 128}
    assert {c.n_warps for c in cfgs} == {4, 8}
    assert {c.d_head for c in cfgs} == {64, 128}
    assert {c.async_copy for c in cfgs} == {True, False}
