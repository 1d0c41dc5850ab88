"""GPU tests of score_mod / mask_mod compiled into the kernels (marked ``gpu``), on both engines.

Every example of ``examples/mods.py`` against the float64 reference (``flashgen.reference.attention``
with the same functions), FlashAttention's rule, odd lengths, GQA, seq_q != seq_k, combined with the
built-in masks; new captured values reuse the kernel; captured tensors may live on the CPU. Diagonal
mask_mods (causal, sliding window, a band) run as the built-in masks: bit for bit, forward and backward.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import mods as fg_mods  # noqa: E402
from flashgen.attention.scheduler import orders_tiles  # noqa: E402
from flashgen.attention.score_mask import ScoreMask  # noqa: E402
from flashgen.engines import engine_of, make_plan  # noqa: E402
from flashgen.reference import check_attention, check_gradients  # noqa: E402
from flashgen.runtime import InputError  # noqa: E402
from flashgen.sim.block_mask import block_mask, tile_order  # noqa: E402
from flashgen.targets import of_capability  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_spec = importlib.util.spec_from_file_location("mods_examples", Path(__file__).parents[2] / "examples" / "mods.py")
examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(examples)

CONFIGS = [
    "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(FP16, 64, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent",
    "(FP16, 64, 128, 64, 12): wgmma+stages_2+pingpong+intra+persistent",
]
# (batch, seq_q, seq_k, heads_q, heads_kv)
SHAPES = [(2, 113, 113, 4, 2), (1, 1, 1, 2, 1), (1, 200, 333, 2, 2), (1, 257, 130, 3, 1)]


def _factory(name: str, shape, device):
    """The example ``name`` sized for ``shape`` (its tables cover every index), tensors on ``device``."""
    b, sq, sk, hq, hk = shape
    n = max(sq, sk)
    sized = {
        "alibi": lambda: examples.alibi(hq, device=device),
        "relative_bias": lambda: examples.relative_bias(n, device=device),
        "document_mask": lambda: examples.document_mask(examples.uneven_lengths(n), device=device),
        "prefix_lm": lambda: examples.prefix_lm(min(17, n)),
        "sliding_window_sinks": lambda: examples.sliding_window_sinks(31, 3),
        "block_local": lambda: examples.block_local(19),
    }
    kind, factory = examples.EXAMPLES[name]
    return kind, sized.get(name, factory)()


@pytest.fixture(scope="module", params=CONFIGS)
def attn(request):
    from flashgen.dsl.notation import parse_config

    cfg = parse_config(request.param)
    cap = torch.cuda.get_device_capability()
    if not engine_of(cfg).runs_on(of_capability(cap)):
        pytest.skip(f"{engine_of(cfg).name} kernels do not run on compute capability {cap}")
    return flashgen.compile(cfg)


def _inputs(attn, shape, seed):
    b, sq, sk, hq, hk = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt, d = attn.cfg.dtype.torch, attn.cfg.d_head
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dt, generator=g)
    return q, k, v


@pytest.mark.parametrize("name", list(examples.EXAMPLES))
def test_every_example_against_the_reference(attn, name):
    for n, shape in enumerate(SHAPES):
        kind, fn = _factory(name, shape, "cuda")
        q, k, v = _inputs(attn, shape, seed=n)
        mod = {f"{kind}_mod": fn}
        o, lse = attn(q, k, v, return_lse=True, **mod)
        check_attention(o, q, k, v, f"{attn.cfg.short_form()} {name} {shape}", **mod)
        ref_o, ref_lse = flashgen.reference.attention(q, k, v, return_lse=True, **mod)
        kept = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), kept), "rows without a kept key must give lse -inf, the others finite"
        assert (o.float()[~kept.transpose(1, 2)] == 0).all(), "rows without a kept key give o = 0"
        assert (lse[kept] - ref_lse[kept]).abs().max().item() < 1e-3


@pytest.mark.parametrize("name", ["alibi", "relative_bias"])
@pytest.mark.parametrize("softmax_scale", [0.3, 2.0, 1e-3])
def test_a_bias_at_any_softmax_scale(attn, name, softmax_scale):
    """A score_mod that adds a bias starts the S accumulator at the bias over softmax_scale (flashgen.mods.bias):
    right at scales other than the default, a large one and a small one (a large bias over it), with the
    built-in causal mask cutting blocks (the masked blocks add the bias after the GEMM)."""
    shape = SHAPES[3]
    kind, fn = _factory(name, shape, "cuda")
    q, k, v = _inputs(attn, shape, seed=11)
    for causal in (False, True):
        o = attn(q, k, v, softmax_scale=softmax_scale, causal=causal, score_mod=fn)
        check_attention(o, q, k, v, f"{attn.cfg.short_form()} {name} scale {softmax_scale} causal {causal}",
                        softmax_scale=softmax_scale, causal=causal, score_mod=fn)


@pytest.mark.parametrize("mask_name", ["document_mask", "causal"])
def test_a_bias_with_a_mask_mod(attn, mask_name):
    """A score_mod that adds a bias with a mask_mod: the block mask's entry points run without the kernels' scales
    (a bias's fill refuses a zero softmax_scale), full blocks start S at the bias, partial ones add it where kept."""
    shape = SHAPES[2]
    _, score = _factory("alibi", shape, "cuda")
    _, mask = _factory(mask_name, shape, "cuda")
    q, k, v = _inputs(attn, shape, seed=13)
    o = attn(q, k, v, score_mod=score, mask_mod=mask)
    check_attention(o, q, k, v, f"{attn.cfg.short_form()} alibi + {mask_name}", score_mod=score, mask_mod=mask)


@pytest.mark.parametrize("causal, window, align", [(True, None, "top_left"), (True, None, "bottom_right"),
                                                   (False, (40, 7), "top_left")])
def test_mods_with_the_built_in_masks(attn, causal, window, align):
    shape = SHAPES[2]
    score = examples.softcap(20.0)
    kind, mask = _factory("document_mask", shape, "cuda")
    q, k, v = _inputs(attn, shape, seed=7)
    o = attn(q, k, v, causal=causal, window=window, align=align, score_mod=score, mask_mod=mask)
    check_attention(o, q, k, v, f"{attn.cfg.short_form()} softcap + documents", causal=causal, window=window,
                    align=align, score_mod=score, mask_mod=mask)


def test_new_values_reuse_the_kernel_and_cpu_tensors_are_taken(attn):
    shape = SHAPES[0]
    q, k, v = _inputs(attn, shape, seed=3)
    handles = set()
    for cap in (10.0, 50.0, 0.5):
        fn = examples.softcap(cap)
        check_attention(attn(q, k, v, score_mod=fn), q, k, v, f"softcap {cap}", score_mod=fn)
        handles.add(attn._with_mods(fg_mods.prepare_mods(fn)[0])._handle)
    assert len(handles) == 1, "a new captured number rebuilt the kernel"
    bias = examples.relative_bias(shape[2], device="cpu")  # copied to q's device by the call
    on_gpu = examples.relative_bias(shape[2], device="cuda")
    torch.testing.assert_close(attn(q, k, v, score_mod=bias), attn(q, k, v, score_mod=on_gpu), rtol=0, atol=0)
    before = fg_mods.cache_info()
    attn(q, k, v, score_mod=on_gpu)
    assert fg_mods.cache_info().traces == before.traces, "a repeated call traced again"


def test_repeated_calls_pass_new_values_to_the_kernel_and_the_block_mask(attn):
    """The same function objects called again (the eager fast path): a new number, a new document-id tensor and
    in-place changes of it reach the kernel and its block mask, without tracing."""
    shape = SHAPES[2]
    q, k, v = _inputs(attn, shape, seed=11)
    n = max(shape[1], shape[2])
    cap = 30.0
    doc = torch.arange(n, device="cuda") * 4 // n  # four documents; int64: an int32 copy is made once per version

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mods = {"score_mod": softcap, "mask_mod": same_document}
    attn(q, k, v, **mods)
    traces = fg_mods.cache_info().traces
    for step, cap in enumerate((5.0, 50.0, 0.5)):  # cap: the softcap's captured variable
        if step == 1:
            doc[:60] = 3  # in place
        if step == 2:
            doc[100:] = 0
        check_attention(attn(q, k, v, **mods), q, k, v, f"softcap {cap} + documents, step {step}", **mods)
    doc = torch.arange(n, device="cuda") // 7  # a new tensor
    check_attention(attn(q, k, v, **mods), q, k, v, "a new document tensor", **mods)
    assert fg_mods.cache_info().traces == traces, "a repeated call traced again"


def test_compile_auto_takes_mods_and_refuses_what_it_cannot_do():
    attn = flashgen.compile("auto")
    shape = (2, 300, 300, 4, 4)
    b, sq, sk, hq, hk = shape
    q, k, v = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16) for s, h in ((sq, hq), (sk, hk), (sk, hk)))
    fn = examples.alibi(hq, device="cuda")
    check_attention(attn(q, k, v, causal=True, score_mod=fn), q, k, v, "auto alibi", causal=True, score_mod=fn)
    with pytest.raises(InputError, match="out="):
        attn(q, k, v, out=torch.empty_like(q), score_mod=fn)
    with pytest.raises(fg_mods.ModError, match="sort"):
        attn(q.detach(), k, v, score_mod=lambda s, b, h, i, j: torch.sort(s)[0])


