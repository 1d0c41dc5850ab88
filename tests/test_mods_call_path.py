"""The eager call path of calls with a score_mod / mask_mod, on the CPU: the first call of a pair of functions
takes the full path (trace, build, check, the ``attention_mods`` operator); later calls with the same function
objects go to the launcher's eager entries with the values of the moment, without tracing: ``call_mods`` with the
values Python read, or (once such a call left its state in the launcher's reader) ``call_mods_again`` /
``dispatch_mods``, which read them in C++.

The kernel side is replaced by doubles that log what reached them: builds (with their mods), the operator,
``mask_blocks`` and the eager entries (which, as flashgen/native/launcher.cpp says, return None for a device not
yet allowed and for a call autograd must record, and raise ValueError on a failed check). :class:`ModReader` models
the launcher's reader rule for rule (tests/test_launcher.py checks the C++ one).
"""
from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen import runtime  # noqa: E402
from flashgen.build import Built  # noqa: E402
from flashgen.dsl.config import KernelConfig  # noqa: E402
from flashgen.mods import KernelMods, cache_info, trace  # noqa: E402


_UNREAD = object()


def _read(place):
    cell, table, key = place
    if cell is not None:
        try:
            return cell.cell_contents
        except ValueError:
            return _UNREAD
    return table.get(key, _UNREAD)


def _word(value, is_float: bool):
    """The launcher reader's word of a scalar, or None where it leaves the call to Python."""
    if is_float:
        if type(value) is not float or math.isnan(value):
            return None
        try:
            return struct.unpack("<i", struct.pack("<f", value))[0]
        except OverflowError:
            return None
    return value if type(value) is int and -2**31 <= value < 2**31 else None


class ModReader:
    """The launcher's reader (flashgen/native/launcher.cpp), modelled: the same arguments and rules."""

    def __init__(self, kernel, fns, statics, scalars, tensors, mask_first, mask_count, masked):
        self.kernel, self.fns, self.statics, self.scalars = kernel, fns, list(statics), list(scalars)
        self.slots = [[place, rank, None, 0, None, None] for place, rank in tensors]  # source, version, dtype, passed
        self.mask_words_at, self.masked, self.forgotten = slice(mask_first, mask_first + mask_count), masked, False
        self.device = self.mask_words = self.sizes = self.block_mask = None

    def serves(self, fn, i):
        if self.fns[i] is None:
            return fn is None
        ref, code = self.fns[i]
        return ref() is fn and type(fn).__name__ == "function" and fn.__code__ is code

    def values(self, q, k, score_fn, mask_fn):
        if self.forgotten or not (self.serves(score_fn, 0) and self.serves(mask_fn, 1)):
            return None
        for place, value in self.statics:
            now = _read(place)
            if type(now) is not type(value) or now != value:
                return None
        words = [_word(_read(place), is_float) for place, is_float in self.scalars]
        if None in words or ((self.masked or self.slots) and self.device != q.device):
            return None
        tensors = []
        for place, rank, source, version, dtype, passed in self.slots:
            t = _read(place)
            if source is None or source() is not t or type(t) is not torch.Tensor:
                return None
            if t._version != version or t.dtype != dtype or t.requires_grad or t.dim() != rank:
                return None
            tensors.append(t if passed is None else passed)
        if self.masked and (self.block_mask is None or self.sizes != (tuple(q.shape), k.shape[1])
                            or words[self.mask_words_at] != self.mask_words):
            return None
        return words, tensors, self.block_mask if self.masked else None

    def update(self, device, slots, mask_words, q, k, block_mask):
        if self.forgotten:
            return
        assert len(slots) == len(self.slots) and (block_mask is not None) == self.masked
        for slot, (source, version, dtype, passed) in zip(self.slots, slots):
            slot[2:] = [source, version, dtype, passed]
        self.device, self.mask_words, self.sizes = device, list(mask_words), (tuple(q.shape), k.shape[1])
        self.block_mask = block_mask

    def forget(self):
        self.forgotten, self.fns, self.statics, self.scalars, self.slots, self.block_mask = True, (None, None), [], [], [], None


