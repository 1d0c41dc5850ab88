"""``flashgen.compile(cfg)``: a built kernel as a checked, torch-callable attention op.

Inputs are ``(batch, seq, heads, d_head)`` tensors (any strides with a contiguous,
16-byte aligned ``d_head``; a ``(batch, heads, seq, d)`` tensor passes as its
``.transpose(1, 2)`` view). Calls whose inputs require grad are differentiable
(:mod:`flashgen.autograd`). Every unsupported input is refused before launch, in C++ by
the launcher (see :mod:`flashgen.launcher`): eager calls go straight to its Python entry
points, whose failures :meth:`Attention.check` turns into an :class:`InputError` that says
what is supported; calls traced by ``torch.compile`` go through its operators.
"""
from __future__ import annotations

import functools
import math
import types
import weakref
from typing import Any

import torch

from . import autograd, cache, launcher, tracing
from .attention.scheduler import orders_tiles
from .attention.score_mask import key_window
from .mods.cache import current
from .mods.call_values import CallValues
from .mods.copies import stable_copy
from .mods.diagonal import combine
from .mods.kernel_mods import KernelMods, prepare_mods
from .build import BuildError, Built, build
from .engines import ENGINES, engine_of
from .targets import of_capability
from .dsl import configs
from .dsl.backward_config import BackwardConfig
from .dsl.config import ConfigError, KernelConfig
from .policy import backward_lookup, lookup, seq_bucket


class InputError(ValueError):
    """An input the kernel cannot take; the message says what is supported."""


@functools.lru_cache(maxsize=None)
def device_facts(index: int) -> tuple[str, tuple[int, int]]:
    """(name, compute capability) of a CUDA device, asked once per device."""
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


_attention = torch.ops.flashgen.attention.default
_attention_out = torch.ops.flashgen.attention_out.default
_attention_mods = torch.ops.flashgen.attention_mods.default
_mask_blocks = torch.ops.flashgen.mask_blocks.default
#: Block masks an Attention with a mask_mod keeps before it starts afresh.
_MAX_BLOCK_MASKS = 32
#: (score_mod, mask_mod) pairs an Attention keeps the fast path of (_mods_fast) before it starts afresh.
_MAX_MOD_CALLS = 64
#: The launcher's numbers for a kernel's score mask (its dispatch keys hold them).
_MASK_CODES = {"none": 0, "causal": 1, "window": 2}


def _score_mask(causal: bool, window: "tuple[int, int] | None") -> tuple[str, int, int]:
    """The kernel's score mask and its (left, right) window for a call's ``causal`` / ``window``."""
    try:
        left, right = key_window(causal, window)
    except ValueError as e:
        raise InputError(str(e)) from None
    return ("causal" if causal else "none" if window is None else "window"), left, right


def _load(built: Built, verbose: bool) -> int:
    """The launcher handle of a built kernel; an entry whose library does not load is rebuilt once."""
    def load(b: Built) -> int:
        return launcher.load_kernel(b.library, b.name, b.cfg.short_form(), b.cfg.dtype.torch, b.cfg.d_head,
                                    backward=isinstance(b.cfg, BackwardConfig))

    try:
        return load(built)
    except RuntimeError as exc:
        if not built.cache_hit:
            raise BuildError(f"the freshly built library {built.library} does not load: {exc}") from exc
        cache.discard(built.directory, f"damaged cache entry {built.directory} (its library does not load: {exc}): rebuilding it")
        return load(build(built.cfg, built.capability, verbose=verbose))


#: the largest finite fp32 number, and the smallest whose fp32 inverse is finite
_FLT_MAX = 3.4028234663852886e38
_FLT_MIN_INVERTIBLE = 2.938737e-39