@pytest.mark.parametrize("name", ["document_mask", "prefix_lm", "sliding_window_sinks", "block_local"])
def test_block_mask_classes_and_ranges_are_the_mask_mods(attn, name):
    """The block mask the GPU makes: per query block the range of key blocks holding a kept score and
    each block's class (0 none kept, 1 some, 2 all), against the mask_mod evaluated on every score."""
    shape = SHAPES[3]
    b, sq, sk, hq, hk = shape
    _, fn = _factory(name, shape, "cuda")
    q, k, v = _inputs(attn, shape, seed=11)
    mods, (_, mask_args) = fg_mods.prepare_mods(mask_mod=fn)
    variant = attn._with_mods(mods)
    words, tensors = mods.pack(None, mask_args)
    got = _block_mask_rows(attn, mods, variant._block_mask(mods, q, k, words, tensors).cpu(), shape)
    B_r, B_c = attn.cfg.B_r, attn.cfg.B_c
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    keep = fn(0, 0, i.cuda(), j.cuda()).cpu().expand(sq, sk)
    n_qb, n_kb = -(-sq // B_r), -(-sk // B_c)
    assert got.shape == (1, 1, n_qb, 2 + n_kb)
    for qb in range(n_qb):
        classes = []
        for kb in range(n_kb):
            block = keep[qb * B_r:(qb + 1) * B_r, kb * B_c:(kb + 1) * B_c]
            classes.append(2 if block.all() else 1 if block.any() else 0)
        kept = [kb for kb, c in enumerate(classes) if c]
        want = [kept[0], kept[-1] + 1] if kept else [0, 0]
        assert got[0, 0, qb].tolist() == want + classes, f"query block {qb}"
    # the simulators' numpy block mask is the GPU's, bit for bit
    assert got.tolist() == block_mask(ScoreMask("none", B_r, B_c, mods), mask_args.values(), b, hq, sq, sk).tolist()
    before = dict(variant._block_masks)
    variant._block_mask(mods, q, k, words, tensors)
    assert variant._block_masks == before, "a repeated call made its block mask again"


def _block_mask_rows(attn, mods, made: torch.Tensor, shape, built_in=(0, -1, -1)) -> torch.Tensor:
    """The rows of a forward block mask (the kernel's ``made``); where the kernel takes a tile order (persistent
    wgmma kernels), checked first to be the scheduler's for this GPU and the call's built-in mask ``built_in``
    (offset, window left, right), against the numpy twin."""
    b, sq, sk, hq, _ = shape
    rows = mods.block_mask_shape(b, hq, sq, sk, attn.cfg.B_r, attn.cfg.B_c)
    if not orders_tiles(attn.cfg.persistent, True):
        return made
    tiles = -(-sq // attn.cfg.B_r) * hq * b
    assert made.shape == (math.prod(rows) + tiles,)
    got, order = made[:-tiles].view(rows), made[-tiles:]
    plan = make_plan(attn.cfg, mods)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = tile_order(plan.scheduler, plan.score_mask, got.numpy(), b, hq, sq, sk, min(tiles, sms), *built_in)
    assert order.tolist() == want
    return got


@pytest.mark.parametrize("shape, causal", [((4, 1999, 1999, 16, 4), False), ((1, 300, 4000, 2, 2), False),
                                           ((3, 1500, 1700, 16, 8), True)])
def test_the_tile_order_deals_the_tiles_as_the_scheduler_does(attn, shape, causal):
    """A persistent kernel's block mask ends with the tile order (several sections of rounds, a partial last
    round; with the built-in causal mask, bottom-right, its tiles weighed by the key blocks they walk): the GPU's
    is the scheduler's rule on the same block mask, and the kernel's output is still right."""
    if not orders_tiles(attn.cfg.persistent, True):
        pytest.skip(f"{attn.cfg.short_form()} takes its tiles in the scheduler's order")
    _, fn = _factory("document_mask", shape, "cuda")
    q, k, v = _inputs(attn, shape, seed=5)
    mods, (_, mask_args) = fg_mods.prepare_mods(mask_mod=fn)
    variant = (attn._variant("causal") if causal else attn)._with_mods(mods)
    words, tensors = mods.pack(None, mask_args)
    built_in = (shape[2] - shape[1], -1, -1) if causal else (0, -1, -1)
    _block_mask_rows(variant, mods, variant._block_mask(mods, q, k, words, tensors, built_in).cpu(), shape, built_in)
    align = "bottom_right" if causal else "top_left"
    check_attention(attn(q, k, v, mask_mod=fn, causal=causal, align=align), q, k, v, mask_mod=fn, causal=causal, align=align)


def test_a_block_mask_of_another_size_is_refused_before_any_kernel_runs(attn):
    """The launcher operators check a block mask's size against the kernel's own rule: a caller of the raw
    operators cannot make the kernel read, or the block-mask kernels write, past the tensor."""
    shape = SHAPES[3]
    _, fn = _factory("document_mask", shape, "cuda")
    q, k, v = _inputs(attn, shape, seed=3)
    mods, (_, mask_args) = fg_mods.prepare_mods(mask_mod=fn)
    variant = attn._with_mods(mods)
    words, tensors = mods.pack(None, mask_args)
    good = variant._block_mask(mods, q, k, words, tensors)
    scale = q.shape[-1] ** -0.5
    with pytest.raises(ValueError, match="block_mask has .* elements"):
        torch.ops.flashgen.attention_mods(q, k, v, variant._handle, scale, 0, -1, -1, False, words, tensors, good[..., :-1].contiguous())
    with pytest.raises(ValueError, match="mask_blocks: shape"):
        torch.ops.flashgen.mask_blocks(q, k, variant._handle, [1, 1, 1, 2], words, tensors, 0, -1, -1)
    o, _ = torch.ops.flashgen.attention_mods(q, k, v, variant._handle, scale, 0, -1, -1, False, words, tensors, good)
    assert torch.isfinite(o).all()


@pytest.mark.parametrize("window, sinks, shape", [(40, 3, (1, 999, 1011, 4, 2)), (40, 3, (2, 777, 1029, 12, 4)),
                                                  (40, 0, (1, 1300, 1011, 4, 2))])
def test_sink_window_walks_past_empty_blocks(attn, window, sinks, shape):
    """Attention sinks + a causal window (examples/mods.py): the key blocks between the sinks and the
    window are empty for every later query block, and the kernels walk past them (the wgmma producer and
    consumers alike; persistent CTAs, and wave-tail splits whose parts may hold only empty blocks). Odd
    lengths, GQA; without sinks the query blocks past the keys keep nothing: o = 0, lse = -inf."""
    b, sq, sk, hq, hk = shape
    fn = examples.sliding_window_sinks(window, sinks)
    q, k, v = _inputs(attn, shape, seed=window + sinks)
    mods, (_, mask_args) = fg_mods.prepare_mods(mask_mod=fn)
    rows = block_mask(ScoreMask("none", attn.cfg.B_r, attn.cfg.B_c, mods), mask_args.values(), b, hq, sq, sk)
    rows = rows.reshape(-1, rows.shape[-1])
    if sinks:
        assert any((r[2 + r[0]: 2 + r[1]] == 0).any() for r in rows), "no query block has an empty block to skip"
    else:
        assert any(r[0] == r[1] for r in rows), "no query block without a kept key"
    o, lse = attn(q, k, v, return_lse=True, mask_mod=fn)
    check_attention(o, q, k, v, f"{attn.cfg.short_form()} sinks {sinks} + window {window} {shape}", mask_mod=fn)
    ref_o, ref_lse = flashgen.reference.attention(q, k, v, return_lse=True, mask_mod=fn)
    kept = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), kept), "rows without a kept key must give lse -inf, the others finite"
    assert (o.float()[~kept.transpose(1, 2)] == 0).all(), "rows without a kept key give o = 0"
    assert (lse[kept] - ref_lse[kept]).abs().max().item() < 1e-3


