"""A pair's CallValues reads exactly what ``prepare_mods`` + ``KernelMods.pack`` would give, and answers None
wherever that path must run instead (a stale value, one it refuses, another function or code)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from flashgen.mods import prepare_mods
from flashgen.mods.call_values import CallValues

CPU = torch.device("cpu")


def _slow(score_fn, mask_fn):
    mods, (sa, ma) = prepare_mods(score_fn, mask_fn)
    return mods.pack(sa, ma)


def _pair():
    cap, edge, doc = 30.0, 2, torch.tensor([0, 0, 1, 1, 1, 2])  # int64: passed as an int32 copy

    def score(s, b, h, i, j):
        return cap * torch.tanh(s / cap)

    def mask(b, h, i, j):
        return (doc[i] == doc[j]) | (j < edge)

    def set_values(**values):
        nonlocal cap, edge, doc
        cap, edge, doc = values.get("cap", cap), values.get("edge", edge), values.get("doc", doc)

    return score, mask, set_values


def _same(fast, slow) -> bool:
    (fw, ft), (sw, st) = fast, slow
    return fw == sw and len(ft) == len(st) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ft, st))


def test_reads_what_the_full_path_packs_as_values_change():
    score, mask, set_values = _pair()
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    assert _same(reader.read(CPU), _slow(score, mask))
    for change in ({"cap": 50.0}, {"edge": -7}, {"doc": torch.tensor([3, 3, 3, 4, 4, 4])}):
        set_values(**change)
        got = reader.read(CPU)
        assert _same(got, _slow(score, mask)), change
    doc = got[1][0]
    assert doc.dtype == torch.int32 and doc.tolist() == [3, 3, 3, 4, 4, 4]


def test_an_in_place_change_of_a_captured_tensor_makes_a_new_copy():
    score, mask, set_values = _pair()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    set_values(doc=doc)
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    first = reader.read(CPU)[1][0]
    assert reader.read(CPU)[1][0] is first  # unchanged: the same copy, no conversion
    doc[5] = 1
    second = reader.read(CPU)[1][0]
    assert second is not first and second.tolist() == [0, 0, 1, 1, 1, 1]


def test_a_tensor_of_the_kernel_dtype_is_passed_itself():
    score, mask, set_values = _pair()
    doc = torch.tensor([0, 0, 1, 1, 1, 2], dtype=torch.int32)
    set_values(doc=doc)
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    assert reader.read(CPU)[1][0] is doc and reader.read(CPU)[1][0] is doc


@pytest.mark.parametrize("change", [{"cap": 30}, {"edge": 2.5}, {"edge": 2**31}, {"doc": torch.zeros(2, 3)},
                                    {"doc": "ids"}])
def test_a_value_the_trace_cannot_take_sends_the_call_to_the_full_path(change):
    score, mask, set_values = _pair()
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    set_values(**change)
    assert reader.read(CPU) is None


def test_a_captured_tensor_that_requires_grad_goes_to_the_full_path_which_refuses_it():
    score, mask, set_values = _pair()
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    set_values(doc=torch.tensor([0.0, 0, 1, 1, 1, 2], requires_grad=True))
    assert reader.read(CPU) is None
    with pytest.raises(ValueError, match="requires grad"):
        _slow(score, mask)


def test_a_number_compiled_in_must_keep_its_value():
    n = 2

    def repeat(s, b, h, i, j):
        for _ in range(n):
            s = s * 2
        return s

    reader = CallValues(prepare_mods(repeat)[0], repeat, None)
    assert reader.read(CPU) == ([], [])
    n = 3
    assert reader.read(CPU) is None


def test_serves_only_its_own_functions_with_their_code():
    score, mask, _ = _pair()
    other_score, other_mask, _ = _pair()
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    assert reader.serves(score, mask)
    assert not reader.serves(other_score, mask) and not reader.serves(score, other_mask)
    assert not reader.serves(score, None) and not reader.serves(None, mask)
    cap = 1.0

    def scaled(s, b, h, i, j):  # one free variable, as the softcap
        return s * cap

    score.__code__ = scaled.__code__
    assert not reader.serves(score, mask)


def test_only_plain_functions_are_usable():
    score, mask, _ = _pair()
    assert CallValues.usable(score, mask) and CallValues.usable(None, mask)

    class Softcap:
        def __call__(self, s, b, h, i, j):
            return s

    assert not CallValues.usable(Softcap(), None)


def test_a_dropped_function_releases_what_its_cells_held():
    score, mask, set_values = _pair()
    doc = torch.tensor([0, 0, 1, 1, 1, 2])
    set_values(doc=doc)
    reader = CallValues(prepare_mods(score, mask)[0], score, mask)
    copy = weakref.ref(reader.read(CPU)[1][0])
    held = weakref.ref(doc)
    del doc, set_values, mask, score
    gc.collect()
    assert held() is None and copy() is None
    assert reader.read(CPU) == ([], [])  # nothing left to read; serves() refuses every call anyway


class _Native:
    """The launcher's ``ModReader`` as CallValues uses it: what it was made from, each state given, whether forgotten."""

    class ModReader:
        def __init__(self, kernel, fns, statics, scalars, tensors, mask_first, mask_count, masked):
            self.made = (kernel, fns, statics, scalars, tensors, mask_first, mask_count, masked)
            self.updates, self.forgotten = [], False

        def update(self, device, slots, mask_words, q, k, block_mask):
            self.updates.append((slots, mask_words, block_mask))

        def forget(self):
            self.forgotten = True


