"""The emitted backward (flashgen.emit.backward_kernel): its index functions and address splits,
compiled for the host, equal the plan's objects at every thread, warp and index; its kernels compile
with nvcc for sm_80 and sm_90a without spills or warnings; emitting is pure."""
from __future__ import annotations

import itertools
import shutil
import subprocess

import numpy as np
import pytest

from background import cubin_build  # tests/ is on sys.path (the conftest's folder)

from flashgen.ptxas import parse_ptxas
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import make_backward_plan
from flashgen.emit.backward_kernel import emit_backward, index_functions
from flashgen.sim.layout_eval import offsets

B = BackwardConfig
GXX, NVCC = shutil.which("g++"), shutil.which("nvcc")
#: configs whose kernels must compile without spills; d_head 128 needs its dK, dV and dQ columns
#: split over two warps (d_split=2): one warp's 16 key rows of both at full width leave too few registers
CLEAN = [B.default("fp16", 64), B.default("bf16", 128, "causal"), B.default("bf16", 48),  # the shipped shapes
         B.default("fp16", 256, "causal"), B.default("bf16", 192), B.default("fp16", 96, "window"),
         B.default("bf16", 64, "causal").replace(deterministic=True), B.default("fp16", 128).replace(deterministic=True),
         # the former shapes (a GPU with less shared memory, a call whose mods spill the shipped ones)
         B("fp16", d_head=64, stages=2), B("bf16", mask="causal", stages=2),
         B("fp16", d_head=256, n_warps=8, d_split=2, mask="causal", stages=2),
         # ... and between: 8 warps in fours on 64-column shares (pairs on 128 columns spill some head sizes)
         B("bf16", d_head=192, B_c=32, n_warps=8, d_split=4, mask="causal", stages=2),
         B("fp16", d_head=64, B_r=128, B_c=128, n_warps=8, mask="causal"),
         B("fp16", d_head=40, B_c=32, n_warps=2, swizzled=False, mask="window"),
         B("fp16", n_warps=8, d_split=2, mask="window"),
         # the ordered dQ adds
         B("bf16", d_head=64, mask="causal", stages=2, deterministic=True), B("bf16", n_warps=8, d_split=2, deterministic=True),
         # split_scores (P^T and dS^T through shared memory): d_head 256 in pairs and in fours (dQ in two passes), 128, 64
         B("bf16", d_head=256, n_warps=8, d_split=2, stages=2, split_scores=True),
         B("bf16", d_head=256, n_warps=8, d_split=4, mask="causal", stages=2, split_scores=True),
         B("fp16", d_head=256, n_warps=8, d_split=4, split_scores=True, deterministic=True),
         B("bf16", n_warps=8, d_split=2, mask="causal", stages=2, split_scores=True),
         B("fp16", d_head=64, n_warps=8, d_split=4, stages=2, split_scores=True),
         # dq_split: dQ on a warp grid of its own (d_head 128: 32 x 32 warp tiles; 64: 64 x 16), the ordered adds too
         B.default("bf16", 128).replace(dq_split=4), B.default("fp16", 64, "causal").replace(dq_split=4, deterministic=True)]


def _domain(plan, copy, params):
    ext = {params[0]: copy.partition.tv.n_threads, "v": copy.partition.tv.n_values, "warp": plan.cfg.n_warps,
           **{l.name: l.extent for l in copy.partition.loops}}
    return [ext[p] for p in params]


def _main(plan, name):
    """main() printing, per copy and index: smem offset, its split form, row, col."""
    copies = {c.name: c for _, c in plan.copies()}
    body = []
    for fn, params in index_functions(plan):
        if not fn.endswith("_smem"):
            continue
        cname = fn[: -len("_smem")]
        args = ", ".join(params)
        zero = ", ".join("0" if p not in (params[0], "warp") else p for p in params)
        sub = "".join(f"[{p}]" for p in params if p not in (params[0], "warp"))
        loops = "".join(f"for (uint32_t {p} = 0; {p} < {n}u; ++{p}) " for p, n in zip(params, _domain(plan, copies[cname], params)))
        body.append(f'    {loops}std::printf("%u %u %u %u\\n", {cname}_smem({args}), ({cname}_smem({zero}) ^ {cname}_xor{sub}) + {cname}_add{sub}, '
                    f"{cname}_row({args}), {cname}_col({args}));")
    red = plan.red_dQ
    params = ["lane", "v", "warp"] + [l.name for l in red.partition.loops]
    loops = "".join(f"for (uint32_t {p} = 0; {p} < {n}u; ++{p}) " for p, n in zip(params, _domain(plan, red, params)))
    args, first, steps = ", ".join(params), ", ".join(p if p in ("lane", "warp") else "0" for p in params), ", ".join(params[1:2] + params[3:])
    # and as the kernel's adds address it: the thread's first element plus the compile-time step
    body.append(f'    {loops}std::printf("%u %u %d %d\\n", {red.name}_row({args}), {red.name}_col({args}), '
                f"int({red.name}_row({first})) + {red.name}_drow({steps}), int({red.name}_col({first})) + {red.name}_dcol({steps}));")
    return f'#include "{name}.cu"\n#include <cstdio>\nint main() {{\n    using namespace {name};\n' + "\n".join(body) + "\n    return 0;\n}\n"