class Attention:
    """A compiled kernel: ``attn(q, k, v, out=None, softmax_scale=None, causal=False, window=None, ...) -> o``."""

    def __init__(self, built: Built, verbose: bool = False, deterministic: bool = False,
                 backward_engine: str | None = None) -> None:
        self.built = built
        self.cfg: KernelConfig = built.cfg
        self.verbose = verbose
        self.deterministic = deterministic  # every backward deterministic, not only under torch's setting
        self.backward_engine = backward_engine  # the engine of every backward (None: the tuned or preferred one)
        self._handle = _load(built, verbose)
        self._native = launcher.native()
        self._mask = self.cfg.mask
        self._scale = 1.0 / math.sqrt(self.cfg.d_head)
        self._dtype = self.cfg.dtype.torch
        self._variants: dict[str, Attention] = {}
        self._mod_variants: dict[str, Attention] = {}  # by KernelMods.key: same structure, same kernel
        self._block_masks: dict[tuple, tuple] = {}  # a mask_mod kernel's block masks (_block_mask)
        # (id(score_mod), id(mask_mod)) -> [CallValues, the variant, the last call's block mask]: _mods_fast
        self._mod_calls: dict[tuple, list] = {}
        self._checked_devices: set = set()  # devices check() passed on for calls with mods
        self._table = self._native.new_dispatch_table()  # its launcher readers of repeated calls with mods
        self._backwards: dict[BackwardConfig, int] = {}
        self._backward_cfgs: dict[int, BackwardConfig] = {}  # handle -> config (its block mask's B_r and B_c)
        masked = built.mods is not None and built.mods.mask is not None
        autograd.register(self._handle, self._load_backward, deterministic,
                          block_mask=self._backward_block_mask if masked else None)

    @property
    def compile_seconds(self) -> float:
        return self.built.compile_seconds

    def __repr__(self) -> str:
        return f"flashgen.Attention({self.cfg.short_form()!r})"

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Raise :class:`InputError` for anything the kernel does not support; on success the launcher runs
        this kernel on ``q``'s device from then on. Eager calls run it when the launcher refuses them (to
        explain why) and on their first call on a device."""
        for name, t in (("q", q), ("k", k), ("v", v)) + ((("out", out),) if out is not None else ()):
            _check_tensor(name, t, q, self._dtype, self.cfg)
        self._check_capability(q.device)
        self._native.allow_device(self._handle, _device_index(q.device))
        _check_shapes(q, k, v, out)

    def _check_capability(self, device: torch.device) -> None:
        name, (major, minor) = device_facts(_device_index(device))
        engine = engine_of(self.cfg)
        if not engine.runs_on(of_capability((major, minor))):
            raise InputError(f"{name} has compute capability {major}.{minor}; {engine.name}-engine kernels need {engine.needs}")

    def backward_config(self, seq_k: int = 0, deterministic: bool | None = None) -> BackwardConfig:
        """The backward kernel that differentiates this one (same dtype, head size and mask) for calls whose
        key length is ``seq_k``: this GPU's ``flashgen tune --passes bwd`` winner of its bucket, else the
        default (also for ``seq_k`` 0: unknown), of this object's ``backward_engine`` where it has one;
        ``deterministic`` (default: this object's setting) chooses its variant with ordered dQ adds; with a
        score_mod or mask_mod, the shape its engine builds them in (``BackwardKernels.with_mods``)."""
        gpu = device_facts(_device_index(torch.device("cuda")))[0] if seq_k else None
        try:
            cfg = backward_lookup(self.cfg.dtype, self.cfg.d_head, self.cfg.mask, self.built.capability, gpu=gpu, seq=seq_k,
                                  deterministic=self.deterministic if deterministic is None else bool(deterministic),
                                  engine=self.backward_engine)
        except ConfigError as exc:
            raise InputError(f"{self.cfg.short_form()} cannot be differentiated: {exc}") from None
        return cfg if self.built.mods is None else engine_of(cfg).backward.with_mods(cfg, self.built.mods)

    def _load_backward(self, seq_k: int, deterministic: bool) -> int:
        """Build (or load from the cache) and load the backward kernel of key length ``seq_k`` (or its
        deterministic variant): its launcher handle (one per backward config: buckets whose winners agree
        share it)."""
        cfg = self.backward_config(seq_k, deterministic)
        handle = self._backwards.get(cfg)
        if handle is None:
            built = self._build_backward(cfg)
            handle = self._backwards[cfg] = _load(built, self.verbose)
            self._backward_cfgs[handle] = built.cfg
        return handle

    def _build_backward(self, cfg: BackwardConfig) -> Built:
        """Build ``cfg`` with this kernel's mods; where the mods' code compiled into local memory or serialized
        wgmma there, the engine's shape with fewer registers (:meth:`BackwardKernels.fallback`) if it compiles
        clean: a user's function may need more registers than the examples the shapes were chosen by."""
        built = build(cfg, self.built.capability, verbose=self.verbose, mods=self.built.mods)
        smaller = engine_of(cfg).backward.fallback(cfg) if self.built.mods is not None else None
        if smaller is None or not built.register_problems():
            return built
        retry = build(smaller, self.built.capability, verbose=self.verbose, mods=self.built.mods)
        if retry.register_problems():
            return built
        if self.verbose:
            cache.warn(f"{cfg.short_form()} with {self.built.mods.describe()}: {'; '.join(built.register_problems())}; "
                       f"running {smaller.short_form()}")
        return retry

    def _variant(self, mask: str) -> "Attention":
        """The same kernel with another score mask, built on first use."""
        attn = self._variants.get(mask)
        if attn is None:
            attn = self._variants[mask] = Attention(build(self.cfg.replace(mask=mask), self.built.capability,
                                                          verbose=self.verbose), self.verbose, self.deterministic,
                                                    self.backward_engine)
        return attn

    def _with_mods(self, mods: KernelMods) -> "Attention":
        """This kernel with a score_mod / mask_mod compiled in, built on first use of their structure."""
        attn = self._mod_variants.get(mods.key)
        if attn is None:
            built = build(self.cfg, self.built.capability, verbose=self.verbose, mods=mods)
            attn = self._mod_variants[mods.key] = Attention(built, self.verbose, self.deterministic, self.backward_engine)
        return attn

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
        score_mod=None,
        mask_mod=None,
    ):
        """Attention of (batch, seq, heads, d_head) tensors; k/v may have fewer heads (GQA/MQA).

        ``causal``: query i sees keys j <= i + offset; ``window=(left, right)``: keys in
        [i + offset - left, i + offset + right] (-1 = unbounded); ``align`` chooses offset 0
        ("top_left", PyTorch's ``is_causal``) or seq_k - seq_q ("bottom_right", FlashAttention's).
        A kernel compiled without that mask builds its masked variant on first use.
        ``softmax_scale``: a positive number (default ``1 / sqrt(d_head)``).
        ``return_lse``: also return the fp32 log-sum-exp of the scaled scores, (batch, heads, seq_q);
        rows without any kept key give o = 0 and lse = -inf.

        Differentiable: when q, k or v requires grad (and grad mode is on), autograd records the call and
        its backward kernel (same dtype, head size and mask; the tuned one of the key length's bucket) is
        built with the first such call. Gradients reach q, k and v through o and through the returned lse;
        ``out=`` cannot be differentiated. The backward is deterministic when this object was compiled
        ``deterministic=True`` or the call is made under ``torch.use_deterministic_algorithms(True)``.

        ``score_mod(score, b, h, q_idx, kv_idx)`` / ``mask_mod(b, h, q_idx, kv_idx)``: FlexAttention's
        functions, traced once per function (:mod:`flashgen.mods`) and compiled into a variant of this kernel
        (one per structure: new captured values reuse it). score_mod sees the scaled score; a key is kept where
        the causal/window rule and mask_mod both keep it. Such calls are differentiable too (with respect to q, k
        and v, through the score_mod; captured tensors that require grad are refused). A mask_mod's diagonal
        conjuncts with literal offsets (``q_idx >= kv_idx``, ``q_idx - kv_idx <= 128``) run as the built-in window
        (:mod:`flashgen.mods.diagonal`): a causal mask_mod runs this kernel's causal variant, without mods.
        """
        mask, left, right = _score_mask(causal, window)
        split = None
        if mask_mod is not None and (torch.compiler.is_compiling() or id(mask_mod) in _SPLITTING):
            mask_mod, mask, left, right, align, split = _diagonal(q, k, mask_mod, mask, left, right, align)
        attn = self if mask == self._mask else self._variant(mask)
        if score_mod is not None or mask_mod is not None:
            result = attn._run_mods(q, k, v, out, softmax_scale, left, right, align, return_lse, score_mod, mask_mod, split)
            if result is _SPLIT_FIRST:  # now known to split: this call again, split before any fast path
                return self(q, k, v, out, softmax_scale, causal, window, align, return_lse, score_mod, mask_mod)
            return result
        return attn._launch(q, k, v, out, softmax_scale, left, right, align, return_lse)

    def _run_mods(self, q, k, v, out, softmax_scale, left, right, align, return_lse, score_mod, mask_mod, split=None):
        """A call with a score_mod / mask_mod: through the launcher's reader of the pair (``call_mods_again``, the values
        read in C++ as :class:`CallValues` reads them), else :meth:`_mods_fast`, else :meth:`_launch_mods`. ``split``
        as :func:`_diagonal_call` says: a call that keeps a mask_mod with diagonal conjuncts whole (False) takes the
        full path, since the readers of the pair may hold its rest alone (what calls that split it run).
        :data:`_SPLIT_FIRST` where the fast paths missed and the mask_mod turns out to have diagonal conjuncts not
        known before (the caller splits the call and makes it again)."""
        if out is None and not torch.compiler.is_compiling() and split is not False:
            try:
                result = self._native.call_mods_again(self._table, q, k, v, softmax_scale, left, right, align, return_lse,
                                                      score_mod, mask_mod)
            except (RuntimeError, ValueError, TypeError):
                result = None  # the paths below explain it
            if result is None:
                result = self._mods_fast(q, k, v, softmax_scale, left, right, align, return_lse, score_mod, mask_mod)
            if result is not None:
                return result
        if split is None and mask_mod is not None and not torch.compiler.is_compiling() and _newly_splitting(mask_mod):
            return _SPLIT_FIRST
        return self._launch_mods(q, k, v, out, softmax_scale, left, right, align, return_lse, score_mod, mask_mod,
                                 split is True)

    @torch.compiler.disable  # the mods are traced in Python: torch.compile runs this call eagerly
    def _launch_mods(self, q, k, v, out, softmax_scale, left, right, align, return_lse, score_mod, mask_mod,
                     diagonal: bool = False):
        """Run this kernel's variant built with the call's score_mod / mask_mod, on this call's captured values;
        ``diagonal``: the mask_mod's rest alone (its diagonal conjuncts are the call's built-in window)."""
        mods, (score_args, mask_args) = prepare_mods(score_mod, mask_mod, diagonal)
        if out is not None:
            raise InputError("out= is not supported with score_mod / mask_mod; call without out=")
        attn = self._with_mods(mods)
        if not isinstance(q, torch.Tensor) or q.device not in attn._checked_devices:  # the first call on a device
            attn.check(q, k, v)
            attn._checked_devices.add(q.device)
        limit = mods.index_limit
        if (limit is not None and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k))
                and max(q.shape[1], k.shape[1]) > limit):
            raise InputError(f"{mods.describe()}: this kernel converts index arithmetic to float exactly for sequences of up "
                             f"to {limit} tokens, got seq_q {q.shape[1]}, seq_k {k.shape[1]}")
        differentiate = autograd.needs_grad(q, k, v)
        if differentiate:  # its backward (built with the same mods) is built now: a head size it cannot take fails here
            autograd.backward_handle(attn._handle, k.shape[1], autograd.deterministic(attn._handle))
        words, tensors = mods.pack(score_args, mask_args)
        tensors = [stable_copy(t, t.dtype, q.device) for t in tensors]  # on q's device: copied once per version
        scale = _softmax_scale(attn._scale, softmax_scale)
        try:  # the operator checks every input in C++
            offset = _mask_offset(align, q, k)
            block_mask = attn._block_mask(mods, q, k, words, tensors, (offset, left, right)) if mods.mask is not None else None
            o, lse = _attention_mods(q, k, v, attn._handle, scale, offset, left, right,
                                     return_lse or differentiate, words, tensors, block_mask)
        except (RuntimeError, ValueError, TypeError):
            attn.check(q, k, v)  # raises the InputError that explains a refused input
            raise
        self._remember_mods(mods, score_mod, mask_mod, attn)
        return (o, lse) if return_lse else o

    def _remember_mods(self, mods: KernelMods, score_mod, mask_mod, attn: "Attention") -> None:
        """Keep the fast paths (:meth:`_mods_fast`, the launcher's reader) of a pair of functions that ran through
        ``attn``; the readers this replaces or drops forget what they hold."""
        if CallValues.usable(score_mod, mask_mod):
            key = (id(score_mod), id(mask_mod))
            replaced = self._mod_calls.pop(key, None)
            if replaced is not None:
                if replaced[1] is attn and replaced[0].mods == mods and replaced[0].serves(score_mod, mask_mod):
                    self._mod_calls[key] = replaced  # the same traces (a call to differentiate): its state stays valid
                    return
                replaced[0].forget()
            if len(self._mod_calls) >= _MAX_MOD_CALLS:
                for entry in self._mod_calls.values():
                    entry[0].forget()
                self._mod_calls.clear()
            values = CallValues(mods, score_mod, mask_mod)
            self._mod_calls[key] = [values, attn, None]
            if values.attach(self._native, attn._handle) is not None:
                self._native.remember_mods(self._table, None, 0, score_mod, mask_mod, values.native)

    def mods_reader(self, score_mod, mask_mod):
        """The launcher's reader of calls with this pair of functions (None: none kept)."""
        entry = self._mod_calls.get((id(score_mod), id(mask_mod)))
        return entry[0].native if entry is not None and entry[0].serves(score_mod, mask_mod) else None

    def _mods_fast(self, q, k, v, softmax_scale, left, right, align, return_lse, score_mod, mask_mod):
        """An eager call with the functions of an earlier call (same objects, same code): their values re-read
        (:class:`CallValues`) and the variant launched through the launcher's eager entry, no tracing and no
        dispatcher. None where :meth:`_launch_mods` must run: a new pair, a stale or refused value, an unchecked
        device or a call to differentiate (the launcher's entry answers None for both), or any input the launcher
        refuses (that path explains it)."""
        entry = self._mod_calls.get((id(score_mod), id(mask_mod)))
        if entry is None or not entry[0].serves(score_mod, mask_mod):
            return None
        reader, attn, last = entry
        if not isinstance(q, torch.Tensor):
            return None
        device = q.device
        values = reader.read(device)
        if values is None:
            return None
        words, tensors = values
        try:
            block_mask = None
            if reader.mods.mask is not None:  # the last call's, for the same values and sizes
                state = (reader.epoch, q.shape, k.shape[1], device, align, left, right)
                if last is not None and last[0] == state:
                    block_mask = last[1]
                else:
                    block_mask = attn._block_mask(reader.mods, q, k, words, tensors, (_mask_offset(align, q, k), left, right))
                    entry[2] = (state, block_mask)
            reader.publish(device, q, k, words, block_mask)  # the launcher's reader serves the next such call
            return self._native.call_mods(q, k, v, attn._handle, softmax_scale, left, right, align, return_lse, words,
                                          tensors, block_mask)
        except (RuntimeError, ValueError, TypeError):
            return None

    def _backward_block_mask(self, handle: int, q, k, words: list, tensors: list):
        """The transposed block mask of backward kernel ``handle`` (one this object loaded: built with its mods) for a
        call with these sizes and the forward's values (:meth:`_block_mask`'s cache)."""
        return self._block_mask(self.built.mods, q, k, words, tensors, backward=handle)

    def _block_mask(self, mods: KernelMods, q, k, words: list, tensors: list, built_in: tuple = (0, -1, -1),
                    backward: "int | None" = None):
        """The mask_mod's block mask for this call's sizes and values, made on the GPU once per (kernel, sizes,
        values, captured tensors' addresses and versions, the built-in mask's ``built_in`` = (diagonal offset,
        window left, right): they weigh the tiles of its tile order) and kept (a few dozen of them at most);
        ``backward``: the transposed one of that backward kernel (a handle of :meth:`_load_backward`), with its
        block sizes (its callers pass no ``built_in``: the transposed mask has no tile order)."""
        # only the mask_mod's own values matter (KernelMods.pack: scalars score then mask, tensors likewise); a
        # tensor is named by identity (checked through a weak reference: a new tensor that the allocator places at
        # a dead one's address, of the same version, is another tensor), version and address
        mask = mods.mask
        first = len(mods.score.scalars) if mods.score is not None else 0
        q_shape, k_shape = q.shape, k.shape
        key = [backward, mask.key, q_shape, k_shape[1], q.device, built_in, *words[first:first + len(mask.scalars)]]
        mask_tensors = tensors[len(tensors) - len(mask.tensors):] if mask.tensors else ()
        for t in mask_tensors:
            key += (id(t), t._version, t.data_ptr())
        key = tuple(key)
        found = self._block_masks.get(key)
        if found is not None and _same_objects(found[1], mask_tensors):
            return found[0]
        if len(self._block_masks) >= _MAX_BLOCK_MASKS:
            self._block_masks.clear()
        cfg = self.cfg if backward is None else self._backward_cfgs[backward]
        shape = mods.block_mask_shape(q_shape[0], q_shape[2], q_shape[1], k_shape[1], cfg.B_r, cfg.B_c, transposed=backward is not None,
                                      tile_order=backward is None and orders_tiles(cfg.persistent, True))
        made = _mask_blocks(q, k, self._handle if backward is None else backward, list(shape), words, tensors, *built_in)
        self._block_masks[key] = (made, [weakref.ref(t) for t in mask_tensors])
        return made

    def _launch(self, q, k, v, out, softmax_scale, left: int, right: int, align: str, return_lse: bool):
        """Run this kernel (its mask is the call's). Eager calls are checked by the launcher, and on a failed
        check (or a device not yet checked for this kernel) by :meth:`check`; traced calls by the operator
        when the graph runs."""
        if torch.compiler.is_compiling():
            return _op_launch(self._handle, self._scale, q, k, v, out, softmax_scale, left, right, align, return_lse)
        args = (q, k, v, out, self._handle, softmax_scale, left, right, align, return_lse)
        result = self._eager(args)
        if result is None:  # the first call on this device, or a call to differentiate: check everything
            self.check(q, k, v, out)
            if autograd.needs_grad(q, k, v):
                return _op_launch(self._handle, self._scale, q, k, v, out, softmax_scale, left, right, align, return_lse)
            result = self._eager(args)
        return result

    def _eager(self, args: tuple):
        """The launcher's eager entry point on ``args``; a check it fails raises the InputError explaining it."""
        try:
            return self._native.call(*args)
        except (TypeError, ValueError) as exc:  # a check failed in the launcher
            self.check(*args[:4])  # raises the InputError that explains it
            raise InputError(str(exc)) from None


