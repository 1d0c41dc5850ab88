"""Training through flashgen attention: the autograd formula of the ``flashgen::attention`` operator.

A differentiable call runs the forward operator with ``return_lse`` (the backward recomputes the
probabilities from the log-sum-exp) and autograd saves q, k, v, o and lse. Its backward calls
``flashgen::attention_backward`` with the backward kernel of the forward kernel's dtype, head size
and score mask: every loaded forward kernel that can be differentiated registers here how to build
that kernel (:func:`register`), and it is built once per key length bucket (``flashgen tune --passes
bwd`` winners differ per bucket), on the first differentiable call of that bucket. Both run under
``torch.compile`` too: the backward kernel's handle is a constant of the traced graph.

Deterministic backward (bit-identical dQ, dK, dV run to run; its dQ adds wait for their turn): for
every call of a forward kernel registered ``deterministic`` (``flashgen.compile(..., deterministic=True)``),
and for any call made while ``torch.are_deterministic_algorithms_enabled()``. The choice is made at
the forward call and kept with the saved tensors; each of a kernel's two backward variants is built
on first use.

Calls with a score_mod / mask_mod (``flashgen::attention_mods``) are differentiated the same way, by a backward
kernel built with the same functions, on the values the forward call had (its captured numbers and tensors):
gradients flow through the score_mod with respect to the score (:mod:`flashgen.mods.grad`), not into captured
tensors. With a mask_mod the backward gets its own block mask (transposed: per key block the query blocks it
keeps a score in), made by ``flashgen::mask_blocks`` with the backward kernel's handle and kept by the forward's
object (:func:`register`'s ``block_mask``).

A gradient that reaches the returned lse is taken into account (``d lse_i / d s_ij = scale * p_ij``
folds into the backward's ``D = rowsum(dO * O)`` as ``D - dlse``).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from . import launcher  # noqa: F401  (defines the operators this module registers a formula for)
from .policy import seq_bucket

#: forward kernel handle -> what builds and loads its backward kernel, ``factory(seq_k, deterministic)``
#: for calls of key length ``seq_k`` (0: unknown), returning that kernel's handle
_factories: dict[int, Callable[[int, bool], int]] = {}
#: (forward kernel handle, key length's bucket, deterministic) -> the loaded backward kernel's handle
_handles: dict[tuple[int, int, bool], int] = {}
#: forward kernels whose every backward is the deterministic one
_always_deterministic: set[int] = set()
#: forward kernel handle (one built with a mask_mod) -> ``maker(backward handle, q, k, mod_words, mod_tensors)``: the
#: backward kernel's block mask for a call of these sizes and values (kept by the maker)
_block_masks: dict[int, Callable] = {}
_lock = threading.Lock()


def register(forward: int, factory: Callable[[int, bool], int], deterministic: bool = False,
             block_mask: "Callable | None" = None) -> None:
    """Forward kernel ``forward`` is differentiated by the kernel ``factory(seq_k, deterministic)`` builds
    and loads; ``deterministic``: always by its deterministic variant; ``block_mask`` (a kernel with a mask_mod):
    ``block_mask(backward handle, q, k, mod_words, mod_tensors)`` makes the backward's block mask."""
    _factories[forward] = factory
    if block_mask is not None:
        _block_masks[forward] = block_mask
    else:
        _block_masks.pop(forward, None)
    if deterministic:
        _always_deterministic.add(forward)
    else:
        _always_deterministic.discard(forward)


def deterministic(forward: int) -> bool:
    """Whether a differentiable call of forward kernel ``forward`` made now gets the deterministic backward."""
    return forward in _always_deterministic or torch.are_deterministic_algorithms_enabled()


def backward_handle(forward: int, seq_k: int = 0, deterministic: bool = False) -> int:
    """The backward kernel (``deterministic``: its variant with ordered dQ adds) of forward kernel
    ``forward`` for key length ``seq_k``'s bucket (tuned winners differ per bucket; the backward's CTAs
    own key blocks, so the key length sets its grid), built and loaded on first use. A symbolic length
    picks its bucket under guards (:func:`flashgen.policy.seq_bucket`)."""
    key = (forward, seq_bucket(seq_k) if seq_k else 0, bool(deterministic))
    handle = _handles.get(key)
    if handle is None:
        with _lock:
            handle = _handles.get(key)
            if handle is None:
                factory = _factories.get(forward)
                if factory is None:
                    raise RuntimeError(f"flashgen: forward kernel {forward} has no backward registered; "
                                       "differentiate calls of the objects flashgen.compile returns")
                handle = _handles[key] = factory(seq_k, key[2])
    return handle


def needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd records a call with these inputs."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _launchable(t: torch.Tensor) -> torch.Tensor:
    """``t`` if the kernels can read it (contiguous d_head, rows 16-byte aligned), else a contiguous copy:
    incoming gradients may be expanded or sliced (``o.sum().backward()`` gives stride 0)."""
    if t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1]) and t.storage_offset() % 8 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, kernel, softmax_scale, mask_offset, window_left, window_right, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.call = (kernel, softmax_scale, mask_offset, window_left, window_right)
    ctx.deterministic = deterministic(kernel)  # decided at the forward call, as torch's own setting is read
    ctx.set_materialize_grads(False)  # an unused lse (or o) gets no zero-filled gradient


def _operands(ctx, op: str, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
    """(dout, q, k, v, out, lse, dlse) for a backward operator from the saved tensors of a call of ``op``."""
    q, k, v, out, lse = ctx.saved_tensors[:5]
    if lse.numel() == 0:
        raise RuntimeError(f"flashgen::{op} was called with return_lse=False, so its backward has no "
                           "log-sum-exp to recompute the probabilities from; flashgen's callables pass "
                           "return_lse=True themselves when a call needs gradients")
    # the wgmma backward reads q, k, v and dO through tensor maps (rows 16-byte aligned), whatever engine ran forward
    q, k, v, out = (_launchable(t) for t in (q, k, v, out))
    dout = torch.zeros_like(out) if dout is None else _launchable(dout)
    return dout, q, k, v, out, lse, None if dlse is None else dlse.float().contiguous()


def _backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
    kernel, softmax_scale, mask_offset, window_left, window_right = ctx.call
    operands = _operands(ctx, "attention", dout, dlse)
    handle = backward_handle(kernel, operands[2].shape[1], ctx.deterministic)
    dq, dk, dv = torch.ops.flashgen.attention_backward(*operands, handle, softmax_scale, mask_offset, window_left, window_right)
    return dq, dk, dv, None, None, None, None, None, None


torch.library.register_autograd("flashgen::attention", _backward, setup_context=_setup_context)


def _setup_context_mods(ctx, inputs, output) -> None:
    q, k, v, kernel, softmax_scale, mask_offset, window_left, window_right, _, mod_words, mod_tensors, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *mod_tensors)
    ctx.call = (kernel, softmax_scale, mask_offset, window_left, window_right)
    ctx.mod_words = list(mod_words)
    ctx.n_mod_tensors = len(mod_tensors)
    ctx.deterministic = deterministic(kernel)
    ctx.set_materialize_grads(False)


def _backward_mods(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None):
    """``flashgen::attention_mods``'s backward: the backward kernel built with the same score_mod / mask_mod, on
    the forward call's values (the captured tensors as they were saved: an in-place change after the forward
    is caught by autograd's version check)."""
    mod_tensors = list(ctx.saved_tensors[5:])
    kernel, softmax_scale, mask_offset, window_left, window_right = ctx.call
    operands = _operands(ctx, "attention_mods", dout, dlse)
    q, k = operands[1], operands[2]
    handle = backward_handle(kernel, k.shape[1], ctx.deterministic)
    maker = _block_masks.get(kernel)  # a mask_mod's: the backward skips the key blocks' empty query blocks
    block_mask = maker(handle, q, k, ctx.mod_words, mod_tensors) if maker is not None else None
    dq, dk, dv = torch.ops.flashgen.attention_backward_mods(
        *operands, handle, softmax_scale, mask_offset, window_left, window_right, ctx.mod_words, mod_tensors, block_mask)
    # no gradient for kernel, scale, offsets, return_lse, mod_words; a list for the tensor list; none for the block mask.
    # An empty int list is a list to torch's check of the structure (a mask_mod without numbers), a full one a leaf
    words_grad = None if ctx.mod_words else []
    return (dq, dk, dv) + (None,) * 6 + (words_grad, [None] * ctx.n_mod_tensors, None)


torch.library.register_autograd("flashgen::attention_mods", _backward_mods, setup_context=_setup_context_mods)
