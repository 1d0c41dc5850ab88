"""CPU checks of the benchmark's timing protocol (the GPU timings themselves need a GPU)."""
from __future__ import annotations

import argparse
from collections import Counter

import pytest

from flashgen import bench

try:
    import torch
except ImportError:  # the tests of the timing protocol need no torch
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def test_interleaved_times_every_kernel_once_per_round_in_the_designs_orders():
    calls = []
    clock = iter(range(100))

    def timer(fn):
        fn()
        return float(next(clock))

    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "c": lambda: calls.append("c")}
    times = bench.interleaved(fns, 4, timer)
    assert calls[:3] == ["a", "b", "c"]  # round 0 in the caller's order (a failing kernel raises early)
    assert sorted(calls) == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    # each kernel's timings in round order, wherever it ran in its round
    for name in fns:
        assert times[name] == [float(i) for i, c in enumerate(calls) if c == name]


@pytest.mark.parametrize("n", range(1, 9))
def test_round_orders_balance_places_and_predecessors(n):
    """Over one cycle of the design (n rounds, 2n for odd n) every kernel takes every place equally
    often and, inside the rounds, follows every other kernel equally often."""
    cycle = n if n % 2 == 0 else 2 * n
    rows = [bench.round_order(n, r) for r in range(cycle)]
    assert rows[0] == list(range(n))
    assert all(sorted(row) == list(range(n)) for row in rows)
    places = Counter((place, k) for row in rows for place, k in enumerate(row))
    assert set(places.values()) == {cycle // n}  # every (place, kernel) once per n rounds
    if n > 1:
        follows = Counter((a, b) for row in rows for a, b in zip(row, row[1:]))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1
    assert [bench.round_order(n, r) for r in range(cycle, 2 * cycle)] == rows  # then it repeats


def test_medians_of_rounds_keep_a_transient_slowdown_out_of_the_ratio():
    """Two equal kernels; the GPU runs 30% slow during the first timing (a neighbour's burst). One
    round puts the burst into the ratio; the medians of three interleaved rounds do not."""
    state = {"n": 0}

    def bursty(fn):
        state["n"] += 1
        return 1.3 if state["n"] == 1 else 1.0

    fns = {"a": lambda: None, "b": lambda: None}
    one = bench.interleaved(fns, 1, bursty)
    assert one["a"][0] / one["b"][0] == pytest.approx(1.3)
    state["n"] = 0
    three = bench.interleaved(fns, 3, bursty)
    assert three["a"] == [1.3, 1.0, 1.0]  # every round kept (the JSON reports them)
    assert bench.median(three["a"]) / bench.median(three["b"]) == 1.0


def test_median_and_round_count_checks():
    assert bench.median([3.0, 1.0, 2.0]) == 2.0
    assert bench.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        bench.interleaved({"a": lambda: None}, 0, lambda fn: 1.0)


def test_settle_runs_the_kernel_until_the_time_is_up_and_waits_for_the_device():
    """A fake clock advancing 0.1 s per call: 0.35 s of settling takes 4 calls (0.1 .. 0.4); the
    device is waited on every 2 calls and at the end, so the last call has finished on return."""
    now = {"t": 0.0}
    events = []

    def fn():
        now["t"] += 0.1
        events.append("call")

    n = bench.settle(fn, 0.35, lambda: events.append("sync"), clock=lambda: now["t"], every=2)
    assert n == 4
    assert events == ["call", "call", "sync", "call", "call", "sync", "sync"]
    # a kernel longer than the whole settle time still runs once, and is waited for
    events.clear()
    assert bench.settle(lambda: (now.__setitem__("t", now["t"] + 5.0), events.append("call")), 0.3,
                        lambda: events.append("sync"), clock=lambda: now["t"]) == 1
    assert events == ["call", "sync"]


def test_table_header_says_how_long_kernels_settled():
    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rounds": 6, "rows": [], "matmul_tflops": {}}
    assert "settle" not in bench.format_table(res) and "itself" not in bench.format_table(res)
    res["settle_s"] = 0.3
    assert "median of 6 interleaved round(s), each timing after 0.3 s of the kernel itself" in bench.format_table(res)


def test_table_header_names_the_backward_engine_a_run_forced():
    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rounds": 2, "rows": [], "matmul_tflops": {}}
    assert "engine" not in bench.format_table(res).splitlines()[0]
    res["backward_engine"] = "mma_sync"
    assert bench.format_table(res).splitlines()[0].endswith("; flashgen's backwards on the mma_sync engine")


@pytest.mark.parametrize("command, argv, message", [
    ("bench", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("bench", ["--settle", "-1"], "--settle must be between 0 and 10 seconds, got -1.0"),
    ("bench", ["auto", "--backward-engine", "mma_sync"], "--backward-engine mma_sync: no pass runs a backward"),
    ("tune", ["--finalists", "0"], "--finalists must be at least 1, got 0"),
])
def test_timing_commands_refuse_zero_rounds_before_touching_the_gpu(command, argv, message):
    pytest.importorskip("torch")
    import importlib

    from flashgen.cli import CommandError

    module = importlib.import_module(f"flashgen.{command}")
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    with pytest.raises(CommandError, match=message):  # the CLI prints it and exits 1
        module.main(p.parse_args(argv))


def test_pick_fastest_does_not_crown_a_config_that_was_lucky_once():
    """Candidate "lucky" runs at 1.0 ms in its first timing and 1.2 ms after; "steady" always at
    1.05 ms; "slow" at 2.0 ms drops out after the first timing (one finalist slot too few)."""
    seen = {"lucky": 0}

    def lucky():
        seen["lucky"] += 1
        return 1.0 if seen["lucky"] == 1 else 1.2

    fns = {"lucky": lucky, "steady": lambda: 1.05, "slow": lambda: 2.0}
    name, medians = bench.pick_fastest(fns, rounds=3, finalists=2, timer=lambda fn: fn())
    assert name == "steady"
    assert medians == {"lucky": 1.2, "steady": 1.05}  # the finalists and their medians; "slow" was cut
    assert bench.pick_fastest({"only": lambda: 3.0}, timer=lambda fn: fn()) == ("only", {"only": 3.0})
    with pytest.raises(ValueError, match="no candidates"):
        bench.pick_fastest({})


def test_the_ranking_lists_every_finalist_fastest_first_with_its_rate_and_ratio():
    """2e12 FLOPs a call: 2 ms is 1000 TFLOP/s; each line's ratio is the fastest's time over its own."""
    lines = bench.ranking({"slow": 4.0, "fast": 2.0, "mid": 2.5}, 2e12)
    assert [line.split()[-1] for line in lines] == ["fast", "mid", "slow"]
    assert [(float(w[0]), float(w[2].rstrip("x"))) for w in (line.split() for line in lines)] == [(1000.0, 1.0), (800.0, 0.8), (500.0, 0.5)]


def test_table_shows_the_best_config_its_ratios_and_its_round_spread():
    cfg = "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra"
    row = {"dtype": "fp16", "d_head": 128, "causal": False, "seq": 2048, "batch": 16, "best": cfg,
           "peers": {"FLASH_ATTENTION": 300.0, "CUDNN_ATTENTION": 500.0, "EFFICIENT_ATTENTION": None},
           "flashgen": {cfg: {"tflops": 550.0, "rounds_tflops": [540.0, 550.0, 562.0], "correct": True},
                        "other": {"tflops": 400.0, "rounds_tflops": [400.0], "correct": True}}}
    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rounds": 3, "rows": [row], "matmul_tflops": {"fp16": 700.0}}
    lines = bench.format_table(res).splitlines()
    assert lines[1] == "forward (fwd):"  # one table per pass, each under its title
    line = lines[3]
    fields = line.split()
    assert fields[:6] == ["fp16", "128", "-", "2048", "550", "4.0%"]  # (562 - 540) / 550
    assert fields[6:9] == ["300", "500", "-"] and fields[9:11] == ["1.833", "1.100"]
    assert fields[12] == "-"  # no per-round cuDNN timings in this row
    assert line.endswith(cfg) and " yes " in line
    # with cuDNN's rounds: each round's ratio pairs the two kernels' timings of that round
    row["peer_rounds_tflops"] = {"CUDNN_ATTENTION": [540.0, 500.0, 480.0]}
    fields = bench.format_table(res).splitlines()[3].split()
    assert fields[12] == "1.000-1.171"  # 540 / 540, 550 / 500, 562 / 480
    assert "x cudnn by round" in bench.format_table(res).splitlines()[2]
    assert "median of 3 interleaved round(s)" in bench.format_table(res)


def test_paired_ratio_range_needs_two_rounds_of_both():
    assert bench.paired_ratio_range([600.0, 580.0], [550.0, 560.0]) == "1.036-1.091"
    assert bench.paired_ratio_range([600.0], [550.0]) == "-"
    assert bench.paired_ratio_range([600.0, 580.0], None) == "-"
    assert bench.paired_ratio_range([600.0, 580.0], [550.0, 560.0, 570.0]) == "-"  # rounds do not pair


def test_table_ends_with_the_boards_state_when_it_was_sampled():
    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rounds": 1, "rows": [], "matmul_tflops": {}}
    assert "board while timing" not in bench.format_table(res)
    res["gpu_state"] = {"samples": 40, "clock_mhz": 1620.0, "power_w": 692.4, "power_capped": 0.775, "thermal": 0.0}
    last = bench.format_table(res).splitlines()[-1]
    assert last.startswith("board while timing") and "median 692 W" in last and "SM clock 1620 MHz" in last
    assert "power-capped in 78% of samples" in last and "(40 samples)" in last and "thermal" not in last


# ---- the backward passes, on the CPU with fakes in place of flashgen and SDPA ----------------------


def _tagger():
    """An autograd identity that logs ("fwd", name) when it runs and ("bwd", name) when its backward does."""
    class Tag(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, name, log):
            ctx.name, ctx.log = name, log
            log.append(("fwd", name))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            ctx.log.append(("bwd", ctx.name))
            return g, None, None
    return Tag


def _fake_kernel(name, log, dk_factor=1.0):
    """A flashgen attention stand-in: float32 attention from torch ops, differentiable; ``dk_factor``
    scales dk alone (o unchanged), a wrong gradient."""
    from flashgen import reference

    tag = _tagger()

    def attn(q, k, v, out=None, causal=False):
        k = k + (k - k.detach()) * (dk_factor - 1)
        o = tag.apply(reference.attention(q, k, v, causal=causal, dtype=torch.float32).to(q.dtype), name, log)
        return o if out is None else out.copy_(o)
    return attn


def _fake_peer(name, log):
    """An SDPA stand-in: a maker(q, k, v, causal) of a call returning o as (batch, heads, seq, d)."""
    from flashgen import reference

    tag = _tagger()

    def make(q, k, v, causal):
        return lambda: tag.apply(reference.attention(q, k, v, causal=causal, dtype=torch.float32).to(q.dtype).transpose(1, 2), name, log)
    return make


def _row(pass_, kernels, peers, causal=False, rounds=1, timer=lambda fn: (fn(), 2.0)[1]):
    spec = bench.RowSpec(pass_, "fp16", 16, causal, 64, 1, 2)
    return bench.bench_row(spec, kernels, peers, rounds, timer, device="cpu")


def test_attention_flops_by_hand():
    assert bench.attention_flops(1, 2, 64, 64, 16) == 524288.0  # 4 * 1 * 2 * 64 * 64 * 16
    assert bench.attention_flops(1, 2, 64, 64, 16, causal=True) == 262144.0


# TFLOP/s of a pass timed at 2 ms for batch 1, 2 heads, seq 64, d 16: the forward is 524288 FLOPs
# (causal 262144), the backward 2.5 times that, forward + backward 3.5 times
@needs_torch
@pytest.mark.parametrize("pass_, causal, tflops", [
    ("fwd", False, 524288 / 2e9),
    ("bwd", False, 1310720 / 2e9),
    ("fwd+bwd", False, 1835008 / 2e9),
    ("bwd", True, 655360 / 2e9),
    ("fwd+bwd", True, 917504 / 2e9),
])
def test_rows_of_each_pass_count_their_flops(pass_, causal, tflops):
    log = []
    row = _row(pass_, {"fg": _fake_kernel("fg", log)}, {"CUDNN_ATTENTION": _fake_peer("cudnn", log)}, causal=causal)
    assert row["pass"] == pass_ and row["causal"] == causal
    assert row["peers"]["CUDNN_ATTENTION"] == pytest.approx(tflops, rel=1e-12)
    fg = row["flashgen"]["fg"]
    assert fg["tflops"] == pytest.approx(tflops, rel=1e-12) and fg["rounds_tflops"] == [pytest.approx(tflops, rel=1e-12)]
    assert fg["correct"] and row["best"] == "fg"
    if pass_ != "fwd":
        assert set(fg["max_err"]) == ({"o", "dq", "dk", "dv"} if pass_ == "fwd+bwd" else {"dq", "dk", "dv"})


@needs_torch
@pytest.mark.parametrize("pass_, steps", [("bwd", ["bwd"]), ("fwd+bwd", ["fwd", "bwd"]), ("fwd", ["fwd"])])
def test_interleaved_rounds_time_each_kernels_pass_in_the_designs_orders(pass_, steps):
    """Each timing runs exactly the pass (the backward alone: its forward ran before the timing) of
    one kernel, peers and flashgen alike, in the Williams design's order of each round."""
    log, timed = [], []

    def timer(fn):
        start = len(log)
        fn()
        timed.append(log[start:])
        return 1.0

    names = ["flash", "cudnn", "a", "b"]
    peers = {"FLASH_ATTENTION": _fake_peer("flash", log), "CUDNN_ATTENTION": _fake_peer("cudnn", log)}
    kernels = {n: _fake_kernel(n, log) for n in ("a", "b")}
    _row(pass_, kernels, peers, rounds=4, timer=timer)
    order = [names[i] for r in range(4) for i in bench.round_order(4, r)]
    assert timed == [[(step, name) for step in steps] for name in order]


@needs_torch
def test_a_wrong_gradient_is_flagged_in_the_row_and_the_table():
    log = []
    kernels = {"wrong": _fake_kernel("wrong", log, dk_factor=1.1), "right": _fake_kernel("right", log)}
    row = _row("bwd", kernels, {"FLASH_ATTENTION": _fake_peer("flash", log)}, causal=True)
    wrong, right = row["flashgen"]["wrong"], row["flashgen"]["right"]
    assert right["correct"] and not wrong["correct"]
    assert wrong["max_err"]["dk"] > wrong["bound"]["dk"]  # dk alone is off; dq and dv pass
    assert all(wrong["max_err"][n] <= wrong["bound"][n] for n in ("dq", "dv"))
    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 2, "rounds": 1, "rows": [row], "matmul_tflops": {}}
    text = bench.format_table(res)
    lines = text.splitlines()
    assert lines[1].startswith("backward (bwd)")
    assert lines[3].split()[-2:] == ["NO", "wrong"]  # the fastest (the first of a tie) is the wrong one
    assert f"WRONG bwd fp16 d16 causal seq 64 wrong: dk max error {wrong['max_err']['dk']:.3e} > " in text
    assert "right:" not in text


@needs_torch
def test_a_kernel_without_a_backward_fails_its_row_without_a_number():
    """A callable that records no autograd fails the backward's first call: it is not timed, its entry
    holds the error, the table says FAILED and lists why; a peer that fails has no figure."""
    log = []
    fake = _fake_kernel("fg", log)

    def broken_peer(q, k, v, causal):
        def run():
            raise RuntimeError("No available kernel.\nmore detail")
        return run

    row = _row("fwd+bwd", {"fg": lambda q, k, v, out=None, causal=False: fake(q, k, v, causal=causal).detach()},
               {"FLASH_ATTENTION": _fake_peer("flash", log), "CUDNN_ATTENTION": broken_peer})
    assert row["peers"]["CUDNN_ATTENTION"] is None and row["peers"]["FLASH_ATTENTION"]
    assert row["best"] is None and row["flashgen"]["fg"]["correct"] is False
    assert "does not require grad" in row["flashgen"]["fg"]["error"]
    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 2, "rounds": 1, "rows": [row], "matmul_tflops": {}}
    lines = bench.format_table(res).splitlines()
    assert lines[3].split()[-2:] == ["FAILED", "fg"]
    assert lines[4] == "" and lines[5].startswith("FAILED fwd+bwd fp16 d16 seq 64 fg: ") and "does not require grad" in lines[5]


