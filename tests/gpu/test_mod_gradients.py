"""Gradients through score_mod / mask_mod on a GPU (marked ``gpu``): both backward engines, every example.

The forward runs a fixed wgmma (sm_90a) or mma_sync kernel built with the mods; the backward kernel of each
engine, built with the same mods, runs through ``flashgen::attention_backward_mods`` on the forward's o and
lse and the call's captured values. dq, dk, dv are checked against float64 autograd through
``flashgen.reference.attention`` with the same functions, by FlashAttention's rule: at most twice the error
of autograd through the same reference computed in the inputs' 16-bit dtype, plus a small slack. The gradient
buffers come from a NaN-poisoned allocator. softcap uses a small cap and ALiBi steep slopes, so that a wrong
derivative shows (cap 30 on unit scores has a derivative within 0.2% of 1).
"""
from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from attention_inputs import random_qkv_do  # tests/ is on sys.path (the conftest's folder)

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import mods as fg_mods, reference, runtime  # noqa: E402
from flashgen import engines  # noqa: E402
from flashgen.build import build  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen.dsl.dtypes import DType  # noqa: E402
from flashgen.mods.kernel_mods import prepare_mods  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_spec = importlib.util.spec_from_file_location("mods_examples", Path(__file__).parents[2] / "examples" / "mods.py")
examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(examples)

#: engine -> forward config; d_head 64 on wgmma, whose backward keeps 128-row query blocks for a mask_mod alone
FORWARD = {"mma_sync": "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
           "wgmma": "(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent",
           "wgmma_d64": "(BF16, 64, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent"}
BACKWARD = {"mma_sync": BackwardConfig.default(DType.BF16, 128, "none"), "wgmma": BackwardConfig.wgmma(DType.BF16, 128, "none"),
            "wgmma_d64": BackwardConfig.wgmma(DType.BF16, 64, "none")}


def _with_mods(cfg, mods):
    """The config the runtime builds for a forward carrying ``mods`` (64-row query blocks on wgmma but for a
    mask_mod alone at d_head 64)."""
    return engines.backward_of(cfg).with_mods(cfg, mods)
# (batch, seq_q, seq_k, heads_q, heads_kv): odd lengths, GQA, seq_q != seq_k both ways, a single token
SHAPES = [(2, 113, 113, 4, 2), (1, 257, 130, 3, 1), (1, 77, 200, 2, 2), (1, 1, 1, 2, 1)]
N = max(max(s[1], s[2]) for s in SHAPES)
#: name -> (score_mod, mask_mod); tables and documents cover every index of SHAPES
CASES = {
    "softcap": lambda: (examples.softcap(2.0), None),
    "alibi": lambda: (_steep_alibi(4), None),
    "relative_bias": lambda: (examples.relative_bias(N, device="cuda"), None),
    "document_mask": lambda: (None, examples.document_mask(examples.uneven_lengths(N), device="cuda")),
    "prefix_lm": lambda: (None, examples.prefix_lm(17)),
    "sliding_window_sinks": lambda: (None, examples.sliding_window_sinks(31, 3)),
    "causal": lambda: (None, examples.causal()),
    "block_local": lambda: (None, examples.block_local(19)),
    "softcap+document_mask": lambda: (examples.softcap(3.0), examples.document_mask(examples.uneven_lengths(N), device="cuda")),
}


def _steep_alibi(heads: int):
    slope = torch.tensor([0.5 ** (i + 1) for i in range(heads)], device="cuda")

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slope[h] * (q_idx - kv_idx).abs()
    return alibi_mod


