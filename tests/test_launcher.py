"""The real thing without a GPU: nvcc builds a kernel library, the launcher (g++ against torch's headers)
loads it, and the operator checks a call before launching. Each case runs in a fresh interpreter
(a launcher library can be loaded once per process) with its own cache folder, which starts with
the launcher and the kernels built once for the module (building them is what takes time).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.toolchain import find_nvcc

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.nvcc]

_PRELUDE = """
import sys, torch
from flashgen import runtime
from flashgen.build import build
from flashgen.dsl.config import KernelConfig
cfg = KernelConfig.from_dict({"dtype": "fp16", "d_head": 64, "B_r": 64, "B_c": 32, "n_warps": 4})
"""


def _argv_env(code: str, cache: Path) -> tuple[list[str], dict]:
    return [sys.executable, "-c", _PRELUDE + code], {**os.environ, "FLASHGEN_CACHE": str(cache)}


def run(code: str, cache: Path) -> subprocess.CompletedProcess:
    argv, env = _argv_env(code, cache)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


#: a mask_mod (a captured tensor, no numbers) the cases build a forward and a backward kernel with
_MASKED = """
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.mods.kernel_mods import prepare_mods
doc = torch.zeros(8, dtype=torch.int32)
def same_document(b, h, q_idx, kv_idx):
    return doc[q_idx] == doc[kv_idx]
mods, (_, mask_args) = prepare_mods(None, same_document)
bwd_cfg = BackwardConfig("fp16", d_head=64)
"""

_BUILD = _MASKED + """
from flashgen import launcher
launcher.library()
build(cfg, (8, 0))
build(BackwardConfig("fp16", d_head=64), (8, 0))
build(cfg, (8, 0), mods=mods)
build(bwd_cfg, (8, 0), mods=mods)
"""


def background_builds(folder: Path) -> dict:
    """The launcher and the kernels the cases load (``cfg`` and a backward one), in the cache ``folder``."""
    if find_nvcc() is None:
        return {}
    argv, env = _argv_env(_BUILD, folder)
    return {"cache": functools.partial(subprocess.run, argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)}


@pytest.fixture(scope="module")
def built_launcher(background, request, nvcc) -> Path:
    """A cache folder holding the launcher and the kernels the cases load, built once for the module."""
    proc = background.result(request.module, "cache")
    assert proc.returncode == 0, proc.stderr
    return background.folder(request.module)


@pytest.fixture
def cache(tmp_path, built_launcher) -> Path:
    """This test's cache folder, starting with the module's launcher."""
    folder = tmp_path / "cache"
    shutil.copytree(built_launcher, folder)
    return folder


def test_a_kernel_library_loads_and_the_operator_checks_its_inputs(cache):
    proc = run("""
built = build(cfg, (8, 0))
handle = runtime._load(built, False)
q = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
for args, words in (((q, q, q, handle, 0.125), "q is on cpu"), ((q, q, q, handle + 1, 0.125), "no kernel with handle"),
                     ((q, q, q, handle, -0.5), "negative scale"), ((q, q, q, handle, 1e-39), "no fp32 inverse")):
    try:
        torch.ops.flashgen.attention(*args, 0, -1, -1, False)
        print("no error for", words)
    except (ValueError, RuntimeError) as exc:
        print(type(exc).__name__, exc)
""", cache)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ValueError") and "q is on cpu; flashgen kernels run on CUDA devices" in lines[0]
    assert lines[1].startswith("RuntimeError") and "no kernel with handle 1 is loaded" in lines[1]
    # the scale is checked first: the kernels keep each row's largest raw score, the largest scaled one only for a
    # positive scale
    assert lines[2].startswith("ValueError") and "softmax_scale=-0.5: expected a positive number" in lines[2]
    assert lines[3].startswith("ValueError") and "softmax_scale=1e-39: expected a positive number" in lines[3]


def test_a_library_that_does_not_load_is_rebuilt(cache):
    first = run("built = build(cfg, (8, 0)); print(built.library)", cache)
    assert first.returncode == 0, first.stderr
    library = Path(first.stdout.split()[-1])
    size = library.stat().st_size
    library.write_bytes(b"\0" * size)  # same size, not a library: only loading it tells
    second = run("built = build(cfg, (8, 0)); print(runtime._load(built, False))", cache)
    assert second.returncode == 0, second.stderr
    assert "does not load" in second.stderr and "rebuilding" in second.stderr
    assert second.stdout.split()[-1] == "0" and library.read_bytes()[:4] == b"\x7fELF"


def test_the_eager_entry_points_run_nothing_they_cannot_check(cache):
    proc = run("""
