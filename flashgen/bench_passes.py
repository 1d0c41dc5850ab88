"""The passes ``flashgen bench`` times, their FLOP counts, and the check of the gradients.

* ``fwd``: ``o = attention(q, k, v)``;
* ``bwd``: ``dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)`` of one forward recorded before
  the timing, run again and again on the same graph (``retain_graph``): the backward alone;
* ``fwd+bwd``: a forward and its backward, what a training step spends on attention.

FLOPs are counted in units of the forward's (:func:`flashgen.bench.attention_flops`, causal
half): the backward's five matrix products of the forward's size (S recomputed, dV = P^T dO,
dP = dO V^T, dQ = dS K, dK = dS^T Q) against the forward's two make 2.5 forwards, forward and
backward together 3.5; the convention of FlashAttention's papers, so figures compare with theirs.

The gradients are checked on a slice that keeps them exact: batch 0 and the first query heads
with their kv heads, every query and key row (dK and dV sum over all query rows, so a row slice
would change them). The float64 reference is :func:`flashgen.reference.gradients`; the 16-bit
baseline of FlashAttention's rule is the same backward rounded where a flash backward rounds
(:func:`flashgen.sim.grad_reference.gradients`), as the GPU tests of the backward kernels measure.

Imports torch (and numpy) only inside its functions.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

PASSES = ("fwd", "bwd", "fwd+bwd")

#: FLOPs of each pass in units of the forward's (see the module docstring)
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}

#: what each pass's table is titled
TITLES = {"fwd": "forward (fwd)",
          "bwd": "backward (bwd): dq, dk, dv of a recorded forward, 2.5x the forward's FLOPs",
          "fwd+bwd": "forward + backward (fwd+bwd): 3.5x the forward's FLOPs"}

#: the most scores (query rows x key rows x heads) a gradient check takes: its float64 reference on
#: the GPU and its 16-bit baseline in numpy on the CPU (seconds per row at this size) grow with them;
#: one head is checked whatever the length
CHECK_SCORES = 2**26


def needs_grad(pass_: str) -> bool:
    """Whether ``pass_`` runs a backward (its inputs require grad)."""
    _known(pass_)
    return pass_ != "fwd"


def pass_call(pass_: str, forward: Callable[[], Any], leaves: Sequence, do) -> Callable[[], Any]:
    """The call that ``pass_`` times, for ``forward`` (a call returning o, recorded by autograd from
    ``leaves`` = (q, k, v) when the pass needs grad) and ``do`` (o's gradient, in o's layout).

    ``bwd`` runs ``forward`` once, here, and returns the backward of that o (the graph is kept for
    the next call); ``fwd+bwd`` returns a forward and its backward; ``fwd`` returns ``forward``."""
    import torch

    _known(pass_)
    if pass_ == "fwd":
        return forward
    if pass_ == "bwd":
        o = forward()
        return lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), leaves, do)


def checked_heads(heads: int, kv_heads: int, seq_q: int, seq_k: int) -> int:
    """How many query heads (a whole number of GQA groups, at least one) a gradient check takes:
    as many as :data:`CHECK_SCORES` allows."""
    group = heads // kv_heads
    n = min(heads, CHECK_SCORES // (seq_q * seq_k))
    return max(group, n - n % group)


def gradient_errors(grads: Sequence, q, k, v, do, *, causal: bool, softmax_scale: float) -> dict[str, tuple[float, float]]:
    """``{"dq" | "dk" | "dv": (max |g - ref64|, max |g_16 - ref64|)}`` of ``grads`` = (dq, dk, dv) of
    attention(q, k, v) (``(batch, seq, heads, d)``, top-left causal or none) with gradient ``do``, on
    batch 0 and the first :func:`checked_heads` heads; g_16 is the 16-bit baseline (module docstring).
    An error is NaN where the gradient holds one."""
    import torch

    from .reference import gradients, max_errors
    from .sim.grad_reference import gradients as lowp_gradients

    heads, kv_heads = q.shape[2], k.shape[2]
    n = checked_heads(heads, kv_heads, q.shape[1], k.shape[1])
    n_kv = n // (heads // kv_heads)
    qs, ks, vs, dos = (t.detach()[:1, :, :h] for t, h in ((q, n), (k, n_kv), (v, n_kv), (do, n)))
    want = gradients(qs, ks, vs, dos, causal=causal, softmax_scale=softmax_scale)
    dtype = q.dtype

    def round16(x):
        return torch.from_numpy(x).to(dtype).to(torch.float64).numpy()

    base = lowp_gradients(*(t.to(torch.float64).cpu().numpy() for t in (qs, ks, vs, dos)), causal=causal,
                          softmax_scale=softmax_scale, round16=round16)
    return {name: max_errors(g.detach()[:1, :, :w.shape[2]], w, torch.from_numpy(b).to(w.device))
            for name, g, w, b in zip(("dq", "dk", "dv"), grads, want, base)}


def _known(pass_: str) -> None:
    if pass_ not in PASSES:
        raise ValueError(f"pass {pass_!r}: expected one of {', '.join(PASSES)}")
