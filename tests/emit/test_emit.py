"""The emitter: deterministic text, and every knob changes the emitted code as its help text says.

Text checks read the emitted .cu; instruction checks read the PTX nvcc generates for
sm_90a (``nvcc -ptx``, marked ``nvcc``), so they hold for the code that actually runs.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.dsl.config import KNOBS, KernelConfig, load_config
from flashgen.dsl.notation import parse_config
from flashgen.dsl.plan import make_plan
from flashgen.engines import emit

REPO = Path(__file__).resolve().parents[2]

BASE = parse_config("(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax")
SYNC = parse_config("(FP16, 128, 64, 64, 4): load_0_0_0_tiles")
ASYNC_LAZY = parse_config("(FP16, 128, 64, 64, 4): async+swizzled+load_0_0_0_tiles")
BF16 = BASE.replace(dtype="bf16")

#: One valid alternative per knob, applied to BASE (or to the config named second).
KNOB_CHANGES = {
    "dtype": ({"dtype": "bf16"}, BASE),
    "d_head": ({"d_head": 64}, BASE),
    "B_r": ({"B_r": 64}, BASE),
    "B_c": ({"B_c": 32}, BASE),
    "n_warps": ({"n_warps": 8}, BASE),
    "async_copy": ({"async_copy": False}, BASE.replace(eager_load_blocks=False)),
    "eager_load_blocks": ({"eager_load_blocks": False}, BASE),
    "swizzled": ({"swizzled": False}, BASE),
    "Q_mma_load_K_tiles": ({"Q_mma_load_K_tiles": 0}, BASE),
    "K_mma_load_K_tiles": ({"K_mma_load_K_tiles": 4}, BASE.replace(Q_mma_load_K_tiles=0)),
    "V_mma_load_K_tiles": ({"V_mma_load_K_tiles": 0}, BASE),
    "mma_double_buffer_loads": ({"mma_double_buffer_loads": False}, BASE),
    "optimized_softmax": ({"optimized_softmax": False}, BASE),
}
if "mask" in KNOBS:  # beyond the seed: the score mask compiled into the kernel
    KNOB_CHANGES["mask"] = ({"mask": "causal"}, BASE)


def kernel_body(text: str) -> str:
    """The ``__global__`` function's text (from its signature to the end of its namespace)."""
    start = text.index("__global__ void")
    return text[start : text.index("}  // namespace", start)]


def index_section(text: str) -> str:
    return text[: text.index("#ifndef FLASHGEN_INDEX_ONLY\nnamespace")]


def prologue(text: str) -> str:
    """The code before the key/value loop (after the helpers and lambdas)."""
    return text[text.index("// ---- prologue ----") : text.index("// ---- main loop")]


def main_loop(text: str) -> str:
    """The key/value loop: everything from its banner to the epilogue."""
    return text[text.index("// ---- main loop") : text.index("// ---- epilogue")]


# ---- determinism ----------------------------------------------------------------------------


def test_emit_twice_gives_identical_bytes():
    a, b = emit(BASE), emit(BASE)
    assert a.text.encode() == b.text.encode()
    assert json.dumps(a.meta, sort_keys=True) == json.dumps(b.meta, sort_keys=True)


def test_equal_configs_give_equal_text(source):
    short = BASE.short_form()
    from_dict = KernelConfig.from_dict(BASE.to_dict())
    from_yaml = KernelConfig.from_yaml(BASE.to_yaml())
    assert from_dict == BASE and from_yaml == BASE
    texts = {emit(c).text for c in (load_config(short), from_dict, from_yaml)}
    assert texts == {source(BASE).text}


def test_emission_does_not_depend_on_the_process(source):
    """Another interpreter with another hash seed writes the same bytes (no set/dict-order or id leaks)."""
    code = (
        "import hashlib, sys; from flashgen.engines import emit; from flashgen.dsl.notation import parse_config;"
        "src = emit(parse_config(sys.argv[1])); "
        "print(hashlib.sha256(src.text.encode()).hexdigest())"
    )
    cfg = ASYNC_LAZY
    want = hashlib.sha256(source(cfg).text.encode()).hexdigest()
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, cfg.short_form()], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want


def test_header_names_the_config_and_its_plan(source):
    src = source(BASE)
    head = src.text[: src.text.index("#include")]
    assert BASE.short_form() in head
    knobs = re.search(r"^// knobs: (.*)$", head, re.M).group(1)
    assert json.loads(knobs) == BASE.to_dict()
    plan = make_plan(BASE)
    for t in ("sQ", "sK", "sV", "sO"):
        assert str(plan.tensors[t].layout) in head  # layouts in their text form
    assert plan.mma.ptx in head


