"""The backward's block mask on the CPU: autograd through a call with a mask_mod makes the backward kernel's
(transposed) block mask with ``flashgen::mask_blocks`` and that kernel's handle, keeps it while the sizes and
the mask_mod's values stay, and passes it to ``flashgen::attention_backward_mods``; the operator's schema and
fake take it. The kernels are doubles: CPU implementations of the operators that log what reached them.
"""
from __future__ import annotations

import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen import autograd, launcher, runtime  # noqa: E402
from flashgen.build import Built  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen.dsl.config import KernelConfig  # noqa: E402
from flashgen.mods.kernel_mods import prepare_mods  # noqa: E402


class Kernels:
    """Builds and loads that hand out handles, and CPU doubles of the operators, each logging its calls."""

    def __init__(self):
        self.built: list = []  # (config, mods) per handle
        self.mask_blocks: list = []  # (handle, shape, words) of each mask_blocks call
        self.backward: list = []  # (handle, block_mask) of each attention_backward_mods call

    def build(self, cfg, capability=None, verbose=False, mods=None):
        self.built.append((cfg, mods))
        return Built(cfg, cfg.mangle(), "key", Path("/nonexistent"), (9, 0), 0.0, True, mods)

    def load(self, built, verbose):
        return len(self.built) - 1

    def attention_mods(self, q, k, v, kernel, scale, offset, left, right, return_lse, words, tensors, block_mask):
        b, sq, h, _ = q.shape
        return q * 2, torch.zeros((b, h, sq) if return_lse else (0,), dtype=torch.float32)

    def mask_blocks_op(self, q, k, kernel, shape, words, tensors, offset, left, right):
        self.mask_blocks.append((kernel, tuple(shape), list(words)))
        return torch.full(shape, len(self.mask_blocks), dtype=torch.int32)

    def attention_backward_mods(self, dout, q, k, v, out, lse, dlse, kernel, scale, offset, left, right, words, tensors,
                                block_mask):
        self.backward.append((kernel, block_mask))
        return dout * 2, torch.zeros_like(k), torch.zeros_like(v)


@pytest.fixture
def kernels(monkeypatch):
    fake = Kernels()
    # the launcher's eager entries answer None as for a call to differentiate or an unchecked device, so every call
    # takes the operators, whose CPU kernels are the doubles below
    native = types.SimpleNamespace(call_mods=lambda *args: None, call_mods_again=lambda *args: None,
                                   new_dispatch_table=lambda: 0, remember_mods=lambda *args: None,
                                   ModReader=lambda *args: types.SimpleNamespace(update=lambda *a: None, forget=lambda: None))
    monkeypatch.setattr(runtime.launcher, "native", lambda: native)
    monkeypatch.setattr(runtime.Attention, "check", lambda self, q, k, v, out=None: None)
    monkeypatch.setattr(runtime, "build", fake.build)
    monkeypatch.setattr(runtime, "_load", fake.load)
    monkeypatch.setattr(runtime, "device_facts", lambda index: ("NVIDIA H100", (9, 0)))
    monkeypatch.setattr(runtime, "_device_index", lambda device: 0)
    for name, value in (("_factories", {}), ("_handles", {}), ("_always_deterministic", set()), ("_block_masks", {})):
        monkeypatch.setattr(autograd, name, value)
    lib = torch.library.Library("flashgen", "IMPL")
    lib.impl("attention_mods", fake.attention_mods, "CPU")
    lib.impl("mask_blocks", fake.mask_blocks_op, "CPU")
    lib.impl("attention_backward_mods", fake.attention_backward_mods, "CPU")
    yield fake
    lib._destroy()


DOC = torch.tensor([0] * 50 + [1] * 70 + [2] * 80, dtype=torch.int32)


