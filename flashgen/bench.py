"""``flashgen bench``: emitted kernels next to SDPA's backends and FlashAttention-4, one process, one run.

The peers (:mod:`flashgen.bench_peers`): PyTorch's SDPA backends, and FlashAttention-4 where it is installed.

Protocol: d_head 128, 16 heads, (seq, batch) from
:data:`SHAPES`, (batch, seq, heads, d) contiguous inputs, random normal data; the
median of ``triton.testing.do_bench`` (CUDA-event fallback) after warm-up; SDPA
backends get ``.transpose(1, 2)`` views of the same tensors. The timed flashgen
config's output is checked against the float64 reference in the same run (FlashAttention's rule,
:func:`flashgen.reference.check_close`). Results go
to JSON and a PNG; a ratio table is printed last.

Each row times one pass (:mod:`flashgen.bench_passes`): the forward, the backward alone (dq, dk,
dv of a recorded forward, by ``torch.autograd.grad``; SDPA's own backward for the peers) or both;
a backward row checks flashgen's gradients against float64 and counts 2.5 forwards' FLOPs, a
forward + backward row 3.5. One table per pass; a config that fails or is wrong is named under
the tables, and the exit status is 1.

Shared GPUs drift (clocks, neighbours) by a few percent over seconds, which would tilt
a ratio of two timings taken one after the other. So every kernel of a shape (the peers
and the configs) is timed in ``rounds`` interleaved rounds and each reports the median of its
rounds; the JSON keeps every round. The rounds' orders follow a Williams design (a Latin square
balanced for the predecessor), and before each timing the kernel itself runs back to back for
``settle_s`` seconds: at the power cap a kernel timed right after a cool one (idle, SDPA flash)
rides the clock boost the cool one left (1980 MHz for ~0.25 s, then ~1550), and one timed after a
hot kernel does not; settling first times every kernel at its own steady clock
(docs/results/order_effects_h100.txt). nvidia-smi samples the
board's SM clock, power and throttle reasons meanwhile (:mod:`flashgen.gpu_monitor`): per
row in the JSON, for the run under the table.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable

from . import bench_peers
from .bench_passes import FLOP_FACTOR, PASSES, TITLES, gradient_errors, needs_grad, pass_call
from .bench_peers import LABELS, PEERS

SHAPES = ((512, 16), (1024, 16), (2048, 16), (4096, 16), (8192, 8), (16384, 4))  # (seq, batch)


def log(msg: str) -> None:
    print(f"[flashgen bench] {msg}", file=sys.stderr, flush=True)


#: seconds of back-to-back calls before each timing: the board leaves a predecessor's clock within ~0.25 s
SETTLE_S = 0.3


def settle(fn: Callable[[], Any], seconds: float, sync: Callable[[], Any], clock: Callable[[], float] = time.monotonic,
           every: int = 4) -> int:
    """Call ``fn`` back to back until ``seconds`` have passed on ``clock``, waiting for the device
    (``sync``) every ``every`` calls so the host does not queue far ahead of the clock it reads, and
    once at the end. Returns the number of calls (at least one)."""
    t0, n = clock(), 0
    while True:
        fn()
        n += 1
        if n % every == 0:
            sync()
        if clock() - t0 >= seconds:
            break
    sync()
    return n


def time_ms(fn: Callable[[], Any], settle_s: float = SETTLE_S) -> float:
    """Median milliseconds of ``fn`` after ``settle_s`` seconds of back-to-back calls (its own clock
    at the power cap) and warm-up (triton's do_bench when available)."""
    import torch

    if settle_s > 0:
        settle(fn, settle_s, torch.cuda.synchronize)
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))
    except ImportError:
        for _ in range(10):
            fn()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return median(times)


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, timer: Callable[[Callable[[], Any]], float] = time_ms
                ) -> dict[str, list[float]]:
    """Time each of ``fns`` once per round, round r in the order ``round_order(len(fns), r)``:
    ``{name: [ms per round]}``. A kernel that fails (e.g. a backend that rejects the input) raises
    out of the first round, whose order is ``fns``'s own."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for i in round_order(len(names), r):
            times[names[i]].append(timer(fns[names[i]]))
    return times


def round_order(n: int, r: int) -> list[int]:
    """The order of round ``r`` of ``n`` kernels: row ``r`` of a Williams design. Over any ``n``
    consecutive rounds from round 0 (``2n`` when ``n`` is odd) every kernel takes every place in a
    round equally often and follows every other kernel equally often. Row 0 is ``0 .. n-1``."""
    # the classic first row 0, 1, n-1, 2, n-2, ... (its successive differences are all distinct
    # mod n), each later row adding r; odd n needs each row's mirror too, so it cycles in 2n rounds
    first = [0]
    for k in range(1, n):
        first.append((k + 1) // 2 if k % 2 else n - k // 2)
    row = [(x + r // (2 if n % 2 else 1)) % n for x in first]
    if n % 2 and r % 2:
        row.reverse()
    # relabel so that round 0 is the identity (fns's order), keeping the design's balance
    label = {x: i for i, x in enumerate(first)}
    return [label[x] for x in row]


def pick_fastest(fns: dict[str, Callable[[], Any]], rounds: int = 3, finalists: int = 4,
                 timer: Callable[[Callable[[], Any]], float] = time_ms) -> tuple[str, dict[str, float]]:
    """The fastest of many candidates without a winner's curse: one timing each, then the
    ``finalists`` fastest timed again in ``rounds`` interleaved rounds; the lowest median wins.
    Returns ``(name, {finalist: median ms})``."""
    if not fns:
        raise ValueError("no candidates to time")
    first = {name: t[0] for name, t in interleaved(fns, 1, timer).items()}
    top = sorted(first, key=first.get)[:max(1, finalists)]
    medians = {name: median(t) for name, t in interleaved({n: fns[n] for n in top}, rounds, timer).items()}
    return min(medians, key=medians.get), medians


def ranking(medians: dict[str, float], flops: float) -> list[str]:
    """The finalists of :func:`pick_fastest` fastest first, a line each: their TFLOP/s at ``flops`` per call and
    the ratio to the fastest, so a close race reads as one (``flashgen tune``'s report)."""
    best = min(medians.values())
    return [f"  {flops / ms / 1e9:6.1f} TFLOP/s  {best / ms:6.3f}x  {name}" for name, ms in sorted(medians.items(), key=lambda kv: kv[1])]


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, d: int, causal: bool = False) -> float:
    f = 4.0 * batch * heads * seq_q * seq_k * d
    return f / 2 if causal else f