def test_meta(source):
    src = source(BASE)
    m = src.meta
    assert m["name"] == BASE.mangle() == src.name
    assert m["short_form"] == BASE.short_form()
    assert m["config"] == BASE.to_dict()
    assert m["hash"] == BASE.content_hash()
    assert m["threads"] == 128 and m["smem_bytes"] == BASE.smem_bytes == (128 + 2 * 64) * 128 * 2
    assert m["launcher"] == f"{BASE.mangle()}_launch" == src.launcher
    assert f'extern "C" int {src.launcher}(' in src.text


# ---- every knob -------------------------------------------------------------------------------


@pytest.mark.parametrize("knob", KNOBS)
def test_every_knob_changes_the_text(knob, source):
    if knob not in KNOB_CHANGES:
        pytest.skip(f"knob {knob!r} is newer than this test: add an alternative value to KNOB_CHANGES")
    change, base = KNOB_CHANGES[knob]
    other = base.replace(**change)
    assert other != base
    assert source(other).text != source(base).text


def test_async_copy(source):
    for cfg in (BASE, ASYNC_LAZY):
        text = source(cfg).text
        assert "cp.async.cg.shared.global [%0], [%1], 16;" in text
        assert re.search(r"cp_async_16\w*\(", kernel_body(text)) and "cp_async_commit();" in kernel_body(text)
        assert "st_shared_v4(sQ_addr" not in kernel_body(text)
    text = source(SYNC).text
    assert "cp.async" not in text and "cp_async" not in text
    body = kernel_body(text)
    for op in "QKV":
        assert re.search(rf"st_shared_v4\(s{op}_addr .*ld_global_v4\(", body), op


def test_eager_load_blocks(source):
    text = source(BASE).text
    assert "cp_async_wait<1>();" in main_loop(text)
    assert "copy_K(" in prologue(text)  # the first K block travels with Q
    assert re.search(r"copy_K\([^;]*\(j \+ 1\)", main_loop(text))  # K_{j+1} prefetched in the loop
    for cfg in (ASYNC_LAZY, SYNC):
        text = source(cfg).text
        assert "cp_async_wait<1>" not in text and "(j + 1)" not in main_loop(text)
        assert "copy_K(" not in prologue(text) and "copy_K(" in main_loop(text)
    assert "cp_async_wait<0>();" in main_loop(source(ASYNC_LAZY).text)


def test_swizzled(source):
    swz = source(BASE).text
    plain = source(BASE.replace(swizzled=False)).text
    assert "0x1c0" in swz and "Sw<3,3,3> o" in swz
    assert "0x1c0" not in plain and "Sw<3,3,3>" not in plain
    # The swizzle is written once per tensor, in its offset function; nowhere else.
    lines = swz.splitlines()
    hits = [i for i, l in enumerate(lines) if "0x1c0" in l]
    assert len(hits) >= 4
    for i in hits:
        assert lines[i].strip().startswith("return "), lines[i]
        assert re.match(r"__host__ __device__ __forceinline__ uint32_t s\w+_offset\(uint32_t row, uint32_t col\)", lines[i - 1])


