"""Named config sets and the resolution of command-line config arguments.

An argument is a named set (``defaults``, ``progression``, ``progression-all``,
``tuning-space``), a short form ``(FP16, 128, ...): flags``, or a YAML file (one
config, a list, or a sweep; see :mod:`flashgen.emit.sweep`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from .config import ConfigError, KernelConfig, default_configs, kernel_progression, tuning_space

NAMED_SETS: dict[str, Callable[[], list[KernelConfig]]] = {
    "defaults": default_configs,
    "progression": kernel_progression,
    "progression-all": lambda: kernel_progression(all_block_sizes=True),
    "tuning-space": tuning_space,
}


def resolve_configs(items: Iterable[str]) -> list[KernelConfig]:
    """Configs named by ``items``, deduplicated, in first-seen order."""
    out: dict[KernelConfig, None] = {}
    for item in items:
        text = str(item).strip()
        if text in NAMED_SETS:
            found = NAMED_SETS[text]()
        elif text.startswith("("):
            from .notation import parse_config

            found = [parse_config(text)]
        elif Path(text).exists():
            from ..emit.sweep import load_sweep

            found = load_sweep(Path(text)).configs
        else:
            raise ConfigError(
                f"{text!r} is not a config file, a short form or a named set ({', '.join(NAMED_SETS)})"
            )
        for cfg in found:
            out.setdefault(cfg, None)
    return list(out)
