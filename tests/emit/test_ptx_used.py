"""Only the PTX helpers a kernel calls are emitted (flashgen.emit.ptx.used)."""
from __future__ import annotations

import re

import pytest

from flashgen.dsl.config import KernelConfig
from flashgen.dsl.dtypes import DType
from flashgen.dsl.sets import NAMED_SETS
from flashgen.engines import emit
from flashgen.emit.ptx import hopper, math as ptx_math, vec
from flashgen.emit.ptx.used import HELPERS_MARK, groups, insert_used, keep_used

FAMILIES = [vec.helpers(), ptx_math.helpers(DType.FP16), hopper.helpers()]
DEF = re.compile(r"^__device__ __forceinline__ [^(]*?\b(\w+)\(", re.M)


def _defined(text: str) -> list[str]:
    return DEF.findall(text)


@pytest.mark.parametrize("family", FAMILIES, ids=["vec", "math", "hopper"])
def test_groups_partition_a_family(family):
    cut = groups(family)
    # every line that is not blank lands in exactly one group, in order: nothing is lost
    assert "\n".join(g.text for g in cut).split("\n") == [ln for ln in family.split("\n") if ln.strip()]
    assert [n for g in cut for n in g.names] == _defined(family)
    for g in cut:  # a group opens with its comment (or its first definition)
        assert g.text.startswith(("//", "template", "__device__"))


def test_helpers_reached_through_other_helpers_are_kept():
    text = keep_used(FAMILIES, "void k() { mbar_wait(bar, 0); }")
    assert _defined(text) == ["mbar_try_wait", "mbar_wait"]  # mbar_wait's loop calls mbar_try_wait
    assert "mbarrier.try_wait.parity" in text


def test_a_comment_stays_with_every_helper_it_describes():
    family = "// two moves\n__device__ __forceinline__ void a() {\n}\n__device__ __forceinline__ void b() {\n}"
    assert keep_used([family], "b();") == family  # b has no comment of its own: the group stays whole
    assert keep_used([family], "c();") == ""


def test_bad_helper_text_is_refused():
    with pytest.raises(ValueError, match="no definition"):
        groups("// a comment only")
    with pytest.raises(ValueError, match="unterminated"):
        groups("__device__ __forceinline__ void a() {\n    return;")
    with pytest.raises(ValueError, match="exactly once"):
        insert_used("no mark here", FAMILIES)


def _all_configs() -> list[KernelConfig]:
    return list(dict.fromkeys(c for make in NAMED_SETS.values() for c in make()))


@pytest.mark.parametrize("cfg", _all_configs(), ids=lambda c: c.mangle())
def test_emitted_kernels_define_exactly_the_helpers_they_call(cfg):
    text = emit(cfg).text
    assert HELPERS_MARK not in text
    defined = _defined(text)
    # one definition each; only the operand fence is overloaded (accumulators, A fragments)
    assert all(defined.count(n) == 1 for n in defined if n != "wgmma_fence_operands")
    everything_known = set(_defined("\n\n".join(FAMILIES)))
    for name in defined:
        uses = len(re.findall(rf"\b{name}\b", text)) - defined.count(name)
        assert uses >= 1, f"{name} is defined but never called"
    # every helper family name the kernel calls is defined in it (nvcc tests compile a subset)
    called = {n for n in everything_known if re.search(rf"\b{n}\s*(<[^>]*>)?\(", text)}
    assert called <= set(defined)