def reference_error(o, q, k, v, scale: float, causal: bool = False, rows: int = 512) -> tuple[float, float]:
    """(max |o - ref64|, max |o_16 - ref64|) on batch 0, the first ``rows`` query rows, where o_16 is
    the same attention at a flash kernel's 16-bit precision (:func:`flashgen.reference.lowp_reference`
    with ``pipeline="flash"``, about PyTorch's flash SDPA); causal is top-left."""
    from .reference import attention, lowp_reference, max_errors

    qs, ks, vs = q[:1, :rows], k[:1], v[:1]
    kwargs = {"softmax_scale": scale, "causal": causal}
    return max_errors(o[:1, :rows], attention(qs, ks, vs, **kwargs), lowp_reference(qs, ks, vs, pipeline="flash", **kwargs))


def matmul_ceiling(dtype) -> float:
    """TFLOP/s of a dense 8192^3 matrix product in ``dtype`` (the tensor cores' practical ceiling)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


@dataclass(frozen=True)
class RowSpec:
    """What one row times: the pass ``pass_`` (:data:`flashgen.bench_passes.PASSES`) of ``heads``-head
    attention in ``dtype`` ("fp16" or "bf16") at one (seq, batch), top-left causal or unmasked."""

    pass_: str
    dtype: str
    d_head: int
    causal: bool
    seq: int
    batch: int
    heads: int

    def flops(self) -> float:
        """The pass's FLOPs: :data:`FLOP_FACTOR` forwards of :func:`attention_flops`."""
        return FLOP_FACTOR[self.pass_] * attention_flops(self.batch, self.heads, self.seq, self.seq, self.d_head, self.causal)

    def describe(self) -> str:
        return f"{self.pass_} {self.dtype} d{self.d_head}{' causal' if self.causal else ''} seq {self.seq}"


