"""Reference attention in float64: what flashgen's kernels are checked against.

:func:`attention` computes ``softmax(score_mod(scale * q k^T), masked) v`` directly, in
``dtype`` (float64 by default) on the inputs' device, for the inputs and options that
:meth:`flashgen.runtime.Attention.__call__` takes (layout ``(batch, seq, heads, d_head)``,
GQA/MQA, causal or window masks with either alignment, ``softmax_scale``, the log-sum-exp),
plus FlexAttention's ``score_mod`` / ``mask_mod`` functions. Rows without any kept key give
o = 0 and lse = -inf, as the kernels do.

The backward needs no code of its own: ``torch.autograd.grad`` through :func:`attention` on
float64 leaves gives the reference dQ, dK and dV (for GQA the kv heads' gradients sum over
their query-head group, since the heads are repeated inside the graph); :func:`gradients`
does exactly that.

The tolerance is FlashAttention's rule (:func:`check_close`): an output's max error against
the float64 reference may be at most twice the max error of the same computation done at the
inputs' 16-bit precision (:func:`lowp_reference`), plus :data:`ATOL`. :func:`check_attention`
runs both references for one call and measures against a flash kernel's precision, as strict
as comparing with PyTorch's flash SDPA.

Imports torch; ``import flashgen`` does not import this module until it is used.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .attention.score_mask import key_window

#: Absolute slack of :func:`check_close`. It matters only where the 16-bit reference happens to
#: be exact (rows that keep no key, an output of zeros), where the rule would otherwise demand
#: a bit-exact result; 1e-5 is below half an fp16 ulp (bf16: far below) of outputs of size
#: 0.05 and up, so it hides no rounding step of a real error.
ATOL = 1e-5

#: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> keep``,
#: FlexAttention's signatures; called once on broadcast index tensors (see :func:`attention`).
ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              window: "tuple[int, int] | None" = None, align: str = "top_left", softmax_scale: float | None = None,
              score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None, return_lse: bool = False,
              dtype: torch.dtype = torch.float64):
    """Attention of ``(batch, seq, heads, d_head)`` tensors, computed in ``dtype``; returns o
    ``(batch, seq_q, heads, d_v)`` in ``dtype``, and with ``return_lse`` also the natural-log
    log-sum-exp of the kept (modified) scores, ``(batch, heads, seq_q)`` in ``dtype``.

    k and v may have fewer heads (GQA/MQA): query head h reads kv head ``h // (heads // kv_heads)``.
    ``causal``: query i keeps keys j <= i + offset; ``window=(left, right)``: keys in
    [i + offset - left, i + offset + right] (-1 = unbounded on that side); ``align``: offset 0
    ("top_left") or seq_k - seq_q ("bottom_right"). ``softmax_scale`` defaults to 1/sqrt(d_head).
    ``score_mod`` and ``mask_mod`` are called once each with FlexAttention's arguments as
    broadcastable index tensors: b ``(B,1,1,1)``, h ``(1,H,1,1)`` (the query head), q_idx
    ``(1,1,Sq,1)``, kv_idx ``(1,1,1,Sk)``, and score ``(B,H,Sq,Sk)``; so functions written for
    FlexAttention with torch ops work unchanged. ``score_mod`` sees the scaled score; a score it
    makes -inf counts as masked. Keys are kept where the causal/window rule and ``mask_mod`` both
    keep them.
    """
    s, vt = _masked_scores(q, k, v, dtype, causal=causal, window=window, align=align, softmax_scale=softmax_scale,
                           score_mod=score_mod, mask_mod=mask_mod)
    o = _softmax_v(s, vt, dtype)
    return (o, torch.logsumexp(s, -1)) if return_lse else o


def lowp_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pipeline: str = "plain",
                   return_lse: bool = False, **kwargs):
    """:func:`attention` at 16-bit precision, the baseline of :func:`check_close`; o in q's dtype.

    ``pipeline="plain"``: every step in q's dtype (16-bit scores, probabilities and products, as
    PyTorch's kernels round them): FlashAttention's ``attention_ref(..., upcast=False)``.
    ``pipeline="flash"``: float32 scores and softmax, the probabilities rounded to q's dtype before
    a float32 P V, the output rounded: the precision of a FlashAttention kernel (flashgen's, or
    PyTorch's flash SDPA). Its error is 2-4x smaller than "plain"'s on random inputs, so a check
    against it is as strict; lse comes in float32.
    """
    if pipeline == "plain":
        return attention(q, k, v, dtype=q.dtype, return_lse=return_lse, **kwargs)
    if pipeline != "flash":
        raise ValueError(f"pipeline={pipeline!r}: expected 'plain' or 'flash'")
    s, vt = _masked_scores(q, k, v, torch.float32, **kwargs)
    o = _softmax_v(s, vt, q.dtype).to(q.dtype)
    return (o, torch.logsumexp(s, -1)) if return_lse else o


def gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, **kwargs) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in float64 of ``(attention(q, k, v, **kwargs) * do).sum()``, by autograd; dk
    and dv have k's and v's shapes (for GQA each sums over its group of query heads)."""
    if kwargs.get("return_lse") or kwargs.get("dtype", torch.float64) != torch.float64:
        raise ValueError("gradients() differentiates the float64 output o; pass neither return_lse nor dtype")
    leaves = [t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v)]
    o = attention(*leaves, **kwargs)
    return torch.autograd.grad(o, leaves, do.to(torch.float64))


