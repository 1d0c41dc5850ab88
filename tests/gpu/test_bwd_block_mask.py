"""The backward's block mask on a GPU (marked ``gpu``): both backward engines, with and without the deterministic
variant, skip the query blocks the mask_mod's transposed block mask calls empty and skip the mask in full ones.

Masks: a document mask over packed documents of odd lengths, a sliding window with sink tokens inside each
document, and a window whose width depends on the query head (the block mask's rows per head: a CTA clips to the
union over its kv head's group). Shapes: odd lengths, seq_q != seq_k both ways, GQA. Each case checks the GPU's
transposed block mask against the numpy twin bit for bit, dq / dk / dv through ``flashgen::attention_backward_mods``
with that block mask against float64 autograd through ``flashgen.reference.attention`` (FlashAttention's rule: at
most twice the error of the same reference in the inputs' 16-bit dtype), the same gradients without the block
mask (every block masked, none skipped) to rounding, and the deterministic kernels bit for bit run to run.
Autograd through a compiled kernel makes the backward's block mask and passes it too.
"""
from __future__ import annotations

import pytest
from attention_inputs import random_qkv_do  # tests/ is on sys.path (the conftest's folder)

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import reference, runtime  # noqa: E402
from flashgen.attention.score_mask import ScoreMask  # noqa: E402
from flashgen import engines  # noqa: E402
from flashgen.build import build  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen.dsl.dtypes import DType  # noqa: E402
from flashgen.mods.kernel_mods import prepare_mods  # noqa: E402
from flashgen.sim.block_mask import block_mask as numpy_block_mask  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FORWARD = {"mma_sync": "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
           "wgmma": "(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent"}
def _with_mods(cfg):
    """The config the runtime builds for a forward carrying mods (64-row query blocks on wgmma)."""
    return engines.backward_of(cfg).with_mods(cfg)


BACKWARD = {"mma_sync": BackwardConfig.default(DType.BF16, 128, "none"), "wgmma": _with_mods(BackwardConfig.wgmma(DType.BF16, 128, "none"))}
# (batch, seq_q, seq_k, heads_q, heads_kv): odd lengths, GQA, seq_q != seq_k both ways
SHAPES = [(2, 1001, 1001, 4, 2), (1, 777, 1029, 6, 2), (1, 1030, 333, 4, 1)]
N = max(max(s[1], s[2]) for s in SHAPES)


def _documents(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token its document id and its document's first token: packed documents of odd lengths 37 .. 301."""
    lengths, left, k = [], n, 0
    while left:
        lengths.append(min(left, 37 + 97 * k % 265))
        left -= lengths[-1]
        k += 1
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return doc.int().cuda(), starts[doc].int().cuda()


def _document_mask():
    doc, _ = _documents(N)

    def document_mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]
    return document_mask_mod


def _document_window_sinks(window: int = 150, sinks: int = 5):
    """Inside a token's document: a causal window of ``window`` earlier keys and the document's first ``sinks`` tokens."""
    doc, start = _documents(N)

    def document_window_sinks_mod(b, h, q_idx, kv_idx):
        near = (kv_idx <= q_idx) & (q_idx - kv_idx <= window)
        return (doc[q_idx] == doc[kv_idx]) & (near | (kv_idx < start[kv_idx] + sinks))
    return document_window_sinks_mod


def _head_window():
    """A causal window 40 + 90 h wide: each query head keeps other query blocks of a key block."""
    def head_window_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 40 + 90 * h)
    return head_window_mod


def _alibi(score, b, h, q_idx, kv_idx):  # a bias beside a mask_mod that loads: full items run apart (two loops)
    return score - 0.05 * (h + 1) * (q_idx - kv_idx).abs()


def _softcap(score, b, h, q_idx, kv_idx):  # a derivative that reads the score beside an arithmetic mask_mod: two loops
    return 4.0 * torch.tanh(score / 4.0)


#: name -> () -> (score_mod, mask_mod)
CASES = {"document_mask": lambda: (None, _document_mask()), "document_window_sinks": lambda: (None, _document_window_sinks()),
         "head_window": lambda: (None, _head_window()), "alibi+document_mask": lambda: (_alibi, _document_mask()),
         "softcap+head_window": lambda: (_softcap, _head_window())}


