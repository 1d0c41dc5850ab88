"""The canonical key depends on structure, dtypes, tensor ranks and literals, never on captured
values or names; the per-function cache traces a function once and reads its values on every call."""
from __future__ import annotations

import gc

import pytest
import torch

from flashgen.mods import cache_info, clear_cache, prepare, trace

ROUNDS = 2


def _softcap(cap):
    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap_mod


def _closure_with_setter(value):
    def fn(s, b, h, q, k):
        return s * value

    def set_value(v):
        nonlocal value
        value = v
    return fn, set_value


def test_key_ignores_captured_values_and_names():
    a, b = trace(_softcap(20.0), "score"), trace(_softcap(50.0), "score")
    limit = 7.0
    renamed = trace(lambda s, bb, hh, qq, kk: limit * torch.tanh(s / limit), "score")
    assert a.key == b.key == renamed.key
    assert a.to_cpp() == b.to_cpp() == renamed.to_cpp()
    t1, t2 = torch.arange(4.0), torch.arange(8.0) * 3
    assert trace(lambda s, b, h, q, k: s + t1[h], "score").key == trace(lambda s, b, h, q, k: s + t2[h], "score").key


def test_key_follows_structure_dtypes_ranks_and_literals():
    cap = 30.0
    keys = [trace(f, "score").key for f in (
        lambda s, b, h, q, k: cap * torch.tanh(s / cap),
        lambda s, b, h, q, k: cap * torch.tanh(s * cap),  # another operation
        lambda s, b, h, q, k: s * 2,
        lambda s, b, h, q, k: s * 3,  # another literal: part of the code
        lambda s, b, h, q, k: s + F1[h],
        lambda s, b, h, q, k: s + I1[h],  # another tensor dtype
        lambda s, b, h, q, k: s + F2[h, 0],  # another rank
        lambda s, b, h, q, k: s * cap,
        lambda s, b, h, q, k: s * STEP,  # a captured int, not a float: other casts
    )]
    assert len(set(keys)) == len(keys)


F1, I1, F2, STEP = torch.zeros(4), torch.zeros(4, dtype=torch.int32), torch.zeros(4, 1), 3


def test_number_used_as_python_value_becomes_a_literal():
    def repeat_add(n):
        def fn(s, b, h, q, k):
            for i in range(n):  # n must be a Python int here: it is compiled in
                s = s + i
            return s
        return fn
    two, three = trace(repeat_add(2), "score"), trace(repeat_add(3), "score")
    assert two.key != three.key and not two.scalars
    assert [src.name for src, _ in two.static] == ["n"]


def test_cache_traces_once_per_function():
    clear_cache()
    fn = _softcap(30.0)
    for _ in range(ROUNDS + 1):
        mod, args = prepare(fn, "score")
    assert cache_info().traces == 1 and cache_info().hits == ROUNDS
    other, _ = prepare(_softcap(10.0), "score")  # a new function: traced, one key
    assert cache_info().traces == 2 and other.key == mod.key
    del fn, other, mod
    gc.collect()
    assert cache_info().functions == 0


def test_cache_reads_new_values_and_retraces_stale_ones():
    clear_cache()
    fn, set_value = _closure_with_setter(2.0)
    mod, args = prepare(fn, "score")
    assert args.scalars == (2.0,)
    set_value(5.5)
    mod2, args = prepare(fn, "score")
    assert mod2 is mod and args.scalars == (5.5,) and cache_info().traces == 1
    set_value(4)  # an int now: int * fp32 casts differently, so the trace is stale
    mod3, args = prepare(fn, "score")
    assert cache_info().traces == 2 and mod3.scalars[0].dtype == "int32" and args.scalars == (4,)
    fn.__code__ = fn.__code__.replace()
    prepare(fn, "score")
    assert cache_info().traces == 3  # a new code object retraces



def test_a_compiled_in_number_that_changes_retraces():
    clear_cache()
    n = 2

    def fn(s, b, h, q, k):
        return s + len(range(n))

    first, _ = prepare(fn, "score")
    n = 3
    second, _ = prepare(fn, "score")
    assert cache_info().traces == 2 and first.key != second.key


def test_a_captured_flag_that_changes_retraces():
    clear_cache()
    soft = True

    def fn(s, b, h, q, k):
        return torch.tanh(s) if soft else s

    first, _ = prepare(fn, "score")
    prepare(fn, "score")
    soft = False
    second, _ = prepare(fn, "score")
    assert cache_info().traces == 2 and "tanh" in first.canonical and "tanh" not in second.canonical
