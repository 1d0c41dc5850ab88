"""A score_mod that adds a bias to the score: the forward kernels start the S accumulator at it.

ALiBi (``score - slope * (q_idx - kv_idx)``) and a relative-bias table (``score + table[q_idx - kv_idx]``)
return the scaled score plus a value ``B`` free of the score. Such a score_mod need not run after the S
GEMM: with ``acc = B / scale`` before the GEMM accumulates ``Q K^T`` onto it, ``acc * scale`` is the
score_mod's result (to rounding), and the softmax takes ``acc`` at the kernels' usual scale, as it does
without a mod. The division folds into ``B``'s factor where it has one (ALiBi's slope: still one
multiply-add per score), so the bias costs the softmax nothing and its own work a multiply-add a score
fewer than ``score * scale + B`` after the GEMM.

:func:`bias_over_scale` returns that ``B / scale`` as a DAG over one more leaf, ``inv_scale`` (the
kernels' ``1 / softmax_scale``), which renders (flashgen.mods.cpp) and evaluates (flashgen.mods.evaluate)
like any mod.
"""
from __future__ import annotations

from typing import Optional

from .expr import FLOAT, Arg, Binary, Unary, postorder
from .ranges import reads_indices

#: the leaf standing for 1 / softmax_scale in :func:`bias_over_scale`'s DAG
INV_SCALE = Arg("inv_scale", FLOAT)


def _is_score(node) -> bool:
    return isinstance(node, Arg) and node.name == "score"


def _free_of_score(node) -> bool:
    return not any(_is_score(n) for n in postorder(node))


def additive_bias(root) -> "tuple[object, bool] | None":
    """``(B, negated)`` where the score_mod ``root`` is ``score + B``, ``B + score`` (negated False) or
    ``score - B`` (True) with ``B`` free of the score; None for any other score_mod (softcap, a scaled score)."""
    if not isinstance(root, Binary) or root.dtype != FLOAT or root.op not in ("add", "sub"):
        return None
    if _is_score(root.a) and _free_of_score(root.b):
        return root.b, root.op == "sub"
    if root.op == "add" and _is_score(root.b) and _free_of_score(root.a):
        return root.a, False
    return None


def _times(node, k):
    """``node * k`` as a DAG (``k`` free of the indices), ``k`` joining a factor free of the indices where ``node``
    has one, so that a product with a split conversion stays one multiply-add per score (flashgen.mods.cpp's fused
    products) and a negation costs nothing per score."""
    if isinstance(node, Unary) and node.op == "neg":  # -(x k) == x (-k) exactly: the negation joins the hoisted factor
        return _times(node.x, Unary("neg", k, FLOAT))
    if isinstance(node, Binary) and node.op == "mul" and node.dtype == FLOAT:
        reads = reads_indices(node)
        for u, other, first in ((node.a, node.b, True), (node.b, node.a, False)):
            if not reads[u] and u.dtype == FLOAT:
                scaled = Binary("mul", u, k, FLOAT)
                return Binary("mul", scaled, other, FLOAT) if first else Binary("mul", other, scaled, FLOAT)
    if node.dtype != FLOAT:
        raise ValueError(f"a score_mod's bias is {node.dtype}, not fp32: the tracer casts the sum's operands")
    return Binary("mul", node, k, FLOAT)


def bias_over_scale(root) -> Optional[object]:
    """``B / scale`` (the value the S accumulator starts at) for a score_mod that adds ``B`` to the score, as
    a DAG over :data:`INV_SCALE`; None for a score_mod of another form."""
    found = additive_bias(root)
    if found is None:
        return None
    bias, negated = found
    return _times(Unary("neg", bias, FLOAT) if negated else bias, INV_SCALE)
