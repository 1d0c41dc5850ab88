"""Named config sets, usable wherever a config file is (resolved by :mod:`flashgen.emit.sweep`)."""
from __future__ import annotations

from typing import Callable

from .config import KernelConfig, default_configs, hopper_configs, kernel_progression, tuning_space

NAMED_SETS: dict[str, Callable[[], list[KernelConfig]]] = {
    "defaults": default_configs,
    "progression": kernel_progression,
    "progression-all": lambda: kernel_progression(all_block_sizes=True),
    "tuning-space": tuning_space,
    "hopper": hopper_configs,
}