@pytest.mark.parametrize("heads, kv_heads, seq, n", [
    (16, 16, 1024, 16),   # 2^26 / 2^20 = 64 heads allowed: all 16
    (16, 16, 4096, 4),    # 2^26 / 2^24
    (16, 16, 16384, 1),   # over the budget: one head all the same
    (16, 4, 16384, 4),    # GQA: one whole group of 4 query heads
    (16, 4, 2048, 16),
])
def test_gradient_checks_take_whole_heads_within_the_budget(heads, kv_heads, seq, n):
    from flashgen.bench_passes import checked_heads

    assert checked_heads(heads, kv_heads, seq, seq) == n


def test_tables_come_one_per_pass_in_pass_order():
    def row(pass_, seq):
        return {"pass": pass_, "dtype": "bf16", "d_head": 128, "causal": False, "seq": seq, "batch": 1, "best": "auto",
                "peers": {}, "flashgen": {"auto": {"tflops": 100.0, "correct": True}}}

    res = {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rows": [row("fwd+bwd", 1024), row("fwd", 1024), row("bwd", 2048)],
           "matmul_tflops": {}}
    lines = bench.format_table(res).splitlines()
    titles = [i for i, line in enumerate(lines) if line.endswith(":") and "(" in line]
    assert [lines[i].split(" (")[0] for i in titles] == ["forward", "backward", "forward + backward"]
    assert [lines[i + 2].split()[3] for i in titles] == ["1024", "2048", "1024"]  # each table's row
    assert lines[titles[1] - 1] == ""  # tables apart


@needs_torch
def test_passes_option_parses_and_reaches_the_run(monkeypatch, tmp_path):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args([]).passes == ["fwd"]
    assert p.parse_args(["--passes", "bwd", "fwd+bwd"]).passes == ["bwd", "fwd+bwd"]
    assert p.parse_args(["--pass", "bwd"]).passes == ["bwd"]
    with pytest.raises(SystemExit):
        p.parse_args(["--passes", "backward"])
    seen = {}

    def run_bench(cfgs, dtypes, shapes, **kwargs):
        seen.update(cfgs=cfgs, shapes=shapes, **kwargs)
        return {"gpu": "GPU", "torch": "t", "cuda": "c", "heads": 16, "rows": [], "matmul_tflops": {}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_bench", run_bench)
    monkeypatch.setattr(bench, "plot", lambda results, path: False)
    args = p.parse_args(["auto", "--passes", "bwd", "fwd+bwd", "bwd", "--seqs", "1024", "-o", str(tmp_path)])
    assert bench.main(args) == 0
    assert seen["cfgs"] == [] and seen["auto"] is True and seen["passes"] == ("bwd", "fwd+bwd")
    assert seen["shapes"] == [(1024, 16)]
    assert (tmp_path / "bench.json").exists()
