"""Differentiable calls on the CPU: what autograd records, which backward kernel it runs, and with what.

The launcher's operators are replaced by CPU doubles that do the attention math in float64
(``flashgen::attention`` returns o and lse; ``flashgen::attention_backward`` returns the exact
gradients of ``sum(o * dout) + sum(lse * dlse)``) and log the kernel handles they were given; builds
and loads are the doubles of ``test_runtime.py``. So the gradients a test gets are right exactly when
the runtime saved the right tensors, passed the lse's gradient, picked the backward kernel of the
forward's dtype, head size and mask and handed over its handle. ``tests/gpu`` runs the real kernels.
"""
from __future__ import annotations

import math

import pytest

from flashgen import engines

torch = pytest.importorskip("torch")

from flashgen import autograd, runtime  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen.dsl.dtypes import DType  # noqa: E402
from flashgen.tune import lookup  # noqa: E402

from test_runtime import Kernels, Native  # noqa: E402


def _math(q, k, v, scale, offset, left, right):
    """o and lse of (batch, seq, heads, d) float64 tensors with the kernels' mask convention (GQA by repeat)."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i = torch.arange(q.shape[1])[:, None] + offset
    j = torch.arange(k.shape[1])[None, :]
    keep = torch.ones_like(s[0, 0], dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v), lse


class Ops:
    """CPU doubles of the operators; ``calls`` logs (operator, kernel handle, return_lse or dlse given)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def attention(self, q, k, v, kernel, scale, offset, left, right, return_lse):
        self.calls.append(("attention", kernel, return_lse))
        o, lse = _math(q, k, v, scale, offset, left, right)
        return o.to(q.dtype), (lse.float() if return_lse else q.new_empty((0,), dtype=torch.float32))

    def attention_backward(self, dout, q, k, v, out, lse, dlse, kernel, scale, offset, left, right):
        self.calls.append(("attention_backward", kernel, dlse is not None))
        assert dout.stride(-1) == 1 and all(st % 8 == 0 for st in dout.stride()[:-1]), "the kernel cannot read dout"
        with torch.enable_grad():
            qkv = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            o, lse_ = _math(*qkv, scale, offset, left, right)
            assert torch.allclose(lse_.float(), lse) and torch.allclose(o, out)  # the saved forward results
            loss = (o * dout).sum() + ((lse_ * dlse).sum() if dlse is not None else 0)
            return torch.autograd.grad(loss, qkv)


@pytest.fixture
def ops(monkeypatch):
    kernels, doubles = Kernels(), Ops()
    native = Native(kernels)
    monkeypatch.setattr(runtime.launcher, "native", lambda: native)
    monkeypatch.setattr(runtime.Attention, "check", lambda self, q, k_, v, out=None: native.allow_device(self._handle, 0))
    monkeypatch.setattr(runtime, "build", kernels.build)
    monkeypatch.setattr(runtime, "_load", kernels.load)
    # float64 inputs (the doubles' exact math) look up the fp16 kernels
    monkeypatch.setattr(runtime, "_select", lambda device, dtype, *shape: kernels.select(device, torch.float16, *shape))
    monkeypatch.setattr(runtime, "device_facts", lambda index: ("NVIDIA H100", (9, 0)))
    monkeypatch.setattr(runtime, "_device_index", lambda device: 0)
    # the doubles' handles restart at 0 in every test; real handles are unique in a process
    monkeypatch.setattr(autograd, "_factories", {})
    monkeypatch.setattr(autograd, "_handles", {})
    monkeypatch.setattr(autograd, "_always_deterministic", set())
    lib = torch.library.Library("flashgen", "IMPL")
    lib.impl("attention", doubles.attention, "CPU")
    lib.impl("attention_backward", doubles.attention_backward, "CPU")
    doubles.kernels = kernels
    yield doubles
    lib._destroy()


