"""Every supported operation traces to the node torch's semantics call for, and computes what torch
computes: the numpy evaluation equals calling the same function on fp32 / int32 torch tensors
(bitwise, dtype included, except exp/log/tanh: two libraries' float32 functions, within 2 ulp),
and the rendered C++ compiled for the host equals the numpy evaluation (bitwise; exp/log/tanh
within 2 ulp: glibc vs numpy).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen.mods import prepare
from flashgen.mods.expr import Cast

from host import grid, needs_gxx, run, ulps  # tests/mods is on sys.path (pytest's prepend mode)

SHAPE = (2, 3, 9, 11)
CAP = 2.5  # a captured float: a run-time scalar
STEP = 3  # a captured int
SHIFT = torch.tensor(0.75)  # a captured 0-d tensor: a run-time scalar too
TABLE = torch.arange(3 * 9, dtype=torch.float32).reshape(9, 3).t() * 0.5 - 4  # (3, 9), strides (1, 3)
LUT = torch.tensor([4, -2, 7, 0, 1, -5, 3, 3, 9, 2, -1], dtype=torch.int64)
TRANSCENDENTAL = ("exp", "exp2", "log", "tanh")
#: torch's vectorized CPU sqrt (AVX-512 builds) may miss correct rounding by one ulp; the evaluator's and the
#: kernels' are correctly rounded (test_ops_host_cpp_equals_evaluate holds them to the same bits)
TORCH_SQRT = ("sqrt", "int_sqrt", "pow_half")

OPS = {
    "add": lambda s, b, h, q, k: s + q,
    "radd_float": lambda s, b, h, q, k: 1.5 + s,
    "int_add_float": lambda s, b, h, q, k: q + 0.5,
    "int_sub": lambda s, b, h, q, k: q - k,
    "rsub": lambda s, b, h, q, k: 3 - q,
    "mul": lambda s, b, h, q, k: s * CAP,
    "int_mul": lambda s, b, h, q, k: (q - k) * STEP,
    "truediv": lambda s, b, h, q, k: s / (k + 1),
    "truediv_capture": lambda s, b, h, q, k: s / CAP,  # the kernels' scale folds into the divisor (as softcap's)
    "int_truediv": lambda s, b, h, q, k: q / (k + 1),
    "rtruediv": lambda s, b, h, q, k: 1 / (q + 1),
    "floordiv": lambda s, b, h, q, k: (q - k) // STEP,
    "rfloordiv": lambda s, b, h, q, k: -7 // (k + 1),
    "mod": lambda s, b, h, q, k: (q - k) % 3,
    "mod_negative": lambda s, b, h, q, k: (q - k) % -4,
    "neg": lambda s, b, h, q, k: -s,
    "int_neg": lambda s, b, h, q, k: -q,
    "abs": lambda s, b, h, q, k: abs(s),
    "int_abs": lambda s, b, h, q, k: torch.abs(q - k),
    "lt": lambda s, b, h, q, k: s < 0.5,
    "le": lambda s, b, h, q, k: q <= k,
    "gt": lambda s, b, h, q, k: q > k,
    "ge_reflected": lambda s, b, h, q, k: 2 <= q,
    "eq": lambda s, b, h, q, k: q == k,
    "ne": lambda s, b, h, q, k: h != b,
    "mixed_compare": lambda s, b, h, q, k: s > q,
    "and": lambda s, b, h, q, k: (q < k) & (k < 5),
    "or": lambda s, b, h, q, k: (q < 2) | (k > 8),
    "xor": lambda s, b, h, q, k: (q < 4) ^ (k < 4),
    "not": lambda s, b, h, q, k: ~(q < k),
    "int_bitwise": lambda s, b, h, q, k: (q & k) | (~h ^ 6),
    "where": lambda s, b, h, q, k: torch.where(q <= k, s, -float("inf")),
    "where_mixed": lambda s, b, h, q, k: torch.where(s > 0, q, 0.25),
    "exp": lambda s, b, h, q, k: torch.exp(s),
    "exp2": lambda s, b, h, q, k: torch.exp2(s),
    "log": lambda s, b, h, q, k: torch.log(s),
    "tanh": lambda s, b, h, q, k: s.tanh(),
    "sqrt": lambda s, b, h, q, k: torch.sqrt(s),
    "int_sqrt": lambda s, b, h, q, k: torch.sqrt(q),
    "minimum": lambda s, b, h, q, k: torch.minimum(s, q),
    "maximum": lambda s, b, h, q, k: torch.maximum(q, k),
    "clamp": lambda s, b, h, q, k: s.clamp(-1, 1),
    "to_float": lambda s, b, h, q, k: q.float(),
    "to_int": lambda s, b, h, q, k: s.int(),
    "bool_to_float": lambda s, b, h, q, k: (s > 0).to(torch.float32),
    "to_bool": lambda s, b, h, q, k: (q - k).bool(),
    "logical_and": lambda s, b, h, q, k: torch.logical_and(q, k),
    "logical_not": lambda s, b, h, q, k: torch.logical_not(q - 3),
    "scalar_tensor": lambda s, b, h, q, k: s * SHIFT,
    "load_2d_strided": lambda s, b, h, q, k: s + TABLE[h, q],
    "load_int": lambda s, b, h, q, k: LUT[k] * q,
    "load_in_load": lambda s, b, h, q, k: TABLE[h, torch.remainder(LUT[k], 9)],
    "torch_min_of_two": lambda s, b, h, q, k: torch.min(q, k),
    "torch_max_of_two": lambda s, b, h, q, k: torch.max(s, s * 0.5),
    "pow_2": lambda s, b, h, q, k: s ** 2,
    "pow_0": lambda s, b, h, q, k: s ** 0,
    "int_pow_3": lambda s, b, h, q, k: (q - k) ** 3,
    "int_pow_4": lambda s, b, h, q, k: torch.pow(q - k, 4),
    "int_square": lambda s, b, h, q, k: torch.square(q - k),
    "sign": lambda s, b, h, q, k: torch.sign(s),
    "int_sign": lambda s, b, h, q, k: torch.sign(q - k),
    "zeros_like": lambda s, b, h, q, k: s + torch.zeros_like(s),
    "int_ones_like": lambda s, b, h, q, k: q * torch.ones_like(q),
    "full_like": lambda s, b, h, q, k: torch.full_like(s, 2.5) * s,
    "pow_half": lambda s, b, h, q, k: torch.abs(s) ** 0.5,
}


def _score() -> np.ndarray:
    s = np.random.default_rng(3).normal(0, 3, SHAPE).astype(np.float32)
    s.ravel()[::7] = 0.0  # exact zeros: log(0), sqrt(0), comparisons at 0
    return s


def _torch_result(fn):
    """``fn`` on fp32 scores and int32 index tensors, as the kernel's dtypes would be in torch."""
    args = (torch.from_numpy(_score()),) + tuple(torch.from_numpy(g) for g in grid(SHAPE))
    return fn(*args)


