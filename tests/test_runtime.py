"""The call path of ``compile("auto")`` on the CPU: dispatch, what a hit may not do, masks, torch.compile.

The kernel side is replaced by doubles: building returns a record without compiling,
loading hands out launcher handles, and both ways into the launcher (its eager entry
points, and a CPU implementation of the ``flashgen::attention`` operator for traced calls)
record which handle each call reached and return ``q + handle`` (so a test can tell
kernels apart by the output). Everything between the user's call and the launcher is
the real code; ``test_launcher.py`` runs the real launcher.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen import runtime  # noqa: E402
from flashgen.build import Built  # noqa: E402
from flashgen.mods.kernel_mods import prepare_mods  # noqa: E402
from flashgen.ptxas import PtxasStats  # noqa: E402
from flashgen.dsl.dtypes import DType  # noqa: E402
from flashgen.tune import lookup, seq_bucket  # noqa: E402

REAL_SELECT = runtime._select


class Kernels:
    """Doubles for the build, the load and the device, with a log of what each was asked."""

    def __init__(self):
        self.built: list = []  # configs built, in order
        self.selects: list = []  # (device, dtype, d_head, seq, masked) looked up
        self.launched: list[int] = []  # handles the operator ran

    def build(self, cfg, capability=None, verbose=False, mods=None):
        self.built.append(cfg)
        return Built(cfg, cfg.mangle(), "key", Path("/nonexistent"), tuple(capability), 0.0, True, mods)

    def load(self, built, verbose):
        return len(self.built) - 1  # the handle of the kernel just built

    def select(self, device, dtype, d_head, seq_q, masked):
        self.selects.append((device, dtype, d_head, seq_q, masked))
        return lookup("NVIDIA H100", DType.parse(str(dtype)), int(d_head), int(seq_q), cache={}, capability=(9, 0),
                      masked=masked)


class Native:
    """The launcher's eager entry points, as their contract says (flashgen/native/launcher.cpp): ``call`` runs a
    kernel or returns None for a device not yet allowed for it and for a call autograd must record; ``dispatch`` runs the kernel a table holds for
    the call's key or returns None; a failed check raises ValueError."""

    def __init__(self, kernels: Kernels):
        self.kernels = kernels
        self.allowed: set[int] = set()
        self.tables: list[dict] = []

    def allow_device(self, kernel, index):
        self.allowed.add(kernel)

    def call(self, q, k, v, out, kernel, scale, left, right, align, return_lse):
        if kernel not in self.allowed or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return None
        if align not in ("top_left", "bottom_right"):
            raise ValueError(f"align='{align}': expected 'top_left' or 'bottom_right'")
        self.kernels.launched.append(kernel)
        o = q + kernel
        return (o, q.new_empty((0,), dtype=torch.float32)) if return_lse else o

    def new_dispatch_table(self):
        self.tables.append({})
        return len(self.tables) - 1

    def remember(self, table, q, mask, kernel):
        self.tables[table][(q.dtype, q.shape[3], q.shape[1], mask)] = kernel

    def dispatch(self, table, q, k, v, out, scale, mask, left, right, align, return_lse):
        if not isinstance(q, torch.Tensor):
            raise TypeError("dispatch(): incompatible function arguments")
        if q.dim() != 4:
            return None
        kernel = self.tables[table].get((q.dtype, q.shape[3], q.shape[1], mask))
        return None if kernel is None else self.call(q, k, v, out, kernel, scale, left, right, align, return_lse)


@pytest.fixture
def kernels(monkeypatch):
    k = Kernels()
    native = Native(k)
    monkeypatch.setattr(runtime.launcher, "native", lambda: native)
    # CPU tensors pass the checks; a passed check allows the device, as the real one does
    monkeypatch.setattr(runtime.Attention, "check", lambda self, q, k_, v, out=None: native.allow_device(self._handle, 0))
    monkeypatch.setattr(runtime, "build", k.build)
    monkeypatch.setattr(runtime, "_load", k.load)
    monkeypatch.setattr(runtime, "_select", k.select)
    monkeypatch.setattr(runtime, "device_facts", lambda index: ("NVIDIA H100", (9, 0)))
    monkeypatch.setattr(runtime, "_device_index", lambda device: 0)

    def attention(q, k_, v, kernel, scale, offset, left, right, return_lse):
        k.launched.append(kernel)
        return q + kernel, q.new_empty((0,), dtype=torch.float32)

    lib = torch.library.Library("flashgen", "IMPL")
    lib.impl("attention", attention, "CPU")
    yield k
    lib._destroy()