def run_bench(cfgs, dtypes, shapes=SHAPES, heads: int = 16, d_heads=(128,), causal_modes=(False,), peers=None,
              rounds: int = 3, settle_s: float = SETTLE_S, passes=("fwd",), auto: bool = False,
              backward_engine: str | None = None) -> dict:
    """Time every (dtype, d_head, causal) x shape x pass: the given configs (d_head adapted), with ``auto``
    also ``flashgen.compile("auto")`` (named "auto"), and ``peers`` (names of :data:`flashgen.bench_peers.PEERS`;
    default: :func:`flashgen.bench_peers.default_peers`), in ``rounds`` interleaved rounds (medians reported), each
    timing after ``settle_s`` seconds of the kernel itself; ``backward_engine``: the engine of flashgen's backwards
    (``flashgen.compile``'s argument)."""
    import torch

    from .gpu_monitor import GpuMonitor, nvidia_smi_id
    from .runtime import compile as fg_compile

    attns = _build(cfgs, dtypes, d_heads, causal_modes, backward_engine)
    if not attns and not auto:
        from .cli import CommandError

        raise CommandError(f"no config matches dtypes {' '.join(dtypes)}")
    auto_attn = fg_compile("auto", backward_engine=backward_engine) if auto else None  # builds on first calls, before timing
    peers = bench_peers.default_peers() if peers is None else tuple(peers)
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "heads": heads,
        "rounds": rounds,
        "settle_s": settle_s,
        "d_heads": list(d_heads),
        "passes": list(passes),
        "backward_engine": backward_engine,
        "peers": list(peers),
        "fa4_version": bench_peers.fa4_version() if bench_peers.FA4 in peers else None,
        "rows": [],
        "matmul_tflops": {},
        "gpu_state": None,
    }
    makers = bench_peers.makers(peers)
    # nvidia-smi in the background for the whole run (stopped even if a row raises)
    with GpuMonitor(nvidia_smi_id(torch.cuda.current_device())) as monitor:
        if not monitor.running:
            log("nvidia-smi not found: no clock / power record")
        run_t0 = time.monotonic()
        for dt_name in dtypes:
            dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt_name]
            results["matmul_tflops"][dt_name] = matmul_ceiling(dt)
            log(f"dense {dt_name} 8192^3 matmul: {results['matmul_tflops'][dt_name]:.0f} TFLOP/s")
            for d_head in d_heads:
                for causal in causal_modes:
                    mine = {c.replace(mask="none").short_form(): attns[c] for c in attns
                            if c.dtype.value == dt_name and c.d_head == d_head and (c.mask == "causal") == causal}
                    if auto_attn is not None:
                        mine["auto"] = auto_attn
                    for seq, batch in shapes:
                        for pass_ in passes:
                            spec = RowSpec(pass_, dt_name, d_head, causal, seq, batch, heads)
                            results["rows"].append(bench_row(spec, mine, makers, rounds, lambda fn: time_ms(fn, settle_s), monitor))
        whole = monitor.window(run_t0, time.monotonic())
    results["gpu_state"] = whole.to_dict() if whole else None
    return results