def lowp_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, **kwargs) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) by autograd through :func:`attention` computed in q's dtype: FlashAttention's baseline for a
    backward's error (its ``attention_ref(..., upcast=False)``)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    return torch.autograd.grad(attention(*leaves, dtype=q.dtype, **kwargs), leaves, do)


def check_gradients(got: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, what: str = "",
                    **kwargs) -> None:
    """:func:`check_close` of ``got`` = (dq, dk, dv) against :func:`gradients`, measured by :func:`lowp_gradients`'
    own error; the message names ``what`` and the gradient."""
    for name, g, w, b in zip(("dq", "dk", "dv"), got, gradients(q, k, v, do, **kwargs), lowp_gradients(q, k, v, do, **kwargs)):
        check_close(g, w, b, f"{what} {name}".strip())


def max_errors(out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref|, max |ref_lowp - ref|), computed in float64 (NaN if ``out`` holds a NaN)."""
    for name, t in (("out", out), ("ref_lowp", ref_lowp)):
        if t.shape != ref.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the reference {tuple(ref.shape)}")
    ref64 = ref.to(torch.float64)
    return _max_abs(out, ref64), _max_abs(ref_lowp, ref64)


def tolerance(err_lowp: float) -> float:
    """The largest error FlashAttention's rule allows an output whose 16-bit reference errs by ``err_lowp``."""
    return 2.0 * err_lowp + ATOL


def check_close(out: torch.Tensor, ref: torch.Tensor, ref_lowp: torch.Tensor, what: str = "") -> None:
    """FlashAttention's rule: ``out`` must be finite and within :func:`tolerance` of the float64
    ``ref``, measured by ``ref_lowp``'s own error (same shapes, e.g. from :func:`attention` and
    :func:`lowp_reference`). Raises AssertionError with both errors and where the worst one is."""
    prefix = f"{what}: " if what else ""
    bad = ~torch.isfinite(out)
    if bad.any():
        raise AssertionError(f"{prefix}{int(bad.sum())} NaN/Inf values in the output, the first at {_where(bad)}")
    err, err_lowp = max_errors(out, ref, ref_lowp)
    if not err <= tolerance(err_lowp):
        diff = (out.to(torch.float64) - ref.to(torch.float64)).abs()
        at = _where(diff == diff.max())
        raise AssertionError(f"{prefix}max error {err:.3e} at {at} (out {out[at].item():.6g}, reference {ref[at].item():.6g}) "
                             f"> 2 * {err_lowp:.3e} (the {ref_lowp.dtype} reference's max error) + {ATOL:g}")