def _diagonal_call(q, k, mask_mod, mask: str, left: int, right: int, align: str) -> tuple:
    """A call's mask_mod with its diagonal conjuncts run as the built-in rule (:mod:`flashgen.mods.diagonal`):
    ``(mask_mod, mask, left, right, align, split)``. ``split`` True: the diagonal conjuncts became the top-left
    window ``(left, right)`` of ``mask`` (the call's own causal / window intersected in), ``mask_mod`` is None where
    nothing else is left (the call runs without mods) and the kernel holds the rest (:func:`prepare_mods`'s
    ``diagonal``). None: no diagonal conjunct, or inputs the call path refuses; False: this call keeps the mask_mod
    whole, where its own window is aligned bottom-right on unequal lengths (no top-left window holds both) or
    its lengths are past those for which the split is exact. Either way the arguments come back as given."""
    found = _diagonal_of(mask_mod)  # None for what is not a function: the call path explains what it refuses
    if found is None or not (align in ("top_left", "bottom_right") and isinstance(q, torch.Tensor)
                             and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4):
        return mask_mod, mask, left, right, align, None
    diagonal, rest = found
    seq_q, seq_k = q.size(1), k.size(1)
    if not diagonal.exact_for(seq_q, seq_k) or (mask != "none" and align != "top_left" and seq_q != seq_k):
        return mask_mod, mask, left, right, align, False
    new_left, new_right = diagonal.window if mask == "none" else combine(diagonal.window, (left, right))
    kind = "causal" if (new_left, new_right) == (-1, 0) else "window"
    return (mask_mod if rest is not None else None), kind, new_left, new_right, "top_left", True


