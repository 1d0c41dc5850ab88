"""The one launcher: torch operators that call any emitted kernel library.

Every kernel is built alone, with nvcc and without torch's headers, into a shared
library exporting ``<name>_launch`` and ``<name>_workspace`` (the C ABI of
:mod:`flashgen.emit.abi`). This module holds the only C++ compiled against torch: a
small library, built once per torch/CUDA version into the cache, that

* loads a kernel library (``flashgen::load_kernel(path, name, ...) -> handle``) and
  remembers what it was built for (dtype, d_head, compute capability);
* defines the operators ``flashgen::attention``, ``flashgen::attention_out``,
  ``flashgen::attention_mods`` (kernels built with a score_mod / mask_mod),
  ``flashgen::attention_backward`` and ``flashgen::attention_backward_mods`` that
  take a kernel handle, check every input (in C++: no Python on the call
  path), fill the argument struct and launch on the current stream;
* is also a Python module (:func:`native`) whose entry points do the same without
  the dispatcher, for eager calls: ``call`` (one kernel), ``dispatch`` (the
  kernel a dispatch table holds for the call's shape) and ``call_mods`` (a kernel
  built with a score_mod / mask_mod, as ``attention_mods``).

The operator schemas and their fake (meta) implementations are registered from
Python, so ``torch.compile`` traces calls before any library is loaded.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import subprocess
import time
from pathlib import Path
from types import ModuleType

import torch

from . import cache

#: ``attention(q, k, v, kernel, scale, mask_offset, window_left, window_right, return_lse) -> (o, lse)``;
#: lse is (batch, heads, seq_q) fp32 when ``return_lse``, else an empty tensor.
ATTENTION_SCHEMA = ("attention(Tensor q, Tensor k, Tensor v, int kernel, float softmax_scale, int mask_offset, "
                    "int window_left, int window_right, bool return_lse) -> (Tensor, Tensor)")
ATTENTION_OUT_SCHEMA = ("attention_out(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int kernel, float softmax_scale, "
                        "int mask_offset, int window_left, int window_right, bool return_lse) -> Tensor")
#: ``attention_mods(..., mod_words, mod_tensors) -> (o, lse)``: a kernel built with a score_mod / mask_mod, and
#: their values (:meth:`flashgen.mods.KernelMods.pack`).
ATTENTION_MODS_SCHEMA = ("attention_mods(Tensor q, Tensor k, Tensor v, int kernel, float softmax_scale, int mask_offset, "
                         "int window_left, int window_right, bool return_lse, int[] mod_words, Tensor[] mod_tensors, "
                         "Tensor? block_mask) -> (Tensor, Tensor)")
#: ``mask_blocks(q, k, kernel, shape, mod_words, mod_tensors, mask_offset, window_left, window_right) -> block_mask``:
#: a mask_mod's block mask (int32 of ``shape``, :meth:`flashgen.mods.KernelMods.block_mask_shape`; transposed where
#: ``kernel`` is a backward kernel) for calls of q's and k's sizes; the built-in mask's diagonal and window (as
#: ``attention_mods`` takes them) weigh the tiles of a forward block mask's tile order, and nothing else.
MASK_BLOCKS_SCHEMA = ("mask_blocks(Tensor q, Tensor k, int kernel, int[] shape, int[] mod_words, Tensor[] mod_tensors, "
                      "int mask_offset, int window_left, int window_right) -> Tensor")
#: ``attention_backward(dout, q, k, v, out, lse, dlse, kernel, ...) -> (dq, dk, dv)`` through a backward kernel;
#: ``dlse`` (optional) is the gradient of the forward's returned lse.
ATTENTION_BACKWARD_SCHEMA = ("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                             "Tensor? dlse, int kernel, float softmax_scale, int mask_offset, int window_left, "
                             "int window_right) -> (Tensor, Tensor, Tensor)")
#: ``attention_backward_mods(..., mod_words, mod_tensors, block_mask) -> (dq, dk, dv)``: the backward of an
#: ``attention_mods`` call, through a backward kernel built with the same score_mod / mask_mod, on the same values;
#: ``block_mask``: ``mask_blocks`` with the backward kernel's handle (its transposed block mask), or None.
ATTENTION_BACKWARD_MODS_SCHEMA = ATTENTION_BACKWARD_SCHEMA.replace("attention_backward(", "attention_backward_mods(").replace(
    "int window_right)", "int window_right, int[] mod_words, Tensor[] mod_tensors, Tensor? block_mask)")

class LauncherError(RuntimeError):
    """The launcher library could not be built; the message holds the compiler's output."""


_LIB = torch.library.Library("flashgen", "DEF")
_LIB.define(ATTENTION_SCHEMA)
_LIB.define(ATTENTION_OUT_SCHEMA)
_LIB.define(ATTENTION_BACKWARD_SCHEMA)
_LIB.define(ATTENTION_MODS_SCHEMA)
_LIB.define(MASK_BLOCKS_SCHEMA)
_LIB.define(ATTENTION_BACKWARD_MODS_SCHEMA)


