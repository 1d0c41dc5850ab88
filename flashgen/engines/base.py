"""The interface every kernel engine implements (one entry per engine in :mod:`flashgen.engines`).

An engine is a way to build the attention kernel for some GPUs: a plan maker, an emitter and
a simulator behind one set of methods, so the build, check, tune, benchmark, report and
runtime code asks the engine instead of asking which engine it has.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..dsl.config import DType, KernelConfig
from ..emit.source import KernelSource
from ..targets import TARGETS, Target


class BackwardKernels:
    """An engine's backward pass (dQ, dK, dV from dO): plan maker, emitter and simulator of a
    :class:`~flashgen.dsl.backward_config.BackwardConfig`, kept apart from the forward's methods."""

    def make_plan(self, cfg: Any, mods: Any = None) -> Any:
        """The plan of a backward config; ``mods``: the score_mod / mask_mod of the forward it differentiates."""
        raise NotImplementedError

    def emit(self, plan: Any) -> KernelSource:
        """The CUDA source of a backward plan (pure, deterministic)."""
        raise NotImplementedError

    def coverage(self, plan: Any) -> dict:
        """The copies' coverage checks, keyed by copy name."""
        raise NotImplementedError

    def simulate(self, plan: Any, q: Any, k: Any, v: Any, do: Any, **mask: Any) -> Any:
        """dQ, dK, dV of ``(batch, seq, heads, d)`` inputs through every simulated CTA, with the hazards found."""
        raise NotImplementedError

    def verify_checks(self, plan: Any) -> tuple:
        """The proofs (:class:`flashgen.sim.verify.Check`) of what the emitter takes from ``plan`` on trust."""
        raise NotImplementedError

    def report(self, plan: Any, verification: dict, cta: bool = True) -> dict[str, Any]:
        """``flashgen simulate``'s report of one backward plan (``verification``: the proofs' ``to_dict``)."""
        raise NotImplementedError

    def default_config(self, dtype: DType, d_head: int, mask: str = "none", target: Target | None = None) -> Any:
        """The shipped backward config of a dtype, head size and score mask for ``target`` (None: the
        largest shared memory of the engine's targets), or None where this engine's backward does not
        take the head size."""
        raise NotImplementedError

    def tuning_space(self, dtype: DType, d_head: int, mask: str = "none") -> list:
        """What ``flashgen tune --passes bwd`` times by default for a dtype, head size and mask (empty where
        this engine's backward does not take the head size)."""
        raise NotImplementedError

    def with_mods(self, cfg: Any, mods: Any = None) -> Any:
        """The config to build in place of ``cfg`` where the forward carries a score_mod or mask_mod (``mods``,
        :class:`flashgen.mods.KernelMods`; None: any): ``cfg`` unless its shape leaves the mods' code too few
        registers."""
        return cfg

    def fallback(self, cfg: Any) -> Any:
        """A shape with fewer registers to build where ``cfg``'s kernel with a user's mods compiled into local
        memory or serialized wgmma (:meth:`flashgen.build.Built.register_problems`), or None: none."""
        return None


class Engine:
    """One engine. Subclasses set the class attributes and implement the methods."""

    #: its backward kernels, or None where the engine has none yet
    backward: "BackwardKernels | None" = None

    #: the config's ``engine`` knob value
    name: str
    #: the target its emitter writes for (the build default and the ``--arch`` it needs at least)
    target: Target
    #: PTX instruction families its kernels use: it runs on every target that has them all
    instructions: frozenset
    #: among the engines a target runs, the highest rank gives the shipped default
    rank: int
    #: what a user of another GPU should do instead, for refusals
    hint: str = ""

    # ---- targets ----------------------------------------------------------------------

    def runs_on(self, target: Target) -> bool:
        return target.has(self.instructions)

    @property
    def needs(self) -> str:
        """``compute capability 9.0 (sm_90a)`` or ``compute capability 8.0 (sm_80) or newer``."""
        only = [t for t in TARGETS.values() if self.runs_on(t)] == [self.target]
        return self.target.described + ("" if only else " or newer")

    def refusal(self, target: Target) -> str | None:
        """Why this engine's kernels cannot run on ``target`` (short, for listings); None when they can."""
        if self.runs_on(target):
            return None
        return f"{self.name} kernels need {self.target.name}" + ("" if self.needs.endswith(")") else " or newer")

    # ---- plan, text, simulation ------------------------------------------------------------

    def make_plan(self, cfg: KernelConfig, mods: Any = None) -> Any:
        """The plan of ``cfg``; ``mods``: the score_mod / mask_mod it applies (a flashgen.mods.KernelMods)."""
        raise NotImplementedError

    def emit(self, plan: Any) -> KernelSource:
        """The CUDA source of a plan of this engine (pure, deterministic)."""
        raise NotImplementedError

    def verify_checks(self, plan: Any) -> tuple:
        """The proofs (:class:`flashgen.sim.verify.Check`) of what the emitter takes from ``plan`` on trust."""
        raise NotImplementedError

    def check_schedule(self, plan: Any, n_blocks: int = 3, **kw: Any) -> list[str]:
        """Hazards of the plan's schedule over ``n_blocks`` key blocks (no data moved)."""
        raise NotImplementedError

    def simulate(self, plan: Any, verification: dict, cta: bool = True) -> dict[str, Any]:
        """``flashgen simulate``'s report of one plan (``verification``: the proofs' ``to_dict``)."""
        raise NotImplementedError

    def report(self, plan: Any, verification: dict, cta: bool = True) -> dict[str, Any]:
        """The report under the name both kinds of kernels share (:class:`BackwardKernels` too)."""
        return self.simulate(plan, verification, cta=cta)

    # ---- shipped configs ---------------------------------------------------------------------

    def tuning_space(self, dtypes: Sequence[str] | None = None) -> list[KernelConfig]:
        """What ``flashgen tune`` times by default on a target where this engine is preferred."""
        raise NotImplementedError

    def default_config(self, dtype: DType, d_head: int) -> KernelConfig | None:
        """The shipped config for a head size (every length and mask; ``flashgen tune`` results override it per
        length bucket), or None where the engine does not take it."""
        raise NotImplementedError

    def bench_configs(self) -> list[KernelConfig]:
        """What ``flashgen bench`` times by default."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<engine {self.name} ({self.target.name})>"
