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
