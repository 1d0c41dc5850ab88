"""The rendered mods compiled by nvcc and run on the GPU equal their numpy evaluation.

Bitwise for masks and for + - * / sqrt, loads and casts: the fp32 helpers round each operation
(``__fadd_rn`` etc.: no FMA contraction) and sqrt is correctly rounded under nvcc's defaults.
exp/log/tanh: CUDA's expf/logf/tanhf are within 2/1/2 ulp of the exact value and numpy's float32
functions within about 1, so they may differ by 3 ulp; softcap's multiply by cap after tanh can
double an ulp count (see test_examples.py), hence 6 there.
"""
from __future__ import annotations

import numpy as np
import pytest

from flashgen.mods import prepare

from host import grid, run, ulps  # tests/mods is on sys.path (pytest's prepend mode)
from test_ops import OPS, SHAPE, TRANSCENDENTAL, _score

pytestmark = pytest.mark.gpu


def _arch() -> str:
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def test_ops_on_the_device_equal_evaluate(nvcc, tmp_path):
    mods = [prepare(fn, "score") for fn in OPS.values()]
    score = _score()
    for name, (mod, args), got in zip(OPS, mods, run(mods, SHAPE, score, tmp_path, nvcc, _arch())):
        want = np.broadcast_to(mod.evaluate(score, *grid(SHAPE), args=args), SHAPE)
        if name in TRANSCENDENTAL:
            assert ulps(got, want).max() <= 3, name
        else:  # bit for bit, except that a NaN's payload is the hardware's own (sqrt of a negative)
            same = got.view(np.int32) == want.view(np.int32)
            if got.dtype.kind == "f":
                same |= np.isnan(got) & np.isnan(want)
            assert same.all(), name


def test_examples_on_the_device_equal_evaluate(examples, nvcc, tmp_path):
    mods = [prepare(factory(), kind) for kind, factory in examples.EXAMPLES.values()]
    shape = (2, 8, 28, 28)
    score = np.random.default_rng(0).normal(0, 20, shape).astype(np.float32)
    for (name, (kind, _)), (mod, args), got in zip(examples.EXAMPLES.items(), mods, run(mods, shape, score, tmp_path, nvcc, _arch())):
        want = np.broadcast_to(mod.evaluate(*(((score,) if kind == "score" else ()) + grid(shape)), args=args), shape)
        if kind == "mask":
            assert np.array_equal(got, want), name
        elif "tanh" in mod.canonical:
            assert ulps(got, want).max() <= 6, name
        else:
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), name
