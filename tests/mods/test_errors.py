"""What cannot be compiled raises a ModError that names the function, its file and line, and says
what to write instead."""
from __future__ import annotations

import math

import pytest
import torch

from flashgen.mods import ModError, trace

BIAS = torch.zeros(16)


def softcap_sigmoid(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.sigmoid(score / 30.0)


def branchy(score, b, h, q_idx, kv_idx):
    if score > 0:
        return score
    return -score


def _line(fn, text: str) -> int:
    """The line of ``fn``'s source holding ``text``."""
    import inspect
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_unsupported_torch_function_names_the_function_and_line():
    with pytest.raises(ModError) as e:
        trace(softcap_sigmoid, "score")
    msg = str(e.value)
    assert msg.startswith("score_mod softcap_sigmoid (test_errors.py:")
    assert f"line {_line(softcap_sigmoid, 'torch.sigmoid')}" in msg
    assert "uses torch.sigmoid, which flashgen cannot compile; supported:" in msg and "torch.where" in msg


def test_unsupported_method_and_operator():
    with pytest.raises(ModError, match=r"uses Tensor\.sigmoid"):
        trace(lambda s, b, h, q, k: s.sigmoid(), "score")
    with pytest.raises(ModError, match=r"x \*\* 1\.5; flashgen compiles the powers 0, 1, 2, 3, 4, 0\.5"):
        trace(lambda s, b, h, q, k: s ** 1.5, "score")
    with pytest.raises(ModError, match=r"x \*\* y of a traced exponent"):
        trace(lambda s, b, h, q, k: s ** (q - k), "score")
    with pytest.raises(ModError, match=r"a \*\* x of a traced exponent"):
        trace(lambda s, b, h, q, k: 2 ** s, "score")
    with pytest.raises(ModError, match=r"torch\.min\(x, \.\.\.\) as a reduction"):
        trace(lambda b, h, q, k: torch.min(q, 0) > 2, "mask")


def test_data_dependent_control_flow():
    with pytest.raises(ModError) as e:
        trace(branchy, "score")
    msg = str(e.value)
    assert msg.startswith("score_mod branchy (") and f"line {_line(branchy, 'if score')}" in msg
    assert "bool()" in msg and "torch.where" in msg
    for fn in (lambda b, h, q, k: q < k and k < 3,  # Python and
               lambda b, h, q, k: min(q, k) > 2,  # builtin min
               lambda b, h, q, k: 0 <= k < q):  # chained comparison
        with pytest.raises(ModError, match="data-dependent Python control flow"):
            trace(fn, "mask")
    with pytest.raises(ModError, match=r"float\(\)"):
        trace(lambda s, b, h, q, k: math.tanh(s), "score")


def test_unindexed_and_uncaptured_tensors():
    with pytest.raises(ModError, match=r"captured tensor 'BIAS' of shape \(16,\) as a whole"):
        trace(lambda s, b, h, q, k: s + BIAS, "score")
    with pytest.raises(ModError, match="not captured"):
        trace(lambda s, b, h, q, k: s + torch.arange(16)[k], "score")
    with pytest.raises(ModError, match="only integer expressions"):
        trace(lambda s, b, h, q, k: s + BIAS[k, None], "score")
    with pytest.raises(ModError, match="Python value"):  # a slice bound is turned into a Python int first
        trace(lambda s, b, h, q, k: s + BIAS[k:], "score")
    with pytest.raises(ModError, match="indices must be integers"):
        trace(lambda s, b, h, q, k: BIAS[s], "score")
    with pytest.raises(ModError, match="1-D tensor 'BIAS' with 2 indices"):
        trace(lambda s, b, h, q, k: BIAS[q, k], "score")


def test_type_rules():
    with pytest.raises(ModError, match="'floordiv' on floats"):
        trace(lambda s, b, h, q, k: s // 2, "score")
    with pytest.raises(ModError, match="bitwise 'and' on a float"):
        trace(lambda s, b, h, q, k: s & q, "score")
    with pytest.raises(ModError, match="condition must be bool"):
        trace(lambda s, b, h, q, k: torch.where(q, s, 0.0), "score")
    with pytest.raises(ModError, match=r"\.to\(torch\.float16\)"):
        trace(lambda s, b, h, q, k: s.to(torch.float16), "score")
    with pytest.raises(ModError, match="does not fit the kernel's int32"):
        trace(lambda s, b, h, q, k: q + 2**40, "score")


def test_bad_callables():
    with pytest.raises(ModError, match="must take 4 arguments"):
        trace(lambda s, b, h, q, k: s, "mask")
    with pytest.raises(ModError, match="plain Python function"):
        trace(torch.exp, "score")
    with pytest.raises(ValueError, match="kind="):
        trace(lambda b, h, q, k: q, "both")


def test_shape_queries_and_dtype():
    with pytest.raises(ModError, match=r"uses Tensor\.shape"):
        trace(lambda s, b, h, q, k: s * s.shape[0], "score")
    mod = trace(lambda s, b, h, q, k: torch.where(q < k, s, torch.tensor(-1.5, dtype=s.dtype)), "score")
    assert "Const '-0x1.8" in mod.canonical