def qkv(seq=64, d=128, dtype=torch.float16):
    q = torch.zeros(2, seq, 4, d, dtype=dtype)
    return q, q, q


def no_device(*args, **kwargs):
    raise AssertionError("the dispatch hit path asked the device")


def test_a_hit_asks_the_device_nothing_and_reads_no_tuning_table(kernels, monkeypatch):
    auto = runtime.compile("auto")
    auto(*qkv())
    assert len(kernels.selects) == 1 and len(kernels.built) == 1
    for name in ("get_device_name", "get_device_capability", "get_device_properties", "current_device"):
        monkeypatch.setattr(torch.cuda, name, no_device)
    monkeypatch.setattr(runtime, "device_facts", no_device)
    monkeypatch.setattr(runtime, "_select", no_device)
    for _ in range(3):
        auto(*qkv())
    assert kernels.launched == [0, 0, 0, 0]


def test_the_first_masked_call_builds_only_the_masked_kernel(kernels):
    auto = runtime.compile("auto")
    o = auto(*qkv(), causal=True)
    assert [c.mask for c in kernels.built] == ["causal"] and kernels.selects[0][-1] is True
    assert torch.equal(o, qkv()[0] + 0)
    auto(*qkv(), window=(8, 0))
    assert [c.mask for c in kernels.built] == ["causal", "window"]
    auto(*qkv())
    assert [c.mask for c in kernels.built] == ["causal", "window", "none"]


def test_lengths_of_one_bucket_share_a_kernel_and_other_buckets_may_not(kernels, monkeypatch):
    shipped = kernels.select

    def tuned_512(device, dtype, d_head, seq_q, masked):  # a tune cache holding a config of its own for bucket 512
        cfg = shipped(device, dtype, d_head, seq_q, masked)
        return cfg.replace(B_c=64) if seq_bucket(int(seq_q)) == 512 else cfg

    monkeypatch.setattr(runtime, "_select", tuned_512)
    auto = runtime.compile("auto")
    for seq in (2048, 2000, 2500, 4096):  # buckets 2048 and 4096: the shipped default
        auto(*qkv(seq))
    auto(*qkv(512))
    assert len(kernels.built) == 2 and kernels.built[0].B_c != kernels.built[1].B_c
    assert kernels.launched == [0, 0, 0, 0, 1]


def _spill(function="k"):
    return PtxasStats(function, 168, 16, 16, 16, 0)


@pytest.mark.parametrize("clean_rows, tried_rows, run_rows", [((128, 64), [128], 128), ((64,), [128, 64], 64), ((), [128, 64], 128)],
                         ids=["preferred-clean", "fallback-clean", "neither-clean"])