@pytest.mark.parametrize(
    "cfg_text, q_resident, k, v",
    [
        ("(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax", False, 2, 2),
        ("(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax", False, 2, 0),
        ("(FP16, 128, 128, 64, 4): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax", True, 2, 2),
        ("(FP16, 128, 128, 64, 4): async+eager+swizzled+load_0_4_2_tiles+opt_softmax", True, 4, 2),
        ("(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_0_0_tiles", True, 0, 0),
    ],
)
def test_tile_counts(cfg_text, q_resident, k, v, source):
    cfg = parse_config(cfg_text)
    body = kernel_body(source(cfg).text)
    if q_resident:
        assert re.search(r"uint32_t q_res\[MT\]\[D\w* / 16\]\[4\];", body)
        assert re.search(r"if \(j == \w+\) \{\s*load_Q\(q_res, 0\);", body)  # the first key block only
        assert "q_frag" not in body
    else:
        assert "q_res" not in body
        assert f"uint32_t q_frag[{cfg.rf_buffers('Q')}][MT][{k // 2}][4];" in body
    k_cols = 8 * (k or cfg.d_head // 8)
    assert f"uint32_t k_frag[{cfg.rf_buffers('K')}][B_c / 16][{k_cols // 16}][4];" in body
    assert re.search(rf"// S = Q K_j\^T: [^\n]* in {cfg.d_head // k_cols} step\(s\) of {k_cols}\b", body)
    v_rows = 8 * (v or cfg.B_c // 8)
    assert re.search(rf"uint32_t v_frag\[{cfg.rf_buffers('V')}\]\[{v_rows // 16}\]\[D\w* / 16\]\[4\];", body)
    assert re.search(rf"// O \+= P V_j: [^\n]* in {cfg.B_c // v_rows} step\(s\) of {v_rows}\b", body)


def test_mma_double_buffer_loads(source):
    on = kernel_body(source(BASE).text)
    off = kernel_body(source(BASE.replace(mma_double_buffer_loads=False)).text)
    for frag in ("q_frag", "k_frag", "v_frag"):
        assert f"uint32_t {frag}[2]" in on and f"uint32_t {frag}[1]" in off
    assert "(register double buffered)" in on and "double buffering: next step's fragments first" in on
    assert "double buffer" not in off
    # A whole-block load (tile count 0) has nothing to double-buffer.
    whole_v = kernel_body(source(BASE.replace(V_mma_load_K_tiles=0)).text)
    assert "uint32_t v_frag[1]" in whole_v and "uint32_t k_frag[2]" in whole_v


def test_dtype(source):
    for cfg, ptx_t, elem in ((BASE, "f16", "__half"), (BF16, "bf16", "__nv_bfloat16")):
        text = source(cfg).text
        other = "bf16" if ptx_t == "f16" else "f16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_t}.{ptx_t}.f32" in text
        assert f".f32.{other}.{other}.f32" not in text
        assert f"cvt.rn.{ptx_t}x2.f32" in text and f"cvt.rn.{other}x2.f32" not in text
        assert f"using elem_t = {elem};" in text


@pytest.mark.parametrize(
    "cfg_text",
    [
        "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
        "(FP16, 128, 64, 32, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
        "(BF16, 64, 128, 128, 8): async+swizzled+load_0_2_2_tiles+opt_softmax",
    ],
)
def test_block_sizes_and_warps(cfg_text, source):
    cfg = parse_config(cfg_text)
    text = source(cfg).text
    consts = dict(re.findall(r"\b(B_r|B_c|D|D_HEAD|N_WARPS|THREADS|MT) = (\d+)u?\b", index_section(text)))
    assert int(consts["B_r"]) == cfg.B_r and int(consts["B_c"]) == cfg.B_c
    assert int(consts.get("D_HEAD", consts.get("D"))) == cfg.d_head
    assert int(consts["N_WARPS"]) == cfg.n_warps and int(consts["THREADS"]) == cfg.threads
    assert int(consts["MT"]) == cfg.m_tiles_per_warp
    assert f"constexpr int smem = {cfg.smem_bytes};" in text
    assert f"grid: (ceil(seq_q / {cfg.B_r}), heads, batch), block: {cfg.threads} threads" in text
    assert "__launch_bounds__(THREADS)" in text


def test_ldmatrix_trans_only_for_v(source):
    text = source(BASE).text
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in text
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in text
    body = kernel_body(text)
    loaders = {op: body[body.index(f"auto load_{op}"):].split("};", 1)[0] for op in "QKV"}
    assert "ldsm_x4_trans(" in loaders["V"]
    assert "ldsm_x4(" in loaders["Q"] and "ldsm_x4(" in loaders["K"]
    assert "trans" not in loaders["Q"] + loaders["K"]


def test_index_functions_are_host_device(source):
    from flashgen.emit.kernel import index_functions

    text = index_section(source(BASE).text)
    for name, params in index_functions(make_plan(BASE)):
        sig = ", ".join(f"uint32_t {p}" for p in params)
        assert f"__host__ __device__ __forceinline__ uint32_t {name}({sig})" in text, name


# ---- the PTX nvcc generates (sm_90a) ------------------------------------------------------------

PTX_CONFIGS = [BASE, BF16, SYNC, ASYNC_LAZY, BASE.replace(swizzled=False, B_c=32, n_warps=8, B_r=128)]


def _count(ptx: str, instr: str) -> int:
    return len(re.findall(rf"^\s*{re.escape(instr)}\s", ptx, re.M))


def _ptx_id(cfg):
    return cfg.mangle()


def body_instances(text: str) -> int:
    """How many compile-time variants of the key/value loop body the source instantiates.

    1 for a plain loop; 2 when the body is a generic lambda called with
    ``std::true_type{}`` and ``std::false_type{}`` (a masked and an unmasked copy).
    """
    return len(set(re.findall(r"std::(?:true|false)_type\{\}", main_loop(text)))) or 1


@pytest.mark.nvcc
@pytest.mark.parametrize("cfg", PTX_CONFIGS, ids=_ptx_id)
def test_ptx_instructions(cfg, ptx, source):
    text = ptx(cfg, "sm_90a")
    assert re.search(r"^\.target sm_90a", text, re.M)
    # cp.async only with async_copy; wait_group 1 only with eager loads
    assert (_count(text, "cp.async.cg.shared.global") > 0) == cfg.async_copy
    assert (_count(text, "cp.async.wait_group 1;") > 0) == (cfg.async_copy and cfg.eager_load_blocks)
    if not cfg.async_copy:
        assert "cp.async" not in text
    # Per key/value block the plan implies: ldmatrix Q (MT x d/16, once even when resident)
    # and K (B_c/16 x d/16) non-transposed, V (B_c/16 x d/16) with .trans; MMAs
    # S = Q K^T (MT x B_c/8 x d/16) + O += P V (MT x d/8 x B_c/16). The j loop is not
    # unrolled, so the PTX holds exactly that once per variant of the loop body.
    n = body_instances(source(cfg).text)
    mt, d, bc = cfg.m_tiles_per_warp, cfg.d_head, cfg.B_c
    t = cfg.dtype.ptx
    other = "bf16" if t == "f16" else "f16"
    assert _count(text, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == n * (bc // 16) * (d // 16)
    assert _count(text, "ldmatrix.sync.aligned.m8n8.x4.shared.b16") == n * (mt * (d // 16) + (bc // 16) * (d // 16))
    per_block = mt * (bc // 8) * (d // 16) + mt * (d // 8) * (bc // 16)
    assert _count(text, f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32") == n * per_block
    assert f".f32.{other}.{other}.f32" not in text
    # exp: ex2.approx is also how libdevice's expf ends (after a range reduction with
    # fma.rm.f32), so the optimized softmax is told apart by that expansion's absence
    ex2, libm = _count(text, "ex2.approx.ftz.f32"), _count(text, "fma.rm.f32")
    calls = mt * 2 * (1 + bc // 4)  # per row pair: one rescale factor + one per S element
    if cfg.optimized_softmax:
        assert libm == 0
        assert ex2 >= n * calls  # nvcc may duplicate some of them
    else:
        assert ex2 == libm == n * calls  # every ex2 is one expf call of the source
    # the swizzle's XOR: address arithmetic has xor only when swizzled
    assert (_count(text, "xor.b32") > 0) == cfg.swizzled


def test_public_emit_stays_callable_once_the_emit_modules_are_imported():
    """``flashgen.emit(cfg)`` is the package itself: importing its modules (as compile() does)
    cannot shadow it, and every config form gives the text ``flashgen.engines.emit`` does."""
    import flashgen
    import flashgen.emit.sweep  # noqa: F401  (any module of the package)

    expected = emit(BASE).text
    for form in (BASE, BASE.short_form(), BASE.to_dict()):
        assert flashgen.emit(form).text == expected
    # a fresh interpreter: the first call imports the modules, the second must still work
    code = ("import flashgen; c = %r; a = flashgen.emit(c); import flashgen.build; "
            "b = flashgen.emit(c); assert a.text == b.text; print(len(b.text))") % BASE.short_form()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(expected)



def test_emitting_leaves_the_proofs_and_the_simulator_alone():
    """A fresh interpreter emitting both engines' kernels imports neither the verification step
    (flashgen.sim: proofs run in flashgen.verify, cached per config), nor Numba, nor torch."""
    wgmma = KernelConfig.wgmma("bf16")
    code = ("import sys, flashgen; flashgen.emit(sys.argv[1]); flashgen.emit(flashgen.KernelConfig.from_dict(%r)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'torch') or m.startswith('flashgen.sim')))"
            ) % wgmma.to_dict()
    done = subprocess.run([sys.executable, "-c", code, BASE.short_form()], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_key_block_loop_and_prefetch_walk_past_empty_blocks_with_a_mask_mod():
    """With a mask_mod the loop steps with ``block_mask_next`` and the eager schedule prefetches, and
    guards on, the walk's next block (``j_next``), never ``j + 1``; without one the text keeps ``j + 1``."""
    from flashgen.mods.kernel_mods import prepare_mods

    def sinks(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (q_idx - kv_idx <= 40)) | (kv_idx < 3)

    cfg = parse_config("(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax")
    text = emit(cfg, prepare_mods(mask_mod=sinks)[0]).text
    loop = text[text.index("auto kv_block = [&]"): text.index("// ---- epilogue")]
    assert "const int j_next = block_mask_next(bm_row, j, n_blocks);" in loop
    assert "for (int j = j_begin; j < n_blocks; j = block_mask_next(bm_row, j, n_blocks)) {" in loop
    assert "copy_K(gK + int64_t(j_next) * B_c * p.k_ld, p.k_ld, p.seq_k - j_next * (int)B_c);" in loop
    assert loop.count("if (j_next < n_blocks) {") == 3 and "if (j_next >= n_blocks) {" in loop
    assert "j + 1" not in loop and "++j)" not in loop
    plain = emit(cfg).text
    assert "block_mask_next" not in plain and "if (j + 1 < n_blocks) {" in plain
