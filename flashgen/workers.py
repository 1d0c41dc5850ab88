"""Run a function over many items in worker processes, stoppable at once.

:func:`run_parallel` maps a picklable top-level ``fn`` over ``items`` in spawned
processes (a :class:`concurrent.futures.ProcessPoolExecutor`) and returns the results
in input order. Its contract on the way out:

* Ctrl-C (SIGINT) or SIGTERM in the parent, or an exception in ``fn``, cancels the
  items not started and ends the workers at once, with whatever they started
  (nvcc, ...): each worker leads its own process group, which gets SIGTERM, then
  SIGKILL after :data:`GRACE_S`. No process is left behind; the parent re-raises
  (SIGTERM as :class:`Terminated`, a KeyboardInterrupt).
* Workers ignore SIGINT: a Ctrl-C at a terminal reaches the whole foreground
  process group, and the parent alone decides what happens (no traceback from
  every worker).

The same pool serves work that is not one map (e.g. builds started early and
awaited later): :func:`process_pool`, :func:`submit` and :func:`stop_pool`.

A plain ``with ProcessPoolExecutor()`` waits, on the way out, for every queued item
to finish: that is why a Ctrl-C used to take effect only after the whole job. And
while the executor works, the parent notes SIGINT and SIGTERM instead of raising at
whatever line runs: an exception raised inside one of the executor's locks can leave
it held, and the interpreter's exit then waits forever for the executor's thread.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator

#: seconds the workers get to exit after SIGTERM before they are killed
GRACE_S = 1.0
#: seconds between two looks at the noted signals while results are awaited
POLL_S = 0.1
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A KeyboardInterrupt, so whatever cleans up after Ctrl-C cleans up after it."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` in the main thread (so ``finally``
    blocks run) instead of ending the process; the previous handler is restored after.
    Elsewhere than in the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def _stop_signals_noted() -> Iterator[list[int]]:
    """Within the block, SIGINT and SIGTERM are appended to the yielded list instead of raising
    (those that are ignored stay ignored); the previous handlers are restored after. Only the
    main thread has signal handlers: elsewhere the list stays empty."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, frame: noted.append(signum))
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _raise_if_noted(signals: list[int]) -> None:
    """Raise what the first noted signal means: Terminated for SIGTERM, else KeyboardInterrupt."""
    if signals:
        raise Terminated(signals[0]) if signals[0] == signal.SIGTERM else KeyboardInterrupt


@contextlib.contextmanager
def _stop_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while workers start; they are delivered when the block ends.

    The signal mask survives fork and exec, so a worker starts with both blocked and a
    Ctrl-C that reaches it before :func:`_worker_init` ran stays pending there (and is then
    discarded by SIG_IGN) instead of raising in its half-started interpreter.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _worker_init() -> None:  # runs first in every worker
    os.setpgid(0, 0)  # lead a process group: stopping the worker reaches its children too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


def process_pool(workers: int) -> cf.ProcessPoolExecutor:
    """A pool of ``workers`` spawned processes as :func:`run_parallel` uses them: each leads its own
    process group and ignores SIGINT. Give it work with :func:`submit`, end it with :func:`stop_pool`
    (a plain ``shutdown`` waits for every queued item)."""
    return cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init)


def submit(pool: cf.ProcessPoolExecutor, fn: Callable, *args: Any, **kwargs: Any) -> cf.Future:
    """``pool.submit(fn, *args, **kwargs)`` with SIGINT and SIGTERM held while it may start a worker
    (see :func:`_stop_signals_held`)."""
    with _stop_signals_held():
        return pool.submit(fn, *args, **kwargs)


def _signal_group(proc: mp.process.BaseProcess, sig: int) -> None:
    """``sig`` to the worker's process group, or to the worker alone before it formed one
    (terminate/kill signal a worker only while it is not reaped: its pid is still its own)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        (proc.kill if sig == signal.SIGKILL else proc.terminate)()


def stop_pool(pool: cf.ProcessPoolExecutor) -> None:
    """Cancel what has not started and end every worker (and its children) now; the futures of the
    items that ran are left as they were (a killed one may never complete)."""
    # The executor offers no handle on its workers and queues (before Python 3.14's
    # terminate_workers), so this reads private fields; shutdown() drops them: read them first.
    procs = [p for p in (pool._processes or {}).values() if p.pid is not None]
    results, manager = pool._result_queue, pool._executor_manager_thread
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:  # workers still alive, and children that outlived their worker (same group)
        _signal_group(p, signal.SIGKILL)
        p.join(GRACE_S)  # bounded: a process stuck in the kernel must not hang flashgen
    # A worker killed while sending a result leaves half a message in the result pipe, and the
    # executor's thread waits for the rest forever (and interpreter exit waits for that thread).
    # With this writer closed too, no writer is left: the thread reads end-of-file and ends.
    if results is not None:
        results._writer.close()
    if manager is not None:  # wound down here, while signals are still noted, not at interpreter exit
        manager.join(GRACE_S)


def run_parallel(
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    jobs: int | None = None,
    on_result: Callable[[int, Any], None] | None = None,
) -> list:
    """``[fn(item) for item in items]``, computed in ``jobs`` processes (default: the CPU count).

    ``fn`` must be a top-level function and the items and results picklable. ``on_result(index,
    result)`` is called in this process as each result arrives (completion order), e.g. for
    progress; keep it quick: a stop is noticed between results. With one job or one item everything runs here, without a process. An exception
    of ``fn``, Ctrl-C or SIGTERM stops all work at once (see the module docstring) and propagates.
    """
    items = list(items)
    if jobs is None:
        jobs = os.cpu_count() or 1
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    if jobs == 1 or len(items) <= 1:
        with sigterm_raises():
            return _run_here(fn, items, on_result)
    return _run_in_processes(fn, items, min(jobs, len(items)), on_result)


def _run_here(fn: Callable, items: list, on_result: Callable | None) -> list:
    results = []
    for i, item in enumerate(items):
        results.append(fn(item))
        if on_result:
            on_result(i, results[-1])
    return results


def _as_completed(futures: Iterable[cf.Future], signals: list[int]) -> Iterator[cf.Future]:
    """The futures as they complete; raises as soon as a stop signal is noted (within POLL_S)."""
    pending = set(futures)
    while pending:
        done, pending = cf.wait(pending, POLL_S, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            _raise_if_noted(signals)
            yield fut
        _raise_if_noted(signals)  # also after a wait that timed out


def _run_in_processes(fn: Callable, items: list, workers: int, on_result: Callable | None) -> list:
    results: list = [None] * len(items)
    pool = process_pool(workers)
    with _stop_signals_noted() as signals:
        try:
            with _stop_signals_held():  # the executor starts its workers inside submit()
                futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
            for fut in _as_completed(futures, signals):
                i = futures[fut]
                results[i] = fut.result()
                if on_result:
                    on_result(i, results[i])
        except BaseException:
            stop_pool(pool)
            raise
        pool.shutdown(wait=True)
    _raise_if_noted(signals)  # one came while the last workers exited: the work is done, yet asked to stop
    return results