def _build(cfgs, dtypes, d_heads, causal_modes, backward_engine: str | None = None) -> dict:
    """{config with its d_head and mask: Attention} of every config of ``dtypes`` at every d_head and
    mask, built in parallel; a config that cannot take a d_head, or fails to build, is logged and left out."""
    import torch

    from .build import build_many
    from .runtime import compile as fg_compile

    todo: dict = {}
    for c in cfgs:
        if c.dtype.value not in dtypes:
            continue
        for d in d_heads:
            try:
                cd = c if c.d_head == d else c.replace(d_head=d)
            except ValueError as exc:
                log(f"skipping {c.short_form()} at d_head {d}: {exc}")
                continue
            for causal in causal_modes:
                todo[cd.replace(mask="causal" if causal else "none")] = None
    if not todo:
        return {}
    log(f"building {len(todo)} kernel(s) in parallel")
    t0 = time.perf_counter()
    failures = build_many(list(todo), torch.cuda.get_device_capability())
    for name, err in failures.items():
        log(f"build failed: {name}\n{err}")
    attns = {c: fg_compile(c, backward_engine=backward_engine) for c in todo if c.short_form() not in failures}
    log(f"builds ready in {time.perf_counter() - t0:.0f} s")
    return attns


def bench_row(spec: RowSpec, kernels: dict, peers: dict, rounds: int, timer: Callable[[Callable[[], Any]], float],
              monitor=None, device: str = "cuda") -> dict:
    """One table row: ``spec``'s pass of the peers ({name: maker(q, k, v, causal) -> call returning o as
    (batch, heads, seq, d)}, :mod:`flashgen.bench_peers`) and of ``kernels`` ({name: flashgen attention}),
    timed by ``timer`` in ``rounds`` interleaved rounds on fresh random inputs; then each kernel is
    checked against float64 (:func:`check_kernel`). One that fails its first call is not timed: a
    peer's figure is None, a kernel's entry holds the error and is not correct."""
    q, k, v, do = _inputs(spec, spec.seq, device)
    forwards, outs = _forwards(spec, kernels, peers, q, k, v, do)
    calls, failed = _first_calls(spec.pass_, forwards, (q, k, v), peers)
    for name, msg in failed.items():
        log(f"{name} {'unavailable' if name in peers else 'FAILED'} at {spec.describe()}: {msg}")
    t0 = time.monotonic()
    times = interleaved(calls, rounds, timer)
    state = monitor.window(t0, time.monotonic()) if monitor is not None else None
    calls.clear()  # the recorded forwards of the backward pass: their memory goes before the checks
    flops = spec.flops()
    row: dict[str, Any] = {"pass": spec.pass_, "dtype": spec.dtype, "d_head": spec.d_head, "causal": spec.causal,
                           "seq": spec.seq, "batch": spec.batch, "flashgen": {}, "peers": {},
                           "gpu_state": state.to_dict() if state else None}
    for peer in peers:
        row["peers"][peer] = flops / median(times[peer]) / 1e9 if peer in times else None
    row["peer_rounds_tflops"] = {n: [flops / ms / 1e9 for ms in t] for n, t in times.items() if n in peers}
    for name, attn in kernels.items():
        if name in failed:
            row["flashgen"][name] = {"error": failed[name], "correct": False}
            continue
        row["flashgen"][name] = {"tflops": flops / median(times[name]) / 1e9,
                                 "rounds_tflops": [flops / t / 1e9 for t in times[name]],
                                 **check_kernel(spec, attn, q, k, v, outs.get(name), device)}
    timed = {n: e for n, e in row["flashgen"].items() if "tflops" in e}
    row["best"] = max(timed, key=lambda n: timed[n]["tflops"], default=None)
    if row["best"]:
        fa = row["peers"].get("FLASH_ATTENTION")
        log(f"{spec.describe()}: best {timed[row['best']]['tflops']:.0f} TFLOP/s ({row['best']}), sdpa flash "
            f"{fa or float('nan'):.0f}" + (f"; board {state.describe()}" if state else ""))
    return row


def _inputs(spec: RowSpec, seed: int, device: str) -> tuple:
    """(q, k, v, do): random normal (batch, seq, heads, d_head) tensors of ``spec``, requiring grad
    when its pass runs a backward (do is None when it does not)."""
    import torch

    torch.manual_seed(seed)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    grad = needs_grad(spec.pass_)
    shape = (spec.batch, spec.seq, spec.heads, spec.d_head)
    q, k, v = (torch.randn(shape, device=device, dtype=dt).requires_grad_(grad) for _ in range(3))
    return q, k, v, torch.randn(shape, device=device, dtype=dt) if grad else None


