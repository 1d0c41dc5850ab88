"""Attention and its gradients in float64 numpy: the backward simulator's oracle (no torch).

Same conventions as :mod:`flashgen.reference` (which differentiates with torch's autograd; a test
checks the two agree): tensors ``(batch, seq, heads, d)``, k and v with fewer heads for GQA/MQA
(query head ``h`` reads kv head ``h // group``), a causal or window mask aligned top-left
(offset 0) or bottom-right (``seq_k - seq_q``), ``scale`` default ``1/sqrt(d)``. A row without a
kept key has o = 0, lse = -inf and contributes no gradient.

For one head, with ``P = softmax(scale * Q K^T)`` over the kept keys and ``O = P V``:
``dV = P^T dO``, ``dP = dO V^T``, ``D = rowsum(dO * O)``, ``dS = P * (dP - D)``,
``dQ = scale * dS K``, ``dK = scale * dS^T Q``; a kv head's dK and dV sum over its query heads.
With a score_mod ``f`` (``P = softmax(f(scale * Q K^T))``, :func:`head_gradients`' ``score``) the
gradient reaching the modded score is multiplied by ``f'`` before it goes on to Q and K:
``dS = P * (dP - D) * f'``; a mask_mod is one more ``keep`` (:func:`gradients`' ``head_mods``).
"""
from __future__ import annotations

from typing import Callable

import attrs
import numpy as np

from flashgen.attention.score_mask import key_window


def keep_mask(seq_q: int, seq_k: int, causal: bool = False, window: "tuple[int, int] | None" = None,
              align: str = "top_left") -> np.ndarray:
    """``[seq_q, seq_k]`` bool: the scores the causal / window rule keeps."""
    left, right = key_window(causal, window)
    diag = np.arange(seq_q)[:, None] + (seq_k - seq_q if align == "bottom_right" else 0)
    j = np.arange(seq_k)[None, :]
    keep = np.ones((seq_q, seq_k), dtype=bool)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    return keep


@attrs.frozen
class HeadGradients:
    """One query head's forward results and gradients (float64): ``o``, ``lse`` ``[seq_q]``,
    ``delta`` (D) ``[seq_q]``, ``dq`` ``[seq_q, d]``, ``dk``, ``dv`` ``[seq_k, d]``."""

    o: np.ndarray
    lse: np.ndarray
    delta: np.ndarray
    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray


def softmax(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(P, lse) of scores ``[rows, cols]`` (float64, -inf where masked) along the rows; a row without a
    finite score has P = 0 and lse = -inf."""
    m = s.max(axis=1, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe[:, None])
    l = e.sum(axis=1)
    has = l > 0
    p = np.where(has[:, None], e / np.where(has, l, 1.0)[:, None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(has, m_safe + np.log(np.where(has, l, 1.0)), -np.inf)
    return p, lse


#: a score_mod for :func:`head_gradients`: the scaled scores ``[seq_q, seq_k]`` (float64) -> (the modded
#: scores, their derivative with respect to the scaled score), float64
ScoreFn = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray]"]


def head_gradients(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, scale: float,
                   keep: np.ndarray | None = None, round16: "Callable[[np.ndarray], np.ndarray] | None" = None,
                   score: "ScoreFn | None" = None) -> HeadGradients:
    """The backward of one head: ``q``, ``do`` ``[seq_q, d]``, ``k``, ``v`` ``[seq_k, d]``; ``keep``
    ``[seq_q, seq_k]`` (None: every score). ``round16``: the kernel's precision, applied where a flash
    backward rounds to 16 bits (the forward's output O, which D reads; P before dV, dS before dK and
    dQ; the three gradients); the baseline of the simulator's and the GPU checks' tolerance (with D
    from the exact O instead, a backward at exactly that precision erred by up to 2.8x the baseline's
    dQ error at seq 1024). ``score``: a score_mod and its derivative (a modded score of -inf counts
    as masked)."""
    r = (lambda x: x) if round16 is None else round16
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    s = scale * (q @ k.T)
    grad = np.ones_like(s)
    if score is not None:
        s, grad = (np.asarray(x, dtype=np.float64) for x in score(s))
    if keep is not None:
        s = np.where(keep, s, -np.inf)
    p, lse = softmax(s)
    o = p @ v
    delta = (do * r(o)).sum(axis=1)
    ds = np.where(p != 0, p * (do @ v.T - delta[:, None]) * grad, 0.0)
    return HeadGradients(o, lse, delta, r(scale * (r(ds) @ k)), r(scale * (r(ds).T @ q)), r(r(p).T @ do))


def gradients(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, *, causal: bool = False,
              window: "tuple[int, int] | None" = None, align: str = "top_left",
              softmax_scale: float | None = None, round16: "Callable[[np.ndarray], np.ndarray] | None" = None,
              head_mods: "Callable[[int, int], tuple[np.ndarray | None, ScoreFn | None]] | None" = None,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dq, dk, dv) in float64 with q's, k's and v's shapes (``(batch, seq, heads, d)``); ``round16``:
    see :func:`head_gradients` (a kv head's dK and dV are rounded per query head, then summed);
    ``head_mods(b, h)``: batch ``b``'s query head ``h``'s mask_mod as a ``keep`` ``[seq_q, seq_k]``
    (None: all) and its score_mod (:data:`ScoreFn` or None)."""
    B, Sq, H, d = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    if H % Hk:
        raise ValueError(f"q's {H} heads are not a multiple of k/v's {Hk} heads")
    group = H // Hk
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    keep = keep_mask(Sq, Sk, causal, window, align)
    dq = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            extra, score = (None, None) if head_mods is None else head_mods(b, h)
            g = head_gradients(q[b, :, h], k[b, :, h // group], v[b, :, h // group], do[b, :, h], scale,
                               keep if extra is None else keep & extra, round16, score)
            dq[b, :, h] = g.dq
            dk[b, :, h // group] += g.dk
            dv[b, :, h // group] += g.dv
    return dq, dk, dv