def same_document(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def _inputs(seq=200):
    q = torch.randn(2, seq, 4, 64, dtype=torch.float16)
    k, v = torch.randn(2, seq, 2, 64, dtype=torch.float16), torch.randn(2, seq, 2, 64, dtype=torch.float16)
    return q.requires_grad_(), k, v


def test_autograd_passes_the_backward_kernels_block_mask(kernels):
    attn = runtime.Attention(runtime.build(KernelConfig(dtype="fp16", d_head=64)))
    q, k, v = _inputs()
    attn(q, k, v, mask_mod=same_document).sum().backward()
    (fwd_handle, fwd_shape, words), (bwd_handle, bwd_shape, bwd_words) = kernels.mask_blocks
    handle, block_mask = kernels.backward[-1]
    cfg, mods = kernels.built[handle]
    assert isinstance(cfg, BackwardConfig) and mods is not None and mods.mask is not None
    assert bwd_handle == handle != fwd_handle and bwd_words == words  # the forward call's values
    assert bwd_shape == mods.block_mask_shape(2, 4, 200, 200, cfg.B_r, cfg.B_c, transposed=True)
    assert fwd_shape == mods.block_mask_shape(2, 4, 200, 200, attn.cfg.B_r, attn.cfg.B_c)  # the forward's own layout
    assert torch.equal(block_mask, torch.full(bwd_shape, 2, dtype=torch.int32))  # the one mask_blocks made for it
    assert torch.equal(q.grad, torch.full_like(q, 2))


def test_the_backwards_block_mask_is_kept_while_sizes_and_mask_values_stay(kernels):
    attn = runtime.Attention(runtime.build(KernelConfig(dtype="fp16", d_head=64)))

    def backward_masks():
        return [m for m in kernels.mask_blocks if isinstance(kernels.built[m[0]][0], BackwardConfig)]

    for _ in range(2):
        attn(*_inputs(), mask_mod=same_document).sum().backward()
    assert len(backward_masks()) == 1 and kernels.backward[0][1] is kernels.backward[1][1]
    DOC[60:] = 3 - DOC[60:]  # the captured tensor changed in place: a new block mask
    try:
        attn(*_inputs(), mask_mod=same_document).sum().backward()
    finally:
        DOC[60:] = 3 - DOC[60:]
    attn(*_inputs(seq=120), mask_mod=same_document, score_mod=softcap).sum().backward()  # another length
    assert len(backward_masks()) == 3
    attn(*_inputs(), score_mod=softcap).sum().backward()  # no mask_mod: no block mask
    assert kernels.backward[-1][1] is None and len(backward_masks()) == 3


def test_each_backward_variant_gets_a_block_mask_of_its_own_handle(kernels):
    attn = runtime.Attention(runtime.build(KernelConfig(dtype="fp16", d_head=64)))
    attn(*_inputs(), mask_mod=same_document).sum().backward()
    with _deterministic():
        attn(*_inputs(), mask_mod=same_document).sum().backward()
    (h0, m0), (h1, m1) = kernels.backward
    assert h0 != h1 and kernels.built[h1][0].deterministic and not kernels.built[h0][0].deterministic
    assert [m[0] for m in kernels.mask_blocks if m[0] in (h0, h1)] == [h0, h1]
    assert not torch.equal(m0, m1)


class _deterministic:
    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.was)


def test_the_operator_takes_a_block_mask_and_its_fake_gives_the_gradients_shapes():
    schema = str(torch.ops.flashgen.attention_backward_mods.default._schema)
    assert schema.endswith("Tensor[] mod_tensors, Tensor? block_mask) -> (Tensor, Tensor, Tensor)")
    assert launcher.ATTENTION_BACKWARD_MODS_SCHEMA in schema
    meta = lambda *shape: torch.empty(*shape, device="meta")  # noqa: E731
    q, k = meta(2, 9, 4, 64), meta(2, 7, 2, 64)
    for block_mask in (None, meta(5).int()):
        dq, dk, dv = torch.ops.flashgen.attention_backward_mods(q, q, k, k, q, meta(2, 4, 9), None, 0, 0.1, 0, -1, -1, [3],
                                                                [meta(9).int()], block_mask)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)


def test_a_kernel_without_a_mask_mod_registers_no_block_mask(kernels):
    mods, _ = prepare_mods(softcap, None)
    attn = runtime.Attention(runtime.build(KernelConfig(dtype="fp16", d_head=64), mods=mods))
    assert attn._handle in autograd._factories and attn._handle not in autograd._block_masks
    masked, _ = prepare_mods(None, same_document)
    attn = runtime.Attention(runtime.build(KernelConfig(dtype="fp16", d_head=64), mods=masked))
    assert autograd._block_masks[attn._handle] == attn._backward_block_mask