def _forwards(spec: RowSpec, kernels: dict, peers: dict, q, k, v, do) -> tuple[dict, dict]:
    """({name: (call returning o, o's gradient in o's layout or None)}, peers first; {kernel name:
    output buffer of the forward pass}). The forward pass writes into a buffer the check poisons
    first, so a kernel that writes nothing fails; the backward passes let autograd allocate o."""
    import torch

    forwards = {name: (make(q, k, v, spec.causal), None if do is None else do.transpose(1, 2))
                for name, make in peers.items()}
    outs = {}
    for name, attn in kernels.items():
        if do is None:
            out = outs[name] = torch.empty_like(q)
            forwards[name] = (lambda attn=attn, out=out: attn(q, k, v, out=out, causal=spec.causal), None)
        else:
            forwards[name] = (lambda attn=attn: attn(q, k, v, causal=spec.causal), do)
    return forwards, outs


def _first_calls(pass_: str, forwards: dict, leaves, peers=()) -> tuple[dict, dict]:
    """({name: the pass's timed call}, {name: first line of its error}): each call made and run once,
    so a backend that rejects the input, or a kernel that fails, drops out before the timing. A
    flashgen kernel drops out on a RuntimeError or ValueError (anything else is a bug and raises); a
    peer (named in ``peers``) on any error, since other libraries refuse inputs in their own ways."""
    calls, failed = {}, {}
    for name, (forward, do) in forwards.items():
        tolerated = Exception if name in peers else (RuntimeError, ValueError)
        try:
            call = pass_call(pass_, forward, leaves, do)
            call()
        except tolerated as exc:  # a backend or kernel that does not take this input
            failed[name] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            continue
        calls[name] = call
    return calls, failed


def check_kernel(spec: RowSpec, attn, q, k, v, out, device: str = "cuda") -> dict:
    """``{"max_err", "torch_err", "bound", "correct"}`` of ``attn`` against float64: the forward pass
    checks ``out`` (NaN-poisoned, written again) on the timed inputs (:func:`reference_error`); the
    backward passes check dq, dk, dv (:func:`flashgen.bench_passes.gradient_errors`), and fwd+bwd also
    o, on fresh inputs, so gradients left over from the timed calls cannot pass. Errors and bounds
    are per output ("o", "dq", "dk", "dv") in the backward passes; correct needs every error within
    its bound and every output finite."""
    import torch

    from .reference import tolerance

    scale = 1 / math.sqrt(spec.d_head)
    if not needs_grad(spec.pass_):
        out.fill_(float("nan"))
        attn(q, k, v, out=out, causal=spec.causal)
        err, err_t = reference_error(out, q, k, v, scale, spec.causal)
        finite = not bool(torch.isnan(out).any())
        return {"max_err": err, "torch_err": err_t, "bound": tolerance(err_t), "correct": bool(err <= tolerance(err_t)) and finite,
                **({} if finite else {"nonfinite": True})}
    q, k, v, do = _inputs(spec, spec.seq + 1, device)
    o = attn(q, k, v, causal=spec.causal)
    grads = torch.autograd.grad(o, (q, k, v), do)
    errors = gradient_errors(grads, q, k, v, do, causal=spec.causal, softmax_scale=scale)
    outputs = dict(zip(("dq", "dk", "dv"), grads))
    if spec.pass_ == "fwd+bwd":
        errors = {"o": reference_error(o.detach(), q.detach(), k.detach(), v.detach(), scale, spec.causal), **errors}
        outputs["o"] = o
    finite = all(bool(torch.isfinite(t).all()) for t in outputs.values())
    return {"max_err": {n: e[0] for n, e in errors.items()}, "torch_err": {n: e[1] for n, e in errors.items()},
            "bound": {n: tolerance(e[1]) for n, e in errors.items()},
            "correct": finite and all(bool(e[0] <= tolerance(e[1])) for e in errors.values()),
            **({} if finite else {"nonfinite": True})}


