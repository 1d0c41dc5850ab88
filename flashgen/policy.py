"""The default-config policy: which kernel ``compile("auto")`` runs for a call's shape.

A call's (GPU, dtype, d_head, sequence length, masked?) maps to the winner that
``flashgen tune`` stored for its sequence bucket (``$FLASHGEN_CACHE/tune.json``), else to
the shipped default: the wgmma engine on compute capability 9.0 where it takes the head
size, the mma.sync default elsewhere. The choice depends on the length only through its
bucket. Backward kernels are chosen alike (:func:`backward_lookup`), their winners stored under keys of
their own (``bwd/4096``) beside the forward's. This module sits below the runtime and the tuner: it times nothing.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import cache, engines
from .dsl.config import ConfigError, DType, KernelConfig
from .engines import wgmma as wgmma_defaults
from .targets import of_capability

BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)


def tune_cache_path() -> Path:
    return Path(os.environ.get("FLASHGEN_TUNE_CACHE", cache.root() / "tune.json"))


def seq_bucket(seq: int) -> int:
    """The tuned bucket a sequence length falls into: the nearest power of two on a log scale, clamped.

    Comparisons only (seq < b * sqrt(2), in integers), so a traced call with a symbolic length picks
    its bucket under guards instead of breaking the graph."""
    for b in BUCKETS[:-1]:
        if seq * seq < 2 * b * b:
            return b
    return BUCKETS[-1]


def bucket_key(seq: int, masked: bool = False) -> str:
    """The cache key of a sequence length's bucket; masked calls have buckets of their own (a mask
    changes which config wins: tiles of unequal length, no larger key block)."""
    return f"{seq_bucket(seq)}/masked" if masked else str(seq_bucket(seq))


def load_cache(path: Path | None = None) -> dict:
    path = path or tune_cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        print(f"[flashgen] ignoring unreadable tune cache {path}: {exc}", file=sys.stderr, flush=True)
        return {}


def replaced_faster(old: "dict | None", new: dict) -> "str | None":
    """A note where a tune's winner ``new`` replaces a bucket's entry ``old`` of another config that was faster
    when it was tuned (a tune of other configs, or of another engine's, for the same bucket), else None."""
    was, now = (old or {}).get("tflops"), new.get("tflops")
    if was is None or now is None or old.get("config") == new.get("config") or not was > now:
        return None
    return (f"replaces {old.get('config')} ({was:.0f} TFLOP/s, tuned {old.get('time', 'earlier')}), faster than "
            f"this winner's {now:.0f}: include it among the configs to keep it")


def save_cache(data: dict, path: Path | None = None) -> None:
    """Write the tune cache atomically (a reader never sees half of it)."""
    path = path or tune_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


#: The wgmma engine's default key block per d_head (:mod:`flashgen.engines.wgmma` says why).
HOPPER_B_C = wgmma_defaults.DEFAULT_B_C


def hopper_default(dtype: DType, d_head: int) -> KernelConfig | None:
    """The default wgmma-engine config for a head size, or None where that engine does not take it."""
    return engines.engine_named("wgmma").default_config(dtype, d_head)


def lookup(gpu: str, dtype: DType, d_head: int, seq: int, cache: dict | None = None,
           capability: tuple[int, int] | None = None, masked: bool = False) -> KernelConfig:
    """The tuned config for a shape, else the shipped default of the first engine the GPU runs (preferred
    first: wgmma on sm_90a) that takes the head size; without a ``capability``, the baseline target's
    (mma.sync). ``masked``: a causal or window mask will be applied (only ``--causal`` tuning serves it)."""
    from .dsl.notation import parse_config

    cache = load_cache() if cache is None else cache
    entry = cache.get(gpu, {}).get(dtype.value, {}).get(str(d_head), {}).get(bucket_key(seq, masked))
    if entry:
        return parse_config(entry["config"])
    target = of_capability(capability) if capability is not None else None
    for engine in engines.runnable_on(target):  # preferred first; mma.sync takes every head size
        cfg = engine.default_config(dtype, d_head)
        if cfg is not None:
            return cfg
    raise ConfigError(f"no engine has a default config for d_head={d_head}")


#: What the tune cache's backward keys start with (``bwd/4096``, ``bwd/4096/masked``): the forward's keys
#: are the bucket's bare numbers, so no key of one pass is ever the other's.
BACKWARD_KEY_PREFIX = "bwd/"


def backward_bucket_key(seq: int, masked: bool = False) -> str:
    """The cache key of a sequence length's bucket for backward winners (masked calls apart, as the forward's)."""
    return BACKWARD_KEY_PREFIX + bucket_key(seq, masked)


def tuned_backward(gpu: str, dtype: DType, d_head: int, seq: int, mask: str, cache: dict | None = None):
    """The backward config ``flashgen tune --passes bwd`` stored for this GPU, dtype, head size and the
    bucket of ``seq`` (the masked bucket for a causal or window ``mask``), with the call's mask; None where
    none is stored or the stored name is not a backward config of this dtype and head size (with a note)."""
    from .dsl.configs import backward_from_short_form
    from .dsl.notation import NotationError

    cache = load_cache() if cache is None else cache
    entry = cache.get(gpu, {}).get(dtype.value, {}).get(str(d_head), {}).get(backward_bucket_key(seq, mask != "none"))
    if not entry:
        return None
    try:
        cfg = backward_from_short_form(entry["config"])
    except (ConfigError, NotationError, KeyError, TypeError) as exc:
        print(f"[flashgen] ignoring the tuned backward entry {entry!r}: {exc}", file=sys.stderr, flush=True)
        return None
    if (cfg.dtype, cfg.d_head) != (dtype, d_head):
        print(f"[flashgen] ignoring the tuned backward entry {cfg.short_form()} stored for {dtype.value} "
              f"d_head={d_head}", file=sys.stderr, flush=True)
        return None
    return cfg.replace(mask=mask)


def _variant(cfg, deterministic: bool):
    """``cfg`` with ``deterministic`` set, or None where its engine's backward has no such variant."""
    try:
        return cfg.replace(deterministic=deterministic)
    except ConfigError:
        return None


def backward_lookup(dtype: DType, d_head: int, mask: str, capability: tuple[int, int] | None = None,
                    gpu: str | None = None, seq: int = 0, cache: dict | None = None, deterministic: bool = False,
                    engine: str | None = None):
    """The backward config that differentiates a forward kernel of this dtype, head size and score mask:
    with a ``gpu`` name and a key length ``seq``, the tuned winner of its bucket (:func:`tuned_backward`)
    where its engine runs on ``capability``; else the default of the first engine the GPU runs (preferred
    first) that has a backward taking the head size. ``deterministic``: its variant with ordered dQ adds,
    from the first engine whose backward has one. ``engine``: that engine's backward only (a tuned winner of
    another engine is passed over); a ConfigError where it does not run on ``capability`` or has no such backward."""
    target = of_capability(capability) if capability is not None else None
    candidates = engines.runnable_on(target)
    if engine is not None:
        chosen = engines.engine_named(engine)
        if chosen not in candidates:
            cap = (target or engines.BASELINE).capability
            raise ConfigError(f"the {engine} backward needs {chosen.needs}, not compute capability {cap[0]}.{cap[1]}")
        candidates = [chosen]
    tuned = tuned_backward(gpu, dtype, d_head, seq, mask, cache) if gpu is not None and seq else None
    if tuned is not None:
        usable = tuned.engine == engine if engine is not None else target is None or engines.engine_of(tuned).runs_on(target)
        found = _variant(tuned, deterministic) if usable else None
        if found is not None:
            return found
    for eng in candidates:
        cfg = eng.backward.default_config(dtype, d_head, mask, target) if eng.backward is not None else None
        found = _variant(cfg, deterministic) if cfg is not None else None
        if found is not None:
            return found
    if engine is not None:
        variant = " with ordered dQ adds" if deterministic else ""
        on = f" on compute capability {target.capability[0]}.{target.capability[1]}" if target is not None else ""
        raise ConfigError(f"the {engine} backward has no kernel{variant} for {dtype.value} d_head={d_head}{on}")
    where = f" within the {target.smem_per_block}-byte shared memory per block of compute capability " \
            f"{target.capability[0]}.{target.capability[1]}" if target is not None else ""
    raise ConfigError(f"no backward kernel takes d_head={d_head}{where} (the mma_sync backward takes every d_head "
                      "the forward takes, multiples of 8 up to 256, where a block's shared memory holds its kernel)")
