"""A score_mod's derivative (flashgen.mods.grad) against torch autograd through the user's function."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen.mods import prepare
from flashgen.mods.evaluate import evaluate
from flashgen.mods.grad import derivative, is_one, reads_score

SHAPE = (2, 3, 9, 11)  # (B, H, Sq, Sk)


def _grid():
    B, H, S, K = SHAPE
    return (torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
            torch.arange(S).view(1, 1, S, 1), torch.arange(K).view(1, 1, 1, K))


def _autograd(fn, score):
    x = torch.tensor(score, requires_grad=True)
    fn(x, *_grid()).sum().backward()
    return x.grad.numpy()


def _derivative(fn, score):
    mod, args = prepare(fn, "score")
    d = derivative(mod.expr)
    if d is None:
        return np.zeros(SHAPE, np.float32), d
    inputs = dict(zip(("score", "b", "h", "q_idx", "kv_idx"), (score,) + tuple(t.numpy() for t in _grid())))
    return np.broadcast_to(evaluate(d, inputs, args.values()), SHAPE), d


def _score(seed=0, scale=4.0):
    return (np.random.default_rng(seed).normal(0, scale, SHAPE)).astype(np.float32)


@pytest.mark.parametrize("name", ["softcap", "alibi", "relative_bias"])
def test_example_derivatives_match_autograd(examples, name):
    fn = examples.EXAMPLES[name][1]()
    score = _score()
    got, d = _derivative(fn, score)
    np.testing.assert_allclose(got, _autograd(fn, score), rtol=1e-5, atol=1e-6)
    assert reads_score(d) == (name == "softcap")  # a bias's derivative is 1 everywhere
    assert is_one(d) == (name != "softcap")


def _table():
    return torch.linspace(-1, 2, 7)


FUNCTIONS = {
    "product": lambda s, b, h, q, k: s * s * 0.25 - s * 3.0,
    "quotient": lambda s, b, h, q, k: (s + 20.0) / (s * s + 1.0),
    "exp_log": lambda s, b, h, q, k: torch.log(torch.exp(s * 0.1) + 2.0) + torch.sqrt(s * s + 1.0),
    "abs_neg": lambda s, b, h, q, k: -torch.abs(s) * (q - k),
    "where": lambda s, b, h, q, k: torch.where(q >= k, s * 2.0, -s),
    "maximum": lambda s, b, h, q, k: torch.maximum(s, (q - k) * 1.0) + torch.minimum(s * 0.5, 1.0 + h),
    "index_only": lambda s, b, h, q, k: (q - k) * 0.5 + s * 0.0 + h,
    "table": lambda s, b, h, q, k: s * _TABLE[(q + k) % 7],
    "exp2_powers": lambda s, b, h, q, k: torch.exp2(s * 0.2) + s ** 3 * 0.01 + torch.sign(s) * s ** 2,
}
_TABLE = _table()


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_rules_match_autograd(name):
    fn = FUNCTIONS[name]
    score = _score(seed=1)
    score[0, 0, 0, :4] = 0.0  # abs's kink (sign 0 there in both)
    got, _ = _derivative(fn, score)
    np.testing.assert_allclose(got, _autograd(fn, score), rtol=2e-5, atol=2e-5)


def test_ties_of_minimum_and_maximum_split_the_gradient_as_torch_does():
    fn = lambda s, b, h, q, k: torch.maximum(s, (q - k) * 1.0)  # noqa: E731
    score = np.broadcast_to((np.arange(9)[:, None] - np.arange(11)[None, :]).astype(np.float32), SHAPE).copy()
    got, _ = _derivative(fn, score)
    assert np.all(got == 0.5)
    np.testing.assert_array_equal(got, _autograd(fn, score))


def test_a_function_of_the_indices_alone_has_no_derivative():
    _, d = _derivative(lambda s, b, h, q, k: (q - k) * 1.0, _score())
    assert d is None and not reads_score(d)
