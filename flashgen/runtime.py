"""``flashgen.compile(cfg)``: a built kernel as a checked, torch-callable attention op.

Inputs are ``(batch, seq, heads, d_head)`` tensors (any strides with a contiguous,
16-byte aligned ``d_head``; a ``(batch, heads, seq, d)`` tensor passes as its
``.transpose(1, 2)`` view). Every unsupported input is refused before launch.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .build import Built, build
from .dsl.config import KernelConfig, load_config


class InputError(ValueError):
    """An input the kernel cannot take; the message says what is supported."""


_FAKES: set[str] = set()


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    """Compute capability per device, asked once (the checks run on every call)."""
    return torch.cuda.get_device_capability(device_index)


def _ops(built: Built):
    """The kernel's torch operators; a fake (meta) implementation makes them traceable by torch.compile."""
    name = built.source.name
    if name not in _FAKES:
        @torch.library.register_fake(f"flashgen::{name}")
        def _(q, k, v, lse, softmax_scale, mask_offset, window_left, window_right):
            return torch.empty_like(q)

        _FAKES.add(name)
    ns = torch.ops.flashgen
    return getattr(ns, name), getattr(ns, f"{name}_out")


class Attention:
    """A compiled kernel: ``attn(q, k, v, out=None, softmax_scale=None) -> o``."""

    def __init__(self, built: Built) -> None:
        self.built = built
        self.cfg: KernelConfig = built.cfg
        self._op, self._op_out = _ops(built)
        self._variants: dict[str, Attention] = {}

    @property
    def compile_seconds(self) -> float:
        return self.built.compile_seconds

    def __repr__(self) -> str:
        return f"flashgen.Attention({self.cfg.short_form()!r})"

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Raise :class:`InputError` for anything the kernel does not support."""
        cfg = self.cfg
        want = cfg.dtype.torch
        for name, t in (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ()):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_cuda:
                raise InputError(f"{name} is on {t.device}; flashgen kernels run on CUDA devices")
            if t.dtype != want:
                raise InputError(f"{name} has dtype {t.dtype}, this kernel was built for {want} ({cfg.short_form()})")
            if t.dim() != 4:
                raise InputError(f"{name} must be 4-D (batch, seq, heads, d_head), got shape {tuple(t.shape)}")
            if t.shape[3] != cfg.d_head:
                raise InputError(f"{name} has d_head={t.shape[3]}, this kernel was built for d_head={cfg.d_head}")
            if t.stride(3) != 1:
                raise InputError(f"{name}: the last (d_head) dimension must be contiguous, got stride {t.stride(3)}")
            if any(s % 8 for s in t.stride()[:3]) or t.data_ptr() % 16:
                raise InputError(f"{name}: rows must be 16-byte aligned (strides {t.stride()} in elements must be multiples of 8)")
            if t.device != q.device:
                raise InputError(f"{name} is on {t.device} but q is on {q.device}")
        major, minor = _capability(q.device.index if q.device.index is not None else torch.cuda.current_device())
        if cfg.is_wgmma and (major, minor) != (9, 0):
            raise InputError(f"{torch.cuda.get_device_name(q.device)} has compute capability {major}.{minor}; "
                             "wgmma-engine kernels are built for sm_90a (H100/H200)")
        if major < 8:
            raise InputError(f"{torch.cuda.get_device_name(q.device)} has compute capability < 8.0; mma.sync/cp.async need sm_80+")
        b, sq, h, _ = q.shape
        if k.shape != v.shape:
            raise InputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if k.shape[0] != b:
            raise InputError(f"k/v batch {k.shape[0]} must match q's {b}")
        hk = k.shape[2]
        if hk == 0 or h % hk:
            raise InputError(f"q's {h} heads must be a multiple of k/v's {hk} heads (GQA/MQA: each k/v head serves h/hk query heads)")
        if sq == 0 or k.shape[1] == 0:
            raise InputError(f"sequence lengths must be >= 1, got seq_q={sq}, seq_k={k.shape[1]}")
        if b == 0 or h == 0:
            raise InputError(f"batch and heads must be >= 1, got batch={b}, heads={h}")
        if out is not None and out.shape != q.shape:
            raise InputError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")

    def _variant(self, mask: str) -> "Attention":
        """The same kernel with another score mask, built on first use."""
        if mask == self.cfg.mask:
            return self
        if mask not in self._variants:
            self._variants[mask] = Attention(build(self.cfg.replace(mask=mask)))
        return self._variants[mask]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window: "tuple[int, int] | None" = None,
        align: str = "top_left",
        return_lse: bool = False,
    ):
        """Attention of (batch, seq, heads, d_head) tensors; k/v may have fewer heads (GQA/MQA).

        ``causal``: query i sees keys j <= i + offset; ``window=(left, right)``: keys in
        [i + offset - left, i + offset + right] (-1 = unbounded); ``align`` chooses offset 0
        ("top_left", PyTorch's ``is_causal``) or seq_k - seq_q ("bottom_right", FlashAttention's).
        A kernel compiled without that mask builds its masked variant on first use.
        ``return_lse``: also return the fp32 log-sum-exp of the scaled scores, (batch, heads, seq_q);
        rows without any kept key give o = 0 and lse = -inf.
        """
        if not torch.compiler.is_compiling():  # traced calls are checked when the graph's inputs are built eagerly
            self.check(q, k, v, out)
        if align not in ("top_left", "bottom_right"):
            raise InputError(f"align={align!r}: expected 'top_left' or 'bottom_right'")
        mask, left, right = _score_mask(causal, window)
        attn = self._variant(mask)
        offset = 0 if align == "top_left" else int(k.shape[1]) - int(q.shape[1])
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(self.cfg.d_head)
        b, sq, h, _ = q.shape
        lse = torch.empty((b, h, sq) if return_lse else (0,), device=q.device, dtype=torch.float32)
        if out is None:
            out = attn._op(q, k, v, lse, scale, offset, left, right)
        else:
            attn._op_out(q, k, v, out, lse, scale, offset, left, right)
        return (out, lse) if return_lse else out


def _score_mask(causal: bool, window: "tuple[int, int] | None") -> tuple[str, int, int]:
    """The kernel's score mask and its (left, right) window for a call's ``causal`` / ``window``."""
    if window is None:
        return ("causal" if causal else "none"), -1, (0 if causal else -1)
    if causal:
        raise InputError("pass either causal=True or window=(left, right) (causal is window=(-1, 0))")
    left, right = (int(x) for x in window)
    return "window", left, right


class AutoAttention:
    """``compile("auto")``: picks the tuned config per (GPU, dtype, d_head, sequence bucket) at call time.

    Buckets without a ``flashgen tune`` result use the shipped defaults. Each picked
    config is built once and kept.
    """

    def __init__(self, verbose: bool = False) -> None:
        self.verbose = verbose
        self._built: dict[KernelConfig, Attention] = {}

    def select(self, q: torch.Tensor, masked: bool = False) -> KernelConfig:
        """The config for ``q``'s shape (``masked``: the call applies a causal or window mask)."""
        from .dsl.dtypes import DType
        from .tune import lookup

        try:
            dtype = DType.parse(str(q.dtype))
        except ValueError:
            raise InputError(f"q has dtype {q.dtype}; flashgen kernels take float16 or bfloat16") from None
        if q.dim() != 4:
            raise InputError(f"q must be 4-D (batch, seq, heads, d_head), got shape {tuple(q.shape)}")
        return lookup(torch.cuda.get_device_name(q.device), dtype, int(q.shape[3]), int(q.shape[1]),
                      capability=torch.cuda.get_device_capability(q.device), masked=masked)

    def __call__(self, q, k, v, **kwargs):
        cfg = self.select(q, masked=_score_mask(kwargs.get("causal", False), kwargs.get("window"))[0] != "none")
        attn = self._built.get(cfg)
        if attn is None:
            attn = self._built[cfg] = Attention(build(cfg, verbose=self.verbose))
        return attn(q, k, v, **kwargs)


def compile(cfg: Any, verbose: bool = False) -> "Attention | AutoAttention":  # noqa: A001 - the public name users expect
    """Build (or load from the cache) the kernel for ``cfg``: a KernelConfig, dict, YAML path or short form.

    ``"auto"`` returns an :class:`AutoAttention` that uses ``flashgen tune``'s results.
    """
    if isinstance(cfg, str) and cfg.strip() == "auto":
        return AutoAttention(verbose)
    config = load_config(cfg)
    return Attention(build(config, verbose=verbose))
