"""flashgen: a Python DSL and CUDA code generator for FlashAttention-style kernels.

``flashgen.dsl`` (layouts, swizzles, tensors, copy/MMA atoms, configs, plans),
``flashgen.emit`` (plan -> CUDA C++ with inline PTX) and ``flashgen.sim`` (Numba
simulation) import without torch or a GPU; ``flashgen.compile`` builds a torch op.
``flashgen.verify`` proves, once per config, what the emitter takes from the plan on trust.
"""
from __future__ import annotations

from .dsl.config import ConfigError, KernelConfig, load_config
from .dsl.dtypes import DType
from . import emit  # the package is callable: flashgen.emit(cfg) -> KernelSource (see flashgen/emit/__init__.py)

__all__ = ["ConfigError", "DType", "KernelConfig", "compile", "emit", "load_config", "make_hopper_plan", "make_plan", "reference", "verify"]
__version__ = "0.1.0"


def compile(cfg, verbose: bool = False, deterministic: bool = False, backward_engine: str | None = None):  # noqa: A001
    """Build (or load from the on-disk cache) the kernel for ``cfg`` and return a callable.

    ``cfg``: a KernelConfig, a dict of knobs, a YAML path or a short form such as
    ``"(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"``.
    ``deterministic``: every backward of the callable gives bit-identical gradients run to run (as every
    backward does while ``torch.use_deterministic_algorithms(True)`` holds at the forward call).
    ``backward_engine``: ``"mma_sync"`` or ``"wgmma"`` runs every backward on that engine (default: the GPU's
    preferred engine for the head size, or the ``flashgen tune --passes bwd`` winner).
    """
    from .runtime import compile as _compile

    return _compile(cfg, verbose=verbose, deterministic=deterministic, backward_engine=backward_engine)


def __getattr__(name: str):
    """``flashgen.reference`` (float64 attention, the tests' oracle; imports torch) loads on first use."""
    if name == "reference":
        import importlib

        return importlib.import_module(f"{__name__}.reference")
    raise AttributeError(f"module 'flashgen' has no attribute {name!r}")


def make_plan(cfg):
    """The plan of a config, made by its engine (:class:`flashgen.dsl.plan.KernelPlan` for mma.sync,
    :class:`flashgen.dsl.hopper_plan.HopperPlan` for wgmma)."""
    from .engines import make_plan as _make_plan

    return _make_plan(cfg)


def make_hopper_plan(cfg):
    """The :class:`flashgen.dsl.hopper_plan.HopperPlan` of a wgmma-engine config."""
    from .dsl.hopper_plan import make_hopper_plan as _make_hopper_plan

    return _make_hopper_plan(load_config(cfg))


def verify(cfg):
    """Prove what the plan of ``cfg`` derived and the emitter relies on (address splits, fragment
    maps, register tables); cached per config. Returns the :class:`flashgen.sim.verify.Verification`,
    raises :class:`flashgen.sim.verify.VerificationError` naming every failing check."""
    from .engines import verify as _verify

    return _verify(cfg)
