"""The example mods trace, their C++ compiled for the host equals their numpy evaluation, and
that equals flashgen.reference's evaluation of the original Python function.

Host C++ vs numpy: bitwise for masks and for scores made of + - * / and loads (each fp32 operation
rounds once on both sides). Where tanh is involved, glibc's tanhf and numpy's float32 tanh are
different implementations, each within about 1 ulp of the exact value, so they differ by up to 2
ulp of tanh's result; softcap then multiplies by cap, and 2 ulp of a value in [0.5, 1) can be 4 ulp
of the product when the product lies lower in its binade.
numpy vs the reference: the reference runs the user's function in float64 on int64 index tensors,
so masks are equal and scores agree to fp32 rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen import reference
from flashgen.mods import prepare

from host import grid, needs_gxx, run, ulps  # tests/mods is on sys.path (pytest's prepend mode)

SHAPE = (2, 8, 28, 28)  # (B, H, Sq, Sk): 28 tokens cover every document of document_mask


def _reference_calls(kind: str, fn):
    """(inputs, output) of ``fn`` as flashgen.reference.attention calls it, recorded by a spy."""
    B, H, S, _ = SHAPE
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, S, H, 16, generator=g) * 3 for _ in range(3))
    seen = {}

    def spy(*args):
        seen["args"], seen["out"] = args, fn(*args)
        return seen["out"]

    reference.attention(q, k, v, **{f"{kind}_mod": spy})
    return seen["args"], seen["out"]


@pytest.mark.parametrize("name", ["softcap", "alibi", "relative_bias", "document_mask", "prefix_lm",
                                  "sliding_window_sinks", "causal", "block_local"])
def test_example_equals_the_reference(examples, name):
    kind, factory = examples.EXAMPLES[name]
    fn = factory()
    mod, args = prepare(fn, kind)
    inputs, want = _reference_calls(kind, fn)
    got = np.broadcast_to(mod.evaluate(*(t.numpy() for t in inputs), args=args), SHAPE)
    want = want.expand(SHAPE).numpy()
    if kind == "mask":
        assert got.dtype == np.bool_ and np.array_equal(got, want.astype(bool))
    else:
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@needs_gxx
def test_examples_host_cpp_equals_evaluate(examples, tmp_path):
    mods = [prepare(factory(), kind) for kind, factory in examples.EXAMPLES.values()]
    score = np.random.default_rng(0).normal(0, 20, SHAPE).astype(np.float32)
    host = run(mods, SHAPE, score, tmp_path)
    for (name, (kind, _)), (mod, args), got in zip(examples.EXAMPLES.items(), mods, host):
        want = mod.evaluate(*(((score,) if kind == "score" else ()) + grid(SHAPE)), args=args)
        want = np.broadcast_to(want, SHAPE)
        if kind == "mask":
            assert np.array_equal(got, want), name
        elif "tanh" in mod.canonical:
            assert ulps(got, want).max() <= 4, name
        else:
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), name
