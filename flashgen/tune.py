"""``flashgen tune``: time a config space on this GPU and remember the best per shape bucket.

The cache (``$FLASHGEN_CACHE/tune.json``) maps ``gpu name -> dtype -> d_head -> seq
bucket`` to the winning short form and its TFLOP/s; buckets tuned with ``--causal`` are
kept apart (``"4096/masked"``) and serve calls with a causal or window mask.
``flashgen.compile("auto")`` looks configs up there (:mod:`flashgen.policy`, falling back to the
shipped defaults when a bucket is missing). ``--passes bwd`` tunes the backward kernels its
gradients use (:mod:`flashgen.tune_backward`), stored under keys of their own (``"bwd/4096"``).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import engines
from .dsl.config import KernelConfig
from .policy import (BUCKETS, HOPPER_B_C, bucket_key, hopper_default, load_cache,  # noqa: F401
                     lookup, replaced_faster, save_cache, seq_bucket, tune_cache_path)
from .targets import of_capability


def log(msg: str) -> None:
    print(f"[flashgen tune] {msg}", file=sys.stderr, flush=True)


def default_space(dtypes, capability: tuple[int, int]) -> list[KernelConfig]:
    """What ``flashgen tune`` times when given no configs: the tuning space of the engine the GPU
    prefers (the one ``compile("auto")`` would otherwise pick: wgmma on sm_90a, mma.sync elsewhere)."""
    return engines.preferred(of_capability(capability)).tuning_space(dtypes)


def tune(cfgs: list[KernelConfig], seqs: list[int], heads: int = 16, rounds: int = 3, finalists: int = 4,
         causal: bool = False) -> dict[str, Any]:
    """Time the configs per (dtype, d_head, sequence bucket) and store the fastest in the cache: one
    timing each, then the ``finalists`` fastest again in ``rounds`` interleaved rounds (medians), so
    a config that was lucky once does not win (:func:`flashgen.bench.pick_fastest`). ``causal``: time
    causal attention and store the winners under the masked buckets."""
    import torch

    from .bench import SHAPES, attention_flops, pick_fastest, ranking
    from .build import build_many
    from .runtime import compile as fg_compile

    gpu = torch.cuda.get_device_name()
    log(f"building {len(cfgs)} configs")
    failures = build_many(cfgs, torch.cuda.get_device_capability())
    ok = [c for c in cfgs if c.short_form() not in failures]
    cache = load_cache()
    batch_for = dict(SHAPES)  # the benchmark's batch per sequence length
    found: dict[str, Any] = {}
    for dtype in sorted({c.dtype for c in ok}, key=lambda d: d.value):
        for d_head in sorted({c.d_head for c in ok if c.dtype == dtype}):
            group = [c for c in ok if c.dtype == dtype and c.d_head == d_head]
            for seq in seqs:
                batch = batch_for[seq_bucket(seq)]
                q, k, v = (torch.randn(batch, seq, heads, d_head, device="cuda", dtype=dtype.torch) for _ in range(3))
                out = torch.empty_like(q)
                flops = attention_flops(batch, heads, seq, seq, d_head, causal)
                # every kernel takes any length (a key tail is masked in its last block)
                fns = {cfg.short_form(): (lambda attn=fg_compile(cfg): attn(q, k, v, out=out, causal=causal)) for cfg in group}
                name, medians = pick_fastest(fns, rounds, finalists)
                best_tf = flops / medians[name] / 1e9
                log(f"{dtype.value} d{d_head} seq {seq}{' causal' if causal else ''}: best {best_tf:.0f} TFLOP/s of {len(fns)} (median of {rounds} rounds "
                    f"among {len(medians)} finalists): {name}")
                for line in ranking(medians, flops):
                    log(line)
                entry = {"config": name, "tflops": round(best_tf, 1), "candidates": len(fns),
                         "finalists": {n: round(flops / ms / 1e9, 1) for n, ms in medians.items()}, "time": time.strftime("%Y-%m-%d")}
                bucket = cache.setdefault(gpu, {}).setdefault(dtype.value, {}).setdefault(str(d_head), {})
                note = replaced_faster(bucket.get(bucket_key(seq, causal)), entry)
                if note:
                    log(f"{dtype.value}/d{d_head}/{bucket_key(seq, causal)}: {note}")
                bucket[bucket_key(seq, causal)] = entry
                found[f"{dtype.value}/d{d_head}/{bucket_key(seq, causal)}"] = entry
    save_cache(cache)
    return found


#: What ``flashgen tune`` can time (``--passes``): the forward kernels, or the backward kernels alone
#: (:mod:`flashgen.tune_backward`); the names of ``flashgen bench --passes``.
PASSES = ("fwd", "bwd")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*",
                   help="config space: YAML files, short forms or named sets; forward configs go to the fwd pass, "
                        "backward ones ('bwd(...)') to the bwd pass (default: the hopper set on compute capability "
                        "9.0, else tuning-space; for bwd, the backward tuning space of --d-heads)")
    p.add_argument("--passes", "--pass", nargs="+", choices=PASSES, default=["fwd"], metavar="PASS",
                   help="what to tune: fwd (the forward configs compile('auto') runs) and/or bwd (the backward "
                        "configs its gradients use: each timed alone, the winner's dq, dk, dv checked against "
                        "float64, stored under bwd/ keys of its own) (default: fwd)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"],
                   help="element types to tune (default: fp16 bf16)")
    p.add_argument("--d-heads", nargs="+", type=int, default=None, metavar="D",
                   help="head sizes of the backward tuning space, for --passes bwd without backward configs "
                        "(default: 128)")
    p.add_argument("--seqs", nargs="+", type=int, default=list(BUCKETS),
                   help=f"sequence lengths to tune, one per bucket (buckets: {' '.join(map(str, BUCKETS))}; default: all)")
    p.add_argument("--causal", action="store_true",
                   help="time causal attention; its winners serve compile('auto') calls with a causal or window mask")
    p.add_argument("--allow-spills", action="store_true",
                   help="bwd: time backward configs that spill too (default: drop those whose kernel ptxas "
                        "compiles with local memory or serialized wgmma for this GPU)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of the finalists (default: 3)")
    p.add_argument("--finalists", type=int, default=4, help="fastest configs of the first timing that are timed again (default: 4)")


def _check_options(args: argparse.Namespace) -> None:
    """CommandError for options that cannot work, before any GPU work."""
    from .cli import CommandError

    for flag, value in (("--rounds", args.rounds), ("--finalists", args.finalists)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    if any(s < 1 for s in args.seqs):
        raise CommandError(f"--seqs must be positive, got {' '.join(map(str, args.seqs))}")
    buckets: dict[int, int] = {}
    for seq in args.seqs:
        if seq_bucket(seq) in buckets:
            raise CommandError(f"--seqs {buckets[seq_bucket(seq)]} and {seq} fall into the same bucket ({seq_bucket(seq)}); "
                               "give one length per bucket")
        buckets[seq_bucket(seq)] = seq
    if "bwd" not in args.passes:
        for flag, given in (("--d-heads", args.d_heads is not None), ("--allow-spills", args.allow_spills)):
            if given:
                raise CommandError(f"{flag} applies to the backward pass; add --passes bwd")
    if args.d_heads is not None and any(d < 1 for d in args.d_heads):
        raise CommandError(f"--d-heads must be positive, got {' '.join(map(str, args.d_heads))}")


def split_configs(specs: list[str], passes) -> dict[str, list]:
    """``{pass: the given configs of its kind}`` (forward configs for fwd, backward ones for bwd); CommandError
    for a config whose pass is not asked for."""
    from .cli import CommandError, resolve_configs
    from .dsl.configs import kind_of

    given: dict[str, list] = {p: [] for p in PASSES}
    if specs:
        for cfg in resolve_configs(specs).configs:
            given["bwd" if kind_of(cfg) == "backward" else "fwd"].append(cfg)
    for pass_, cfgs in given.items():
        if cfgs and pass_ not in passes:
            kind = "a backward" if pass_ == "bwd" else "a forward"
            raise CommandError(f"{cfgs[0].short_form()} is {kind} config; add --passes {pass_} to tune it")
    return given


def main(args: argparse.Namespace) -> int:
    import torch

    from .cli import CommandError

    _check_options(args)
    given = split_configs(args.configs, args.passes)
    if not torch.cuda.is_available():
        raise CommandError("tune needs a CUDA GPU")
    capability = torch.cuda.get_device_capability()
    found: dict[str, Any] = {}
    if "fwd" in args.passes:
        space = given["fwd"] or default_space(args.dtypes, capability)
        space = [c for c in space if c.dtype.value in args.dtypes]
        if not space:
            raise CommandError(f"no forward config of dtype {' or '.join(args.dtypes)} to tune")
        found.update(tune(space, args.seqs, rounds=args.rounds, finalists=args.finalists, causal=args.causal))
    if "bwd" in args.passes:
        found.update(_backward_pass(args, given["bwd"], capability))
    print(f"tuned {len(found)} bucket(s); cache: {tune_cache_path()}")
    for key, entry in found.items():
        print(f"  {key:28} {entry['tflops']:7.1f} TFLOP/s  {entry['config']}")
    return 0


def _backward_pass(args: argparse.Namespace, given: list, capability: tuple[int, int]) -> dict[str, Any]:
    """The bwd pass of :func:`main`: the given backward configs (with the timed calls' mask) or the space."""
    from .cli import CommandError
    from .tune_backward import default_space as backward_space, tune_backward

    mask = "causal" if args.causal else "none"
    space = list(dict.fromkeys(c.replace(mask=mask) for c in given)) if given else \
        backward_space(args.dtypes, args.d_heads or [128], args.causal, capability)
    space = [c for c in space if c.dtype.value in args.dtypes]
    if not space:
        raise CommandError(f"no backward config of dtype {' or '.join(args.dtypes)} and d_head "
                           f"{' or '.join(map(str, args.d_heads or [128]))} to tune")
    return tune_backward(space, args.seqs, rounds=args.rounds, finalists=args.finalists, causal=args.causal,
                         allow_spills=args.allow_spills)