#: id -> weak reference of each live mask_mod whose trace has diagonal conjuncts: its calls are split before any
#: fast path (the launcher's readers of a split call hold the rest of the mask_mod alone); a mask_mod not in it
#: reaches the fast paths without a look-up of its trace
_SPLITTING: dict = {}
#: :meth:`Attention._run_mods`'s answer for a call to make again, split
_SPLIT_FIRST = object()


def _splitting(mask_mod) -> None:
    """Put ``mask_mod`` in :data:`_SPLITTING` (until it dies)."""
    key = id(mask_mod)
    if key not in _SPLITTING:
        _SPLITTING[key] = weakref.ref(mask_mod, lambda _, key=key: _SPLITTING.pop(key, None))


def _diagonal_of(mask_mod) -> "tuple | None":
    """``mask_mod``'s (:class:`~flashgen.mods.diagonal.Diagonal`, rest) where it is a function whose trace has
    diagonal conjuncts (it joins :data:`_SPLITTING`), else None."""
    if type(mask_mod) is not types.FunctionType:
        return None
    found = current(mask_mod, "mask").diagonal
    if found is not None:
        _splitting(mask_mod)
    return found


def _newly_splitting(mask_mod) -> bool:
    """Whether ``mask_mod`` has diagonal conjuncts and was not in :data:`_SPLITTING` (it is now): its first call,
    or its first since its code changed."""
    return id(mask_mod) not in _SPLITTING and _diagonal_of(mask_mod) is not None