from flashgen import launcher
attn = runtime.Attention(build(cfg, (8, 0)))
native = launcher.native()
q = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
args = (None, attn._handle, None, -1, -1, "top_left", False)
print(native.call(q, q, q, *args))  # a CPU tensor's device is never allowed: Python checks (and refuses) it
try:
    attn(q, q, q)
except runtime.InputError as exc:
    print("InputError", exc)
table = native.new_dispatch_table()
print(native.dispatch(table, q, q, q, None, None, 0, -1, -1, "top_left", False))
doc = torch.zeros(8, dtype=torch.int32)
mods = (attn._handle, None, -1, -1, "top_left", False, [1, 2**31 - 1], [doc])  # as flashgen.runtime passes them
print(native.call_mods(q, q, q, *mods, None), native.call_mods(q, q, q, *mods, torch.zeros(3, dtype=torch.int32)))
for bad in (lambda: native.call(q, q, q, None, attn._handle + 1, None, -1, -1, "top_left", False),
            lambda: native.remember(table, q, 0, attn._handle),
            lambda: native.call("q", q, q, *args),
            lambda: native.call_mods(q, q, q, attn._handle + 1, *mods[1:], None),
            lambda: native.call_mods(q, q, q, *mods[:-1], ["doc"], None)):
    try:
        bad()
        print("no error")
    except Exception as exc:
        print(type(exc).__name__, str(exc).splitlines()[0])
""", cache)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "None" and lines[2] == "None" and lines[3] == "None None"
    assert lines[1] == "InputError q is on cpu; flashgen kernels run on CUDA devices"
    assert lines[4].startswith("RuntimeError") and "no kernel with handle 1 is loaded" in lines[4]
    assert lines[5].startswith("ValueError") and "4-D CUDA tensor" in lines[5]
    assert lines[6].startswith("TypeError")
    assert lines[7].startswith("RuntimeError") and "no kernel with handle 1 is loaded" in lines[7]
    assert lines[8].startswith("TypeError")


def test_the_backward_operator_runs_backward_kernels_only_and_checks_its_inputs(cache):
    proc = run("""
from flashgen.dsl.backward_config import BackwardConfig
forward = runtime._load(build(cfg, (8, 0)), False)
backward = runtime._load(build(BackwardConfig("fp16", d_head=64), (8, 0)), False)
q = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
lse = torch.zeros(1, 1, 8)
for name, call in (("fwd kernel", lambda: torch.ops.flashgen.attention_backward(q, q, q, q, q, lse, None, forward, 0.125, 0, -1, -1)),
                   ("bwd kernel", lambda: torch.ops.flashgen.attention(q, q, q, backward, 0.125, 0, -1, -1, False)),
                   ("cpu", lambda: torch.ops.flashgen.attention_backward(q, q, q, q, q, lse, None, backward, 0.125, 0, -1, -1))):
    try:
        call()
        print(name, "no error")
    except (ValueError, RuntimeError) as exc:
        print(name, type(exc).__name__, str(exc).splitlines()[0])
""", cache)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "is a forward kernel; the backward operator cannot run it" in lines[0]
    assert "is a backward kernel; the forward operator cannot run it" in lines[1]
    assert lines[2].startswith("cpu ValueError") and "q is on cpu" in lines[2]


def test_block_masks_are_checked_against_each_kernels_own_size(cache):
    """The operators refuse a block mask of another size than the kernel's rule gives: a forward kernel's, and a
    backward kernel's transposed one (the launcher asks each library through its own argument struct); a mask of
    the right size passes to the next check."""
    proc = run(_MASKED + """
import math
forward = runtime._load(build(cfg, (8, 0), mods=mods), False)
backward = runtime._load(build(bwd_cfg, (8, 0), mods=mods), False)
words, tensors = mods.pack(None, mask_args)
q, k = torch.zeros(1, 300, 2, 64, dtype=torch.float16), torch.zeros(1, 200, 1, 64, dtype=torch.float16)
lse = torch.zeros(1, 2, 300)
calls = {"forward": lambda bm: torch.ops.flashgen.attention_mods(q, k, k, forward, 0.1, 0, -1, -1, False, words, tensors, bm),
         "backward": lambda bm: torch.ops.flashgen.attention_backward_mods(q, q, k, k, q, lse, None, backward, 0.1, 0, -1, -1,
                                                                          words, tensors, bm)}
