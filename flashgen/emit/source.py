"""What an emitter returns: the kernel's text and its manifest entry (both engines)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from ..dsl.config import KernelConfig

if TYPE_CHECKING:
    from ..dsl.backward_config import BackwardConfig


@attrs.frozen
class KernelSource:
    """The emitted kernel: ``text`` (.cu, with the C launcher of :mod:`flashgen.emit.abi`) and ``meta`` (JSON-able)."""

    name: str
    text: str
    meta: dict

    @property
    def launcher(self) -> str:
        return f"{self.name}_launch"


def kernel_meta(cfg: "KernelConfig | BackwardConfig", name: str, threads: int, smem_bytes: int, grid: str = "",
                arch: str | None = None, kind: str = "forward", **extra: Any) -> dict:
    """The manifest entry of an emitted kernel; ``arch``: the one target it runs on (None: any that
    has its instructions); ``kind``: forward or backward; ``extra`` adds to ``requires``."""
    grid = grid or f"(ceil(seq_q / {cfg.B_r}), heads, batch)"
    return {
        "name": name,
        "kind": kind,
        "short_form": cfg.short_form(),
        "config": cfg.to_dict(),
        "hash": cfg.content_hash(),
        "threads": threads,
        "smem_bytes": smem_bytes,
        "grid": grid,
        "launcher": f"{name}_launch",
        **({"arch": arch} if arch else {}),
        "requires": {"d_head": cfg.d_head, "dtype": cfg.dtype.value, "mask": cfg.mask,
                     "seq": "any length >= 1; heads % kv_heads == 0", **extra},
    }
