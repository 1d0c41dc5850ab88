"""CPU checks of the benchmark's timing protocol (the GPU timings themselves need a GPU)."""
from __future__ import annotations

import argparse
from collections import Counter

import pytest

from flashgen import bench


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


@pytest.mark.parametrize("command, argv, message", [
    ("bench", ["--rounds", "0"], "--rounds must be at least 1, got 0"),
    ("bench", ["--settle", "-1"], "--settle must be between 0 and 10 seconds, got -1.0"),
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
