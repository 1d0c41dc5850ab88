"""CPU checks of the peers ``flashgen bench`` times: which are timed, FlashAttention-4's layout, the table's
columns, and peers that refuse an input (a stand-in module replaces flash_attn.cute)."""
from __future__ import annotations

import argparse
import sys
import types

import pytest

from flashgen import bench, bench_peers
from flashgen.bench_peers import FA4

try:
    import torch
except ImportError:
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


@pytest.fixture
def fake_fa4(monkeypatch):
    """A stand-in flash_attn.cute whose flash_attn_func records its calls and returns (out, lse) as
    FlashAttention-4 does: out in the inputs' (batch, seq, heads, d) layout (here q * 2 + v)."""
    calls = []

    def flash_attn_func(q, k, v, causal=False, **kwargs):
        calls.append({"causal": causal, "shape": tuple(q.shape)})
        return q * 2 + v, None

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_func = flash_attn_func
    package = types.ModuleType("flash_attn")
    package.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls


@pytest.fixture
def no_fa4(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)


def test_fa4_is_timed_by_default_only_where_it_imports(fake_fa4, monkeypatch):
    assert bench_peers.fa4_version() is not None
    assert bench_peers.default_peers() == bench_peers.SDPA_PEERS + (FA4,)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    assert bench_peers.fa4_version() is None
    assert bench_peers.default_peers() == bench_peers.SDPA_PEERS


def test_peer_labels_map_to_names_in_the_tables_order(fake_fa4):
    assert bench_peers.from_labels(["fa4", "flash"]) == ("FLASH_ATTENTION", FA4)
    assert bench_peers.from_labels(["mem-eff", "cudnn", "cudnn"]) == ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def test_asking_for_fa4_where_it_is_missing_says_how_to_install_it(no_fa4):
    with pytest.raises(bench_peers.PeerUnavailable, match="pip install flash-attn-4"):
        bench_peers.from_labels(["cudnn", "fa4"])


def test_bench_refuses_a_missing_fa4_before_touching_the_gpu(no_fa4):
    pytest.importorskip("torch")
    from flashgen.cli import CommandError

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    with pytest.raises(CommandError, match="--peers fa4: FlashAttention-4 is not installed"):
        bench.main(p.parse_args(["auto", "--peers", "fa4"]))


@needs_torch
@pytest.mark.parametrize("causal", [False, True])
def test_fa4_peer_takes_the_inputs_as_they_are_and_returns_o_as_the_sdpa_peers_do(fake_fa4, causal):
    q, k, v = (torch.randn(2, 5, 3, 4) for _ in range(3))  # (batch, seq, heads, d)
    o = bench_peers.makers([FA4])[FA4](q, k, v, causal)()
    assert fake_fa4 == [{"causal": causal, "shape": (2, 5, 3, 4)}]
    assert o.shape == (2, 3, 5, 4)  # (batch, heads, seq, d), like SDPA's o
    torch.testing.assert_close(o, (q * 2 + v).transpose(1, 2))


def _result(row, peers, fa4_version=None):
    return {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rounds": 2, "rows": [row], "matmul_tflops": {},
            "peers": list(peers), "fa4_version": fa4_version}


def _timed_row(peers):
    return {"dtype": "bf16", "d_head": 128, "causal": False, "seq": 2048, "batch": 8, "best": "auto", "peers": peers,
            "flashgen": {"auto": {"tflops": 600.0, "rounds_tflops": [600.0, 600.0], "correct": True}}}


def test_the_table_gives_fa4_its_own_figure_and_ratio():
    row = _timed_row({"FLASH_ATTENTION": 300.0, "CUDNN_ATTENTION": 500.0, "EFFICIENT_ATTENTION": None, FA4: 480.0})
    lines = bench.format_table(_result(row, bench_peers.PEERS, "4.0.0b36")).splitlines()
    assert lines[0].startswith("flashgen vs SDPA and FlashAttention-4 4.0.0b36 on GPU")
    header, fields = lines[2].split(), lines[3].split()
    assert header[6:10] == ["flash", "cudnn", "mem-eff", "fa4"]
    assert fields[6:10] == ["300", "500", "-", "480"]
    assert fields[10:14] == ["2.000", "1.200", "-", "1.250"]  # 600 / 300, 600 / 500, no mem-eff, 600 / 480


def test_the_table_has_no_fa4_columns_when_it_was_not_timed():
    row = _timed_row({"FLASH_ATTENTION": 300.0, "CUDNN_ATTENTION": 500.0, "EFFICIENT_ATTENTION": 200.0})
    lines = bench.format_table(_result(row, bench_peers.SDPA_PEERS)).splitlines()
    assert lines[0].startswith("flashgen vs SDPA on GPU")
    assert "fa4" not in lines[2]
    assert lines[3].split()[9:12] == ["2.000", "1.200", "3.000"]


@needs_torch
def test_a_peer_that_refuses_an_input_in_its_own_way_drops_out_of_the_row():
    """FlashAttention-4 refuses unsupported shapes with assertions, not RuntimeError: the peer goes
    untimed (no figure) and the row carries on; the same error from a flashgen kernel would be a bug
    and raises."""
    from flashgen import reference

    def refusing(q, k, v, causal):
        def run():
            raise AssertionError("head dimension not supported")
        return run

    def kernel(q, k, v, out=None, causal=False):
        o = reference.attention(q, k, v, causal=causal, dtype=torch.float32).to(q.dtype)
        return o if out is None else out.copy_(o)

    spec = bench.RowSpec("fwd", "fp16", 16, False, 64, 1, 2)
    row = bench.bench_row(spec, {"fg": kernel}, {FA4: refusing}, 1, lambda fn: (fn(), 2.0)[1], device="cpu")
    assert row["peers"][FA4] is None and row["flashgen"]["fg"]["correct"]

    def broken(q, k, v, out=None, causal=False):
        raise AssertionError("a flashgen bug")

    with pytest.raises(AssertionError, match="a flashgen bug"):
        bench.bench_row(spec, {"fg": broken}, {}, 1, lambda fn: (fn(), 2.0)[1], device="cpu")
