"""A score_mod that adds a bias (flashgen.mods.bias): which score_mods are recognised, and that the bias over the
scale the forward kernels start the S accumulator at, times the scale, is what the score_mod adds. Its rendered
form is checked bit for bit against numpy by tests/mods/test_score_rule.py (ALiBi, a bias table)."""
from __future__ import annotations

import numpy as np
import torch

from flashgen.mods import prepare
from flashgen.mods.bias import INV_SCALE, additive_bias, bias_over_scale
from flashgen.mods.cpp import _fused_products, tile_values
from flashgen.mods.evaluate import evaluate
from flashgen.mods.expr import Unary, postorder
from flashgen.mods.ranges import reads_indices, split_casts

SLOPE = torch.tensor([0.5, 0.25, 0.125])
TABLE = torch.linspace(-2.0, 3.0, 41)

BIASES = {
    "alibi": lambda s, b, h, q, k: s - SLOPE[h] * (q - k),
    "bias_first": lambda s, b, h, q, k: (k - q) * SLOPE[h] + s,
    "table": lambda s, b, h, q, k: s + TABLE[q - k + 20],
    "negated_table": lambda s, b, h, q, k: s - TABLE[(q + 2 * k) % 41] * 0.75,
    "mask_as_bias": lambda s, b, h, q, k: s + torch.where(k <= q, 0.0, -float("inf")),
    "constant": lambda s, b, h, q, k: s + 1.5,
}
OTHERS = {
    "softcap": lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0),
    "scaled": lambda s, b, h, q, k: 2.0 * s + SLOPE[h],
    "score_in_bias": lambda s, b, h, q, k: s + s * 0.5,
    "bias_minus_score": lambda s, b, h, q, k: SLOPE[h] * q - s,
    "identity": lambda s, b, h, q, k: s,
}


def _expr(fn):
    mod, args = prepare(fn, "score")
    return mod, args.values()


def test_which_score_mods_add_a_bias():
    for name, fn in BIASES.items():
        assert bias_over_scale(_expr(fn)[0].expr) is not None, name
    for name, fn in OTHERS.items():
        assert additive_bias(_expr(fn)[0].expr) is None and bias_over_scale(_expr(fn)[0].expr) is None, name


def test_the_bias_over_the_scale_times_the_scale_is_what_the_score_mod_adds():
    rng = np.random.default_rng(0)
    q, k = rng.integers(0, 20, 200).astype(np.int32), rng.integers(0, 20, 200).astype(np.int32)
    score = (3 * rng.standard_normal(200)).astype(np.float32)
    h = 1
    for scale in (0.125, 0.0883883476):
        inv = np.float32(1) / np.float32(scale)
        for name, fn in BIASES.items():
            mod, values = _expr(fn)
            added = evaluate(mod.expr, {"score": score, "b": 0, "h": h, "q_idx": q, "kv_idx": k}, values) - score
            over = np.broadcast_to(evaluate(bias_over_scale(mod.expr), {INV_SCALE.name: inv, "b": 0, "h": h, "q_idx": q,
                                                                         "kv_idx": k}, values), added.shape)
            finite = np.isfinite(added)
            assert (np.isneginf(over) == np.isneginf(added)).all(), name
            # the score_mod's sum rounds once more than the bias: within an ulp of the sum
            np.testing.assert_allclose((over * np.float32(scale))[finite], added[finite], rtol=2e-6,
                                       atol=2e-6 * float(np.abs(score).max()), err_msg=name)


def test_the_scale_joins_a_factor_so_alibi_stays_one_multiply_add_a_score():
    """ALiBi's slope times its split conversion keeps the fused form (one multiply-add per score), with the inverse
    scale and the minus sign in the hoisted factor: no negation or extra product reads the indices."""
    bias = bias_over_scale(_expr(BIASES["alibi"])[0].expr)
    reads = reads_indices(bias)
    assert _fused_products(bias, split_casts(bias), reads)
    assert not any(isinstance(n, Unary) and reads[n] for n in postorder(bias))
    assert not any(n is INV_SCALE for n in _fused_products(bias, split_casts(bias), reads))


def test_the_captured_values_a_bias_reads_per_tile():
    """ALiBi's slope (times the inverse scale) is read once per tile; a table indexed by the indices is not."""
    alibi = bias_over_scale(_expr(BIASES["alibi"])[0].expr)
    (tile,) = tile_values(alibi)
    assert not reads_indices(tile)[tile] and any(n is INV_SCALE for n in postorder(tile))
    assert tile_values(bias_over_scale(_expr(BIASES["table"])[0].expr)) == ()
    assert tile_values(bias_over_scale(_expr(BIASES["constant"])[0].expr)) == ()  # no captured tensor: nothing to load
