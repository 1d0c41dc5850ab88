"""The GPU's clock and power while kernels are timed (nvidia-smi sampled in the background).

A board at its power limit shares out watts, not cycles: the SM clock falls until the board draws
its cap, and a kernel's time then follows its energy per call (on an H100 every attention kernel
of the benchmark, ours and cuDNN's, holds the board at 700 W with the SM clock at 1.3-1.6 GHz:
docs/results/power_bound_h100.txt). ``flashgen bench`` keeps, per row and for the run, the median
SM clock and board power and the share of samples throttled by the power cap or by heat, so a
ratio can be read against the state the GPU was in.

:class:`GpuMonitor` runs ``nvidia-smi --query-gpu=... -lms N`` as one child process and timestamps
each line as it arrives; :meth:`GpuMonitor.window` summarises the samples of a time window. Without
nvidia-smi the monitor stays off and every window is None.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from statistics import median
from typing import Optional, Sequence

import attrs

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
#: NVML clock event reasons (nvmlClocksEventReason*): the software power cap, and the thermal ones
REASON_POWER_CAP = 0x4
REASON_THERMAL = 0x20 | 0x40


@attrs.frozen
class Sample:
    """One nvidia-smi line: SM clock (MHz), board power (W), clock event reason bits; None where the
    driver reports no value ("[N/A]", "[Not Supported]")."""

    clock_mhz: Optional[float]
    power_w: Optional[float]
    reasons: Optional[int]

    @classmethod
    def parse(cls, line: str) -> "Sample | None":
        """A ``clocks.sm, power.draw, clocks_event_reasons.active`` line in csv,noheader,nounits
        form; None for a line that is not one (a header, a message)."""
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            return None

        def num(text: str, conv):
            try:
                return conv(text)
            except ValueError:
                return None
        clock, power = num(parts[0], float), num(parts[1], float)
        reasons = num(parts[2], lambda s: int(s, 16))
        if clock is None and power is None and reasons is None and not parts[0].startswith("["):
            return None
        return cls(clock, power, reasons)


@attrs.frozen
class GpuState:
    """Summary of the samples of a window: medians, and the share of samples per throttle cause."""

    samples: int
    clock_mhz: Optional[float]
    power_w: Optional[float]
    power_capped: Optional[float]  # share of samples with the power-cap reason set
    thermal: Optional[float]  # share of samples with a thermal slowdown reason set

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> "GpuState | None":
        if not samples:
            return None

        def med(xs):
            xs = [x for x in xs if x is not None]
            return median(xs) if xs else None

        def share(bits):
            rs = [s.reasons for s in samples if s.reasons is not None]
            return sum(1 for r in rs if r & bits) / len(rs) if rs else None
        return cls(len(samples), med(s.clock_mhz for s in samples), med(s.power_w for s in samples),
                   share(REASON_POWER_CAP), share(REASON_THERMAL))

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    def describe(self) -> str:
        parts = []
        if self.power_w is not None:
            parts.append(f"median {self.power_w:.0f} W")
        if self.clock_mhz is not None:
            parts.append(f"SM clock {self.clock_mhz:.0f} MHz")
        if self.power_capped is not None:
            parts.append(f"power-capped in {self.power_capped:.0%} of samples")
        if self.thermal:
            parts.append(f"thermal slowdown in {self.thermal:.0%}")
        return ", ".join(parts) + f" ({self.samples} samples)"


class GpuMonitor:
    """Samples one GPU every ``interval_ms`` in a background nvidia-smi; use as a context manager.

    ``device``: nvidia-smi's ``-i`` (an index or a PCI bus id; None: nvidia-smi's first GPU).
    ``command``: the program (and leading arguments) to run instead of nvidia-smi (tests)."""

    def __init__(self, device: Optional[str] = None, interval_ms: int = 200, command: Sequence[str] = ("nvidia-smi",)) -> None:
        self.device, self.interval_ms, self.command = device, interval_ms, tuple(command)
        self.samples: list[tuple[float, Sample]] = []
        self._proc: Optional[subprocess.Popen] = None
        self._reader: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._proc is not None

    def start(self) -> bool:
        """Start sampling; False (and no error) when the program is not there."""
        if self._proc is not None:
            return True
        if shutil.which(self.command[0]) is None:
            return False
        args = [*self.command, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)]
        if self.device is not None:
            args += ["-i", str(self.device)]
        try:
            self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return True

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            s = Sample.parse(line)
            if s is not None:
                with self._lock:
                    self.samples.append((time.monotonic(), s))

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._proc = None

    def window(self, t0: float, t1: float) -> "GpuState | None":
        """The samples taken between monotonic times ``t0`` and ``t1``, summarised (None: none)."""
        with self._lock:
            picked = [s for t, s in self.samples if t0 <= t <= t1]
        return GpuState.of(picked)

    def __enter__(self) -> "GpuMonitor":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def nvidia_smi_id(torch_device: int = 0) -> "str | None":
    """nvidia-smi's ``-i`` for a torch CUDA device: its PCI bus id when torch reports one (right
    whatever CUDA_VISIBLE_DEVICES says), else None (nvidia-smi's first GPU)."""
    import torch

    props = torch.cuda.get_device_properties(torch_device)
    bus, dev, dom = (getattr(props, f"pci_{k}_id", None) for k in ("bus", "device", "domain"))
    if bus is None or dev is None or dom is None:
        return None
    return f"{dom:08X}:{bus:02X}:{dev:02X}.0"