#: under torch.compile the trace cache is looked up eagerly (a graph break); eager calls skip the wrapper's cost
_diagonal_traced = torch.compiler.disable(_diagonal_call)


def _diagonal(q, k, mask_mod, mask: str, left: int, right: int, align: str) -> tuple:
    """:func:`_diagonal_call`, eager or (under torch.compile) run eagerly."""
    run = _diagonal_traced if torch.compiler.is_compiling() else _diagonal_call
    return run(q, k, mask_mod, mask, left, right, align)


def _same_objects(refs: list, objects) -> bool:
    """Whether each weak reference still points to the object in the same place."""
    for ref, obj in zip(refs, objects):
        if ref() is not obj:
            return False
    return True


def _op_launch(handle: int, default_scale: float, q, k, v, out, softmax_scale, left: int, right: int, align: str,
               return_lse: bool):
    """A call through the operators (kernel ``handle``, the call's tensors and mask window): traced calls, and
    calls autograd records (those keep the lse for the backward even when the caller does not want it)."""
    scale = _softmax_scale(default_scale, softmax_scale)
    offset = _mask_offset(align, q, k)
    differentiate = autograd.needs_grad(q, k, v)
    if differentiate:
        if out is not None:
            raise InputError("out= cannot be differentiated (the operator that writes into it has no backward); "
                             "call without out= when q, k or v requires grad")
        # built with the forward: a head size it cannot take fails at this call
        autograd.backward_handle(handle, k.shape[1], autograd.deterministic(handle))
    if out is None:
        out, lse = _attention(q, k, v, handle, scale, offset, left, right, return_lse or differentiate)
    else:
        lse = _attention_out(q, k, v, out, handle, scale, offset, left, right, return_lse)
    return (out, lse) if return_lse else out