def inputs(seq_q=37, seq_k=45, heads=4, kv_heads=2, d=64, grad=True):
    gen = torch.Generator().manual_seed(seq_q * 7 + seq_k)
    q = torch.randn(2, seq_q, heads, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, seq_k, kv_heads, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def expected(q, k, v, dout, dlse=None, **mask):
    """The exact gradients of the same loss through the float64 math."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = _math(*leaves, **mask)
    loss = (o * dout).sum() + ((lse * dlse).sum() if dlse is not None else 0)
    return torch.autograd.grad(loss, leaves)


def attention_of(ops, d=64, mask="none", deterministic=False):
    cfg = lookup("H100", DType.FP16, d, 64, cache={}, capability=(9, 0)).replace(mask=mask)
    return runtime.Attention(ops.kernels.build(cfg, (9, 0)), deterministic=deterministic)


@pytest.mark.parametrize("mask", [{"causal": True}, {"causal": True, "align": "bottom_right"}, {"window": (5, 3)}, {}])
def test_gradients_reach_q_k_v_through_o_with_the_backward_kernel_of_the_forwards_mask(ops, mask):
    attn = attention_of(ops)
    q, k, v = inputs()
    o = attn(q, k, v, softmax_scale=0.3, **mask)
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    offset = k.shape[1] - q.shape[1] if mask.get("align") == "bottom_right" else 0
    left, right = (-1, 0) if mask.get("causal") else mask.get("window", (-1, -1))
    for got, want in zip(grads, expected(q, k, v, dout, scale=0.3, offset=offset, left=left, right=right)):
        torch.testing.assert_close(got, want)
    forward, backward = ops.calls[-2], ops.calls[-1]
    assert forward[0] == "attention" and forward[2] is True  # the lse is kept for the backward
    assert backward == ("attention_backward", autograd.backward_handle(forward[1], k.shape[1]), False)
    bwd_cfg = ops.kernels.built[backward[1]]
    want_mask = "causal" if mask.get("causal") else "window" if "window" in mask else "none"
    assert isinstance(bwd_cfg, BackwardConfig) and (bwd_cfg.mask, bwd_cfg.d_head, bwd_cfg.dtype) == (want_mask, 64, DType.FP16)


def test_a_gradient_through_the_returned_lse_reaches_the_backward(ops):
    attn = attention_of(ops)
    q, k, v = inputs()
    o, lse = attn(q, k, v, return_lse=True)
    dout, dlse = torch.randn_like(o), torch.randn_like(lse).double()
    grads = torch.autograd.grad((o * dout).sum() + (lse * dlse).sum(), (q, k, v))
    for got, want in zip(grads, expected(q, k, v, dout, dlse, scale=1 / 8, offset=0, left=-1, right=-1)):
        torch.testing.assert_close(got, want)
    assert ops.calls[-1][2] is True


def test_the_backward_kernel_is_built_once_with_the_first_differentiable_call(ops):
    attn = attention_of(ops)
    for _ in range(3):
        attn(*inputs()).sum().backward()  # sum(): an expanded, stride-0 gradient reaches the backward
    assert sum(isinstance(c, BackwardConfig) for c in ops.kernels.built) == 1
    assert [c[0] for c in ops.calls] == ["attention", "attention_backward"] * 3


def test_calls_without_grad_stay_on_the_eager_entry_point(ops):
    attn = attention_of(ops)
    attn(*inputs(grad=False))
    with torch.no_grad():
        attn(*inputs())
    assert not ops.calls and len(ops.kernels.launched) == 2  # the eager double ran both


def test_out_and_unsupported_head_sizes_are_refused_at_the_forward_call(ops):
    attn = attention_of(ops)
    q, k, v = inputs()
    with pytest.raises(runtime.InputError, match="out= cannot be differentiated"):
        attn(q, k, v, out=torch.empty_like(q))
    # d_head 160's backward needs 102,912 bytes of shared memory: more than compute capability 8.6 gives a block
    small = runtime.Attention(ops.kernels.build(lookup("RTX", DType.FP16, 160, 64, cache={}, capability=(8, 6)), (8, 6)))
    with pytest.raises(runtime.InputError, match="cannot be differentiated: no backward kernel takes d_head=160 within the 101376-byte"):
        small(*inputs(d=160))


@pytest.mark.parametrize("d", [160, 192])
def test_head_sizes_between_128_and_256_are_differentiated(ops, d):
    attn = attention_of(ops, d=d)
    q, k, v = inputs(d=d)
    o = attn(q, k, v, softmax_scale=0.3, causal=True)
    dout = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), dout)
    for got, want in zip(grads, expected(q, k, v, dout, scale=0.3, offset=0, left=-1, right=0)):
        torch.testing.assert_close(got, want)
    bwd_cfg = ops.kernels.built[ops.calls[-1][1]]
    assert (bwd_cfg.d_head, bwd_cfg.mask) == (d, "causal")


def test_compile_auto_is_differentiable_and_traced_by_torch_compile(ops):
    auto = runtime.compile("auto")
    q, k, v = inputs(seq_q=64, seq_k=64)
    dout = torch.randn_like(q)
    eager = torch.autograd.grad(auto(q, k, v, causal=True), (q, k, v), dout)
    compiled = torch.compile(lambda q, k, v: auto(q, k, v, causal=True), fullgraph=True, backend="aot_eager")
    traced = torch.autograd.grad(compiled(q, k, v), (q, k, v), dout)
    for a, b, c in zip(eager, traced, expected(q, k, v, dout, scale=1 / 8, offset=0, left=-1, right=0)):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)


def test_backward_handle_of_an_unregistered_kernel_says_what_to_do():
    with pytest.raises(RuntimeError, match="has no backward registered"):
        autograd.backward_handle(10**9)


def test_only_gradients_the_kernels_cannot_read_are_copied():
    g = torch.zeros(2, 8, 4, 64)
    assert autograd._launchable(g) is g
    for view in (g.transpose(1, 2), g[:, :, :, :32], g[:, 1:]):  # strided, rows still 16-byte aligned
        assert autograd._launchable(view) is view
    expanded = torch.ones(()).expand(2, 8, 4, 64)
    assert autograd._launchable(expanded).stride() == g.stride()
    shifted = torch.zeros(2 * 8 * 4 * 64 + 4)[4:].view(2, 8, 4, 64)  # rows 8 bytes off
    assert autograd._launchable(shifted).storage_offset() == 0


def _backward_configs(ops):
    """The backward configs the differentiable calls ran, in order."""
    return [ops.kernels.built[c[1]] for c in ops.calls if c[0] == "attention_backward"]


def test_compile_deterministic_runs_every_backward_on_the_deterministic_kernel(ops, monkeypatch):
    monkeypatch.setattr(runtime, "build", lambda cfg, capability=None, verbose=False, mods=None: ops.kernels.build(cfg, (9, 0), mods=mods))
    attn = runtime.compile(lookup("H100", DType.FP16, 64, 64, cache={}, capability=(9, 0)), deterministic=True)
    plain = attention_of(ops)
    q, k, v = inputs()
    dout = torch.randn(q.shape, dtype=q.dtype)
    for call in (lambda: attn(q, k, v, softmax_scale=0.3), lambda: attn(q, k, v, softmax_scale=0.3, causal=True),
                 lambda: plain(q, k, v, softmax_scale=0.3)):
        torch.autograd.grad(call(), (q, k, v), dout)
    det, det_causal, other = _backward_configs(ops)
    assert (det.deterministic, det.mask) == (True, "none")
    assert (det_causal.deterministic, det_causal.mask) == (True, "causal")  # the masked variant inherits the choice
    assert other.deterministic is False and det.replace(deterministic=False) == other
    assert attn.backward_config().deterministic and not plain.backward_config().deterministic


def test_torch_deterministic_mode_at_the_forward_call_chooses_the_deterministic_backward(ops):
    attn = attention_of(ops)
    q, k, v = inputs()
    dout = torch.randn(q.shape, dtype=q.dtype)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        o_det = attn(q, k, v)
        torch.use_deterministic_algorithms(False)
        o_plain = attn(q, k, v)
        torch.use_deterministic_algorithms(True)  # the setting at the backward call does not matter
        grads = torch.autograd.grad((o_plain * dout).sum() + (o_det * dout).sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(was)
    assert sorted(c.deterministic for c in _backward_configs(ops)) == [False, True]
    for got, want in zip(grads, expected(q, k, v, 2 * dout, scale=1 / 8, offset=0, left=-1, right=-1)):
        torch.testing.assert_close(got, want)
    handles = {c[1] for c in ops.calls if c[0] == "attention_backward"}
    forward = ops.calls[0][1]
    seq_k = k.shape[1]
    assert handles == {autograd.backward_handle(forward, seq_k, False), autograd.backward_handle(forward, seq_k, True)}


def test_each_backward_variant_is_built_once_and_calls_without_grad_build_none(ops):
    attn = attention_of(ops, deterministic=True)
    with torch.no_grad():
        attn(*inputs())
    assert not any(isinstance(c, BackwardConfig) for c in ops.kernels.built) and not ops.calls
    for _ in range(2):
        attn(*inputs()).sum().backward()
    assert [c.deterministic for c in ops.kernels.built if isinstance(c, BackwardConfig)] == [True]


def test_compile_refuses_a_deterministic_that_is_not_a_bool():
    with pytest.raises(TypeError, match="deterministic='yes': expected True or False"):
        runtime.compile("auto", deterministic="yes")


def test_compile_auto_deterministic_passes_the_choice_to_the_kernels_it_picks(ops):
    auto = runtime.compile("auto", deterministic=True)
    q, k, v = inputs(seq_q=64, seq_k=64)
    torch.autograd.grad(auto(q, k, v, causal=True), (q, k, v), torch.randn(q.shape, dtype=q.dtype))
    (cfg,) = _backward_configs(ops)
    assert cfg.deterministic and cfg.mask == "causal"


def test_compile_backward_engine_runs_every_backward_on_that_engine(ops, monkeypatch):
    monkeypatch.setattr(runtime, "build", lambda cfg, capability=None, verbose=False, mods=None: ops.kernels.build(cfg, (9, 0), mods=mods))
    cfg = lookup("H100", DType.FP16, 64, 64, cache={}, capability=(9, 0))
    sync, preferred = runtime.compile(cfg, backward_engine="mma_sync"), runtime.compile(cfg)
    q, k, v = inputs()
    dout = torch.randn(q.shape, dtype=q.dtype)
    for call in (lambda: sync(q, k, v), lambda: sync(q, k, v, causal=True), lambda: preferred(q, k, v)):
        torch.autograd.grad(call(), (q, k, v), dout)
    plain, causal, other = _backward_configs(ops)
    assert (plain.engine, plain.mask) == ("mma_sync", "none")
    assert (causal.engine, causal.mask) == ("mma_sync", "causal")  # the masked variant inherits the choice
    assert other.engine == "wgmma"  # compute capability 9.0's preferred backward at d_head 64


def test_compile_auto_backward_engine_passes_the_choice_to_the_kernels_it_picks(ops):
    auto = runtime.compile("auto", backward_engine="mma_sync")
    q, k, v = inputs(seq_q=64, seq_k=64)
    torch.autograd.grad(auto(q, k, v), (q, k, v), torch.randn(q.shape, dtype=q.dtype))
    (cfg,) = _backward_configs(ops)
    assert cfg.engine == "mma_sync"


def test_compile_refuses_an_unknown_backward_engine():
    with pytest.raises(ValueError, match="backward_engine='tpu': expected None or one of 'mma_sync', 'wgmma'"):
        runtime.compile("auto", backward_engine="tpu")


def test_a_backward_engine_the_call_cannot_use_is_an_input_error_at_the_differentiable_call(ops):
    """The backward kernel is built with the first forward that records a graph, so the forward says why."""
    attn = runtime.Attention(ops.kernels.build(lookup("H100", DType.FP16, 96, 64, cache={}, capability=(9, 0)), (9, 0)),
                             backward_engine="wgmma")
    with torch.no_grad():
        attn(*inputs(d=96, grad=False))  # no graph: no backward needed
    with pytest.raises(runtime.InputError, match="cannot be differentiated: the wgmma backward has no kernel for fp16 d_head=96"):
        attn(*inputs(d=96))


def test_each_key_length_bucket_gets_its_tuned_backward_kernel(ops, tmp_path, monkeypatch):
    from flashgen.policy import backward_bucket_key, save_cache

    tuned = BackwardConfig("fp16", d_head=64, B_r=128, B_c=32, n_warps=2)
    save_cache({"NVIDIA H100": {"fp16": {"64": {backward_bucket_key(512): {"config": tuned.short_form()}}}}},
               tmp_path / "tune.json")
    monkeypatch.setenv("FLASHGEN_TUNE_CACHE", str(tmp_path / "tune.json"))
    attn = attention_of(ops)
    handles, built_by_forward = [], []
    for seq_k in (45, 800, 60, 700):  # buckets 512, 1024, 512, 512 (the key length's, not the query's)
        q, k, v = inputs(seq_q=37, seq_k=seq_k)
        o = attn(q, k, v)
        built_by_forward.append(sum(isinstance(c, BackwardConfig) for c in ops.kernels.built))
        torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
        handles.append(ops.calls[-1][1])
    backwards = [c for c in ops.kernels.built if isinstance(c, BackwardConfig)]
    untuned = engines.ENGINES["wgmma"].backward.default_config(DType.FP16, 64)  # compute capability 9.0's
    assert backwards == [tuned, untuned]  # each built once, with its first forward call
    assert built_by_forward == [1, 2, 2, 2]
    assert [ops.kernels.built[h] for h in handles] == [tuned, backwards[1], tuned, tuned]
