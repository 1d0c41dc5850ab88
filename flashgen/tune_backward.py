"""``flashgen tune --passes bwd``: time backward kernels per sequence bucket and remember the best.

Candidates: the backward configs given, else the backward tuning space of each dtype and head size
(the GPU's engine's, :func:`flashgen.dsl.backward_config.tuning_space`), less those whose shared
memory this GPU's blocks cannot have and those that spill or serialize their wgmma on its arch: ptxas's
report of each kernel compiled alone (:mod:`flashgen.check`, on the CPU, cached) drops them before anything
is built, as such a kernel only loses (``--allow-spills`` keeps them). A candidate whose first launch
fails drops out of its bucket.

Timing: per (dtype, d_head, length), one forward of the kernel ``compile("auto")`` runs gives o and
the lse; each candidate is then timed alone, by calling ``flashgen::attention_backward`` with its
kernel handle on those tensors: what the autograd formula runs (:mod:`flashgen.autograd`), without
autograd's bookkeeping. One timing each, then the finalists in interleaved rounds
(:func:`flashgen.bench.pick_fastest`). TFLOP/s count the backward as 2.5 forwards
(:data:`flashgen.bench_passes.FLOP_FACTOR`).

Check: the winner's dq, dk, dv on fresh inputs against float64
(:func:`flashgen.bench_passes.gradient_errors`, FlashAttention's bound
:func:`flashgen.reference.tolerance`); a winner that fails gives way to the next finalist, and a
bucket none of whose finalists pass keeps what the cache had.

Cache: ``bwd/<bucket>`` (``bwd/<bucket>/masked`` with ``--causal``) beside the forward's keys
(:func:`flashgen.policy.backward_bucket_key`), read by :func:`flashgen.policy.backward_lookup`.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Sequence

from . import engines
from .attention.score_mask import key_window
from .dsl.backward_config import BackwardConfig
from .dsl.dtypes import DType
from .policy import backward_bucket_key, load_cache, replaced_faster, save_cache, seq_bucket
from .targets import of_capability



def log(msg: str) -> None:
    print(f"[flashgen tune] {msg}", file=sys.stderr, flush=True)


def default_space(dtypes: Sequence[str], d_heads: Sequence[int], masked: bool,
                  capability: tuple[int, int]) -> list[BackwardConfig]:
    """The backward tuning space of each dtype and head size (causal configs when ``masked``), of the first
    engine the GPU runs (preferred first) whose backward takes the head size."""
    mask = "causal" if masked else "none"
    out: list[BackwardConfig] = []
    for dtype in dtypes:
        for d_head in d_heads:
            for engine in engines.runnable_on(of_capability(capability)):
                space = engine.backward.tuning_space(DType.parse(dtype), d_head, mask) if engine.backward else []
                if space:
                    out += space
                    break
    return out


def spill_free(cfgs: Sequence[BackwardConfig], capability: tuple[int, int],
               check: Callable[..., list] | None = None) -> tuple[list[BackwardConfig], dict[str, str]]:
    """The configs that ptxas compiles for the GPU's arch without local memory (spills or a stack frame) and
    without serializing their wgmma (C7512: each waits for the one before, for want of registers), and
    ``{short form: why}`` of the others; ``check``: :func:`flashgen.check.check_configs`."""
    if check is None:
        from .check import check_configs as check
    arch = of_capability(capability).name
    results = {r.cfg: r for r in check(cfgs, [arch])}
    kept, dropped = [], {}
    for cfg in cfgs:
        r = results.get(cfg)
        if r is None:
            dropped[cfg.short_form()] = f"cannot be compiled for {arch}"
        elif not r.ok:
            dropped[cfg.short_form()] = f"does not compile for {arch}:\n{r.log.strip()}"
        elif not r.stats.clean:
            s = r.stats
            dropped[cfg.short_form()] = (f"spills on {arch}: {s.spill_stores} B stores, {s.spill_loads} B loads, "
                                         f"{s.stack_frame} B stack")
        elif r.stats.serialized:
            dropped[cfg.short_form()] = f"ptxas serialized its wgmma on {arch} (too few registers)"
        else:
            kept.append(cfg)
    return kept, dropped


def fitting(cfgs: Sequence[BackwardConfig], capability: tuple[int, int]) -> tuple[list[BackwardConfig], dict[str, str]]:
    """The configs whose shared memory one block of the GPU may have (the config's own rule allows the
    largest target's), and ``{short form: why}`` of the others."""
    target = of_capability(capability)
    kept = [c for c in cfgs if c.smem_bytes <= target.smem_per_block]
    return kept, {c.short_form(): f"needs {c.smem_bytes} B of shared memory; {target.name} blocks may have "
                                  f"{target.smem_per_block}" for c in cfgs if c not in kept}


def runnable(fns: dict[str, Callable[[], Any]], what: str) -> dict[str, Callable[[], Any]]:
    """``fns`` less those whose first call raises (a launch the GPU refuses), each logged."""
    ok = {}
    for name, fn in fns.items():
        try:
            fn()
        except (RuntimeError, ValueError) as exc:
            log(f"{what}: {name} does not run: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}")
            continue
        ok[name] = fn
    return ok


def choose(fns: dict[str, Callable[[], Any]], check: Callable[[str], "str | None"], rounds: int, finalists: int,
           timer: Callable | None = None) -> tuple["str | None", dict[str, float], dict[str, str]]:
    """``(winner, {finalist: median ms}, {finalist: why its check failed})``: the fastest finalist of
    :func:`flashgen.bench.pick_fastest` whose ``check(name)`` passes (returns None), tried fastest first;
    winner None when none passes."""
    from .bench import pick_fastest

    _, medians = pick_fastest(fns, rounds, finalists, **({"timer": timer} if timer else {}))
    failed: dict[str, str] = {}
    for name in sorted(medians, key=medians.get):
        why = check(name)
        if why is None:
            return name, medians, failed
        failed[name] = why
    return None, medians, failed


class Bucket:
    """One timed shape: (batch, seq, heads, d_head) inputs of a dtype, o and lse from ``forward`` (default:
    ``compile("auto")``, the forward whose gradients the tuned kernels compute), and the backward call
    of a kernel handle on them."""

    def __init__(self, dtype: DType, d_head: int, batch: int, seq: int, heads: int, causal: bool, seed: int,
                 forward: Callable | None = None) -> None:
        import torch

        from .runtime import compile as fg_compile

        forward = forward or fg_compile("auto")
        gen = torch.Generator(device="cuda").manual_seed(seed)
        shape = (batch, seq, heads, d_head)
        self.q, self.k, self.v, self.dout = (torch.randn(shape, device="cuda", dtype=dtype.torch, generator=gen)
                                             for _ in range(4))
        self.causal = causal
        self.scale = 1.0 / math.sqrt(d_head)
        with torch.no_grad():
            self.out, self.lse = forward(self.q, self.k, self.v, causal=causal, return_lse=True)

    def call(self, handle: int) -> Callable[[], Any]:
        """The timed call: dq, dk, dv through backward kernel ``handle`` (no lse gradient, as ``o.backward``)."""
        import torch

        op, (left, right) = torch.ops.flashgen.attention_backward, key_window(self.causal, None)  # none or top-left causal
        args = (self.dout, self.q, self.k, self.v, self.out, self.lse, None, handle, self.scale, 0, left, right)
        return lambda: op(*args)

    def check(self, handle: int) -> "str | None":
        """None when the gradients of kernel ``handle`` are finite and within FlashAttention's bound of
        float64 (:func:`flashgen.bench_passes.gradient_errors`), else the errors."""
        import torch

        from .bench_passes import gradient_errors
        from .reference import tolerance

        grads = self.call(handle)()
        errors = gradient_errors(grads, self.q, self.k, self.v, self.dout, causal=self.causal, softmax_scale=self.scale)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if finite and all(e <= tolerance(base) for e, base in errors.values()):
            return None
        return ("non-finite gradients; " if not finite else "") + ", ".join(
            f"{n} error {e:.3g} (bound {tolerance(base):.3g})" for n, (e, base) in errors.items())


def tune_bucket(handles: dict[str, int], dtype: DType, d_head: int, seq: int, heads: int, causal: bool,
                rounds: int, finalists: int, forward: Callable) -> "dict[str, Any] | None":
    """Time ``handles`` ({short form: backward kernel handle}) at one length on o and lse of ``forward`` and
    check the winner on fresh inputs: the cache entry, or None when no finalist's gradients pass."""
    from .bench import SHAPES, attention_flops, ranking
    from .bench_passes import FLOP_FACTOR

    batch = dict(SHAPES)[seq_bucket(seq)]
    timed = Bucket(dtype, d_head, batch, seq, heads, causal, seed=seq, forward=forward)
    fresh = Bucket(dtype, d_head, 1, seq, heads, causal, seed=seq + 1, forward=forward)  # the timing's gradients cannot pass
    what = f"{dtype.value} d{d_head} seq {seq}{' causal' if causal else ''} backward"
    fns = runnable({name: timed.call(h) for name, h in handles.items()}, what)
    if not fns:
        log(f"{what}: no candidate runs; the cache keeps what it had")
        return None
    name, medians, failed = choose(fns, lambda n: fresh.check(handles[n]), rounds, finalists)
    for bad, why in failed.items():
        log(f"{what}: {bad} FAILED the gradient check: {why}")
    if name is None:
        log(f"{what}: no finalist passed the gradient check; the cache keeps what it had")
        return None
    flops = attention_flops(batch, heads, seq, seq, d_head, causal) * FLOP_FACTOR["bwd"]
    tflops = flops / medians[name] / 1e9
    log(f"{what}: best {tflops:.0f} TFLOP/s of {len(fns)} (median of {rounds} rounds among {len(medians)} finalists): {name}")
    for line in ranking(medians, flops):
        log(line)
    return {"config": name, "tflops": round(tflops, 1), "candidates": len(fns),
            "finalists": {n: round(flops / ms / 1e9, 1) for n, ms in medians.items()}, "time": time.strftime("%Y-%m-%d")}


def store(cache: dict, gpu: str, cfg: BackwardConfig, seq: int, causal: bool, entry: dict) -> str:
    """Put a winner's ``entry`` where :func:`flashgen.policy.backward_lookup` reads it; returns its name."""
    key = backward_bucket_key(seq, causal)
    bucket = cache.setdefault(gpu, {}).setdefault(cfg.dtype.value, {}).setdefault(str(cfg.d_head), {})
    note = replaced_faster(bucket.get(key), entry)
    if note:
        log(f"{cfg.dtype.value}/d{cfg.d_head}/{key}: {note}")
    bucket[key] = entry
    return f"{cfg.dtype.value}/d{cfg.d_head}/{key}"


def tune_backward(cfgs: list[BackwardConfig], seqs: list[int], heads: int = 16, rounds: int = 3, finalists: int = 4,
                  causal: bool = False, allow_spills: bool = False) -> dict[str, Any]:
    """Drop the configs that spill here (unless ``allow_spills``), build the rest, time them per (dtype,
    d_head, sequence bucket) and store the checked winners in the tune cache; ``{name: entry}`` of those."""
    import torch

    from .build import build, build_many
    from .runtime import _load  # loads a built library (rebuilding a damaged cache entry)
    from .runtime import compile as fg_compile

    capability = tuple(torch.cuda.get_device_capability())
    cfgs, dropped = fitting(cfgs, capability)
    if not allow_spills:
        log(f"asking ptxas which of {len(cfgs)} backward configs spill on {of_capability(capability).name}")
        cfgs, spilled = spill_free(cfgs, capability)
        dropped.update(spilled)
    for name, why in dropped.items():
        log(f"dropped {name}: {why}")
    if not cfgs:
        log("no backward config left to time")
        return {}
    log(f"building {len(cfgs)} backward configs")
    failures = build_many(cfgs, capability)
    ok = [c for c in cfgs if c.short_form() not in failures]
    gpu, cache, found, forward = torch.cuda.get_device_name(), load_cache(), {}, fg_compile("auto")
    for dtype, d_head in dict.fromkeys((c.dtype, c.d_head) for c in ok):
        group = [c for c in ok if (c.dtype, c.d_head) == (dtype, d_head)]
        handles = {c.short_form(): _load(build(c, capability), False) for c in group}
        for seq in seqs:
            entry = tune_bucket(handles, dtype, d_head, seq, heads, causal, rounds, finalists, forward)
            if entry is not None:
                cfg = next(c for c in group if c.short_form() == entry["config"])
                found[store(cache, gpu, cfg, seq, causal, entry)] = entry
    save_cache(cache)
    return found