def test_a_backward_with_mods_that_spills_falls_back_to_fewer_rows(kernels, monkeypatch, clean_rows, tried_rows, run_rows):
    """A mask_mod's d_head-64 wgmma backward prefers 128-row query blocks; where the user's function spilled
    there, the 64-row kernel runs if it compiled clean, else the preferred one."""
    mods = prepare_mods(mask_mod=lambda b, h, q, kv: (q // 7) == (kv // 7))[0]
    fwd = lookup("NVIDIA H100", DType.FP16, 64, 2048, cache={}, capability=(9, 0))
    attn = runtime.Attention(kernels.build(fwd, (9, 0), mods=mods))
    tried = []

    def build(cfg, capability=None, verbose=False, mods=None):
        tried.append(cfg.B_r)
        stats = () if cfg.B_r in clean_rows else (_spill(),)
        return Built(cfg, cfg.mangle(), "key", Path("/nonexistent"), tuple(capability), 0.0, True, mods, stats)

    monkeypatch.setattr(runtime, "build", build)
    preferred = attn.backward_config()
    assert preferred.B_r == 128 and preferred.engine == "wgmma"
    built = attn._build_backward(preferred)
    assert tried == tried_rows and built.cfg.B_r == run_rows and built.mods is mods


def test_an_mma_sync_backward_with_mods_that_spills_falls_back_to_the_former_shape(kernels, monkeypatch):
    """On an sm_80 GPU the d_head-64 backward prefers 8 warps in pairs with split scores; where the user's
    functions spilled there, the former 4-warp shape (no split) runs."""
    mods = prepare_mods(mask_mod=lambda b, h, q, kv: (q // 7) == (kv // 7))[0]
    fwd = lookup("NVIDIA A100", DType.FP16, 64, 2048, cache={}, capability=(8, 0))
    attn = runtime.Attention(kernels.build(fwd, (8, 0), mods=mods))
    tried = []

    def build(cfg, capability=None, verbose=False, mods=None):
        tried.append(cfg)
        stats = (_spill(),) if cfg.split_scores else ()
        return Built(cfg, cfg.mangle(), "key", Path("/nonexistent"), tuple(capability), 0.0, True, mods, stats)

    monkeypatch.setattr(runtime, "build", build)
    preferred = attn.backward_config()
    assert preferred.engine == "mma_sync" and preferred.split_scores
    built = attn._build_backward(preferred)
    assert tried[0] == preferred and len(tried) == 2 and built.cfg == tried[1]
    assert (built.cfg.n_warps, built.cfg.split_scores, built.cfg.mask, built.cfg.stages) == (4, False, preferred.mask, preferred.stages)


def test_a_backward_without_mods_keeps_its_kernel_whatever_ptxas_said(kernels, monkeypatch):
    attn = runtime.Attention(kernels.build(lookup("NVIDIA H100", DType.FP16, 64, 2048, cache={}, capability=(9, 0)), (9, 0)))
    tried = []

    def build(cfg, capability=None, verbose=False, mods=None):
        tried.append(cfg.B_r)
        return Built(cfg, cfg.mangle(), "key", Path("/nonexistent"), tuple(capability), 0.0, True, mods, (_spill(),))

    monkeypatch.setattr(runtime, "build", build)
    assert attn._build_backward(attn.backward_config()).cfg.B_r == 128 and tried == [128]


def test_calls_that_cannot_be_dispatched_raise_input_errors(kernels, monkeypatch):
    monkeypatch.setattr(runtime, "_select", REAL_SELECT)  # the real checks of what can be looked up
    auto = runtime.compile("auto")
    with pytest.raises(runtime.InputError, match="q is on cpu; flashgen kernels run on CUDA devices"):
        auto(*qkv())
    with pytest.raises(runtime.InputError, match="float16 or bfloat16"):
        auto(*qkv(dtype=torch.float32))
    with pytest.raises(runtime.InputError, match="4-D"):
        auto(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(runtime.InputError, match="must be a torch.Tensor"):
        auto([1], [1], [1])
    with pytest.raises(runtime.InputError, match="either causal=True or window"):
        auto(*qkv(), causal=True, window=(1, 1))
    assert not kernels.built


def test_torch_compile_fullgraph_picks_the_kernel_while_tracing(kernels):
    auto = runtime.compile("auto")

    def f(q, k, v):
        return auto(q, k, v, causal=True) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    assert torch.equal(compiled(*qkv(64)), f(*qkv(64)))
    assert torch.equal(compiled(*qkv(3000)), f(*qkv(3000)))  # another bucket: traced again (or guarded)
    unmasked = torch.compile(lambda q, k, v: auto(q, k, v), fullgraph=True, backend="eager")
    assert torch.equal(unmasked(*qkv(2048)), auto(*qkv(2048)))
    assert unmasked(*qkv(2048))[0, 0, 0, 0] != compiled(*qkv(64))[0, 0, 0, 0] / 2  # not the causal kernel


def test_an_attention_refuses_a_bad_align_and_builds_mask_variants_once(kernels):
    attn = runtime.Attention(kernels.build(lookup("H100", DType.FP16, 128, 64, cache={}, capability=(9, 0)), (9, 0)))
    with pytest.raises(runtime.InputError, match="align="):
        attn(*qkv(), align="center")
    attn(*qkv(), causal=True)
    attn(*qkv(), causal=True)
    assert [c.mask for c in kernels.built] == ["none", "causal"]
