"""run_parallel: results in input order, and Ctrl-C, SIGTERM or a failing item end every worker
and every process a worker started, at once; stop_pool does the same for a pool given work by submit."""
from __future__ import annotations

import gc
import multiprocessing.queues
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import needs_proc, running, wait_for

from flashgen.workers import Terminated, process_pool, run_parallel, stop_pool, submit

WAIT_S = 20  # generous bound for workers to start on a busy 2-core machine; passing runs take ~1 s


# ---- worker functions: top level, so spawned workers can import them ---------------------------


def square(x: int) -> int:
    return x * x


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three is not allowed")
    time.sleep(0.2)
    return x


def quick_or_hang(folder: str | None) -> None:
    """Return at once for None; else start a child process, note both pids in ``folder`` and hang."""
    if folder is None:
        return
    child = subprocess.Popen(["sleep", "60"])
    Path(folder, f"{os.getpid()}-{child.pid}").touch()
    time.sleep(60)


def quick_or_half_sent(folder: str | None) -> None:
    """Return at once for None; else, once ``folder``/go exists, write half a result message
    to the executor's result pipe, as a worker killed while sending leaves it, and hang."""
    if folder is None:
        return
    assert wait_for(lambda: Path(folder, "go").exists(), WAIT_S)
    (results,) = [o for o in gc.get_objects() if isinstance(o, multiprocessing.queues.SimpleQueue)]
    os.write(results._writer.fileno(), struct.pack("!i", 1000) + b"only 16 of 1000")
    Path(folder, "sent").touch()
    time.sleep(60)


# ---- helpers -------------------------------------------------------------------------------


def noted_pids(folder: Path) -> list[int]:
    return [int(p) for f in folder.iterdir() for p in f.name.split("-")]


# ---- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("jobs", [1, 3])
def test_results_come_in_input_order(jobs):
    seen = []
    assert run_parallel(square, range(7), jobs, lambda i, r: seen.append((i, r))) == [x * x for x in range(7)]
    assert sorted(seen) == [(x, x * x) for x in range(7)]  # once each, as they arrive


def test_jobs_must_be_positive():
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        run_parallel(square, [1, 2], 0)


def test_a_failing_item_stops_the_rest():
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="three is not allowed"):
        run_parallel(fail_on_three, [3] + [0] * 60, 2)  # the others would take 6 s
    assert time.monotonic() - t0 < 5


def raise_keyboard_interrupt():
    raise KeyboardInterrupt


def send_sigterm_to_self():
    os.kill(os.getpid(), signal.SIGTERM)


@needs_proc
@pytest.mark.parametrize("stop, error", [(raise_keyboard_interrupt, KeyboardInterrupt),
                                         (send_sigterm_to_self, Terminated)])
def test_a_stop_ends_the_workers_and_their_children_at_once(stop, error, tmp_path):
    """The quick item's result stops the run while two workers hang, each with a child process."""
    before = signal.getsignal(signal.SIGTERM)
    t0 = None

    def on_result(i: int, result) -> None:
        nonlocal t0
        assert wait_for(lambda: len(list(tmp_path.iterdir())) == 2, WAIT_S), "the workers did not start"
        t0 = time.monotonic()
        stop()

    with pytest.raises(error):
        run_parallel(quick_or_hang, [None, str(tmp_path), str(tmp_path)], 3, on_result)
    assert time.monotonic() - t0 < 3
    pids = noted_pids(tmp_path)
    assert len(pids) == 4
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=2), [p for p in pids if running(p)]
    assert signal.getsignal(signal.SIGTERM) is before  # the SIGTERM handler was put back


def test_a_worker_stopped_while_sending_a_result_does_not_hang_the_exit(tmp_path):
    """A worker killed halfway through sending a result must not leave the executor's thread
    waiting for the rest of the message: the interpreter's exit would wait for that thread."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path[:0] = [{str(Path(__file__).parent)!r}]
        from test_workers import quick_or_half_sent, wait_for
        from flashgen.workers import run_parallel

        def on_result(i, result):
            Path({str(tmp_path)!r}, "go").touch()
            assert wait_for(lambda: Path({str(tmp_path)!r}, "sent").exists(), 20)
            raise KeyboardInterrupt

        try:
            run_parallel(quick_or_half_sent, [None, {str(tmp_path)!r}], 2, on_result)
        except KeyboardInterrupt:
            print("stopped")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "stopped\n", proc.stderr


@needs_proc
def test_stop_pool_ends_a_running_item_and_its_children_at_once(tmp_path):
    """A pool's worker ignores SIGINT (the parent decides what a Ctrl-C means); stop_pool ends it,
    with the process its item started, at once."""
    pool = process_pool(1)
    try:
        hanging = submit(pool, quick_or_hang, str(tmp_path))
        assert wait_for(lambda: len(list(tmp_path.iterdir())) == 1, WAIT_S), "the worker did not start"
        pids = noted_pids(tmp_path)
        os.kill(pids[0], signal.SIGINT)
        time.sleep(0.3)
        assert all(running(p) for p in pids) and not hanging.done()
    finally:
        t0 = time.monotonic()
        stop_pool(pool)
    assert time.monotonic() - t0 < 3
    assert wait_for(lambda: not any(running(p) for p in pids), timeout=2), [p for p in pids if running(p)]
