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
    def __call__(self, cfg):
        """The CUDA source (:class:`flashgen.emit.source.KernelSource`) of a config."""
        from ..engines import emit

        return emit(cfg)


sys.modules[__name__].__class__ = _EmitPackage