def _softmax_scale(default: float, softmax_scale: Any) -> float:
    """A call's softmax_scale (``default`` for None), refused unless it is a positive fp32 number with a finite fp32
    inverse: the kernels keep each row's largest raw score, which is the largest scaled one only for a positive
    scale, and a score_mod that adds a bias holds it over the scale. The launcher's eager entries refuse the same."""
    if softmax_scale is None:
        return default
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        raise InputError(f"softmax_scale={softmax_scale!r}: expected a number") from None
    if not (_FLT_MIN_INVERTIBLE <= scale <= _FLT_MAX):
        raise InputError(f"softmax_scale={softmax_scale!r}: expected a positive number between {_FLT_MIN_INVERTIBLE:.3g} "
                         f"and {_FLT_MAX:.3g} (an fp32 number whose inverse is one too)")
    return scale


def _mask_offset(align: str, q: torch.Tensor, k: torch.Tensor) -> int:
    """The causal/window diagonal's offset for ``align``."""
    if align == "top_left":
        return 0
    if align == "bottom_right":
        return k.shape[1] - q.shape[1]
    raise InputError(f"align={align!r}: expected 'top_left' or 'bottom_right'")


def _check_tensor(name: str, t: Any, q: torch.Tensor, want: torch.dtype, cfg: KernelConfig) -> None:
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


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None) -> None:
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