@pytest.mark.parametrize("cfg, seq_q, seq_k", [(CONFIGS[0], 37, 91), (CONFIGS[2], 37, 91), (CONFIGS[2], 3001, 2999)])
def test_memcheck_clean_with_mods(cfg, seq_q, seq_k):
    """A score_mod and a mask_mod reading a captured tensor, odd lengths, GQA: the kernel, its block mask's
    kernels and the mods' loads stay in bounds (at 3001 x 2999 the persistent kernel walks two rounds of its
    block mask's tile order, the second partial)."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not on PATH")
    repo = Path(__file__).parents[2]
    res = subprocess.run([exe, "--tool", "memcheck", "--error-exitcode", "9", sys.executable,
                          str(repo / "tests/gpu/run_mods.py"), cfg, str(seq_q), str(seq_k)],
                         capture_output=True, text=True, cwd=repo, timeout=600)
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "ERROR SUMMARY: 0 errors" in text, text[-6000:]


# ---- diagonal mask_mods run as the built-in masks (flashgen.mods.diagonal) ----------------------------------

#: name -> (mask_mod, the built-in call that keeps the same keys)
DIAGONAL = {
    "causal": (examples.causal(), dict(causal=True)),
    "sliding_window": (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 37), dict(window=(37, 0))),
    "band": (lambda b, h, q_idx, kv_idx: (kv_idx - q_idx <= 5) & (kv_idx >= q_idx - 20), dict(window=(20, 5))),
}
# seq_q != seq_k both ways; in (1, 257, 130, ...) the rows past key 129 + the window keep no key
DIAGONAL_SHAPES = [(2, 113, 113, 4, 2), (1, 200, 333, 2, 2), (1, 257, 130, 3, 1)]


def _run(attn, q, k, v, do, **kw):
    """(o, lse, dq, dk, dv) of one differentiated call."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = attn(*leaves, return_lse=True, **kw)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do))