class Launcher:
    """Doubles for building, loading, the operators and the eager entries, with a log of each."""

    ModReader = ModReader

    def __init__(self):
        self.builds: list = []  # the KernelMods key of each build (None: no mods)
        self.allowed: set[int] = set()
        self.operator: list = []  # (handle, words, tensors, offset, left, right) of attention_mods calls
        self.eager: list = []  # (handle, words, tensors, block_mask, align, left, right) of the eager entries' launches
        self.served: list = []  # of those, the launches whose values the launcher's reader read: their entry's name
        self.block_masks: list = []  # (words, tensors) of each mask_blocks call
        self.tables: list = []  # per dispatch table: (dispatch key, id(score_mod), id(mask_mod)) -> ModReader
        self.masks: list = []  # the built-in mask of each build, by handle
        self.plain: list = []  # (handle, offset or align, left, right) of launches without mods: operator or eager entry

    def build(self, cfg, capability=None, verbose=False, mods=None):
        self.builds.append(None if mods is None else mods.key)
        self.masks.append(cfg.mask)
        return Built(cfg, cfg.mangle(), "key", Path("/nonexistent"), (9, 0), 0.0, True, mods)

    def load(self, built, verbose):
        return len(self.builds) - 1

    def allow_device(self, kernel, index):
        self.allowed.add(kernel)

    def attention_mods(self, q, k, v, handle, scale, offset, left, right, return_lse, words, tensors, block_mask):
        self.operator.append((handle, list(words), list(tensors), offset, left, right))
        return q + handle, q.new_empty((0,), dtype=torch.float32)

    def mask_blocks(self, q, k, handle, shape, words, tensors, offset, left, right):
        self.block_masks.append((list(words), [t.clone() for t in tensors]))
        return torch.full(shape, len(self.block_masks), dtype=torch.int32)

    def call_mods(self, q, k, v, handle, scale, left, right, align, return_lse, words, tensors, block_mask):
        if handle not in self.allowed or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return None
        if align not in ("top_left", "bottom_right"):
            raise ValueError(f"align='{align}': expected 'top_left' or 'bottom_right'")
        self.eager.append((handle, list(words), list(tensors), block_mask, align, left, right))
        o = q + handle
        return (o, q.new_empty((0,), dtype=torch.float32)) if return_lse else o

    def attention(self, q, k, v, handle, scale, offset, left, right, return_lse):
        self.plain.append((handle, offset, left, right))
        return q + handle, q.new_empty((0,), dtype=torch.float32)

    def call(self, q, k, v, out, handle, scale, left, right, align, return_lse):
        if handle not in self.allowed or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return None
        self.plain.append((handle, align, left, right))
        o = q + handle
        return (o, q.new_empty((0,), dtype=torch.float32)) if return_lse else o

    def dispatch(self, table, q, k, v, out, scale, mask, left, right, align, return_lse):
        handle = self.tables[table].get(("plain", self._key(q, mask)))
        return None if handle is None else self.call(q, k, v, out, handle, scale, left, right, align, return_lse)

    def remember(self, table, q, mask, handle):
        self.tables[table][("plain", self._key(q, mask))] = handle

    def new_dispatch_table(self):
        self.tables.append({})
        return len(self.tables) - 1

    @staticmethod
    def _key(q, mask):
        return None if q is None else (q.device, q.dtype, q.shape[3], q.shape[1], mask)

    def remember_mods(self, table, q, mask, score_mod, mask_mod, reader):
        self.tables[table][(self._key(q, mask), id(score_mod), id(mask_mod))] = reader

    def _call_read(self, entry, table, key, q, k, v, scale, left, right, align, return_lse, score_mod, mask_mod):
        reader = self.tables[table].get((key, id(score_mod), id(mask_mod)))
        if reader is None or reader.kernel not in self.allowed:
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return None
        values = reader.values(q, k, score_mod, mask_mod)
        if values is None:
            return None
        result = self.call_mods(q, k, v, reader.kernel, scale, left, right, align, return_lse, *values)
        if result is not None:
            self.served.append(entry)
        return result

    def call_mods_again(self, table, q, k, v, scale, left, right, align, return_lse, score_mod, mask_mod):
        return self._call_read("call_mods_again", table, None, q, k, v, scale, left, right, align, return_lse,
                               score_mod, mask_mod)

    def dispatch_mods(self, table, q, k, v, scale, mask, left, right, align, return_lse, score_mod, mask_mod):
        return self._call_read("dispatch_mods", table, self._key(q, mask), q, k, v, scale, left, right, align, return_lse,
                               score_mod, mask_mod)