def paired_ratio_range(mine: list[float] | None, peer: list[float] | None) -> str:
    """"lo-hi" of mine[i] / peer[i] over the rounds (round i timed both in one pass of the design, so
    each ratio pairs timings taken close together): how far one round's ratio strays from the
    medians' ratio. "-" without two rounds of both."""
    if not mine or not peer or len(mine) != len(peer) or len(mine) < 2:
        return "-"
    ratios = [a / b for a, b in zip(mine, peer)]
    return f"{min(ratios):.3f}-{max(ratios):.3f}"


def _columns(peers) -> list[tuple[str, int]]:
    """(peer, width of its ratio column) of each peer column in the table, in :data:`PEERS`'s order."""
    return [(p, max(8, len(LABELS[p]) + 2)) for p in PEERS if p in peers]


def _header(peers) -> str:
    cols = _columns(peers)
    return (f"{'dtype':5} {'d':>3} {'mask':6} {'seq':>6} {'flashgen':>9} {'spread':>6} "
            + " ".join(f"{LABELS[p]:>7}" for p, _ in cols) + " "
            + " ".join(f"{'x ' + LABELS[p]:>{w}}" for p, w in cols) + f" {'x cudnn by round':>16}  ok  best config")


def format_table(results: dict) -> str:
    """The printed result: a title, one table per pass (rows without any timed config say why), the
    entries that failed or were wrong with their errors, the matmul ceilings and the board's state."""
    lines = [
        f"flashgen vs SDPA{' and FlashAttention-4 ' + str(results['fa4_version']) if results.get('fa4_version') else ''} "
        f"on {results['gpu']} (torch {results['torch']}, CUDA {results['cuda']}), "
        f"{results['heads']} heads, TFLOP/s, median of {results.get('rounds', 1)} interleaved round(s)"
        + (f", each timing after {results['settle_s']:g} s of the kernel itself" if results.get("settle_s") else "")
        + " (causal counts half the FLOPs; ratio = flashgen / peer)"
        + (f"; flashgen's backwards on the {results['backward_engine']} engine" if results.get("backward_engine") else ""),
    ]
    passes = [p for p in PASSES if any(r.get("pass", "fwd") == p for r in results["rows"])] or ["fwd"]
    peers = results.get("peers") or bench_peers.SDPA_PEERS  # runs before the peer list was recorded: SDPA's
    for i, pass_ in enumerate(passes):
        lines += [""] * (i > 0) + [f"{TITLES[pass_]}:", _header(peers)]
        lines += [_row_line(r, peers) for r in results["rows"] if r.get("pass", "fwd") == pass_ and r["flashgen"]]
    failures = _failure_lines(results["rows"])
    lines += [""] * bool(failures) + failures
    for dt, tf in results.get("matmul_tflops", {}).items():
        lines.append(f"dense {dt} 8192^3 matmul (practical ceiling): {tf:.0f} TFLOP/s")
    if results.get("gpu_state"):
        from .gpu_monitor import GpuState

        lines.append(f"board while timing (nvidia-smi; per row in the JSON): {GpuState(**results['gpu_state']).describe()}")
    return "\n".join(lines)