@pytest.mark.parametrize("name", list(DIAGONAL))
def test_diagonal_mask_mods_are_the_built_in_masks_bit_for_bit(attn, name):
    """A mask_mod that is a diagonal rule runs as the built-in causal / window kernels: o, lse and the gradients
    equal those of the built-in call bit for bit (deterministic backward) and match the float64 reference."""
    mask_mod, builtin = DIAGONAL[name]
    det = flashgen.compile(attn.cfg, deterministic=True)  # ordered dQ adds: equal inputs, equal bits
    for n, shape in enumerate(DIAGONAL_SHAPES):
        q, k, v = _inputs(attn, shape, seed=30 + n)
        do = torch.randn_like(q)
        what = f"{attn.cfg.short_form()} {name} as a mask_mod {shape}"
        got = _run(det, q, k, v, do, mask_mod=mask_mod)
        want = _run(det, q, k, v, do, **builtin)
        for g, w, part in zip(got, want, ("o", "lse", "dq", "dk", "dv")):
            assert torch.equal(g, w), f"{what}: {part} differs from the built-in {builtin}'s"
        check_attention(got[0], q, k, v, what, mask_mod=mask_mod)
        check_gradients(got[2:], q, k, v, do, what, mask_mod=mask_mod)


def test_rows_without_a_kept_key_agree_between_the_built_in_window_and_a_kept_mask_mod(attn):
    """The same band, once with literal sizes (the built-in window) and once with captured ones (a mask_mod):
    rows without a kept key give o = 0 and lse = -inf in both, the others agree with the reference."""
    shape = DIAGONAL_SHAPES[2]
    right, left = 5, 20

    def captured_band(b, h, q_idx, kv_idx):
        return (kv_idx - q_idx <= right) & (kv_idx >= q_idx - left)

    assert fg_mods.trace(captured_band, "mask").diagonal is None  # captured numbers: a mask_mod
    q, k, v = _inputs(attn, shape, seed=41)
    _, ref_lse = flashgen.reference.attention(q, k, v, return_lse=True, mask_mod=captured_band)
    kept = torch.isfinite(ref_lse)
    assert not kept.all(), "the shape leaves rows without a kept key"
    for mod in (DIAGONAL["band"][0], captured_band):
        o, lse = attn(q, k, v, return_lse=True, mask_mod=mod)
        assert torch.equal(torch.isfinite(lse), kept), "rows without a kept key must give lse -inf, the others finite"
        assert (o.float()[~kept.transpose(1, 2)] == 0).all(), "rows without a kept key give o = 0"
        assert (lse[kept] - ref_lse[kept]).abs().max().item() < 1e-3
        check_attention(o, q, k, v, f"{attn.cfg.short_form()} band", mask_mod=mod)


