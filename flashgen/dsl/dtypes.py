"""Element types of the kernels: 16-bit inputs/outputs, fp32 accumulation."""
from __future__ import annotations

import enum


class DType(enum.Enum):
    """A 16-bit floating-point element type (value = canonical lower-case name)."""

    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def size(self) -> int:
        """Bytes per element."""
        return 2

    @property
    def cpp(self) -> str:
        """CUDA C++ scalar type."""
        return {"fp16": "__half", "bf16": "__nv_bfloat16"}[self.value]

    @property
    def cpp2(self) -> str:
        """CUDA C++ packed pair type (two elements in one 32-bit register)."""
        return {"fp16": "__half2", "bf16": "__nv_bfloat162"}[self.value]

    @property
    def ptx(self) -> str:
        """PTX type name used in mma/cvt instructions."""
        return {"fp16": "f16", "bf16": "bf16"}[self.value]

    @property
    def short(self) -> str:
        """Upper-case name used in the short form, e.g. ``FP16``."""
        return self.name

    @property
    def torch(self):
        """The matching ``torch.dtype`` (torch is imported only here, lazily)."""
        import torch

        return {"fp16": torch.float16, "bf16": torch.bfloat16}[self.value]

    @classmethod
    def parse(cls, value: "str | DType") -> "DType":
        """Accept a DType, ``fp16``/``FP16``/``bf16``/``BF16``, or a torch dtype name."""
        if isinstance(value, DType):
            return value
        text = str(value).strip().lower().removeprefix("torch.")
        aliases = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
        if text not in aliases:
            raise ValueError(f"unknown dtype {value!r}: expected one of fp16, bf16")
        return cls(aliases[text])

    def __str__(self) -> str:
        return self.value
