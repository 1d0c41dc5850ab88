"""PTX inline-asm builders, one module per instruction family.

Each builder renders a ``__device__ __forceinline__`` C++ helper from the DSL
object (copy atom, MMA atom, dtype) the simulator evaluates too; :mod:`.used` keeps
the ones a kernel calls.
"""
