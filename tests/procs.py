"""Process helpers for the tests that stop parallel work: which processes live, read from /proc."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

#: the tests read process states and parents from /proc
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first, then the parent), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return [c for c in pids if (f := _stat(c)) is not None and int(f[1]) == pid and f[0] not in ("Z", "X")]


def wait_for(predicate, timeout: float) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def signal_masks(pid: int) -> dict[str, str]:
    """Per thread of ``pid``: its blocked and ignored signal masks, as /proc shows them (for failure messages)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        out[task.name] = f"blocked {fields['SigBlk'].strip()} ignored {fields['SigIgn'].strip()}"
    return out