#: torch's result dtypes as the kernel's: int64 (a captured int64 tensor's values) computes in int32
KERNEL_DTYPE = {torch.float32: "fp32", torch.int32: "int32", torch.int64: "int32", torch.bool: "bool"}


def _traced_dtype(mod, want: str) -> str:
    """The traced result's dtype before a score_mod's final cast to fp32 (an fp32 result has none)."""
    root = mod.expr
    return root.x.dtype if isinstance(root, Cast) and want != "fp32" else root.dtype


@pytest.mark.parametrize("name", list(OPS))
def test_op_traces_to_what_torch_computes(name):
    mod, args = prepare(OPS[name], "score")
    want = _torch_result(OPS[name])
    assert _traced_dtype(mod, KERNEL_DTYPE[want.dtype]) == KERNEL_DTYPE[want.dtype]
    got = np.broadcast_to(mod.evaluate(_score(), *grid(SHAPE), args=args), SHAPE)
    want = want.to(torch.float32).expand(SHAPE).numpy()
    if name in TRANSCENDENTAL:
        assert ulps(got, want).max() <= 2
    elif name in TORCH_SQRT:
        assert ulps(got, want).max() <= 1
    else:
        assert np.array_equal(got.view(np.int32), want.view(np.int32)) or np.array_equal(got, want, equal_nan=True)


def test_captured_values_become_arguments():
    mod, args = prepare(OPS["load_int"], "score")
    assert [(a.name, a.source.name, a.dtype, a.rank) for a in mod.tensors] == [("t0", "LUT", "int32", 1)]
    assert args.tensors[0].dtype == torch.int32
    mod, args = prepare(lambda s, b, h, q, k: s * CAP + STEP * SHIFT, "score")
    assert [(a.name, a.source.name, a.dtype) for a in mod.scalars] == [("s0", "CAP", "fp32"), ("s1", "STEP", "int32"),
                                                                       ("s2", "SHIFT", "fp32")]
    assert args.scalars == (CAP, STEP, 0.75)


@needs_gxx
@pytest.mark.parametrize("scale", [1.0, 0.0883883476])
def test_ops_host_cpp_equals_evaluate(tmp_path, scale):
    """Also with the score passed apart from the scale the mod sees it at (as the kernels pass softmax_scale:
    folded into a factor or divisor on the device, rounded as written on the host)."""
    mods = [prepare(fn, "score") for fn in OPS.values()]
    score = _score()
    scaled = (score * np.float32(scale)).astype(np.float32)
    for name, (mod, args), got in zip(OPS, mods, run(mods, SHAPE, score, tmp_path, scale=scale)):
        want = np.broadcast_to(mod.evaluate(scaled, *grid(SHAPE), args=args), SHAPE)
        if name in TRANSCENDENTAL:
            if scale != 1.0:  # the scaled run checks the scale's rounding; the library functions' ulps are checked above
                continue
            assert ulps(got, want).max() <= 2, name
        else:
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), name
