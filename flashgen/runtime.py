"""``flashgen.compile(cfg)``: a built kernel as a checked, torch-callable attention op.

Inputs are ``(batch, seq, heads, d_head)`` tensors (any strides with a contiguous,
16-byte aligned ``d_head``; a ``(batch, heads, seq, d)`` tensor passes as its
``.transpose(1, 2)`` view). Every unsupported input is refused before launch.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .build import Built, build
from .dsl.config import KernelConfig, load_config


class InputError(ValueError):
    """An input the kernel cannot take; the message says what is supported."""


_OPS: dict[str, Any] = {}


def _register_op(built: Built):
    """A torch custom op per kernel, so calls trace under torch.compile and CUDA graphs."""
    name = f"flashgen::attn_{built.key}"
    if name in _OPS:
        return _OPS[name]
    module = built.module

    @torch.library.custom_op(name, mutates_args=())
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
        o = torch.empty_like(q)
        module.run(q, k, v, o, softmax_scale)
        return o

    @attn.register_fake
    def _(q, k, v, softmax_scale):
        return torch.empty_like(q)

    _OPS[name] = attn
    return attn


class Attention:
    """A compiled kernel: ``attn(q, k, v, out=None, softmax_scale=None) -> o``."""

    def __init__(self, built: Built) -> None:
        self.built = built
        self.cfg: KernelConfig = built.cfg
        self._op = _register_op(built)

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
        major, _ = torch.cuda.get_device_capability(q.device)
        if major < 8:
            raise InputError(f"{torch.cuda.get_device_name(q.device)} has compute capability < 8.0; mma.sync/cp.async need sm_80+")
        b, sq, h, _ = q.shape
        if k.shape != v.shape:
            raise InputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if k.shape[0] != b or k.shape[2] != h:
            raise InputError(f"k/v batch and heads {tuple(k.shape[::2])} must match q's ({b}, {h}) (GQA is not supported yet)")
        sk = k.shape[1]
        if sq % cfg.B_r or sk % cfg.B_c or sq == 0 or sk == 0:
            raise InputError(
                f"seq_q={sq} must be a positive multiple of B_r={cfg.B_r} and seq_k={sk} of B_c={cfg.B_c} "
                "(tail blocks are not supported yet)"
            )
        if out is not None and out.shape != q.shape:
            raise InputError(f"out has shape {tuple(out.shape)}, expected {tuple(q.shape)}")

    def __call__(self, q, k, v, out: torch.Tensor | None = None, softmax_scale: float | None = None) -> torch.Tensor:
        self.check(q, k, v, out)
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(self.cfg.d_head)
        if out is None:
            return self._op(q, k, v, scale)
        with torch.cuda.device(q.device):
            self.built.module.run(q, k, v, out, scale)
        return out


def compile(cfg: Any, verbose: bool = False) -> Attention:  # noqa: A001 - the public name users expect
    """Build (or load from the cache) the kernel for ``cfg``: a KernelConfig, dict, YAML path or short form."""
    config = load_config(cfg)
    return Attention(build(config, verbose=verbose))
