"""The nvidia-smi sampler behind ``flashgen bench``'s clock / power record (no GPU needed: a stand-in
program prints nvidia-smi's lines)."""
from __future__ import annotations

import statistics
import sys
import textwrap
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashgen.gpu_monitor import REASON_POWER_CAP, GpuMonitor, GpuState, Sample


def test_lines_parse_to_samples_and_other_lines_are_skipped():
    assert Sample.parse("1620, 691.87, 0x0000000000000004\n") == Sample(1620.0, 691.87, 4)
    assert Sample.parse("1980, 95.10, 0x0000000000000000") == Sample(1980.0, 95.1, 0)
    assert Sample.parse("[N/A], [Not Supported], 0x0000000000000001") == Sample(None, None, 1)
    assert Sample.parse("clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active") is None
    assert Sample.parse("No devices were found") is None and Sample.parse("") is None


samples = st.lists(st.builds(Sample, st.one_of(st.none(), st.floats(100, 2000)), st.one_of(st.none(), st.floats(10, 800)),
                             st.one_of(st.none(), st.integers(0, 0x1FF))), min_size=1, max_size=30)


@given(samples)
def test_state_is_medians_and_shares_of_the_values_present(ss):
    s = GpuState.of(ss)
    clocks = [x.clock_mhz for x in ss if x.clock_mhz is not None]
    reasons = [x.reasons for x in ss if x.reasons is not None]
    assert s.samples == len(ss)
    assert s.clock_mhz == (statistics.median(clocks) if clocks else None)
    if reasons:
        assert s.power_capped == pytest.approx(sum(bool(r & REASON_POWER_CAP) for r in reasons) / len(reasons))
        assert s.thermal == pytest.approx(sum(bool(r & 0x60) for r in reasons) / len(reasons))
    else:
        assert s.power_capped is None and s.thermal is None


def test_no_samples_no_state():
    assert GpuState.of([]) is None


def test_monitor_timestamps_the_programs_lines_and_summarises_a_window(tmp_path):
    """A stand-in for nvidia-smi prints a fast line, then (after a pause) a capped one: a window around
    each picks only its own, and the arguments name the query, the interval and the device."""
    fake = tmp_path / "fake_smi.py"
    argv_file = tmp_path / "argv.txt"
    fake.write_text(textwrap.dedent(f"""
        import sys, time
        open({str(argv_file)!r}, "w").write(" ".join(sys.argv[1:]))
        print("1980, 120.0, 0x0000000000000000", flush=True)
        time.sleep(0.6)
        print("1500, 699.0, 0x0000000000000004", flush=True)
        time.sleep(30)
    """))
    mon = GpuMonitor(device="00000000:1B:00.0", interval_ms=100, command=(sys.executable, str(fake)))
    t0 = time.monotonic()
    with mon:
        assert mon.running
        deadline = time.monotonic() + 20
        while len(mon.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not mon.running  # stopped on exit, without waiting for the program's sleep
    assert len(mon.samples) == 2
    (ta, _), (tb, _) = mon.samples
    assert tb - ta >= 0.5
    first, second = mon.window(t0, (ta + tb) / 2), mon.window((ta + tb) / 2, time.monotonic())
    assert (first.clock_mhz, first.power_w, first.power_capped) == (1980.0, 120.0, 0.0)
    assert (second.clock_mhz, second.power_w, second.power_capped) == (1500.0, 699.0, 1.0)
    assert mon.window(t0, (ta + tb) / 2).samples == 1 and mon.window(t0 - 10, t0 - 5) is None
    args = argv_file.read_text().split()
    assert "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active" in args
    assert args[args.index("-lms") + 1] == "100" and args[args.index("-i") + 1] == "00000000:1B:00.0"


def test_a_missing_program_leaves_the_monitor_off():
    mon = GpuMonitor(command=("no-such-nvidia-smi-here",))
    with mon:
        assert not mon.running
    assert mon.window(0, time.monotonic()) is None
