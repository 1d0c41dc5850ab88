"""The peers ``flashgen bench`` times beside flashgen: PyTorch's SDPA backends and, where it is
installed, FlashAttention-4 (``pip install flash-attn-4``, its CuTe DSL kernels).

A peer is a maker ``(q, k, v, causal) -> call``: q, k, v are (batch, seq, heads, d_head) tensors,
the call returns o as a (batch, heads, seq, d_head) view, recorded by autograd when the inputs
require grad, so the backward rows run the peer's own backward. Peers are timed, not checked.

Imports torch and flash_attn only inside its functions.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

SDPA_PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
FA4 = "FLASH_ATTENTION_4"

#: every peer's column label in the table and name on the command line
LABELS = {"FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn", "EFFICIENT_ATTENTION": "mem-eff", FA4: "fa4"}
PEERS = SDPA_PEERS + (FA4,)


class PeerUnavailable(Exception):
    """A peer that was asked for cannot run here (FlashAttention-4 not installed)."""


def fa4_version() -> str | None:
    """The installed flash-attn-4's version, or None when ``flash_attn.cute`` does not import."""
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:  # importable from a source tree
        return "unknown"


def default_peers() -> tuple[str, ...]:
    """The SDPA backends, and FlashAttention-4 when it is installed."""
    return SDPA_PEERS + ((FA4,) if fa4_version() else ())


def from_labels(labels) -> tuple[str, ...]:
    """Peer names of the command line's labels (``flash cudnn mem-eff fa4``), in :data:`PEERS`'s order;
    :class:`PeerUnavailable` when fa4 is asked for and not installed."""
    by_label = {v: k for k, v in LABELS.items()}
    names = {by_label[label] for label in labels}
    if FA4 in names and not fa4_version():
        raise PeerUnavailable("--peers fa4: FlashAttention-4 is not installed here (pip install flash-attn-4)")
    return tuple(p for p in PEERS if p in names)


def makers(peers) -> dict[str, Callable[..., Callable[[], Any]]]:
    """{peer: maker} of ``peers`` (names of :data:`PEERS`)."""
    return {p: fa4_peer if p == FA4 else functools.partial(sdpa_peer, p) for p in peers}


def sdpa_peer(backend: str, q, k, v, causal: bool) -> Callable[[], Any]:
    """A call of PyTorch's SDPA forced onto ``backend`` (an SDPBackend name); SDPA takes the inputs as
    (batch, heads, seq, d_head) views and returns o in that layout."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    chosen = getattr(SDPBackend, backend)

    def run():
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return run


def fa4_peer(q, k, v, causal: bool) -> Callable[[], Any]:
    """A call of FlashAttention-4's ``flash_attn_func``, which takes (batch, seq, heads, d_head) as they
    are; its o is returned as the (batch, heads, seq, d_head) view the other peers return. Its causal
    mask is aligned to the bottom right, the same as top-left at seq_q == seq_k (the bench's shapes)."""
    from flash_attn.cute import flash_attn_func

    def run():
        out = flash_attn_func(q, k, v, causal=causal)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
    return run