@pytest.fixture
def launcher(monkeypatch):
    fake = Launcher()
    monkeypatch.setattr(runtime.launcher, "native", lambda: fake)
    monkeypatch.setattr(runtime.Attention, "check", lambda self, q, k, v, out=None: fake.allow_device(self._handle, 0))
    monkeypatch.setattr(runtime, "build", fake.build)
    monkeypatch.setattr(runtime, "_load", fake.load)
    monkeypatch.setattr(runtime, "_attention_mods", fake.attention_mods)
    monkeypatch.setattr(runtime, "_attention", fake.attention)
    monkeypatch.setattr(runtime, "_mask_blocks", fake.mask_blocks)
    monkeypatch.setattr(runtime, "device_facts", lambda index: ("NVIDIA H100", (9, 0)))
    monkeypatch.setattr(runtime, "_device_index", lambda device: 0)
    return fake


def _attention():
    return runtime.Attention(runtime.build(KernelConfig(dtype="fp16", d_head=64)))


Q = torch.zeros(1, 6, 2, 64, dtype=torch.float16)


def _float_word(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def test_new_captured_numbers_reach_the_kernel_without_tracing(launcher):
    attn = _attention()
    cap = 30.0

    def softcap(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    attn(Q, Q, Q, score_mod=softcap)
    traces = cache_info().traces
    assert len(launcher.operator) == 1 and not launcher.eager  # the first call: the full path
    for value in (50.0, 7.5, 50.0):
        cap = value
        o = attn(Q, Q, Q, score_mod=softcap)
        assert launcher.eager[-1][1] == [_float_word(value)]
    assert len(launcher.eager) == 3 and len(launcher.operator) == 1
    assert launcher.served == ["call_mods_again"] * 3  # numbers only: the launcher's reader needs no state of a read
    assert cache_info().traces == traces and launcher.builds == [None, launcher.builds[1]]
    assert torch.equal(o, Q + launcher.eager[-1][0])  # the variant built with the mods ran


def test_values_the_launchers_reader_leaves_to_python_reach_the_kernel_through_pythons_read(launcher):
    import numpy as np

    attn = _attention()
    cap = 30.0

    def softcap(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    attn(Q, Q, Q, score_mod=softcap)
    for value in (np.float64(2.0), float("nan"), 4.0, np.float64(8.0), 16.0, 32.0):
        cap = value
        attn(Q, Q, Q, score_mod=softcap)
        assert launcher.eager[-1][1] == [_float_word(float(value))]
    # a float subclass and a NaN (whose payload Python keeps) are read by Python, exact floats by the launcher's reader
    assert launcher.served == ["call_mods_again"] * 3 and len(launcher.eager) == 6 and len(launcher.operator) == 1


def test_a_dropped_function_frees_what_it_captured_though_the_launcher_keeps_its_reader(launcher, monkeypatch):
    import gc
    import weakref

    monkeypatch.setattr(runtime, "_select", lambda device, dtype, d_head, seq_q, masked: KernelConfig(dtype="fp16", d_head=64))
    auto = runtime.compile("auto")
    same_document, _ = _document_mask(torch.tensor([0, 0, 1, 1, 1, 2]))
    doc = weakref.ref(same_document.__closure__[0].cell_contents)
    for _ in range(3):
        auto(Q, Q, Q, mask_mod=same_document)
    assert launcher.served == ["dispatch_mods"]
    readers = [r for table in launcher.tables for r in table.values()]
    assert readers and all(r.slots for r in readers)  # the tables hold the reader, the reader the function's cell
    del same_document
    gc.collect()
    assert doc() is None and all(r.forgotten for r in readers)


def _document_mask(doc):
    def same_document(b, h, i, j):
        return doc[i] == doc[j]

    def set_doc(new):
        nonlocal doc
        doc = new

    return same_document, set_doc


def test_a_new_document_tensor_and_an_in_place_change_reach_the_kernel_and_the_block_mask(launcher):
    attn = _attention()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])  # int64: the kernel gets an int32 copy
    same_document, set_doc = _document_mask(doc)
    attn(Q, Q, Q, mask_mod=same_document)
    attn(Q, Q, Q, mask_mod=same_document)
    assert len(launcher.eager) == 1 and len(launcher.block_masks) == 1  # the block mask is kept
    doc[5] = 1
    attn(Q, Q, Q, mask_mod=same_document)
    assert launcher.eager[-1][2][0].tolist() == [0, 0, 1, 1, 1, 1] and len(launcher.block_masks) == 2
    assert launcher.eager[-1][3].flatten()[0] == 2  # the new block mask went with the call
    set_doc(torch.tensor([4, 4, 4, 4, 5, 5], dtype=torch.int32))
    attn(Q, Q, Q, mask_mod=same_document)
    assert launcher.eager[-1][2][0].tolist() == [4, 4, 4, 4, 5, 5] and len(launcher.block_masks) == 3
    assert launcher.block_masks[-1][1][0].tolist() == [4, 4, 4, 4, 5, 5]
    attn(Q, Q[:, :5], Q[:, :5], mask_mod=same_document)  # another key length: another block mask
    attn(Q, Q, Q, mask_mod=same_document)  # and back: the kept one
    assert len(launcher.block_masks) == 4 and launcher.eager[-1][3].flatten()[0] == 3
    assert len(launcher.operator) == 1 and len(launcher.eager) == 5


def test_a_new_tensor_at_a_dead_ones_address_gets_its_own_block_mask(launcher):
    """The allocator hands a freed block to the next tensor of its size: same address, version 0."""
    attn = _attention()
    memory = bytearray(struct.pack("<6i", 0, 0, 1, 1, 1, 2))
    same_document, set_doc = _document_mask(torch.frombuffer(memory, dtype=torch.int32))
    attn(Q, Q, Q, mask_mod=same_document)
    memory[:] = struct.pack("<6i", 7, 7, 7, 7, 7, 7)  # the old tensor's memory, rewritten by its next owner
    set_doc(torch.frombuffer(memory, dtype=torch.int32))
    attn(Q, Q, Q, mask_mod=same_document)
    assert len(launcher.block_masks) == 2 and launcher.block_masks[-1][1][0].tolist() == [7] * 6


def test_a_changed_closure_structure_retraces_and_builds_another_kernel(launcher):
    attn = _attention()
    scale = 2.0

    def mod(s, b, h, i, j):
        return s * scale

    def other(s, b, h, i, j):  # the same free variable, another operation
        return s + scale

    attn(Q, Q, Q, score_mod=mod)
    attn(Q, Q, Q, score_mod=mod)
    traces, builds = cache_info().traces, len(launcher.builds)
    scale = 3  # an int where a float was traced: other casts, another kernel
    attn(Q, Q, Q, score_mod=mod)
    assert cache_info().traces == traces + 1 and len(launcher.builds) == builds + 1
    assert launcher.operator[-1][1] == [3]
    mod.__code__ = other.__code__  # new code: traced again
    attn(Q, Q, Q, score_mod=mod)
    assert cache_info().traces == traces + 2 and len(launcher.builds) == builds + 2
    attn(Q, Q, Q, score_mod=mod)  # and then served by the fast path again: the launcher's reader of the new kernel
    assert cache_info().traces == traces + 2 and launcher.eager[-1][1] == [3]
    assert launcher.eager[-1][0] == len(launcher.builds) - 1 and launcher.served == ["call_mods_again"] * 2


def test_refusals_on_the_fast_path_are_those_of_the_first_call(launcher):
    attn = _attention()
    cap = 30.0

    def softcap(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    attn(Q, Q, Q, score_mod=softcap)
    with pytest.raises(runtime.InputError, match="align='diagonal'"):
        attn(Q, Q, Q, score_mod=softcap, align="diagonal")
    with pytest.raises(runtime.InputError, match="out= is not supported"):
        attn(Q, Q, Q, out=torch.empty_like(Q), score_mod=softcap)
    cap = 1e300  # no fp32: the full path's error
    with pytest.raises(OverflowError):
        attn(Q, Q, Q, score_mod=softcap)
    assert len(launcher.eager) == 0


def test_a_call_to_differentiate_takes_the_full_path_and_builds_its_backward_with_the_mods(launcher):
    attn = _attention()
    cap = 30.0

    def softcap(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    attn(Q, Q, Q, score_mod=softcap)
    forward_mods = launcher.builds[-1]
    attn(Q.clone().requires_grad_(), Q, Q, score_mod=softcap)
    assert len(launcher.operator) == 2 and not launcher.eager  # the operator autograd records, not the eager entry
    assert launcher.builds[-1] == forward_mods and len(launcher.builds) == 3  # the backward, built with the same mods


def test_calls_to_differentiate_leave_the_launchers_reader_its_state(launcher):
    """A call to differentiate takes the full path; the reader of the pair stays, with the state of the last read
    (captured tensor, block mask), so the next call without grad goes straight to it."""
    attn = _attention()
    same_document, _ = _document_mask(torch.tensor([0, 0, 1, 1, 1, 2]))
    attn(Q, Q, Q, mask_mod=same_document)
    attn(Q, Q, Q, mask_mod=same_document)  # Python's read: the reader gets its state
    attn(Q.clone().requires_grad_(), Q, Q, mask_mod=same_document)
    attn(Q, Q, Q, mask_mod=same_document)
    assert len(launcher.operator) == 2 and launcher.served == ["call_mods_again"] and len(launcher.block_masks) == 1


def test_sequences_past_the_split_conversions_limit_are_refused_before_launch(launcher):
    from flashgen.mods.ranges import INDEX_LIMIT

    attn = _attention()
    long = torch.zeros(1, 1, 2, 64, dtype=torch.float16).expand(1, INDEX_LIMIT + 1, 2, 64)  # a view: no memory
    with pytest.raises(runtime.InputError, match=f"up to {INDEX_LIMIT} tokens"):
        attn(long, long, long, score_mod=lambda s, b, h, i, j: s - 0.5 * (i - j))
    assert not launcher.operator and not launcher.eager
    attn(long, long, long, score_mod=lambda s, b, h, i, j: s * 0.5)  # no index arithmetic: any length
    assert len(launcher.operator) == 1


def test_a_scale_the_kernels_cannot_hold_is_refused_before_launch(launcher):
    """The kernels keep each row's largest raw score (the largest scaled one for a positive scale only) and hold a
    bias over softmax_scale: a scale that is not positive, or without an fp32 inverse, is refused with the reason,
    with a bias or without (the fast path's launcher refuses it too, sending the call down this path)."""
    attn = _attention()
    slope = torch.tensor([0.5, 0.25])

    def alibi(s, b, h, i, j):
        return s - slope[h] * (i - j)

    def halve(s, b, h, i, j):
        return s * 0.5

    for fn in (alibi, halve):
        for scale in (0.0, -0.5, 1e-39, float("nan"), float("inf"), 1e39):
            with pytest.raises(runtime.InputError, match=re.escape(f"softmax_scale={scale!r}: expected a positive number")):
                attn(Q, Q, Q, score_mod=fn, softmax_scale=scale)
        with pytest.raises(runtime.InputError, match="softmax_scale='half': expected a number"):
            attn(Q, Q, Q, score_mod=fn, softmax_scale="half")
    assert not launcher.operator and not launcher.eager
    attn(Q, Q, Q, score_mod=alibi, softmax_scale=3e-39)  # the smallest scales with an fp32 inverse are taken
    attn(Q, Q, Q, score_mod=halve, softmax_scale=3e38)
    assert len(launcher.operator) == 2


def test_auto_attention_takes_the_fast_path_too(launcher, monkeypatch):
    monkeypatch.setattr(runtime, "_select", lambda device, dtype, d_head, seq_q, masked: KernelConfig(dtype="fp16", d_head=64))
    auto = runtime.compile("auto")
    cap = 30.0

    def softcap(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    auto(Q, Q, Q, score_mod=softcap)
    cap = 20.0
    auto(Q, Q, Q, score_mod=softcap, causal=True)  # another mask: another kernel, its own first call
    auto(Q, Q, Q, score_mod=softcap)
    auto(Q, Q, Q, score_mod=softcap, causal=True)
    assert len(launcher.operator) == 2 and [e[1] for e in launcher.eager] == [[_float_word(20.0)]] * 2
    assert launcher.eager[0][0] != launcher.eager[1][0]
    cap = 10.0
    auto(Q, Q, Q, score_mod=softcap)  # the dispatch table's reader for the call's key and the pair
    auto(Q, Q, Q, score_mod=softcap, causal=True)
    assert launcher.served == ["dispatch_mods"] * 4 and [e[1] for e in launcher.eager[2:]] == [[_float_word(10.0)]] * 2
    assert [e[0] for e in launcher.eager[2:]] == [e[0] for e in launcher.eager[:2]]


def test_auto_gives_calls_with_mods_the_config_of_masked_calls(launcher, monkeypatch):
    """A score_mod's values need registers and a mask_mod's tiles differ in length: compile("auto") picks the
    config it picks for masked calls (the smaller key block) for both, whatever the built-in mask."""
    asked = []

    def select(device, dtype, d_head, seq_q, masked):
        asked.append(masked)
        return KernelConfig(dtype="fp16", d_head=64, B_c=64 if masked else 128)

    monkeypatch.setattr(runtime, "_select", select)
    runtime.compile("auto")(Q, Q, Q, score_mod=lambda s, b, h, i, j: s * 0.5)
    runtime.compile("auto")(Q, Q, Q, mask_mod=lambda b, h, i, j: i // 4 >= j // 4)  # no diagonal conjunct
    runtime.compile("auto").pick(Q.device, Q.dtype, 64, 6, "none")  # a call without mods
    assert asked == [True, True, False]


def test_torch_compile_runs_calls_with_mods_eagerly_through_the_full_path(launcher):
    attn = _attention()
    cap = 30.0

    def softcap(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    compiled = torch.compile(lambda q: attn(q, q, q, score_mod=softcap) * 2, backend="eager")
    assert torch.equal(compiled(Q), (Q + launcher.operator[-1][0]) * 2)
    cap = 10.0
    compiled(Q)
    assert len(launcher.operator) == 2 and not launcher.eager and launcher.operator[-1][1] == [_float_word(10.0)]


# ---- a mask_mod's diagonal conjuncts run as the built-in causal / window rule (flashgen.mods.diagonal) ----------

def _launches(launcher) -> list:
    """Every launch so far as (built-in mask, mods key or None, offset or align, left, right), in order of entry kind:
    the plain ones (operator or eager entry), then those with mods (operator, eager entries)."""
    plain = [(launcher.masks[h], launcher.builds[h], at, left, right) for h, at, left, right in launcher.plain]
    mods = [(launcher.masks[e[0]], launcher.builds[e[0]], e[3], e[4], e[5]) for e in launcher.operator]
    mods += [(launcher.masks[e[0]], launcher.builds[e[0]], e[4], e[5], e[6]) for e in launcher.eager]
    return plain + mods


def test_causal_as_a_mask_mod_runs_the_built_in_causal_kernel_without_mods_or_block_mask(launcher):
    attn = _attention()
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    for _ in range(3):
        attn(Q, Q, Q, mask_mod=causal)
    traces = cache_info().traces
    attn(Q, Q, Q, mask_mod=causal)
    assert cache_info().traces == traces  # a repeated call does not trace again
    assert _launches(launcher) == [("causal", None, "top_left", -1, 0)] * 4
    assert not launcher.block_masks and set(launcher.builds) == {None}
    assert trace(causal, "mask").diagonal[1] is None


def test_repeated_calls_of_a_mask_mod_without_diagonal_conjuncts_reach_the_reader_without_a_trace_look_up(launcher,
                                                                                                          monkeypatch):
    """Only mask_mods known to have diagonal conjuncts are split before the fast paths: another one's trace is looked
    up once, on its first call, and its repeated calls go straight to the launcher's reader."""
    attn = _attention()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])

    def document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    looked = []
    real = runtime.current
    monkeypatch.setattr(runtime, "current", lambda fn, kind: looked.append(fn) or real(fn, kind))
    for _ in range(5):
        attn(Q, Q, Q, mask_mod=document)
    assert looked == [document] and launcher.served == ["call_mods_again"] * 3
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    for _ in range(2):
        attn(Q, Q, Q, mask_mod=causal)
    assert looked[1:] == [causal] * 3  # its first call: found splitting, made again split; then split first


def test_a_sliding_window_mask_mod_meets_the_calls_own_window(launcher):
    attn = _attention()
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 3)  # noqa: E731
    attn(Q, Q, Q, mask_mod=window)
    attn(Q, Q, Q, mask_mod=window, causal=True)
    attn(Q, Q, Q, mask_mod=window, window=(1, 5))
    attn(Q, Q, Q, mask_mod=window, window=(7, -1), align="bottom_right")  # equal lengths: both alignments agree
    attn(Q, Q, Q, mask_mod=lambda b, h, q_idx, kv_idx: kv_idx - q_idx <= 2, window=(4, 9))
    assert _launches(launcher) == [("window", None, "top_left", 3, 0)] * 2 + [("window", None, "top_left", 1, 0),
                                   ("window", None, "top_left", 3, 0), ("window", None, "top_left", 4, 2)]


def test_the_rest_of_a_mask_mod_is_compiled_and_its_diagonal_runs_as_the_built_in_window(launcher):
    attn = _attention()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    for _ in range(4):
        attn(Q, Q, Q, mask_mod=causal_document)
    rest = KernelMods(mask=trace(causal_document, "mask").diagonal[1])
    assert _launches(launcher)[0] == ("causal", rest.key, 0, -1, 0)  # the first call: the operator
    assert _launches(launcher)[1:] == [("causal", rest.key, "top_left", -1, 0)] * 3
    assert launcher.served == ["call_mods_again"] * 2 and len(launcher.block_masks) == 1
    assert rest.key != KernelMods(mask=trace(causal_document, "mask")).key and set(launcher.builds) == {None, rest.key}



def test_a_call_whose_window_no_top_left_window_holds_keeps_the_mask_mod_whole_and_takes_the_full_path(launcher):
    """A bottom-right causal call on unequal lengths: the mask_mod runs whole, by the operator, never by a reader
    of the pair, which may hold the rest alone; the calls that split it still keep what the function keeps."""
    attn = _attention()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    whole, rest = (KernelMods(mask=m).key for m in (trace(causal_document, "mask"),
                                                     trace(causal_document, "mask").diagonal[1]))
    short = Q[:, :4]
    attn(Q, Q, Q, mask_mod=causal_document)
    attn(Q, Q, Q, mask_mod=causal_document)  # Python's read: the launcher's reader of the pair gets its state
    for _ in range(2):
        attn(short, Q, Q, mask_mod=causal_document, causal=True, align="bottom_right")
    assert [e[3:] for e in launcher.operator] == [(0, -1, 0), (2, -1, 0), (2, -1, 0)]
    assert [launcher.builds[e[0]] for e in launcher.operator] == [rest, whole, whole]
    attn(Q, Q, Q, mask_mod=causal_document)
    last = _launches(launcher)[-1]
    assert last[0] == "causal" and last[2:] == ("top_left", -1, 0)
    assert last[1] in (rest, whole)  # either keeps what the function keeps with the causal rule


def test_lengths_past_those_the_split_is_exact_for_keep_the_mask_mod_whole(launcher):
    attn = _attention()
    near_limit = lambda b, h, q_idx, kv_idx: kv_idx + 2147483640 >= q_idx + 2147483637  # noqa: E731  exact below 8
    long = torch.zeros(1, 9, 2, 64, dtype=torch.float16)
    attn(Q, Q, Q, mask_mod=near_limit)
    attn(long, long, long, mask_mod=near_limit)
    assert _launches(launcher) == [("window", None, "top_left", 3, -1),
                                   ("none", KernelMods(mask=trace(near_limit, "mask")).key, 0, -1, -1)]


def test_auto_attention_runs_diagonal_mask_mods_as_its_built_in_masks(launcher, monkeypatch):
    monkeypatch.setattr(runtime, "_select", lambda device, dtype, d_head, seq_q, masked: KernelConfig(dtype="fp16", d_head=64))
    auto = runtime.compile("auto")
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    doc = torch.tensor([0, 0, 1, 1, 1, 2])

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    for _ in range(3):
        auto(Q, Q, Q, mask_mod=causal)
        auto(Q, Q, Q, mask_mod=causal_document)
    rest = KernelMods(mask=trace(causal_document, "mask").diagonal[1]).key
    assert [x for x in _launches(launcher) if x[1] is None] == [("causal", None, "top_left", -1, 0)] * 3
    assert [x[:2] + x[3:] for x in _launches(launcher) if x[1] is not None] == [("causal", rest, -1, 0)] * 3
    assert launcher.served == ["dispatch_mods"] and len(launcher.block_masks) == 1  # the third call: the table's reader


def test_a_call_to_differentiate_builds_the_backward_of_the_rewritten_call(launcher):
    attn = _attention()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])

    def causal_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    attn(Q.clone().requires_grad_(), Q, Q, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    assert launcher.plain[-1][1:] == (0, -1, 0) and launcher.masks[launcher.plain[-1][0]] == "causal"
    assert launcher.builds[-1] is None and launcher.masks[-1] == "causal"  # its backward: no mods, causal
    attn(Q.clone().requires_grad_(), Q, Q, mask_mod=causal_document)
    rest = KernelMods(mask=trace(causal_document, "mask").diagonal[1]).key
    assert launcher.operator[-1][3:] == (0, -1, 0) and launcher.builds[-2:] == [rest, rest]  # forward, backward
    assert launcher.masks[-1] == "causal"


def test_torch_compile_runs_a_diagonal_mask_mod_through_the_built_in_operator(launcher):
    attn = _attention()
    window = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= 2) & (kv_idx <= q_idx)  # noqa: E731
    compiled = torch.compile(lambda q: attn(q, q, q, mask_mod=window) * 2, backend="eager")
    out = compiled(Q)
    handle, offset, left, right = launcher.plain[-1]
    assert (launcher.masks[handle], offset, left, right) == ("window", 0, 2, 0) and torch.equal(out, (Q + handle) * 2)
    assert not launcher.operator and not launcher.block_masks


def test_a_literal_kept_captured_number_that_changes_gives_the_new_window(launcher):
    attn = _attention()
    width = 3

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= int(width))  # int(): the number is compiled in as a literal

    attn(Q, Q, Q, mask_mod=window)
    width = 5
    attn(Q, Q, Q, mask_mod=window)
    width = 3
    attn(Q, Q, Q, mask_mod=window)
    assert [x[3:] for x in _launches(launcher)] == [(3, 0), (5, 0), (3, 0)]