def test_compile_auto_runs_a_sliding_window_mask_mod_as_its_window_kernel():
    """With or without the call's own causal / window (which this window lies inside), bit for bit."""
    attn = flashgen.compile("auto")
    mask_mod = DIAGONAL["sliding_window"][0]
    for n, (b, sq, sk, hq, hk) in enumerate(DIAGONAL_SHAPES):
        g = torch.Generator(device="cuda").manual_seed(50 + n)
        q, k, v = (torch.randn(b, s, h, 128, device="cuda", generator=g).to(torch.bfloat16)
                   for s, h in ((sq, hq), (sk, hk), (sk, hk)))
        want = attn(q, k, v, window=(37, 0))
        for kw in ({}, {"causal": True}, {"window": (64, -1)}):
            got = attn(q, k, v, mask_mod=mask_mod, **kw)
            assert torch.equal(got, want), f"{(b, sq, sk, hq, hk)} {kw}"
            check_attention(got, q, k, v, f"auto sliding window {(b, sq, sk, hq, hk)} {kw}", mask_mod=mask_mod, **kw)


def test_flex_attentions_own_combinators_compile(attn):
    """FlexAttention's ``and_masks`` / ``or_masks`` of the examples (their parts' captured tensors and numbers read
    where the parts hold them): the output and the gradients against the reference with the same functions."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    shape = SHAPES[2]
    _, document = _factory("document_mask", shape, "cuda")
    for fn in (flex.and_masks(examples.causal(), document), flex.or_masks(examples.prefix_lm(40), document)):
        q, k, v = _inputs(attn, shape, seed=9)
        do = torch.randn_like(q)
        what = f"{attn.cfg.short_form()} {fn.__name__}"
        got = _run(attn, q, k, v, do, mask_mod=fn)
        check_attention(got[0], q, k, v, what, mask_mod=fn)
        check_gradients(got[2:], q, k, v, do, what, mask_mod=fn)
