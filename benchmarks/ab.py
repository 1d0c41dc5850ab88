"""Two versions of flashgen's kernels, A/B in one process: did a change to the generator keep its speed?

    python benchmarks/ab.py --before main~3 -o ab_out/            # in a git checkout
    python benchmarks/ab.py --before /path/to/old/checkout -o ab_out/

For every benchmark shape (d_head 128, 16 heads, (seq, batch) from ``flashgen bench``'s
shapes, fp16 and bf16, causal and not) each version picks and builds the kernel its
``compile("auto")`` runs, in its own process and cache. This checkout's launcher then loads
both libraries (the C ABI of ``flashgen/emit/abi.py`` must be the same on both sides) and
times them in interleaved rounds (the benchmark's Williams order, each timing settled at its
own clock), checking both outputs against the float64 reference. Prints a table; writes
``ab.json`` with every round.

A row's ratio is after/before speed (median over rounds). A row counts as slower when its
slowdown exceeds its own round-to-round spread (the larger relative range of the two
versions' round times).
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
rows = json.loads(sys.argv[1])
auto = flashgen.compile("auto")
out = {"abi": args_struct("x"), "rows": []}
for r in rows:
    dtype = getattr(torch, r["dtype"])
    attn = auto.pick(torch.device("cuda", 0), dtype, r["d_head"], r["seq"], "causal" if r["causal"] else "none")
    out["rows"].append({"library": str(attn.built.library), "name": attn.built.name, "config": attn.cfg.short_form()})
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


def pick(source: Path, cache: Path, rows: list[dict]) -> dict:
    """The kernels version ``source`` runs for ``rows`` (built into ``cache``)."""
    env = {**os.environ, "FLASHGEN_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(source)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                          if p and Path(p).resolve() != REPO])}
    proc = subprocess.run([sys.executable, "-c", _PICK, json.dumps(rows)], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    picks = [line for line in proc.stdout.splitlines() if line.startswith("AB-PICKS ")]
    if proc.returncode or not picks:
        raise SystemExit(f"picking the kernels of {source} failed:\n{proc.stderr[-4000:]}")
    return json.loads(picks[-1][len("AB-PICKS "):])


def shape_rows(seqs, dtypes, masks=("none", "causal")) -> list[dict]:
    from flashgen.bench import SHAPES

    return [{"seq": seq, "batch": batch, "d_head": 128, "heads": 16, "dtype": dtype, "causal": mask == "causal"}
            for seq, batch in SHAPES if seq in seqs for dtype in dtypes for mask in masks]


def time_row(row: dict, kernels: dict, rounds: int) -> dict:
    """Both versions' kernels for one row: rounds of timings, ratios, reference errors."""
    import torch

    from flashgen import bench, launcher

    native = launcher.native()
    dtype = getattr(torch, row["dtype"])
    q, k, v = (torch.randn(row["batch"], row["seq"], row["heads"], row["d_head"], device="cuda", dtype=dtype)
               for _ in range(3))
    left, right = (-1, 0) if row["causal"] else (-1, -1)
    fns = {}
    for side, kernel in kernels.items():
        handle = launcher.load_kernel(Path(kernel["library"]), kernel["name"], kernel["config"], dtype, row["d_head"])
        native.allow_device(handle, torch.cuda.current_device())
        fns[side] = (lambda h: lambda: native.call(q, k, v, None, h, None, left, right, "top_left", False))(handle)
    errors = {side: bench.reference_error(fn(), q, k, v, 1 / math.sqrt(row["d_head"]), row["causal"])
              for side, fn in fns.items()}
    times = bench.interleaved(fns, rounds)
    return summarize(row, kernels, times, errors)


def summarize(row: dict, kernels: dict, times: dict, errors: dict) -> dict:
    from flashgen.bench import attention_flops

    flops = attention_flops(row["batch"], row["heads"], row["seq"], row["seq"], row["d_head"], row["causal"])
    spread = max((max(t) - min(t)) / median(t) for t in times.values())
    ratio = median(times["before"]) / median(times["after"])
    return {**row, "config_before": kernels["before"]["config"], "config_after": kernels["after"]["config"],
            "ms": times, "tflops": {s: flops / median(t) / 1e9 for s, t in times.items()},
            "after_over_before": ratio, "spread": spread, "slower": (1 - ratio) > spread,
            "error": {s: {"max_err": e[0], "lowp_err": e[1], "ok": e[0] <= 2 * e[1] + 1e-5} for s, e in errors.items()}}


def report(results: list[dict]) -> str:
    lines = [f"{'seq':>6} {'dtype':>9} {'causal':>6} {'before':>7} {'after':>7} {'ratio':>6} {'spread':>6}  ok"]
    for r in results:
        ok = all(e["ok"] for e in r["error"].values())
        lines.append(f"{r['seq']:>6} {r['dtype']:>9} {str(r['causal']):>6} {r['tflops']['before']:>7.0f} "
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
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    rows = shape_rows(args.seqs, args.dtypes, args.masks)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": checkout(args.before, Path(tmp) / "before"), "after": checkout(args.after, Path(tmp) / "after") if args.after else REPO}
        picks = {side: pick(src, Path(tmp) / f"cache-{side}", rows) for side, src in sides.items()}
        if picks["before"]["abi"] != picks["after"]["abi"]:
            raise SystemExit("the two versions' kernels take different argument structs (flashgen/emit/abi.py)")
        results = []
        for i, row in enumerate(rows):
            results.append(time_row(row, {s: picks[s]["rows"][i] for s in sides}, args.rounds))
            print(f"[ab] seq {row['seq']} {row['dtype']}{' causal' if row['causal'] else ''}: "
                  f"{results[-1]['after_over_before']:.3f}", file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "before": args.before, "after": args.after or "this checkout", "rows": results}, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