def _row_line(row: dict, peers) -> str:
    """One row of a pass's table: its best config's TFLOP/s and ratios to each of ``peers``; without a
    timed config, dashes and FAILED (the failures are listed under the tables)."""
    p = row["peers"]
    cols = _columns(peers)
    head = f"{row['dtype']:5} {row['d_head']:>3} {'causal' if row['causal'] else '-':6} {row['seq']:>6}"

    def num(x):
        return f"{x:7.0f}" if x else "      -"

    figures = " ".join(num(p.get(name)) for name, _ in cols)
    if not row["best"]:
        dashes = " ".join(f"{'-':>{w}}" for _, w in cols)
        return f"{head} {'-':>9} {'-':>6} {figures} {dashes} {'-':>16}  FAILED {' '.join(row['flashgen'])}"
    fg = row["flashgen"][row["best"]]

    def ratio(x, w):
        return f"{fg['tflops'] / x:{w}.3f}" if x else " " * (w - 1) + "-"

    # (max - min) / median of the best config's rounds: how far one timing could have moved its ratios
    r = fg.get("rounds_tflops") or []
    spread = f"{(max(r) - min(r)) / median(r):6.1%}" if len(r) > 1 else "     -"
    by_round = f"{paired_ratio_range(r, row.get('peer_rounds_tflops', {}).get('CUDNN_ATTENTION')):>16}"
    ratios = " ".join(ratio(p.get(name), w) for name, w in cols)
    return (f"{head} {fg['tflops']:9.0f} {spread} {figures} {ratios} {by_round}  "
            f"{'yes' if fg['correct'] else 'NO '} {row['best']}")


def _failure_lines(rows) -> list[str]:
    """``FAILED``/``WRONG`` lines for every flashgen entry that raised or was not correct: the error, or
    each output whose max error exceeds its bound (2x the 16-bit baseline's + slack) or is not finite."""
    lines = []
    for row in rows:
        where = (f"{row.get('pass', 'fwd')} {row['dtype']} d{row['d_head']}{' causal' if row['causal'] else ''} "
                 f"seq {row['seq']}")
        for name, e in row["flashgen"].items():
            if e["correct"]:
                continue
            if "error" in e:
                lines.append(f"FAILED {where} {name}: {e['error']}")
                continue
            errs, bounds = e.get("max_err"), e.get("bound")
            if not isinstance(errs, dict):
                errs, bounds = {"o": errs}, {"o": bounds}
            bad = [f"{n} max error {x:.3e} > {bounds[n]:.3e}" for n, x in errs.items()
                   if bounds and bounds.get(n) is not None and not x <= bounds[n]]
            if e.get("nonfinite"):
                bad.append("NaN/Inf in the outputs")
            lines.append(f"WRONG {where} {name}: " + ("; ".join(bad) or "not correct"))
    return lines


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG written (pip install matplotlib)")
        return False
    def panel(r):
        return PASSES.index(r.get("pass", "fwd")), r["dtype"], r["d_head"], r["causal"]

    panels = sorted({panel(r) for r in results["rows"]})
    ncol = min(4, len(panels))
    nrow = -(-len(panels) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 4 * nrow), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, panels):
        pass_, dt, d_head, causal = PASSES[key[0]], *key[1:]
        rows = [r for r in results["rows"] if panel(r) == key]
        seqs = [r["seq"] for r in rows]
        series = {"flashgen (best)": [r["flashgen"][r["best"]]["tflops"] if r["best"] else None for r in rows]}
        for peer in results.get("peers") or bench_peers.SDPA_PEERS:
            label = "FlashAttention-4" if peer == bench_peers.FA4 else f"SDPA {peer.lower()}"
            series[label] = [r["peers"].get(peer) for r in rows]
        for label, ys in series.items():
            pts = [(s, y) for s, y in zip(seqs, ys) if y]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{pass_}, {dt}, d_head {d_head}{', causal' if causal else ''}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*",
                   help="configs: YAML files, short forms, named sets or 'auto' (flashgen.compile('auto'), its kernel "
                        "picked per shape; named 'auto' in the table) (default: the mma.sync defaults and, on "
                        "compute capability 9.0, the wgmma configs compile('auto') ships for d_head 128)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"],
                   help="element types (default: fp16 bf16)")
    p.add_argument("--seqs", nargs="+", type=int,
                   help=f"sequence lengths among {' '.join(str(s) for s, _ in SHAPES)} (default: all)")
    p.add_argument("--d-heads", nargs="+", type=int, default=[128], help="head dimensions (default: 128)")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="no", help="non-causal, causal or both")
    p.add_argument("--passes", "--pass", nargs="+", choices=PASSES, default=["fwd"], metavar="PASS",
                   help="what to time, one table each: fwd (the forward), bwd (the backward alone: dq, dk, dv of a "
                        "recorded forward, 2.5x its FLOPs, gradients checked against float64) or fwd+bwd (both, 3.5x) "
                        "(default: fwd)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved timing rounds per shape; each kernel reports its median (default: 3)")
    p.add_argument("--settle", type=float, default=SETTLE_S,
                   help="seconds each kernel runs back to back before each of its timings, so it is timed at its own "
                        f"steady clock, not the one its predecessor left (default: {SETTLE_S}; 0: none)")
    from .dsl.backward_config import ENGINES

    p.add_argument("--backward-engine", choices=ENGINES,
                   help="run flashgen's backwards on this engine (flashgen.compile(backward_engine=...)), e.g. the "
                        "mma_sync backward on a Hopper GPU (default: the tuned or the GPU's preferred engine)")
    p.add_argument("--peers", nargs="+", choices=list(LABELS.values()), metavar="PEER",
                   help="peers to time beside flashgen: flash, cudnn, mem-eff (SDPA's backends), fa4 "
                        "(FlashAttention-4, pip install flash-attn-4) (default: the three SDPA backends, and fa4 "
                        "when it is installed)")
    p.add_argument("-o", "--out", default="bench_out", help="folder for bench.json and bench.png (default: bench_out)")