for kind, c in (("forward", cfg), ("backward", bwd_cfg)):
    want = math.prod(mods.block_mask_shape(1, 2, 300, 200, c.B_r, c.B_c, transposed=kind == "backward"))
    for n in (want + 1, want):
        try:
            calls[kind](torch.zeros(n, dtype=torch.int32))
            print(kind, want, "no error")
        except (ValueError, RuntimeError) as exc:
            print(kind, want, str(exc).splitlines()[0])
""", cache)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    (fwd_too_big, fwd_ok, bwd_too_big, bwd_ok) = lines
    fwd_want, bwd_want = int(fwd_too_big.split()[1]), int(bwd_too_big.split()[1])
    assert fwd_want != bwd_want  # the two layouts differ for these sizes
    assert f"block_mask has {fwd_want + 1} elements; a call with these sizes needs {fwd_want}" in fwd_too_big
    assert f"block_mask has {bwd_want + 1} elements; a call with these sizes needs {bwd_want}" in bwd_too_big
    assert "q is on cpu" in fwd_ok and "q is on cpu" in bwd_ok


#: a softcap score_mod (a float, an int, a tuple compiled in) and a document mask_mod (a tensor, an int, a flag compiled
#: in) read by the launcher's reader (``ModReader``) and by CallValues side by side; ``step`` prints what each read and
#: whether the launcher's words and tensors are Python's, then (``publish``) gives the reader the state of Python's read
#: with a new block mask
_READERS = """
import gc, struct, weakref
import numpy as np
from flashgen import launcher
from flashgen.mods.call_values import CallValues
from flashgen.mods.kernel_mods import prepare_mods
native = launcher.native()
handle = runtime._load(build(cfg, (8, 0)), False)
cap, n, w, windowed, offsets = 30.0, 3, 4, True, (0.0, 1.0)

def make_doc_mask():
    doc = torch.tensor([0, 0, 1, 1, 1, 2])  # int64: the reader passes its int32 copy
    def same_doc(b, h, i, j):
        return (doc[i] == doc[j]) & (i - j < w) if windowed else doc[i] == doc[j]
    def set_doc(new):
        nonlocal doc
        doc = new
    return same_doc, set_doc, weakref.ref(doc)

def softcap(s, b, h, i, j):
    return cap * torch.tanh(s / cap) + n + offsets[0]

same_doc, set_doc, doc_ref = make_doc_mask()
mods, _ = prepare_mods(softcap, same_doc)
values = CallValues(mods, softcap, same_doc)
reader = values.attach(native, handle)
q = torch.zeros(1, 6, 2, 64, dtype=torch.float16)
made = [0]

def step(label, q=q, k=q, publish=True):
    mine = reader.values(q, k, softcap, same_doc)
    python = values.read(q.device)
    same = mine is not None and python is not None and mine[0] == python[0] and len(mine[1]) == len(python[1]) and all(
        a is b for a, b in zip(mine[1], python[1]))
    mask = "-" if mine is None else int(mine[2][0])
    print(label, "|", "served" if mine is not None else "None", "same" if same else "-", mask, "python", python is not None)
    if publish and python is not None:
        made[0] += 1
        values.publish(q.device, q, k, python[0], torch.full((4,), made[0], dtype=torch.int32))
"""

_READER_STEPS = """
step("first")
step("again")
cap = 7.5
step("cap 7.5")
for cap in (float("inf"), 1e300, float("nan"), np.float64(2.0), 2):
    step(f"cap {cap!r}", publish=False)
cap = 30.0
for n in (2**31, -2**31, True):
    step(f"n {n!r}", publish=False)
n = 3
step("n 3")
offsets = (0.0, 1.0)  # another tuple, equal: the literal holds
step("equal tuple", publish=False)
offsets = (0.0, 2.0)
step("new tuple", publish=False)
offsets = (0.0, 1.0)
w = 5
step("mask word", publish=False)
step("mask word published")
step("mask word served")
windowed = False
step("flag", publish=False)
windowed = True
set_doc(torch.tensor([4, 4, 4, 4, 5, 5], dtype=torch.int32))
step("new doc", publish=False)
step("new doc published")
step("new doc served")
doc_now = same_doc.__closure__[same_doc.__code__.co_freevars.index("doc")].cell_contents
doc_now[0] = 9
step("in place", publish=False)
step("in place published")
step("sizes", q=q[:, :5], k=q[:, :5], publish=False)
step("seq_k", k=q[:, :5], publish=False)
step("in place served")
print("another function |", reader.values(q, q, lambda s, b, h, i, j: s, same_doc))
print("no mask_mod |", reader.values(q, q, softcap, None))
code = softcap.__code__
softcap.__code__ = (lambda s, b, h, i, j: s).__code__
print("new code |", reader.values(q, q, softcap, same_doc))
softcap.__code__ = code
print("code back |", reader.values(q, q, softcap, same_doc) is not None)
table = native.new_dispatch_table()
native.remember_mods(table, None, 0, softcap, same_doc, reader)
native.remember_mods(table, q, 0, softcap, same_doc, reader)  # a CPU q has no dispatch key: nothing kept
print("entries |", native.call_mods_again(table, q, q, q, None, -1, -1, "top_left", False, softcap, same_doc),
      native.dispatch_mods(table, q, q, q, None, 0, -1, -1, "top_left", False, softcap, same_doc))
