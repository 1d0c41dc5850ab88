"""Two versions of flashgen's kernels, A/B in one process: did a change to the generator keep its speed?

    python benchmarks/ab.py --before main~3 -o ab_out/            # in a git checkout
    python benchmarks/ab.py --before /path/to/old/checkout -o ab_out/
    python benchmarks/ab.py --before main~1 --pass bwd --d-heads 128 64 --seqs 2048 8192
    python benchmarks/ab.py --before main~1 --pass bwd --backward-engine mma_sync   # that engine's backward on both

For every benchmark shape (16 heads, the chosen head sizes (default 128), (seq, batch) from
``flashgen bench``'s shapes, fp16 and bf16, causal and not) each version picks and builds the
kernel its ``compile("auto")`` runs, in its own process and cache: the forward, or with
``--pass bwd`` the backward kernel that differentiates it. This checkout's launcher then loads
both libraries (the C ABI of ``flashgen/emit/abi.py`` must be the same on both sides) and
times them in interleaved rounds (the benchmark's Williams order, each timing settled at its
own clock), checking each side's output (o, or dq, dk, dv) against the float64 reference with
FlashAttention's rule. A backward row times the backward alone, on o and lse of the after side's
forward, and counts 2.5 forwards' FLOPs. Prints a table; writes ``ab.json`` with every round.

A row's ratio is after/before speed (median over rounds). A row counts as slower when its
slowdown exceeds its own round-to-round spread (the larger relative range of the two
versions' round times).

Run the same version on both sides (``--after`` equal to ``--before``) to see what the tool itself
reports: on an H200 (bf16, d_head 128, backward, 3 rounds) such an A/A gave 1.006 at seq 2048 and
0.959 at seq 8192, the after side's rounds slower in each order; a ratio that an A/A of the same rows
also shows is no change. To take that side's bias out of a small effect, run the pair twice, the second time
with ``--before`` and ``--after`` swapped: sqrt(ratio of the first run / ratio of the second) is the change
(on an H200 the two runs' geometric means were 0.988 and 0.986 for a change of about 1.001).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Run by each version in its own process: the kernel its compile("auto") picks per row.
_PICK = r"""
import json, sys, torch, flashgen
from flashgen.emit.abi import args_struct
rows, engine = json.loads(sys.argv[1]), sys.argv[2] or None
auto = flashgen.compile("auto", **({"backward_engine": engine} if engine else {}))
out = {"abi": args_struct("x"), "rows": []}
for r in rows:
    dtype = getattr(torch, r["dtype"])
    attn = auto.pick(torch.device("cuda", 0), dtype, r["d_head"], r["seq"], "causal" if r["causal"] else "none")
    row = {"library": str(attn.built.library), "name": attn.built.name, "config": attn.cfg.short_form()}
    if r["pass"] == "bwd":  # the backward kernel that differentiates it, for this key length
        from flashgen.build import build
        built = build(attn.backward_config(r["seq"]), attn.built.capability)
        row = {"library": str(built.library), "name": built.name, "config": built.cfg.short_form(), "forward": row}
    out["rows"].append(row)
