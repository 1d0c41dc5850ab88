"""Plan -> CUDA C++ text: ``kernel`` (mma.sync engine), ``hopper_kernel`` (wgmma engine), ``source`` (what both
return), ``ptx``
(one builder per PTX family), ``abi`` (the C launcher every kernel exports), ``sweep`` and ``writer`` (config files ->
kernels_out/).

The package is also the public function: ``flashgen.emit(cfg)`` returns the
:class:`~flashgen.emit.source.KernelSource` of a config (its engine's plan, emitted: :func:`flashgen.engines.emit`) (object, dict, YAML path or short form).
A plain function named ``flashgen.emit`` would be replaced by this package as soon as anything
imported one of its modules, so the package itself is made callable.
"""
from __future__ import annotations

import sys
import types


class _EmitPackage(types.ModuleType):
    def __call__(self, cfg, score_mod=None, mask_mod=None):
        """The CUDA source (:class:`flashgen.emit.source.KernelSource`) of a config; ``score_mod`` / ``mask_mod``:
        FlexAttention-style functions compiled into it (:mod:`flashgen.mods`)."""
        from ..engines import emit

        if score_mod is None and mask_mod is None:
            return emit(cfg)
        from ..mods.kernel_mods import prepare_mods  # traces with torch: imported only for mods

        return emit(cfg, prepare_mods(score_mod, mask_mod)[0])


sys.modules[__name__].__class__ = _EmitPackage