@pytest.fixture(scope="module")
def kernels():
    """{(engine, case, deterministic): (forward Attention with the mask_mod, backward config, backward handle, mask_mod)}."""
    cap = torch.cuda.get_device_capability()
    out = {}
    for engine in FORWARD:
        if engine == "wgmma" and cap < (9, 0):
            continue
        forward = flashgen.compile(FORWARD[engine])
        for name, make in CASES.items():
            score_mod, fn = make()
            mods, _ = prepare_mods(score_mod, fn)
            for det in (False, True):
                cfg = BACKWARD[engine].replace(deterministic=det)
                out[(engine, name, det)] = (forward._with_mods(mods), cfg, runtime._load(build(cfg, cap, mods=mods), False),
                                            score_mod, fn)
    return out


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("engine", list(FORWARD))
@pytest.mark.parametrize("name", list(CASES))
def test_backward_with_its_block_mask_matches_the_reference(kernels, engine, name, deterministic):
    if (engine, name, deterministic) not in kernels:
        pytest.skip(f"{engine} kernels need compute capability 9.0")
    fwd, cfg, handle, score_mod, fn = kernels[(engine, name, deterministic)]
    mods, (score_args, mask_args) = prepare_mods(score_mod, fn)
    words, tensors = mods.pack(score_args, mask_args)
    tensors = [t.to("cuda") for t in tensors]
    skipped = 0
    for n, shape in enumerate(SHAPES):
        b, sq, sk, hq, hk = shape
        q, k, v, do = random_qkv_do(shape, seed=n)
        o, lse = fwd(q, k, v, return_lse=True, score_mod=score_mod, mask_mod=fn)
        bm_shape = mods.block_mask_shape(b, hq, sq, sk, cfg.B_r, cfg.B_c, transposed=True)
        bm = torch.ops.flashgen.mask_blocks(q, k, handle, list(bm_shape), words, tensors, 0, -1, -1)
        want_bm = numpy_block_mask(ScoreMask("none", cfg.B_r, cfg.B_c, mods), mask_args.values(), b, hq, sq, sk, transposed=True)
        assert bm.cpu().tolist() == want_bm.tolist(), f"{engine} {name} {shape}: the GPU's transposed block mask"
        skipped += int((want_bm[..., 2:] == 0).sum())

        def run(block_mask):
            for t in (q, k, v):  # NaN-filled blocks of the gradients' sizes, freed: the gradients get them
                torch.full_like(t, float("nan"))
            return torch.ops.flashgen.attention_backward_mods(do, q, k, v, o, lse, None, handle, q.shape[-1] ** -0.5, 0, -1, -1,
                                                              words, tensors, block_mask)
        got, dense = run(bm), run(None)
        assert [g.shape for g in got] == [q.shape, k.shape, v.shape] and all(g.dtype == q.dtype for g in got)
        reference.check_gradients(got, q, k, v, do, f"{engine} backward with block mask, {name} {shape}", score_mod=score_mod,
                                  mask_mod=fn)
        for g, d, what in zip(got, dense, ("dq", "dk", "dv")):
            torch.testing.assert_close(g, d, atol=2e-2, rtol=2e-2, msg=f"{engine} {name} {shape} {what}: with and without the block mask")
        if deterministic:
            again = run(bm)
            assert all(torch.equal(x, y) for x, y in zip(got, again)), f"{engine} {name} {shape}: deterministic gradients differ run to run"
    assert skipped > 0, "the masks leave no empty block: the test would not see a skip"


def test_autograd_passes_the_backwards_block_mask():
    """attn(..., mask_mod=) then .backward(): the forward's object makes the backward kernel's (transposed) block mask
    with that kernel's handle and the operator takes it; the gradients match the reference."""
    attn = flashgen.compile(FORWARD["mma_sync"])
    fn = _document_window_sinks()
    q, k, v, do = random_qkv_do((2, 1001, 1001, 4, 2), seed=7)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(attn(*leaves, mask_mod=fn), leaves, do)
    variant = attn._with_mods(prepare_mods(None, fn)[0])
    backward = [key for key in variant._block_masks if key[0] is not None]  # key[0]: a backward kernel's handle
    assert len(backward) == 1 and backward[0][0] in variant._backward_cfgs
    reference.check_gradients(got, q, k, v, do, "autograd with the backward's block mask", mask_mod=fn)