def _lse_like(q: torch.Tensor, return_lse: bool) -> torch.Tensor:
    b, sq, h, _ = q.shape
    return q.new_empty((b, h, sq) if return_lse else (0,), dtype=torch.float32)


@torch.library.register_fake("flashgen::attention")
def _attention_fake(q, k, v, kernel, softmax_scale, mask_offset, window_left, window_right, return_lse):
    return torch.empty_like(q), _lse_like(q, return_lse)


@torch.library.register_fake("flashgen::attention_out")
def _attention_out_fake(q, k, v, out, kernel, softmax_scale, mask_offset, window_left, window_right, return_lse):
    return _lse_like(q, return_lse)


@torch.library.register_fake("flashgen::attention_mods")
def _attention_mods_fake(q, k, v, kernel, softmax_scale, mask_offset, window_left, window_right, return_lse, mod_words,
                         mod_tensors, block_mask):
    return torch.empty_like(q), _lse_like(q, return_lse)


@torch.library.register_fake("flashgen::mask_blocks")
def _mask_blocks_fake(q, k, kernel, shape, mod_words, mod_tensors, mask_offset, window_left, window_right):
    return q.new_empty(shape, dtype=torch.int32)


@torch.library.register_fake("flashgen::attention_backward")
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, kernel, softmax_scale, mask_offset, window_left, window_right):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("flashgen::attention_backward_mods")
def _attention_backward_mods_fake(dout, q, k, v, out, lse, dlse, kernel, softmax_scale, mask_offset, window_left, window_right,
                                  mod_words, mod_tensors, block_mask):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


SOURCE = Path(__file__).parent / "native" / "launcher.cpp"


def args_header() -> str:
    """``flashgen_args.h``: the argument structs every forward and every backward kernel embeds, for the
    launcher to include."""
    from .emit.abi import args_struct, backward_args_struct

    return f"#pragma once\n#include <cstdint>\n\n{args_struct('flashgen')}\n\n{backward_args_struct('flashgen_bwd')}\n"


def _fingerprint() -> str:
    """The launcher's cache key: its own source (this file and the ABI), torch and CUDA versions."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in (here / "launcher.py", SOURCE, here / "emit" / "abi.py"):
        h.update(path.read_bytes())
    h.update(f"{torch.__version__}\0{torch.version.cuda}".encode())
    return h.hexdigest()[:16]


MODULE = "flashgen_launcher"
SO = f"{MODULE}.so"


@functools.lru_cache(maxsize=None)
def native() -> ModuleType:
    """The launcher library as a Python module (built on first use in this torch environment); loading it
    also registers the operators."""
    entry = _entry()
    if cache.read_entry(entry, (SO,)) is not None:
        try:
            return _import(entry / SO)
        except (OSError, ImportError) as exc:
            cache.discard(entry, f"damaged launcher library {entry / SO} ({exc}): rebuilding it")
    return _build(entry)  # imports it too: a library's operators may be registered only once per process


def library() -> Path:
    """The launcher library's path, loading it first."""
    native()
    return _entry() / SO


def _entry() -> Path:
    return cache.root() / f"launcher-{_fingerprint()}"


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build(entry: Path) -> ModuleType:
    from torch.utils import cpp_extension

    cache.warn("building the kernel launcher (once per torch version) ...")
    t0 = time.perf_counter()
    with cache.staging(entry) as tmp:
        cpp = tmp / "flashgen_launcher.cpp"
        cpp.write_text(SOURCE.read_text())
        (tmp / "flashgen_args.h").write_text(args_header())
        try:
            module = cpp_extension.load(name=MODULE, sources=[str(cpp)], with_cuda=False, extra_cflags=["-O2"],
                               build_directory=str(tmp), verbose=False, is_python_module=True)
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            raise LauncherError("building flashgen's launcher (it needs a C++ compiler and torch's headers) "
                                f"failed:\n{exc}") from exc
        for junk in tmp.iterdir():  # ninja's files and objects
            if junk.name not in (SO, cpp.name, "flashgen_args.h"):
                cache.remove(junk)
        cache.write_record(tmp, {"torch": torch.__version__, "cuda": torch.version.cuda,
                                 "seconds": round(time.perf_counter() - t0, 2)}, (SO,))
    cache.warn(f"launcher built in {time.perf_counter() - t0:.1f} s")
    return module


def load_kernel(path: Path, name: str, short_form: str, dtype: torch.dtype, d_head: int, backward: bool = False) -> int:
    """Load a kernel library (``backward``: a backward kernel's); the handle the operators take."""
    native()
    return int(torch.ops.flashgen.load_kernel(str(path), name, short_form, dtype, d_head, backward))