#: Distinct (device, dtype, d_head, seq_q, mask) keys an AutoAttention remembers before it starts afresh.
_MAX_DISPATCH = 4096


class AutoAttention:
    """``compile("auto")``: the tuned config per (GPU, dtype, d_head, sequence bucket, mask), picked per call.

    Buckets without a ``flashgen tune`` result use the shipped defaults. A call's
    (device, dtype, d_head, seq_q, mask) is looked up in a dispatch table first: a hit
    asks the device nothing and reads no tuning table. A miss picks the config (asking
    the device its name and capability once per device), builds it with the call's
    mask (a causal call builds only the causal kernel) and remembers it. Under
    ``torch.compile`` the pick happens once, while tracing.
    """

    def __init__(self, verbose: bool = False, deterministic: bool = False, backward_engine: str | None = None) -> None:
        self.verbose = verbose
        self.deterministic = deterministic  # passed to every kernel it builds
        self.backward_engine = backward_engine  # likewise
        self._dispatch: dict[tuple, Attention] = {}
        self._built: dict[KernelConfig, Attention] = {}
        self._id = tracing.register(self)  # how a traced call names this object
        self._native = None  # the launcher, loaded (or built) by the first call
        self._table = -1  # the launcher's copy of the dispatch table, for eager calls

    def select(self, q: torch.Tensor, masked: bool = False) -> KernelConfig:
        """The config for ``q``'s shape (``masked``: the call applies a causal or window mask), without its mask."""
        _check_lookup(q)
        return _select(q.device, q.dtype, q.shape[3], q.shape[1], masked)

    def __call__(self, q, k, v, out=None, softmax_scale=None, causal=False, window=None, align="top_left",
                 return_lse=False, score_mod=None, mask_mod=None):
        """As :meth:`Attention.__call__`, with the kernel picked for the call's shape and mask."""
        mask, left, right = _score_mask(causal, window)
        split = None
        if mask_mod is not None and (torch.compiler.is_compiling() or id(mask_mod) in _SPLITTING):
            mask_mod, mask, left, right, align, split = _diagonal(q, k, mask_mod, mask, left, right, align)
        if score_mod is not None or mask_mod is not None:
            # a repeated call: the launcher reads its values (not one keeping a split mask_mod whole: _run_mods)
            if out is None and not torch.compiler.is_compiling() and split is not False:
                native = self._native or self._connect()
                try:
                    result = native.dispatch_mods(self._table, q, k, v, softmax_scale, _MASK_CODES[mask], left, right,
                                                  align, return_lse, score_mod, mask_mod)
                except (RuntimeError, ValueError, TypeError):
                    result = None  # the kernel's own call below explains it
                if result is not None:
                    return result
            if split is None and not torch.compiler.is_compiling() and _newly_splitting(mask_mod):
                # now known to split: this call again, split before any fast path (and before a kernel is picked)
                return self(q, k, v, out, softmax_scale, causal, window, align, return_lse, score_mod, mask_mod)
            return self._call_mods(q, k, v, out, softmax_scale, mask, left, right, align, return_lse, score_mod, mask_mod,
                                   split)
        if torch.compiler.is_compiling():  # picked once while tracing; the graph holds the kernel's handle
            # seq_bucket guards on the length's bucket, not its value
            handle = tracing.traced_pick(self._id, q.device, q.dtype, q.shape[3], seq_bucket(q.shape[1]), mask)
            return _op_launch(handle, 1.0 / math.sqrt(q.shape[3]), q, k, v, out, softmax_scale, left, right, align, return_lse)
        code = _MASK_CODES[mask]
        native = self._native or self._connect()
        try:
            result = native.dispatch(self._table, q, k, v, out, softmax_scale, code, left, right, align, return_lse)
        except (TypeError, ValueError):
            result = None  # the kernel's own call below explains it
        if result is None:  # a new shape, a call to explain, or one to differentiate
            _check_lookup(q)
            attn = self.pick(q.device, q.dtype, q.shape[3], q.shape[1], mask)
            result = attn._launch(q, k, v, out, softmax_scale, left, right, align, return_lse)
            if not autograd.needs_grad(q, k, v):  # the table serves eager calls only
                native.remember(self._table, q, code, attn._handle)
        return result

    def _call_mods(self, q, k, v, out, softmax_scale, mask: str, left: int, right: int, align: str, return_lse: bool,
                   score_mod, mask_mod, split=None):
        """A call with a score_mod / mask_mod through the picked kernel's variant with them; an eager one leaves its
        launcher reader in the dispatch table under the call's key, for ``dispatch_mods``."""
        _check_lookup(q)
        shape = q.shape
        attn = self.pick(q.device, q.dtype, shape[3], shape[1], mask, mods=True)
        result = attn._run_mods(q, k, v, out, softmax_scale, left, right, align, return_lse, score_mod, mask_mod, split)
        if out is None and not torch.compiler.is_compiling():
            reader = attn.mods_reader(score_mod, mask_mod)
            if reader is not None:
                native = self._native or self._connect()
                native.remember_mods(self._table, q, _MASK_CODES[mask], score_mod, mask_mod, reader)
        return result

    def _connect(self):
        self._native = launcher.native()
        self._table = self._native.new_dispatch_table()
        return self._native

    def pick(self, device: torch.device, dtype: torch.dtype, d_head: int, seq_q: int, mask: str,
             mods: bool = False) -> Attention:
        """The kernel for a call's (device, dtype, d_head, seq_q, mask), built on first use. ``mods``: the call has a
        score_mod or mask_mod, and takes a masked call's config: its key block (a score_mod's values need the
        registers the larger key block of long unmasked calls fills: ptxas spilled 250-440 bytes there on sm_90a;
        a mask_mod's tiles differ in length, as a causal call's: H100, seq 2048, a document mask 1.27x, prefix
        LM 1.11x, causal as a mask_mod 1.05x faster with it)."""
        key = (device, dtype, d_head, seq_q, mask, mods)
        attn = self._dispatch.get(key)
        if attn is not None:
            return attn
        cfg = _select(device, dtype, d_head, seq_q, mask != "none" or mods)
        cfg = cfg if cfg.mask == mask else cfg.replace(mask=mask)
        attn = self._built.get(cfg)
        if attn is None:
            capability = device_facts(_device_index(device))[1]
            attn = self._built[cfg] = Attention(build(cfg, capability, verbose=self.verbose), self.verbose, self.deterministic,
                                                self.backward_engine)
        if len(self._dispatch) >= _MAX_DISPATCH:
            self._dispatch.clear()
        self._dispatch[key] = attn
        return attn


