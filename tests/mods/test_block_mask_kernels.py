"""The block mask's kernels as emitted, run on the host (g++): a forward TU's ``<name>_mask_blocks`` and a
backward TU's transposed one (a row per key block, a class per query block) equal the numpy twin
(:func:`flashgen.sim.block_mask.block_mask`), their ``<name>_block_mask_numel`` is the twin's size, and the
backward kernels' ``bwd_block_mask_clip`` / ``bwd_block_mask_partial`` on that mask equal
:class:`flashgen.sim.block_mask.BackwardView`.

The kernels run under a small emulator: a launch ``k<<<grid, block, ...>>>(args)`` becomes a loop over the grid's
blocks and, last thread first, the block's threads; ``__syncthreads_or`` / ``_and`` fold over the threads run so
far, so thread 0 (the one that writes the block's class) sees the whole block's.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import make_backward_plan
from flashgen.dsl.config import KernelConfig
from flashgen.dsl.plan import make_plan
from flashgen.emit.abi import args_struct, backward_args_struct
from flashgen.engines import emit
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.sim import block_mask as bm

from host import HEAD, build_and_run, needs_gxx, words_cpp  # tests/mods is on sys.path (pytest's prepend mode)

pytestmark = needs_gxx

_EMULATOR = """
#define __global__
typedef void* cudaStream_t;
static int cudaGetLastError() { return 0; }
struct dim3 { unsigned x, y, z; dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {} };
static dim3 blockIdx, threadIdx, blockDim;
static bool block_or, block_and;
static bool __syncthreads_or(bool v) { return block_or = block_or || v; }
static bool __syncthreads_and(bool v) { return block_and = block_and && v; }
struct Launch {
    dim3 grid; unsigned block; int smem; cudaStream_t stream;
    template <class K, class... A> void operator()(K kernel, A... args) const {
        blockDim = dim3(block);
        for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = dim3(x, y, z);
            block_or = false; block_and = true;
            for (unsigned t = block; t-- > 0;) { threadIdx = dim3(t); kernel(args...); }
        }
    }
};
"""
_LAUNCH = re.compile(r"(\w+)<<<(.+?)>>>\(")


def _doc(b, h, q_idx, kv_idx):  # a captured tensor, and keys of the first two tokens for all
    return (DOC[q_idx] == DOC[kv_idx]) | (kv_idx < 2)


def _per_head(b, h, q_idx, kv_idx):  # reads b and h: a band per (batch, head), both its ends moving, some empty
    return (q_idx - kv_idx >= 40 * h - 13 * b) & (q_idx - kv_idx < 150 - 40 * h) & (kv_idx + 3 * b >= 5)


DOC = torch.tensor(sum(([d] * n for d, n in enumerate((70, 3, 150, 90, 40))), []), dtype=torch.int32)
BATCH, HEADS, SEQ_Q, SEQ_K = 2, 4, 300, 200


def _program(src_text: str, name: str, score_mask, mods, args_cpp: str, transposed: bool, words: list, n_words: int) -> str:
    """A host program that makes the block mask with the TU's own entry points and prints its size and values."""
    blocks = score_mask.mask_blocks_cpp(name, transposed)
    fns = score_mask.block_mask_fns_cpp(backward=transposed)
    assert blocks in src_text and fns in src_text  # the very text the kernel library is built from
    B_r, B_c = score_mask.B_r, score_mask.B_c
    main = ["int main() {", *("  " + w for w in words), f"  {name}_args a{{}};",
            f"  a.batch = {BATCH}; a.heads = {HEADS}; a.kv_heads = {HEADS // 2}; a.seq_q = {SEQ_Q}; a.seq_k = {SEQ_K};",
            f"  a.mod_words = (const int64_t*)words; a.n_mod_words = {n_words};",
            f"  const int64_t n = {name}_block_mask_numel(&a);",
            "  std::vector<int> out(n, -1);",
            f"  std::printf(\"%lld %d\\n\", (long long)n, {name}_mask_blocks(&a, out.data(), nullptr));",
            "  for (int v : out) std::printf(\"%d\\n\", v);"]
    if transposed:  # every key block and group of query heads: the CTA's clipped range, then each item's path
        n_qb, n_kb = -(-SEQ_Q // B_r), -(-SEQ_K // B_c)
        main += [f"  using namespace {name};",
                 f"  for (int b = 0; b < {BATCH}; ++b) for (int h0 = 0; h0 < {HEADS}; h0 += 2) for (int kb = 0; kb < {n_kb}; ++kb)",
                 f"    for (int lo = 0; lo <= {n_qb}; ++lo) for (int hi = lo; hi <= {n_qb}; ++hi) {{",
                 "      int qb_begin = lo, qb_end = hi;",
                 f"      bwd_block_mask_clip(out.data(), b, h0, 2, kb, {HEADS}, {SEQ_Q}, {SEQ_K}, &qb_begin, &qb_end);",
                 "      std::printf(\"%d %d\\n\", qb_begin, qb_end);",
                 "    }",
                 f"  for (int b = 0; b < {BATCH}; ++b) for (int h = 0; h < {HEADS}; ++h) for (int kb = 0; kb < {n_kb}; ++kb)",
                 f"    for (int qb = 0; qb < {n_qb}; ++qb)",
                 f"      std::printf(\"%d\\n\", (int)bwd_block_mask_partial(out.data(), b, h, kb, qb, {HEADS}, {SEQ_Q}, {SEQ_K}));"]
    host_blocks = _LAUNCH.sub(lambda m: f"Launch{{{m.group(2)}}}({m.group(1)}, ", blocks)
    return "\n".join([HEAD, "#include <vector>", _EMULATOR, f"namespace {name} {{",
                      f"constexpr uint32_t B_r = {B_r}, B_c = {B_c};", mods.to_cpp(transposed), fns, "}", args_cpp,
                      host_blocks, *main, "  return 0;", "}"])


def _kernel(kind: str, mods):
    """(emitted text, kernel name, score mask, args struct) of a forward or a backward mma_sync kernel with ``mods``."""
    if kind == "forward":
        cfg = KernelConfig(dtype="fp16", B_r=64, B_c=32, Q_mma_load_K_tiles=2)
        plan, struct = make_plan(cfg, mods), args_struct
    else:
        cfg = BackwardConfig("fp16", d_head=64)
        plan, struct = make_backward_plan(cfg, mods), backward_args_struct
    src = emit(cfg, mods)
    return src.text, src.name, plan.score_mask, struct(src.name)


def _alibi(score, b, h, q_idx, kv_idx):  # a score_mod that adds a bias: its kernels' scales are not the block mask's
    return score - SLOPES[h] * (q_idx - kv_idx)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("fn, score", [(_doc, None), (_per_head, None), (_doc, _alibi)],
                         ids=lambda f: f.__name__.strip("_") if f is not None else "")
def test_emitted_block_mask_kernels_equal_the_numpy_twin(tmp_path, kind, fn, score):
    """(The entry points run with a zero softmax_scale, as the launcher calls them: with a bias score_mod too.)"""
    mods, (sa, ma) = prepare_mods(score_mod=score, mask_mod=fn)
    text, name, score_mask, struct = _kernel(kind, mods)
    transposed = kind == "backward"
    words, n_words = words_cpp(mods, sa, ma)
    out = [int(x) for x in build_and_run(tmp_path, _program(text, name, score_mask, mods, struct, transposed, words, n_words))]
    want = bm.block_mask(score_mask, ma.values(), BATCH, HEADS, SEQ_Q, SEQ_K, transposed=transposed)
    assert want.shape == mods.block_mask_shape(BATCH, HEADS, SEQ_Q, SEQ_K, score_mask.B_r, score_mask.B_c, transposed=transposed)
    assert out[:2] == [want.size, 0]
    got = np.array(out[2:2 + want.size]).reshape(want.shape)
    np.testing.assert_array_equal(got, want)
    assert len({int(c) for c in np.unique(want[..., 2:])}) == 3  # empty, partial and full blocks all occur
    if not transposed:
        return
    rest = out[2 + want.size:]
    n_kb, n_qb = want.shape[2], want.shape[3] - 2
    ranges = [(lo, hi) for lo in range(n_qb + 1) for hi in range(lo, n_qb + 1)]
    clips = iter(zip(rest[0::2], rest[1::2]))
    for b, h0, kb in itertools.product(range(BATCH), range(0, HEADS, 2), range(n_kb)):
        view = bm.BackwardView(score_mask, want, b, (h0, h0 + 1))
        for lo, hi in ranges:
            assert next(clips) == view.clip(kb, lo, hi, deterministic=False), (b, h0, kb, lo, hi)
    partial = rest[2 * BATCH * (HEADS // 2) * n_kb * len(ranges):]
    cases = list(itertools.product(range(BATCH), range(HEADS), range(n_kb), range(n_qb)))
    assert len(partial) == len(cases)
    for (b, h, kb, qb), p in zip(cases, partial):
        view = bm.BackwardView(score_mask, want, b, (h,))
        assert bool(p) == view.masked(0, kb, qb, needs=False)
