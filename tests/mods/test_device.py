"""The rendered mods compiled by nvcc and run on the GPU agree with their numpy evaluation.

Bitwise for masks, integers and booleans. fp32 is the kernels' fast arithmetic on the device (see
flashgen/mods/ops.py): FMA contraction (``fg_mul_split`` included), division by an approximate reciprocal,
``__expf``/``__logf`` and ``tanh.approx``; so
results agree to a relative 2^-16 (a few ulp, exp's growing with its argument), tanh's to an absolute
2^-10 of the result's scale (softcap multiplies it by cap).
"""
from __future__ import annotations

import numpy as np
import pytest

from flashgen.mods import prepare

from host import grid, run  # tests/mods is on sys.path (pytest's prepend mode)
from test_ops import OPS, SHAPE, _score

pytestmark = pytest.mark.gpu


def _arch() -> str:
    import torch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def assert_agrees(got: np.ndarray, want: np.ndarray, what: str, uses_tanh: bool) -> None:
    """The device's result against numpy's under the accuracy contract above."""
    if got.dtype.kind != "f":
        assert np.array_equal(got, want), what
        return
    special = ~np.isfinite(want)
    assert np.array_equal(np.isnan(got[special]), np.isnan(want[special])), what
    assert np.array_equal(got[special & ~np.isnan(want)], want[special & ~np.isnan(want)]), what
    g, w = got[~special].astype(np.float64), want[~special].astype(np.float64)
    err = np.abs(g - w)
    if uses_tanh:
        assert (err <= 2.0 ** -10 * max(1.0, float(np.abs(w).max(initial=0)))).all(), what
    else:
        assert (err <= 2.0 ** -16 * np.maximum(np.abs(w), 1.0)).all(), what


def test_ops_on_the_device_agree_with_evaluate(nvcc, tmp_path):
    mods = [prepare(fn, "score") for fn in OPS.values()]
    score = _score()
    for name, (mod, args), got in zip(OPS, mods, run(mods, SHAPE, score, tmp_path, nvcc, _arch())):
        want = np.broadcast_to(mod.evaluate(score, *grid(SHAPE), args=args), SHAPE)
        assert_agrees(got, want, name, "tanh" in mod.canonical)


def test_examples_on_the_device_agree_with_evaluate(examples, nvcc, tmp_path):
    mods = [prepare(factory(), kind) for kind, factory in examples.EXAMPLES.values()]
    shape = (2, 8, 28, 28)
    score = np.random.default_rng(0).normal(0, 20, shape).astype(np.float32)
    for (name, (kind, _)), (mod, args), got in zip(examples.EXAMPLES.items(), mods, run(mods, shape, score, tmp_path, nvcc, _arch())):
        want = np.broadcast_to(mod.evaluate(*(((score,) if kind == "score" else ()) + grid(shape)), args=args), shape)
        assert_agrees(got, want, name, "tanh" in mod.canonical)