def check_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str = "", *,
                    pipeline: str = "flash", **kwargs) -> None:
    """:func:`check_close` of ``out`` against :func:`attention` and :func:`lowp_reference` of the same
    call; the 16-bit baseline is a flash kernel's precision unless ``pipeline="plain"`` (see there)."""
    check_close(out, attention(q, k, v, **kwargs), lowp_reference(q, k, v, pipeline=pipeline, **kwargs), what)


def _masked_scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, *, causal: bool = False,
                   window: "tuple[int, int] | None" = None, align: str = "top_left", softmax_scale: float | None = None,
                   score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, v): the modified scaled scores ``(B, H, Sq, Sk)`` in ``dtype`` with -inf at every masked
    place, and v as ``(B, H, Sk, d_v)`` in ``dtype`` (k/v heads repeated to q's)."""
    qt, kt, vt = _heads_first(q, k, v, dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    s = (qt @ kt.transpose(-1, -2)) * scale
    b, h, q_idx, kv_idx = _indices(s)
    if score_mod is not None:
        s = score_mod(s, b, h, q_idx, kv_idx).to(dtype).expand(s.shape)
    keep = _window_keep(q_idx, kv_idx, causal, window, align, k.shape[1] - q.shape[1])
    if mask_mod is not None:
        keep = keep & mask_mod(b, h, q_idx, kv_idx).to(torch.bool)
    # a -inf score from score_mod counts as masked: a row without a kept key is then -inf throughout,
    # every place of it filled here (see _softmax_v)
    return s.masked_fill(~(keep & ~torch.isneginf(s)), float("-inf")), vt


def _softmax_v(s: torch.Tensor, vt: torch.Tensor, p_dtype: torch.dtype) -> torch.Tensor:
    """softmax(s) v as ``(B, Sq, H, d_v)`` in s's dtype, the probabilities rounded to ``p_dtype``
    first; rows of s without a finite score give 0. torch.softmax gives NaN on such a row;
    zeroing it also zeroes its gradient, since every place of the row was filled by masked_fill,
    which passes no gradient to filled places."""
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)
    return (p.to(p_dtype).to(s.dtype) @ vt).transpose(1, 2)


def _heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as ``(batch, heads, seq, d)`` in ``dtype``, k and v repeated to q's heads."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq, heads, d_head), got shape {tuple(t.shape)}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match: "
                         "k and v need q's batch, one seq_k and kv_heads, k needs q's d_head")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q's {q.shape[2]} heads are not a multiple of k/v's {k.shape[2]} heads")
    group = q.shape[2] // k.shape[2]
    return (q.to(dtype).transpose(1, 2),
            *(t.to(dtype).repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v)))


def _indices(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """FlexAttention's (b, h, q_idx, kv_idx) as index tensors broadcasting to ``s``'s (B, H, Sq, Sk)."""
    return tuple(torch.arange(n, device=s.device).view([n if d == i else 1 for d in range(4)]) for i, n in enumerate(s.shape))


def _window_keep(q_idx: torch.Tensor, kv_idx: torch.Tensor, causal: bool, window: "tuple[int, int] | None",
                 align: str, seq_diff: int) -> torch.Tensor:
    """(1, 1, Sq, Sk) bool: the keys the causal / window rule keeps (all of them with neither)."""
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align={align!r}: expected 'top_left' or 'bottom_right'")
    left, right = key_window(causal, window)
    diag = q_idx + (seq_diff if align == "bottom_right" else 0)  # the key each query is aligned with
    keep = torch.ones(1, 1, q_idx.shape[2], kv_idx.shape[3], dtype=torch.bool, device=q_idx.device)
    if left >= 0:
        keep = keep & (kv_idx >= diag - left)
    if right >= 0:
        keep = keep & (kv_idx <= diag + right)
    return keep


def _max_abs(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return (a.to(torch.float64) - ref64).abs().max().item() if a.numel() else 0.0


def _where(flags: torch.Tensor) -> tuple[int, ...]:
    """The index of the first true element of ``flags``."""
    return tuple(int(i) for i in flags.nonzero()[0])
