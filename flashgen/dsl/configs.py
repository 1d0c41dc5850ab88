"""Either kind of config: a forward :class:`KernelConfig` or a :class:`BackwardConfig`.

The tools (emit, check, simulate, build) take both; what tells them apart is written once here:

* short forms: ``(FP16, 128, 64, 64, 4): ...`` is a forward kernel, ``bwd(FP16, 128, 64, 64, 4): ...``
  the backward kernels (:mod:`flashgen.dsl.short_form`);
* mappings (YAML, worker arguments, cache records): ``kind: backward`` names a backward config; no
  ``kind`` (or ``kind: forward``) a forward one, so every forward file and record stays as it was.

:func:`load` reads any of them; :func:`forward` is the loader of the code that runs forward
attention only (``flashgen.compile``), and refuses a backward config saying so.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Union

import attrs

from . import short_form
from .backward_config import BackwardConfig
from .config import ConfigError, KernelConfig, load_config

AnyConfig = Union[KernelConfig, BackwardConfig]
#: a config's kind -> its class; the key ``kind`` of a mapping picks one
KINDS: dict[str, type] = {"forward": KernelConfig, "backward": BackwardConfig}
DEFAULT_KIND = "forward"
#: what a backward short form starts with
BACKWARD_PREFIX = "bwd"


def kind_of(cfg: AnyConfig) -> str:
    return next(kind for kind, cls in KINDS.items() if isinstance(cfg, cls))


def to_record(cfg: AnyConfig) -> dict[str, Any]:
    """The config as a mapping :func:`from_dict` reads back: its ``to_dict``, with ``kind`` unless forward."""
    kind = kind_of(cfg)
    return cfg.to_dict() if kind == DEFAULT_KIND else {"kind": kind, **cfg.to_dict()}


def from_dict(data: Mapping[str, Any]) -> AnyConfig:
    """A config of the mapping's ``kind`` (default forward) from the other keys."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a kernel config must be a mapping of knob names, got {type(data).__name__}")
    kind = data.get("kind", DEFAULT_KIND)
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r}: expected one of {', '.join(KINDS)}")
    return KINDS[kind].from_dict({k: v for k, v in data.items() if k != "kind"})


def is_backward_text(text: str) -> bool:
    """Whether ``text`` is a backward short form (well formed or not): ``bwd(...``."""
    return re.match(rf"\s*{BACKWARD_PREFIX}\s*\(", text) is not None


def backward_from_short_form(text: str) -> BackwardConfig:
    """``bwd(FP16, 128, 64, 64, 4): swizzled+causal`` -> BackwardConfig: NotationError for a malformed
    text, ConfigError (starting with the short form) for kernels that cannot be built."""
    values = short_form.backward_values(text, {f.name for f in attrs.fields(BackwardConfig)})
    try:
        return BackwardConfig.from_dict(values)
    except ConfigError as e:
        raise ConfigError(f"invalid backward config '{' '.join(text.split())}': {e}") from e


def parse_short_form(text: str) -> AnyConfig:
    """A forward or backward short form, by its start."""
    if is_backward_text(text):
        return backward_from_short_form(text)
    return KernelConfig.from_short_form(text)


def load(source: Any) -> AnyConfig:
    """A config of either kind from a config object, a mapping, a short form or a YAML path."""
    if isinstance(source, tuple(KINDS.values())):
        return source
    if isinstance(source, Mapping):
        return from_dict(source)
    text = str(source)
    if text.lstrip().startswith("(") or is_backward_text(text):
        return parse_short_form(text)
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") and path.exists():
        import yaml

        return from_dict(yaml.safe_load(path.read_text()))
    return load_config(source)  # the forward loader's own errors for everything else


def forward(source: Any, what: str = "this") -> KernelConfig:
    """A forward config; a backward one is refused by name (``what``: the caller, for the message)."""
    cfg = load(source)
    if isinstance(cfg, BackwardConfig):
        raise ConfigError(f"{what} runs forward attention; {cfg.short_form()} is a backward config. Backward "
                          "kernels run through autograd: compile a forward config and call it with inputs that "
                          "require grad (flashgen emit/check/simulate/build take backward configs)")
    return cfg
