"""The DSL: configs, the layout algebra, tensors, the copy and MMA atoms, and the plans built from them.

    from flashgen.dsl import KernelConfig, Layout, Swizzle, make_plan, parse_any_layout

Each name is imported from its module on first use, so ``import flashgen`` stays cheap (the plans
and the notation's parser take about 0.1 s to import, which a process that only loads a cached
kernel never needs) and nothing here imports torch.
"""
from __future__ import annotations

import importlib
from typing import Any

#: exported name -> the module of this package that defines it
_HOME = {
    # configs: the knobs, validated
    "KernelConfig": "config", "ConfigError": "config", "load_config": "config",
    "DType": "dtypes",
    # the algebra: layouts, swizzles, thread-value maps, tensors
    "Layout": "layout", "make_layout": "layout",
    "Swizzle": "swizzle", "ComposedLayout": "swizzle",
    "TVMap": "tiling", "Partition": "tiling", "Loop": "tiling",
    "Tensor": "tensor",
    # the text forms: "(8,64):(64,1)", "Sw<3,3,3> o ...", short-form configs
    "parse_layout": "notation", "parse_swizzle": "notation", "parse_composed": "notation",
    "parse_any_layout": "notation", "parse_config": "notation", "NotationError": "notation",
    # atoms: copies (g2s, s2r, r2s, s2g), MMAs, and the Hopper ones (wgmma, TMA, mbarrier)
    "CopyAtom": "atoms.copy", "GM2SM": "atoms.copy", "GM2SM_async": "atoms.copy",
    "SM2RF": "atoms.copy", "RF2SM": "atoms.copy", "SM2GM": "atoms.copy",
    "MMA_16x8x16": "atoms.mma",
    "WGMMA_64xNx16": "atoms.hopper", "SmemDescriptor": "atoms.hopper", "GmmaSwizzle": "atoms.hopper",
    "TmaLoad": "atoms.hopper", "TmaStore": "atoms.hopper", "Mbarrier": "atoms.hopper",
    # plans: a config's objects, the single source of truth for the emitter and the simulator
    "KernelPlan": "plan", "make_plan": "plan",
    "HopperPlan": "hopper_plan", "make_hopper_plan": "hopper_plan",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