try:
    reader.update(q.device, [], [], q, q, None)
except ValueError as exc:
    print("update |", exc)
del softcap
gc.collect()
print("score_mod dropped |", reader.values(q, q, None, same_doc))
del same_doc, set_doc, doc_now, values, mods
gc.collect()
print("doc freed |", doc_ref() is None)
"""


def test_the_launchers_reader_reads_what_call_values_reads_or_leaves_the_call_to_python(cache):
    """The C++ reader serves a repeated call only with CallValues' words and tensors (the same objects) and the block
    mask of the same mask values, tensors and sizes; a value it cannot read exactly as Python does (a NaN's payload, a
    float subclass), a stale one, another function or code, or state it was not given answers None."""
    proc = run(_READERS + _READER_STEPS, cache)
    assert proc.returncode == 0, proc.stderr
    rows = dict(line.split(" | ", 1) for line in proc.stdout.splitlines())
    served = {label: row.split()[0] == "served" for label, row in rows.items() if "python" in row}
    assert {label for label, s in served.items() if s} == {
        "again", "cap 7.5", "cap inf", "n -2147483648", "n 3", "equal tuple", "mask word served", "new doc served",
        "in place served"}
    for label, row in rows.items():
        if "python" in row and served[label]:
            assert row.split()[1] == "same", (label, row)
    # Python reads a NaN and a float subclass; the reader leaves them to it
    assert rows["cap nan"].endswith("python True") and rows["cap np.float64(2.0)"].endswith("python True")
    for stale in ("cap 1e+300", "cap 2", "n 2147483648", "n True", "new tuple", "flag"):
        assert rows[stale].endswith("python False"), stale
    # a new score value keeps the block mask; new mask values, tensors or versions take the one made for them
    assert rows["cap 7.5"].split()[2] == "2" and rows["mask word served"].split()[2] == "5"
    assert rows["new doc served"].split()[2] == "7" and rows["in place served"].split()[2] == "9"
    assert rows["another function"] == rows["no mask_mod"] == rows["new code"] == "None"
    assert rows["code back"] == "True" and rows["entries"] == "None None"  # CPU tensors: never a checked device
    assert rows["update"] == "update: 1 tensor slots, got 0"
    assert rows["score_mod dropped"] == "None" and rows["doc freed"] == "True"


def test_the_launchers_reader_converts_floats_as_struct_does(cache):
    """Every float the reader serves has the word ``struct.pack("<f")`` gives; the ones it refuses are those struct
    refuses (rounding to infinity from a finite number) and NaNs (whose payload Python keeps)."""
    proc = run(_READERS + """
values.read(q.device)
values.publish(q.device, q, q, values.read(q.device)[0], torch.zeros(4, dtype=torch.int32))
f32_max = float(np.finfo(np.float32).max)
midpoint = f32_max + 2.0 ** 103  # halfway to 2**128: rounds to infinity (ties to even)
for x in (0.0, -0.0, 1.0 / 3, -2.5e-38, 1e-45, 7e-46, 5e-324, f32_max, np.nextafter(midpoint, 0), midpoint, -midpoint,
          1e39, float("inf"), float("-inf"), float("nan")):
    cap = float(x)
    mine = reader.values(q, q, softcap, same_doc)
    try:
        want = struct.unpack("<i", struct.pack("<f", cap))[0]
    except OverflowError:
        want = "OverflowError"
    print(repr(cap), None if mine is None else mine[0][0], want)
""", cache)
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    assert len(lines) == 15
    for value, mine, want in lines:
        if mine == "None":
            assert want == "OverflowError" or value == "nan", (value, want)
        else:
            assert mine == want, value
    assert [v for v, mine, _ in lines if mine == "None"] == ["3.4028235677973366e+38", "-3.4028235677973366e+38",
                                                             "1e+39", "nan"]