def default_bench_configs(capability: tuple[int, int]) -> list:
    """The configs timed when none are given: the shipped configs of every engine the GPU runs (the
    mma.sync defaults; on sm_90a also the wgmma defaults)."""
    from . import engines
    from .targets import of_capability

    runnable = engines.runnable_on(of_capability(capability))
    return list(dict.fromkeys(c for e in sorted(runnable, key=lambda e: e.rank) for c in e.bench_configs()))


def main(args: argparse.Namespace) -> int:
    import torch

    from .cli import CommandError, resolve_configs

    if args.rounds < 1:
        raise CommandError(f"--rounds must be at least 1, got {args.rounds}")
    if not 0 <= args.settle <= 10:
        raise CommandError(f"--settle must be between 0 and 10 seconds, got {args.settle}")
    known = [s for s, _ in SHAPES]
    unknown = [s for s in args.seqs or () if s not in known]
    if unknown:
        raise CommandError(f"--seqs {' '.join(map(str, unknown))}: the benchmark's lengths are {' '.join(map(str, known))}")
    if args.backward_engine and not any(needs_grad(p) for p in args.passes):
        raise CommandError(f"--backward-engine {args.backward_engine}: no pass runs a backward (add --passes bwd or fwd+bwd)")
    try:
        peers = bench_peers.from_labels(args.peers) if args.peers else None
    except bench_peers.PeerUnavailable as exc:
        raise CommandError(str(exc)) from None
    if not torch.cuda.is_available():
        raise CommandError("bench needs a CUDA GPU")
    shapes = [s for s in SHAPES if not args.seqs or s[0] in args.seqs]
    specs = [c for c in args.configs if c.strip() != "auto"]
    auto = len(specs) < len(args.configs)
    if specs:
        cfgs = list(resolve_configs(specs, forward_only="flashgen bench").configs)
    else:
        cfgs = [] if auto else default_bench_configs(torch.cuda.get_device_capability())
    modes = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    results = run_bench(cfgs, args.dtypes, shapes, d_heads=tuple(args.d_heads), causal_modes=modes, rounds=args.rounds,
                        settle_s=args.settle, passes=tuple(dict.fromkeys(args.passes)), auto=auto,
                        backward_engine=args.backward_engine, peers=peers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    plot(results, out / "bench.png")
    log(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    print(format_table(results))
    return 0 if all(fg["correct"] for r in results["rows"] for fg in r["flashgen"].values()) else 1