def test_the_launchers_reader_is_made_from_the_same_places_and_given_each_new_state():
    score, mask, set_values = _pair()
    values = CallValues(prepare_mods(score, mask)[0], score, mask)
    reader = values.attach(_Native, 7)
    kernel, fns, statics, scalars, tensors, mask_first, mask_count, masked = reader.made
    assert kernel == 7 and [ref() for ref, _ in fns] == [score, mask] and [code for _, code in fns] == [score.__code__, mask.__code__]
    cells = dict(zip(score.__code__.co_freevars, score.__closure__)) | dict(zip(mask.__code__.co_freevars, mask.__closure__))
    assert scalars == [((cells["cap"], None, None), True), ((cells["edge"], None, None), False)]  # cap a float, edge an int
    assert tensors == [((cells["doc"], None, None), 1)] and (mask_first, mask_count, masked) == (1, 1, True)
    block_mask = torch.zeros(4, dtype=torch.int32)
    q = torch.zeros(1, 6, 1, 8)
    words, passed = values.read(CPU)
    values.publish(CPU, q, q, words, block_mask)
    values.read(CPU)
    values.publish(CPU, q, q, words, block_mask)  # the state it has: not given again
    assert len(reader.updates) == 1
    (source, version, dtype, copy), = reader.updates[0][0]
    assert source() is cells["doc"].cell_contents and version == 0 and dtype == torch.int64 and copy is passed[0]
    assert reader.updates[0][1:] == ([2], block_mask)  # the mask_mod's words: edge
    set_values(edge=3)
    values.publish(CPU, q, q, values.read(CPU)[0], block_mask)
    assert len(reader.updates) == 2 and reader.updates[1][1] == [3]


def test_no_launcher_reader_for_values_it_cannot_read_as_python_does():
    cap = torch.tensor(30.0)  # a 0-d tensor: read with .item()

    def score(s, b, h, i, j):
        return s * cap

    values = CallValues(prepare_mods(score, None)[0], score, None)
    assert values.attach(_Native, 7) is None
    values.publish(CPU, None, None, [0], None)  # nothing to give it


def test_the_launchers_reader_forgets_with_its_function_with_its_call_values_and_when_told():
    for drop in ("function", "call values", "forget"):
        score, mask, _ = _pair()
        values = CallValues(prepare_mods(score, mask)[0], score, mask)
        reader = values.attach(_Native, 7)
        if drop == "function":
            del score
        elif drop == "call values":
            del values
        else:
            values.forget()
            assert not values.serves(score, mask)
        gc.collect()
        assert reader.forgotten, drop