def _check_lookup(q: Any) -> None:
    """InputError for a ``q`` whose shape cannot be looked up."""
    if not isinstance(q, torch.Tensor):
        raise InputError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise InputError(f"q must be 4-D (batch, seq, heads, d_head), got shape {tuple(q.shape)}")


def _select(device: torch.device, dtype: torch.dtype, d_head: int, seq_q: int, masked: bool) -> KernelConfig:
    """The tuned or default config for a call's shape on ``device``."""
    from .dsl.dtypes import DType

    try:
        fg_dtype = DType.parse(str(dtype))
    except ValueError:
        raise InputError(f"q has dtype {dtype}; flashgen kernels take float16 or bfloat16") from None
    if device.type != "cuda":
        raise InputError(f"q is on {device}; flashgen kernels run on CUDA devices")
    name, capability = device_facts(_device_index(device))
    return lookup(name, fg_dtype, int(d_head), int(seq_q), capability=capability, masked=masked)


def compile(cfg: Any, verbose: bool = False, deterministic: bool = False,  # noqa: A001
            backward_engine: str | None = None) -> "Attention | AutoAttention":
    """Build (or load from the cache) the kernel for ``cfg``: a KernelConfig, dict, YAML path or short form.

    ``"auto"`` returns an :class:`AutoAttention` that uses ``flashgen tune``'s results. ``deterministic``:
    every backward of the returned object is the deterministic one (bit-identical gradients run to run).
    ``backward_engine`` (``"mma_sync"`` or ``"wgmma"``): every backward runs that engine's kernel (its tuned
    winner, else its default) instead of the GPU's preferred one; the backward raises InputError where that
    engine does not run on the GPU or has no kernel for the call.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic={deterministic!r}: expected True or False")
    if backward_engine is not None and backward_engine not in ENGINES:
        raise ValueError(f"backward_engine={backward_engine!r}: expected None or one of {', '.join(map(repr, ENGINES))}")
    if isinstance(cfg, str) and cfg.strip() == "auto":
        return AutoAttention(verbose, deterministic, backward_engine)
    config = configs.forward(cfg, "flashgen.compile")
    return Attention(build(config, verbose=verbose), verbose, deterministic, backward_engine)