@pytest.fixture(scope="module")
def kernels():
    """{(engine, case): (forward Attention with the mods, backward handle, mod functions)}, built in parallel."""
    cap = torch.cuda.get_device_capability()
    kinds = [e for e in FORWARD if e == "mma_sync" or cap >= (9, 0)]
    funcs = {name: make() for name, make in CASES.items()}
    forwards = {e: flashgen.compile(FORWARD[e]) for e in kinds}
    jobs = {}
    for name, (score_mod, mask_mod) in funcs.items():
        mods, _ = prepare_mods(score_mod, mask_mod)
        for e in kinds:
            jobs[(e, name, "fwd")] = (forwards[e].cfg, mods)
            jobs[(e, name, "bwd")] = (_with_mods(BACKWARD[e], mods), mods)
    with ThreadPoolExecutor(16) as pool:  # nvcc runs in subprocesses: threads build in parallel
        built = dict(zip(jobs, pool.map(lambda job: build(job[0], cap, mods=job[1]), jobs.values())))
    out = {}
    for name, (score_mod, mask_mod) in funcs.items():
        mods, _ = prepare_mods(score_mod, mask_mod)
        for e in kinds:
            out[(e, name)] = (forwards[e]._with_mods(mods), runtime._load(built[(e, name, "bwd")], False), score_mod, mask_mod)
    return out


def _backward(fwd, handle, q, k, v, do, score_mod, mask_mod):
    """(dq, dk, dv) of the forward kernel's call through the backward kernel ``handle``."""
    mods, (score_args, mask_args) = prepare_mods(score_mod, mask_mod)
    words, tensors = mods.pack(score_args, mask_args)
    tensors = [t.to(q.device) for t in tensors]
    o, lse = fwd(q, k, v, return_lse=True, score_mod=score_mod, mask_mod=mask_mod)
    for t in (q, k, v):  # NaN-filled blocks of the gradients' sizes, freed: the gradients get them
        torch.full_like(t, float("nan"))
    return o, torch.ops.flashgen.attention_backward_mods(do, q, k, v, o, lse, None, handle, q.shape[-1] ** -0.5, 0, -1, -1,
                                                         words, tensors, None)  # no block mask: every block masked


@pytest.mark.parametrize("engine", list(FORWARD))
@pytest.mark.parametrize("name", list(CASES))
def test_gradients_through_every_example(kernels, engine, name):
    if (engine, name) not in kernels:
        pytest.skip(f"{engine} kernels need compute capability 9.0")
    fwd, handle, score_mod, mask_mod = kernels[(engine, name)]
    kw = {"score_mod": score_mod, "mask_mod": mask_mod}
    for n, shape in enumerate(SHAPES):
        q, k, v, do = random_qkv_do(shape, seed=n, d_head=fwd.cfg.d_head)
        o, got = _backward(fwd, handle, q, k, v, do, score_mod, mask_mod)
        reference.check_attention(o, q, k, v, f"{engine} {name} {shape} o", **kw)
        assert [g.shape for g in got] == [q.shape, k.shape, v.shape] and all(g.dtype == q.dtype for g in got)
        reference.check_gradients(got, q, k, v, do, f"{engine} backward, {name} {shape}", **kw)


def test_autograd_through_compile_auto_with_mods_and_built_in_masks():
    """attn(q, k, v, score_mod=, mask_mod=) records the call: .backward() reaches q, k, v through the policy's
    backward kernel, with a built-in causal mask in both alignments; captured tensors that require grad are refused."""
    attn = flashgen.compile("auto")
    score_mod, mask_mod = CASES["softcap+document_mask"]()
    for align, shape in (("top_left", (2, 150, 150, 4, 2)), ("bottom_right", (1, 90, 211, 2, 1))):
        q, k, v, do = random_qkv_do(shape, seed=5)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kw = dict(causal=True, align=align, score_mod=score_mod, mask_mod=mask_mod)
        o = attn(*leaves, **kw)
        got = torch.autograd.grad(o, leaves, do)
        reference.check_gradients(got, q, k, v, do, f"auto causal {align}", **kw)
    slope = torch.ones(4, device="cuda", requires_grad=True)
    q, k, v, _ = random_qkv_do((1, 16, 16, 4, 4), seed=1)
    with pytest.raises(fg_mods.ModError, match="requires grad"):
        attn(q.requires_grad_(), k, v, score_mod=lambda s, b, h, i, j: s + slope[h])
