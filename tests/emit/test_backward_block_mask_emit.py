"""The backward kernels and the block mask: text checks (tests/emit/test_backward_mods_compile.py compiles them).

Without a mask_mod nothing of the block mask reaches a backward kernel (its text is what it was before the
block mask existed: this checks the names; the byte-for-byte comparison was made when the feature landed).
With one, the non-deterministic kernels clip their query-block range before the work items are counted from it,
the deterministic ones do not (each key block of the built-in range takes its turn), and both take the unmasked
path in blocks the mask calls full; the TU exports the transposed block mask's entry points.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.sets import backward_configs
from flashgen.engines import emit
from flashgen.mods.kernel_mods import prepare_mods

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

_NAMES = ("bwd_block_mask", "mask_blocks", "block_mask_numel", "block_mask_row")
ENGINES = {"mma_sync": (BackwardConfig.default("bf16", 128, "causal"), "sm_80"), "wgmma": (BackwardConfig.wgmma("bf16", 128, "causal"), "sm_90a")}


def test_without_a_mask_mod_no_block_mask_reaches_a_backward_kernel():
    softcap, _ = prepare_mods(EX.softcap(), None)
    for cfg in backward_configs()[::3]:
        for c in (cfg, cfg.replace(deterministic=not cfg.deterministic)):
            for mods in (None, softcap):
                text = emit(c, mods).text
                assert not [n for n in _NAMES if n in text], (c.short_form(), mods)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_with_a_mask_mod_the_kernel_clips_its_query_blocks_unless_deterministic(engine, deterministic):
    mods, _ = prepare_mods(None, EX.document_mask())
    text = emit(ENGINES[engine][0].replace(deterministic=deterministic), mods).text
    kernel = text[text.index("kernel(const __grid_constant__ Params p)"):]
    clip = "bwd_block_mask_clip(p.block_mask, batch, kv_head * p.kv_group, p.kv_group, kb, p.heads, p.seq_q, p.seq_k, &qb_begin, &qb_end);"
    range_at, count_at = kernel.index("q_block_range(kb,"), kernel.index("const int n_q = qb_end - qb_begin")
    assert (clip in kernel) != deterministic
    if not deterministic:
        assert range_at < kernel.index(clip) < count_at  # clipped before the work items are counted from it
    assert "|| bwd_block_mask_partial(p.block_mask, batch, head, kb, qb, p.heads, p.seq_q, p.seq_k);" in kernel
    for entry in ("block_mask_numel(const ", "mask_blocks(const "):
        assert f"_{entry}" in text