print("AB-PICKS " + json.dumps(out))
"""


def checkout(version: str, into: Path) -> Path:
    """The source tree of ``version``: a folder holding a ``flashgen`` package, or a git revision of this
    repository (exported with ``git archive``)."""
    path = Path(version)
    if (path / "flashgen" / "__init__.py").exists():
        return path.resolve()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", version, "flashgen"], capture_output=True, check=False)
    if tar.returncode:
        raise SystemExit(f"{version!r} is neither a folder with a flashgen package nor a git revision: "
                         f"{tar.stderr.decode().strip()}")
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    return into


def pick(sources: dict, caches: dict, rows: list[dict], backward_engine: str | None = None) -> dict:
    """The kernels each version (side -> source tree) runs for ``rows``, built into its own cache, the versions'
    builds side by side (one process each); ``backward_engine``: both compile("auto") with it (a version from
    before ``compile(backward_engine=...)`` fails to pick, saying so)."""
    procs = {}
    for side, source in sources.items():
        env = {**os.environ, "FLASHGEN_CACHE": str(caches[side]),
               "PYTHONPATH": os.pathsep.join([str(source)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                              if p and Path(p).resolve() != REPO])}
        procs[side] = subprocess.Popen([sys.executable, "-c", _PICK, json.dumps(rows), backward_engine or ""], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    try:
        outputs = {side: proc.communicate() for side, proc in procs.items()}
    finally:  # Ctrl-C: no build left running
        for proc in procs.values():
            proc.kill()
    picks = {}
    for side, (stdout, stderr) in outputs.items():
        lines = [line for line in stdout.splitlines() if line.startswith("AB-PICKS ")]
        if procs[side].returncode or not lines:
            raise SystemExit(f"picking the kernels of {sources[side]} failed:\n{stderr[-4000:]}")
        picks[side] = json.loads(lines[-1][len("AB-PICKS "):])
    return picks


#: FLOPs of a row's pass in forwards' FLOPs (flashgen bench's count: the backward recomputes S and makes four products)
PASS_FLOPS = {"fwd": 1.0, "bwd": 2.5}


def shape_rows(seqs, dtypes, masks=("none", "causal"), d_heads=(128,), pass_: str = "fwd") -> list[dict]:
    from flashgen.bench import SHAPES

    return [{"seq": seq, "batch": batch, "d_head": d, "heads": 16, "dtype": dtype, "causal": mask == "causal", "pass": pass_}
            for d in d_heads for seq, batch in SHAPES if seq in seqs for dtype in dtypes for mask in masks]


def _load(kernel: dict, dtype, d_head: int, backward: bool) -> int:
    """The launcher's handle of one picked kernel (a backward kernel's where ``backward``)."""
    from flashgen import launcher

    return launcher.load_kernel(Path(kernel["library"]), kernel["name"], kernel["config"], dtype, d_head, backward=backward)


def _forward_calls(row: dict, kernels: dict, q, k, v, left: int, right: int) -> tuple[dict, dict]:
    """Each side's forward call, and its output's error ({"o": (error, 16-bit reference's error)})."""
    import torch

    from flashgen import bench, launcher

    native = launcher.native()
    fns = {}
    for side, kernel in kernels.items():
        handle = _load(kernel, q.dtype, row["d_head"], backward=False)
        native.allow_device(handle, torch.cuda.current_device())
        fns[side] = (lambda h: lambda: native.call(q, k, v, None, h, None, left, right, "top_left", False))(handle)
    scale = 1 / math.sqrt(row["d_head"])
    return fns, {side: {"o": bench.reference_error(fn(), q, k, v, scale, row["causal"])} for side, fn in fns.items()}


def _backward_calls(row: dict, kernels: dict, q, k, v, left: int, right: int) -> tuple[dict, dict]:
    """Each side's backward call (dq, dk, dv of o and lse from the after side's forward, gradient dO), and
    its gradients' errors ({"dq" | "dk" | "dv": (error, 16-bit reference's error)})."""
    import torch

    from flashgen.bench_passes import gradient_errors

    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(row["d_head"])
    forward = _load(kernels["after"]["forward"], q.dtype, row["d_head"], backward=False)
    out, lse = torch.ops.flashgen.attention(q, k, v, forward, scale, 0, left, right, True)
    op = torch.ops.flashgen.attention_backward
    fns = {side: (lambda h: lambda: op(dout, q, k, v, out, lse, None, h, scale, 0, left, right))(
        _load(kernel, q.dtype, row["d_head"], backward=True)) for side, kernel in kernels.items()}
    return fns, {side: gradient_errors(fn(), q, k, v, dout, causal=row["causal"], softmax_scale=scale)
                 for side, fn in fns.items()}


def time_row(row: dict, kernels: dict, rounds: int) -> dict:
    """Both versions' kernels for one row: rounds of timings, ratios, reference errors."""
    import torch

    from flashgen import bench
    from flashgen.attention.score_mask import key_window

    dtype = getattr(torch, row["dtype"])
    q, k, v = (torch.randn(row["batch"], row["seq"], row["heads"], row["d_head"], device="cuda", dtype=dtype)
               for _ in range(3))
    left, right = key_window(row["causal"], None)
    calls = _backward_calls if row["pass"] == "bwd" else _forward_calls
    fns, errors = calls(row, kernels, q, k, v, left, right)
    times = bench.interleaved(fns, rounds)
    return summarize(row, kernels, times, errors)


def judge(errors: dict) -> dict:
    """Per output ({name: (error, the 16-bit reference's error)}): both errors and whether FlashAttention's rule
    (:func:`flashgen.reference.tolerance`) passes it; NaN never passes."""
    from flashgen.reference import tolerance

    return {name: {"max_err": e, "lowp_err": base, "ok": bool(e <= tolerance(base))} for name, (e, base) in errors.items()}


def summarize(row: dict, kernels: dict, times: dict, errors: dict) -> dict:
    """``errors``: per side, {output name: (error, the 16-bit reference's error)}."""
    from flashgen.bench import attention_flops

    flops = PASS_FLOPS[row["pass"]] * attention_flops(row["batch"], row["heads"], row["seq"], row["seq"], row["d_head"], row["causal"])
    spread = max((max(t) - min(t)) / median(t) for t in times.values())
    ratio = median(times["before"]) / median(times["after"])
    judged = {s: judge(e) for s, e in errors.items()}
    return {**row, "config_before": kernels["before"]["config"], "config_after": kernels["after"]["config"],
            "ms": times, "tflops": {s: flops / median(t) / 1e9 for s, t in times.items()},
            "after_over_before": ratio, "spread": spread, "slower": (1 - ratio) > spread,
            "error": judged, "ok": {s: all(e["ok"] for e in j.values()) for s, j in judged.items()}}


def report(results: list[dict]) -> str:
    lines = [f"{'pass':>4} {'d':>3} {'seq':>6} {'dtype':>9} {'causal':>6} {'before':>7} {'after':>7} {'ratio':>6} {'spread':>6}  ok"]
    for r in results:
        ok = all(r["ok"].values())
        lines.append(f"{r['pass']:>4} {r['d_head']:>3} {r['seq']:>6} {r['dtype']:>9} {str(r['causal']):>6} {r['tflops']['before']:>7.0f} "
                     f"{r['tflops']['after']:>7.0f} {r['after_over_before']:>6.3f} {r['spread']:>6.3f}  "
                     f"{'yes' if ok else 'NO'}{'  SLOWER' if r['slower'] else ''}")
    geo = math.exp(sum(math.log(r["after_over_before"]) for r in results) / len(results))
    lines.append(f"geometric mean after/before: {geo:.4f}; rows slower beyond their spread: "
                 f"{sum(r['slower'] for r in results)} of {len(results)}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True, help="a git revision of this repository, or a folder holding a flashgen package")
    p.add_argument("--after", default=None, help="the same for the other side (default: this checkout)")
    p.add_argument("-o", "--out", type=Path, default=Path("."), help="folder for ab.json (default: .)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row (default: 3)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], help="sequence lengths")
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    p.add_argument("--masks", nargs="+", default=["none", "causal"], choices=["none", "causal"])
    p.add_argument("--d-heads", type=int, nargs="+", default=[128], help="head sizes (default: 128)")
    p.add_argument("--pass", dest="pass_", choices=sorted(PASS_FLOPS), default="fwd",
                   help="what to time: the forward, or the backward alone (dq, dk, dv) (default: fwd)")
    p.add_argument("--backward-engine", choices=["mma_sync", "wgmma"],
                   help="with --pass bwd: both versions' backward on this engine (compile(backward_engine=...)); "
                        "default: the GPU's preferred or tuned one")
    args = p.parse_args()
    if args.backward_engine and args.pass_ != "bwd":
        p.error("--backward-engine needs --pass bwd")
    from flashgen.bench import SHAPES

    unknown = sorted(set(args.seqs) - {seq for seq, _ in SHAPES})
    if unknown:
        p.error(f"--seqs {' '.join(map(str, unknown))}: not a benchmark length (those are {' '.join(str(s) for s, _ in SHAPES)})")
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    rows = shape_rows(args.seqs, args.dtypes, args.masks, args.d_heads, args.pass_)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": checkout(args.before, Path(tmp) / "before"), "after": checkout(args.after, Path(tmp) / "after") if args.after else REPO}
        picks = pick(sides, {side: Path(tmp) / f"cache-{side}" for side in sides}, rows, args.backward_engine)
        if picks["before"]["abi"] != picks["after"]["abi"]:
            raise SystemExit("the two versions' kernels take different argument structs (flashgen/emit/abi.py)")
        results = []
        for i, row in enumerate(rows):
            results.append(time_row(row, {s: picks[s]["rows"][i] for s in sides}, args.rounds))
            print(f"[ab] {row['pass']} d_head {row['d_head']} seq {row['seq']} {row['dtype']}{' causal' if row['causal'] else ''}: "
                  f"{results[-1]['after_over_before']:.3f}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "before": args.before, "after": args.after or "this checkout",
                                                  "backward_engine": args.backward_engine, "rows": results}, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