def _expected(plan):
    out = []
    for fn, params in index_functions(plan):
        if not fn.endswith("_smem"):
            continue
        copy = next(c for _, c in plan.copies() if c.name == fn[: -len("_smem")])
        table, rows = offsets(copy.smem.layout), copy.smem.layout.layout[0].size
        for idx in itertools.product(*(range(n) for n in _domain(plan, copy, params))):
            kw = dict(zip(params, idx))
            r, c = copy.partition.coord(idx[0], kw["v"], kw.get("warp", 0), **{l.name: kw[l.name] for l in copy.partition.loops})
            s = int(table[r + rows * c])
            out += [s, s, r, c]
    red = plan.red_dQ
    params = ["lane", "v", "warp"] + [l.name for l in red.partition.loops]
    for idx in itertools.product(*(range(n) for n in _domain(plan, red, params))):
        kw = dict(zip(params, idx))
        out += list(red.partition.coord(idx[0], kw["v"], kw["warp"], **{l.name: kw[l.name] for l in red.partition.loops})) * 2
    return np.array(out, dtype=np.int64)


@pytest.mark.skipif(GXX is None, reason="g++ not found on PATH")
@pytest.mark.parametrize("cfg", [B("fp16")] + CLEAN, ids=str)
def test_emitted_index_functions_and_splits_equal_the_plan(tmp_path, cfg):
    plan = make_backward_plan(cfg)
    src = emit_backward(plan)
    (tmp_path / f"{src.name}.cu").write_text(src.text)
    (tmp_path / "main.cpp").write_text(_main(plan, src.name))
    exe = tmp_path / "index_fns"
    res = subprocess.run([GXX, "-std=c++17", "-O1", "-x", "c++", "-DFLASHGEN_INDEX_ONLY", "main.cpp", "-o", str(exe)],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = np.array(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split(), dtype=np.int64)
    want = _expected(plan)
    assert got.shape == want.shape and np.array_equal(got, want), f"first difference at {int(np.flatnonzero(got != want)[0])}"


ARCHS = ("sm_80", "sm_90a")


def background_builds(folder) -> dict:
    """nvcc's run (device code only) for every clean config and arch; the sources are emitted here."""
    if NVCC is None:
        return {}
    builds = {}
    for cfg in CLEAN:
        src = emit_backward(make_backward_plan(cfg))
        for arch in ARCHS:
            builds[f"{cfg}-{arch}"] = cubin_build(folder, f"{src.name}-{arch}", src.text, arch, NVCC)
    return builds


@pytest.fixture(scope="module")
def compiled(background, request) -> dict:
    """nvcc's (returncode, stderr) for every clean config and arch (background builds)."""
    if NVCC is None:
        pytest.skip("nvcc not found on PATH")
    runs = {(cfg, arch): background.result(request.module, f"{cfg}-{arch}") for cfg in CLEAN for arch in ARCHS}
    return {job: (res.returncode, res.stderr) for job, res in runs.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", CLEAN, ids=str)
def test_kernels_compile_without_spills_or_warnings(compiled, cfg, arch):
    returncode, stderr = compiled[(cfg, arch)]
    assert returncode == 0, stderr[-3000:]
    stats = parse_ptxas(stderr)
    assert len(stats) == 3, stderr[-2000:]  # preprocess, kernel, convert_dq
    dirty = [(s.function, s.registers, s.spill_stores, s.stack_frame) for s in stats if not s.clean]
    assert not dirty
    assert "warning" not in stderr.lower(), stderr[-2000:]  # what it emits compiles without a remark to read past


def test_emitting_is_pure():
    cfg = B("fp16", mask="causal")
    assert emit_backward(make_backward_plan(cfg)).text == emit_backward(make_backward_plan(cfg)).text
    other = emit_backward(make_backward_plan(cfg.replace(swizzled=False))).text
    assert other != emit_backward(make_backward_plan(cfg)).text


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
def test_argument_struct_layout_is_the_field_tables(tmp_path):
    """The launcher's struct, compiled, has the field table's members at the offsets a ctypes struct
    built from the table gives (what a caller without the headers relies on)."""
    import ctypes

    from flashgen.emit.abi import BACKWARD_FIELDS as ARGS_FIELDS

    types = {"const void*": ctypes.c_void_p, "void*": ctypes.c_void_p, "const float*": ctypes.c_void_p, "const int64_t*": ctypes.c_void_p, "const int*": ctypes.c_void_p,
             "int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
    layout = type("Args", (ctypes.Structure,), {"_fields_": [(n, types[t] * k if k else types[t]) for n, t, k, _ in ARGS_FIELDS]})
    src = emit_backward(make_backward_plan(B("fp16", d_head=64)))
    (tmp_path / f"{src.name}.cu").write_text(src.text)
    prints = "".join(f'    std::printf("%zu\\n", offsetof({src.name}_args, {n}));\n' for n, *_ in ARGS_FIELDS)
    (tmp_path / "main.cu").write_text(f'#include "{src.name}.cu"\n#include <cstdio>\n#include <cstddef>\nint main() {{\n{prints}'
                                      f'    std::printf("%zu\\n", sizeof({src.name}_args));\n    return 0;\n}}\n')
    exe = tmp_path / "abi"
    res = subprocess.run([NVCC, "-std=c++17", "-arch=sm_80", "main.cu", "-o", str(exe)], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert got == [getattr(layout, n).offset for n, *_ in ARGS_FIELDS] + [ctypes.sizeof(layout)]


def _emitted(engine: str, deterministic: bool):
    """(source, arch) of a d_head 64 backward of either engine, causal (the masked kernels read D past the counters)."""
    if engine == "wgmma":
        from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
        from flashgen.emit.hopper_backward_kernel import emit_hopper_backward

        cfg = B.wgmma("fp16", 64, "causal").replace(deterministic=deterministic)
        return emit_hopper_backward(make_hopper_backward_plan(cfg)), "sm_90a"
    return emit_backward(make_backward_plan(B("fp16", d_head=64, mask="causal", deterministic=deterministic))), "sm_80"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH")
@pytest.mark.parametrize("engine", ["mma_sync", "wgmma"])
def test_the_turn_counters_of_a_deterministic_kernel_are_the_zeroed_workspace(tmp_path, engine):
    """The zeroed part is one int per (batch, query head, query block[, consumer]) (the counters start at 0), rounded
    up to 16 bytes so that the dQ buffer and D after it stay 16-byte aligned for any count (an odd one misaligned the
    wgmma backward's 16-byte reads of D); nothing is zeroed without the knob (the preprocess zeroes the dQ buffer);
    after the counters the same buffer (whole query blocks' chunks) and row statistics either way."""
    srcs = [_emitted(engine, det) for det in (False, True)]
    arch = srcs[0][1]
    mains = []
    for src, _ in srcs:
        (tmp_path / f"{src.name}.cu").write_text(src.text)
        mains.append(f"""#include "{src.name}.cu"
void print_{src.name}(int batch, int heads, int seq_q) {{
    {src.name}_args a{{}};
    a.batch = batch; a.heads = heads; a.seq_q = seq_q;
    size_t bytes, zeroed;
    {src.name}_workspace(&a, &bytes, &zeroed);
    std::printf("%zu %zu\\n", zeroed, bytes - zeroed);
}}""")
    shapes = [(1, 1, 1), (2, 3, 64), (2, 3, 65), (3, 5, 1000), (1, 1, 257), (1, 3, 130)]
    calls = "".join(f"    print_{s.name}({b}, {h}, {n});\n" for b, h, n in shapes for s, _ in srcs)
    (tmp_path / "main.cu").write_text("#include <cstdio>\n#include <cstddef>\n" + "\n".join(mains) + f"\nint main() {{\n{calls}    return 0;\n}}\n")
    exe = tmp_path / "ws"
    res = subprocess.run([NVCC, "-std=c++17", f"-gencode=arch=compute_{arch[3:]},code={arch}", "main.cu", "-o", str(exe)], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    rows = 64 if engine == "mma_sync" else B.wgmma("fp16", 64, "causal").B_r
    per_block = 1 if engine == "mma_sync" else 2  # the wgmma backward's two consumers take turns of their own
    for i, (b, h, n) in enumerate(shapes):
        plain_zeroed, plain_rest, det_zeroed, det_rest = got[4 * i:4 * i + 4]
        blocks_rows = -(-n // rows) * rows  # both engines' dQ buffers: chunks of whole query blocks
        stats = n if engine == "mma_sync" else 2 * blocks_rows  # D; the wgmma backward's lse * log2(e) too, padded
        assert plain_zeroed == 0 and plain_rest == det_rest == b * h * (blocks_rows * 64 + stats) * 4
        counters = b * h * -(-n // rows) * per_block
        assert 4 * counters <= det_zeroed < 4 * counters + 16 and det_zeroed % 16 == 0


def test_split_scores_score_loops_take_the_warps_query_columns():
    """The recompute's and the gradient's query column ``qc`` (the lse / D it reads, the mask's and the mods' query
    index) starts at the warp's rows of the S GEMM's B operand; the dQ GEMM of two passes adds each slice as made."""
    plan = make_backward_plan(B("bf16", d_head=256, n_warps=8, d_split=4, split_scores=True))
    text = emit_backward(plan).text
    first, _ = plan.gemms["S"].b.copy.partition.warp_offset_cpp("warp")
    assert first == "(warp % 4u) * 16u"
    assert text.count(f"const int qc = int({first} + nt * 8 + ") == 3  # masked, unmasked recompute; the gradient
    assert "for (uint32_t pass = 0; pass < 2; ++pass)" in text and "// added by the dQ GEMM's passes" in text
    # P^T from the S^T accumulator into sP, dS^T from the dP^T one into sdS, dV's and dK's A operands loaded back
    assert "st_shared_b32(sP_addr + 2u * (r2s_P_base" in text and "pack2(s_acc[mi][nt][2 * h], s_acc" in text
    assert "st_shared_b32(sdS_addr + 2u * (r2s_dS_base" in text and "pack2(dp_acc[mi][nt][2 * h], dp_acc" in text
    assert "(a[mi], sP_addr + 2u * (s2r_Pt_base" in text and "(a[mi], sdS_addr + 2u * (s2r_dSt_base" in text
    plain = emit_backward(make_backward_plan(B("bf16", d_head=256, n_warps=8, d_split=2))).text
    assert "const int qc = int(nt * 8 + " in plain and "sP" not in plain and "for (uint32_t pass" not in plain


@pytest.mark.parametrize("cfg, pads", [(B("bf16", n_warps=8, d_split=2, split_scores=True, stages=2), False),
                                       (B("fp16", d_head=40, B_c=32, n_warps=2, swizzled=False, mask="window"), True)], ids=str)
def test_block_copies_of_full_blocks_have_no_predicates(cfg, pads):
    """Each global -> shared copy addresses the thread's first chunk once and walks rows from it; a block whose
    rows all exist copies without predicates, a tail zero-fills its missing rows; padding columns past d_head
    (d_head 40 in 48-column tiles) are zero-filled in every block, so no block takes the unpredicated path."""
    plan = make_backward_plan(cfg)
    text = emit_backward(plan).text
    for name in ("Q", "dO", "K", "V"):
        body = text.split(f"auto copy_{name} = ")[1].split("\n    };")[0]
        rows = cfg.B_r if name in ("Q", "dO") else cfg.B_c
        assert f"const elem_t* g = src + int64_t(row0) * ld + col0;" in body and "cp_async_16_zfill(" in body
        assert (f"if (rows_valid >= {rows}) {{" in body and "cp_async_16(" in body) != pads
        assert ("col0 < D_HEAD" in body or "_dcol[v] < D_HEAD" in body) == pads


def test_a_rotating_item_walk_is_refused_by_the_mma_sync_kernel():
    """Its item(w) and the dQ adds' item_step walk from item 0: a plan that rotates the walk cannot be emitted."""
    import attrs

    from flashgen.attention.item_walk import ItemWalk

    plan = make_backward_plan(BackwardConfig.default("bf16", 64))
    emit_backward(plan)
    with pytest.raises(ValueError, match="walks its items from item 0"):
        emit_backward(attrs.evolve(plan, items=ItemWalk(rotates=True)))
