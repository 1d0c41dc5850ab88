"""The engine registry: every way flashgen builds the attention kernel, behind one interface.

``engine_of(cfg)`` is the engine of a config (its ``engine`` knob); the code that builds, checks,
tunes, benchmarks, reports on and runs kernels asks it (:class:`~flashgen.engines.base.Engine`)
instead of asking which engine or which compute capability it has. ``runnable_on(target)`` lists
the engines a target runs, preferred first.

Config-level entry points: :func:`emit` (config -> plan -> KernelSource), :func:`verify` (the
cached proofs of a config's plan) and :func:`simulate_config` (``flashgen simulate``'s report). They
take either kind of config (:mod:`flashgen.dsl.configs`): :func:`kernels_of` is the one place that
picks a forward config's engine or a backward config's engine's :class:`BackwardKernels`.
"""
from __future__ import annotations

import functools
from typing import Any

import attrs

from ..dsl.backward_config import BackwardConfig
from ..dsl.configs import AnyConfig, load as load_config
from ..emit.source import KernelSource
from ..targets import Target, named as target_named
from .base import BackwardKernels, Engine
from .mma_sync import MmaSyncEngine
from .wgmma import WgmmaEngine

#: Every engine, by its ``engine`` knob value.
ENGINES: dict[str, Engine] = {e.name: e for e in (MmaSyncEngine(), WgmmaEngine())}
#: The target of a build that names none (no GPU to ask): the oldest one flashgen builds for.
BASELINE = target_named("sm_80")


def engine_named(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINES)}") from None


def engine_of(cfg: AnyConfig) -> Engine:
    """The engine that builds ``cfg`` (a backward config's: the engine of its backward kernels)."""
    return engine_named(cfg.engine)


def kernels_of(cfg: AnyConfig) -> "Engine | BackwardKernels":
    """What plans, emits, verifies and reports on ``cfg``: its engine, or for a backward config that
    engine's backward kernels (all four through the same method names)."""
    return backward_of(cfg) if isinstance(cfg, BackwardConfig) else engine_of(cfg)


def runnable_on(target: Target | None) -> list[Engine]:
    """The engines whose kernels run on ``target`` (None: :data:`BASELINE`), preferred first."""
    target = target or BASELINE
    return sorted((e for e in ENGINES.values() if e.runs_on(target)), key=lambda e: -e.rank)


def preferred(target: Target | None) -> Engine:
    """The engine whose configs a target gets by default (tuning, shipped defaults)."""
    return runnable_on(target)[0]


def make_plan(cfg: Any, mods: Any = None):
    """The plan of a config (object, dict, YAML path or short form), by its engine; ``mods``: the
    score_mod / mask_mod compiled in (a :class:`flashgen.mods.KernelMods`; a backward config's: those of the
    forward it differentiates)."""
    cfg = load_config(cfg)
    kernels = kernels_of(cfg)
    return kernels.make_plan(cfg) if mods is None else kernels.make_plan(cfg, mods)


def emit(cfg: Any, mods: Any = None) -> KernelSource:
    """The CUDA source of a config (forward or backward): its plan, emitted; ``mods`` as :func:`make_plan`
    (the manifest entry then describes them: ``KernelMods.manifest``)."""
    cfg = load_config(cfg)
    src = kernels_of(cfg).emit(make_plan(cfg, mods))
    return src if mods is None else attrs.evolve(src, meta={**src.meta, "mods": mods.manifest()})


def emit_named(cfg: Any, mods: tuple = (None, None)) -> KernelSource:
    """:func:`emit` with the (score_mod, mask_mod) that two command-line specs name (:mod:`flashgen.mods.spec`;
    None: none), loaded only when given: the mods package imports torch."""
    if mods == (None, None):
        return emit(cfg)
    from ..mods.spec import kernel_mods

    return emit(cfg, kernel_mods(*mods))


def verify_plan(plan: Any):
    """Every proof of one plan (:mod:`flashgen.sim.verify`; not cached: tests hand it altered plans)."""
    from ..sim.verify import Verification

    return Verification(plan.cfg.short_form(), kernels_of(plan.cfg).verify_checks(plan))


@functools.lru_cache(maxsize=None)
def verify_config(cfg: AnyConfig):
    """The proofs of ``cfg``'s plan (memoized: a config is verified once per process)."""
    return verify_plan(make_plan(cfg))


def verify(cfg: Any):
    """The cached verification of ``cfg``; VerificationError names every failing check."""
    return verify_config(load_config(cfg)).raise_if_failed()


def simulate_config(cfg: Any, cta: bool = True) -> dict[str, Any]:
    """``flashgen simulate``'s report of one config (JSON-able; its engine's checks and the proofs)."""
    cfg = load_config(cfg)
    kernels = kernels_of(cfg)
    return kernels.report(kernels.make_plan(cfg), verify_config(cfg).to_dict(), cta=cta)


def backward_of(cfg: Any) -> BackwardKernels:
    """The backward kernels of a :class:`~flashgen.dsl.backward_config.BackwardConfig`'s engine."""
    engine = engine_named(cfg.engine)
    if engine.backward is None:
        raise ValueError(f"{cfg.short_form()}: engine {engine.name} has no backward kernels yet; "
                         f"use one of {', '.join(e.name for e in ENGINES.values() if e.backward is not None)}")
    return engine.backward


def emit_backward(cfg: Any) -> KernelSource:
    """The CUDA source of a backward config: its engine's backward plan, emitted."""
    cfg = load_config(cfg)
    if not isinstance(cfg, BackwardConfig):
        raise ValueError(f"{cfg.short_form()} is a forward config; emit_backward takes a backward one")
    return emit(cfg)


__all__ = ["BASELINE", "ENGINES", "BackwardKernels", "Engine", "backward_of", "emit", "emit_backward", "emit_named", "engine_named", "engine_of", "kernels_of",
           "make_plan", "preferred",
           "runnable_on", "simulate_config", "verify", "verify_config", "verify_plan"]
