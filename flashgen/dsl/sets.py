"""Named config sets, usable wherever a config file is (resolved by :mod:`flashgen.emit.sweep`).

:data:`NAMED_SETS` is the one list of them: help texts and messages name the sets
through :func:`listing` and :func:`did_you_mean`, never by restating it.
"""
from __future__ import annotations

import difflib
from pathlib import PurePath
from typing import Callable

from .backward_config import BackwardConfig
from .config import KernelConfig, default_configs, hopper_configs, kernel_progression, tuning_space
from .dtypes import DType

#: head sizes the backward set ships
BACKWARD_HEADS = (64, 128, 256)


def backward_configs() -> list[BackwardConfig]:
    """The shipped backward kernels of both engines: the mma.sync default of each dtype and head size of
    :data:`BACKWARD_HEADS`, then the wgmma one of those it takes, unmasked and causal."""
    mma_sync = [BackwardConfig.default(dt, d, m) for dt in DType for d in BACKWARD_HEADS for m in ("none", "causal")]
    wgmma = [BackwardConfig.wgmma(dt, d, m) for dt in DType for d in BACKWARD_HEADS for m in ("none", "causal")]
    return mma_sync + [c for c in wgmma if c is not None]


NAMED_SETS: dict[str, Callable[[], list[KernelConfig | BackwardConfig]]] = {
    "defaults": default_configs,
    "progression": kernel_progression,
    "progression-all": lambda: kernel_progression(all_block_sizes=True),
    "tuning-space": tuning_space,
    "hopper": hopper_configs,
    "backward": backward_configs,
}


def listing() -> str:
    """The names of the sets, for help texts: ``defaults, progression, ...``."""
    return ", ".join(NAMED_SETS)


def did_you_mean(text: str) -> str:
    """``"; did you mean 'defaults'?"`` when ``text`` (or its file name's stem, so that
    ``hopper.yaml`` finds ``hopper``) is close to some set's name; ``""`` when none is."""
    close = [m for t in (text, PurePath(text).stem) for m in difflib.get_close_matches(t, NAMED_SETS)]
    close = list(dict.fromkeys(close))
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(name) for name in close) + "?"
