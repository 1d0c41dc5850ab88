"""Where a flashgen kernel's warps stall, per step of its schedule: Nsight Compute's warp-state samples of
each SASS instruction, attributed through the kernel's line table to the step markers of its .cu.

On the GPU machine, profile one launch and export the source page as CSV:

    ncu --set full --kernel-name-base demangled --kernel-name regex:'flash_bwd.*::kernel' --launch-count 1 \\
        -o prof python my_script.py
    ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv

then, wherever nvcc and nvdisasm are, with the .cu of the same config (``flashgen emit CFG -o kernels_out/``):

    python benchmarks/ncu_steps.py sass.csv kernels_out/flash_bwd_bf16_d128_br80_bc128_w12_wgmma_swz_s2.cu

The .cu is compiled as flashgen builds it (``-lineinfo``) for ``--arch`` and disassembled with its line
table. Its instructions must be the profiled kernel's, one for one (else the tool stops: another config,
flashgen version or compiler). An instruction counts at the line of its outermost call site in the kernel
(an inlined helper's at the line that calls it), a line at the schedule step whose marker (``// [step]`` or
``// ---- section ----``) comes last above it. Prints each step's share of all samples and its commonest
stall reasons, in the order the steps first appear, and, where the report counted them, its share of the warp
instructions executed (work the step's warps issued, waiting or not); ``--top N`` adds the N instructions with the
most samples.
Warps that wait count as much as warps that work: a producer spinning on a barrier shows, so read a step's
share next to what its warps had to do. A stall counts at the instruction waiting to issue: a barrier's wait
shows at the first instruction after it, often the next step's.

``record`` does all of it on the GPU machine for the kernel a user's ``compile("auto")`` runs on a benchmark
shape (16 heads, 16k tokens): it writes that kernel's .cu, profiles one launch under ncu, exports the source
page and prints the attribution:

    python benchmarks/ncu_steps.py record --pass bwd --d-head 128 --seq 2048 [--dtype bf16] [--causal] -o prof/

``record --peer fa4`` profiles FlashAttention-4's kernel of the same pass and shape instead (its main backward
kernel, or its forward), which has no steps to attribute to; ``mix`` then sets kernels' source pages side by side,
the warp instructions each executed per opcode and their stall reasons, so that a gap between two kernels of the
same tiles shows as the instructions one of them issues more of:

    python benchmarks/ncu_steps.py record --peer fa4 --pass bwd --d-head 128 --seq 2048 --causal -o prof_fa4/
    python benchmarks/ncu_steps.py mix prof/sass.csv prof_fa4/sass.csv
"""
from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: ncu's column of every warp-state sample at an instruction, and the prefix of its per-reason columns
ALL_SAMPLES, STALL = "Warp Stall Sampling (All Samples)", "stall_"
#: ncu's column of the warp-level instructions executed at an instruction (absent: counted as 0)
EXECUTED = "Instructions Executed"
_MARKER = re.compile(r"\s*// (?:\[([^\]]+)\]|---- (.+?) ----)")
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*(?:/\*.*)?$")
_KERNEL = re.compile(r"__global__ .*?(\w+)\(const")


@attrs.frozen
class Sample:
    """One SASS instruction's warp-state samples: all of them, and per stall reason."""

    sass: str
    samples: int
    stalls: dict
    executed: int = 0  # warp-level instructions executed


@attrs.define
class StepShare:
    """A step's samples, all and per stall reason."""

    step: str
    samples: int = 0
    stalls: collections.Counter = attrs.Factory(collections.Counter)
    executed: int = 0


def read_samples(text: str) -> tuple[str, list[Sample]]:
    """(the kernel's name, its instructions' samples in address order) from ncu's source page as CSV
    (``--page source --csv --print-source sass``)."""
    rows = list(csv.reader(io.StringIO(text)))
    name = rows[0][1] if rows and rows[0] and rows[0][0] == "Kernel Name" else ""
    at = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if at is None or ALL_SAMPLES not in rows[at]:
        raise SystemExit("no SASS source page with warp-state samples in the CSV: export it with "
                         "`ncu -i REPORT --page source --csv --print-source sass` of a report with SourceCounters")
    head = rows[at]
    reasons = [c for c in head if c.startswith(STALL) and "Not Issued" not in c]
    out = []
    for r in rows[at + 1:]:
        if len(r) != len(head):
            continue
        d = dict(zip(head, r))
        out.append(Sample(d["Source"].strip(), int(d[ALL_SAMPLES] or 0),
                          {c[len(STALL):]: int(d[c] or 0) for c in reasons}, int(d.get(EXECUTED) or 0)))
    return name, out


def section_of(kernel_name: str) -> str:
    """The ``.text`` section nvdisasm names a ``namespace::function(...)`` kernel's code by (its mangled name's
    start; every flashgen kernel is a function of one namespace)."""
    m = re.match(r"(?:void )?(\w+)::(\w+)\(", kernel_name)
    if not m:
        raise SystemExit(f"{kernel_name!r}: not a flashgen kernel's name (namespace::function(...))")
    ns, fn = m.groups()
    return f".text._ZN{len(ns)}{ns}{len(fn)}{fn}E"


def line_table(listing: str, section: str) -> list[tuple[str, int | None]]:
    """(SASS, source line of the outermost call site) of each instruction of ``section`` in an nvdisasm listing
    made with ``--print-line-info-inline``."""
    start = next((m.end() for m in re.finditer(re.escape(section) + r"\w*:", listing)), None)
    if start is None:
        raise SystemExit(f"the disassembly has no section {section}...: another kernel than the profiled one")
    end = listing.find("//------", start)
    line, out = None, []
    for text in listing[start:end if end >= 0 else None].splitlines():
        if "//##" in text:
            found = re.findall(r"line (\d+)", text)
            line = int(found[-1]) if found else line
        elif m := _INSTRUCTION.match(text):
            out.append((m.group(1), line))
    return out


def steps_by_line(source: str) -> dict[int, str]:
    """Each line of a kernel's .cu and the schedule step (or section) whose marker comes last above it; a
    kernel's lines before its first marker (per-thread addresses, which the compiler may recompute in a loop)
    are its setup."""
    step, out = "(before the first marker)", {}
    for n, text in enumerate(source.splitlines(), 1):
        if m := _MARKER.match(text):
            step = m.group(1) or m.group(2)
        elif m := _KERNEL.match(text):
            step = f"{m.group(1)}: setup"
        out[n] = step
    return out


def _opcode(sass: str) -> str:
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].rstrip(";").split(".")[0] if words else ""


def attribute(samples: list[Sample], lines: list[tuple[str, int | None]], steps: dict[int, str]) -> list[StepShare]:
    """Samples per step, in the order the steps first appear in the code; the profiled instructions and the
    disassembly's must agree one for one."""
    if len(samples) != len(lines):
        raise SystemExit(f"the profiled kernel has {len(samples)} instructions, the compiled .cu {len(lines)}: "
                         "emit the .cu with the flashgen version (and nvcc) that built the profiled kernel")
    for i, (s, (sass, _)) in enumerate(zip(samples, lines)):
        if _opcode(s.sass) != _opcode(sass):
            raise SystemExit(f"instruction {i} differs: profiled {s.sass!r}, compiled {sass!r}")
    shares: dict[str, StepShare] = {}
    for s, (_, line) in zip(samples, lines):
        step = steps.get(line, "(no line)") if line else "(no line)"
        share = shares.setdefault(step, StepShare(step))
        share.samples += s.samples
        share.executed += s.executed
        share.stalls.update(s.stalls)
    return list(shares.values())


def disassemble(cu: Path, arch: str) -> str:
    """nvdisasm's listing, with inlined line info, of ``cu`` compiled as flashgen builds kernels."""
    from flashgen.build import BUILD_FLAGS
    from flashgen.targets import TARGETS
    from flashgen.toolchain import find_nvcc

    nvcc = find_nvcc()
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or (
        str(Path(nvcc).parent / "nvdisasm") if nvcc and (Path(nvcc).parent / "nvdisasm").exists() else None)
    if not nvcc or not nvdisasm:
        raise SystemExit("needs nvcc and nvdisasm (CUDA's toolkit, or the pip wheel nvidia-cuda-nvdisasm with "
                         "NVDISASM naming its binary)")
    if arch not in TARGETS:
        raise SystemExit(f"--arch {arch}: expected one of {', '.join(sorted(TARGETS))}")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        subprocess.run([nvcc, *BUILD_FLAGS, TARGETS[arch].gencode, "-cubin", "-o", str(cubin), str(cu)], check=True,
                       capture_output=True)
        return subprocess.run([nvdisasm, "--print-line-info-inline", "-c", str(cubin)], check=True,
                              capture_output=True, text=True).stdout


def opcode_mix(samples: list[Sample]) -> collections.Counter:
    """Warp instructions executed per opcode (the mnemonic before its first ``.``: HGMMA, FFMA, MUFU, ...)."""
    mix: collections.Counter = collections.Counter()
    for s in samples:
        mix[_opcode(s.sass)] += s.executed
    return mix


def stall_totals(samples: list[Sample]) -> collections.Counter:
    """Samples per stall reason over the whole kernel."""
    total: collections.Counter = collections.Counter()
    for s in samples:
        total.update(s.stalls)
    return total


def mix_report(kernels: list[tuple[str, list[Sample]]], rows: int = 25) -> str:
    """The kernels' warp instructions executed per opcode in millions, the first kernel's column first and each
    other's difference to it, the opcodes ordered by the largest difference; then each kernel's commonest stall
    reasons (their share of its samples)."""
    mixes = [opcode_mix(samples) for _, samples in kernels]
    ops = set().union(*mixes)
    gap = {op: max((abs(m[op] - mixes[0][op]) for m in mixes[1:]), default=mixes[0][op]) for op in ops}
    names = [f"K{i}" for i in range(len(kernels))]
    out = [f"{n}: {name} ({sum(m.values()) / 1e6:.1f} M warp instructions executed)" for n, (name, _), m in zip(names, kernels, mixes)]
    out.append(f"{'opcode':16s}" + "".join(f"{n + (' M' if i == 0 else ' - K0'):>12s}" for i, n in enumerate(names)))
    for op in sorted(ops, key=lambda o: (-gap[o], o))[:rows]:
        cells = [f"{mixes[0][op] / 1e6:12.2f}"] + [f"{(m[op] - mixes[0][op]) / 1e6:+12.2f}" for m in mixes[1:]]
        out.append(f"{op:16s}" + "".join(cells))
    for n, (_, samples) in zip(names, kernels):
        stalls, total = stall_totals(samples), sum(s.samples for s in samples) or 1
        out.append(f"{n} stalls: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in stalls.most_common(6) if v))
    return "\n".join(out)


def report(shares: list[StepShare], samples: list[Sample], top: int) -> str:
    total = sum(s.samples for s in samples) or 1
    executed = sum(s.executed for s in samples)
    insts = (lambda sh: f"{100 * sh.executed / executed:5.1f}%  ") if executed else (lambda sh: "")
    out = [f"{'share':>6}  " + ("insts   " if executed else "") + f"{'step':42s} stall reasons (their share of the step's samples)"]
    for sh in shares:
        why = ", ".join(f"{k} {100 * v / (sh.samples or 1):.0f}%" for k, v in sh.stalls.most_common(3) if v)
        out.append(f"{100 * sh.samples / total:5.1f}%  {insts(sh)}{sh.step[:42]:42s} {why}")
    for s in sorted(samples, key=lambda s: -s.samples)[:top]:
        reason = max(s.stalls, key=s.stalls.get) if s.stalls else ""
        out.append(f"{100 * s.samples / total:5.2f}%  {reason:16s} {s.sass}")
    return "\n".join(out)


#: the profiled process (``record``): the pass of the kernel compile("auto") picks, on the benchmark's shape
_RUN = r"""
import json, sys, torch, flashgen
from flashgen.build import build
r = json.loads(sys.argv[1])
dtype, dev = getattr(torch, r["dtype"]), torch.device("cuda", 0)
attn = flashgen.compile("auto")
picked = attn.pick(dev, dtype, r["d_head"], r["seq"], "causal" if r["causal"] else "none")
built = build(picked.backward_config(r["seq"]), picked.built.capability) if r["pass"] == "bwd" else picked.built
open(r["cu"], "w").write(built.source())
shape = (16384 // r["seq"], r["seq"], 16, r["d_head"])
q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=r["pass"] == "bwd") for _ in range(3))
o = attn(q, k, v, causal=r["causal"])
do = torch.randn_like(o)
for _ in range(3):
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True) if r["pass"] == "bwd" else attn(q, k, v, causal=r["causal"])
torch.cuda.synchronize()
"""


#: the same for FlashAttention-4 (``record --peer fa4``), called as ``flashgen bench`` calls it
_RUN_FA4 = r"""
import json, sys, torch
from flashgen.bench_peers import fa4_peer
r = json.loads(sys.argv[1])
dtype, dev = getattr(torch, r["dtype"]), torch.device("cuda", 0)
shape = (16384 // r["seq"], r["seq"], 16, r["d_head"])
q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=r["pass"] == "bwd") for _ in range(3))
run = fa4_peer(q, k, v, r["causal"])
o = run()
do = torch.randn_like(o)
for _ in range(3):
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True) if r["pass"] == "bwd" else run()
torch.cuda.synchronize()
"""

#: ncu's kernel filter (demangled names) of the pass's main kernel: flashgen's, FlashAttention-4's
_KERNELS = {None: {"bwd": "flash_bwd.*::kernel", "fwd": "flash_fwd.*::kernel"},
            "fa4": {"bwd": "FlashAttentionBackwardSm", "fwd": "FlashAttentionForwardSm"}}


def record_commands(row: dict, out: Path, ncu: str = "ncu", peer: "str | None" = None) -> tuple[list[str], list[str]]:
    """(the profiling run, the source page's export) of ``row`` (pass, dtype, d_head, seq, causal) into ``out``: one
    launch of the pass's main kernel (flashgen's ``<kernel>::kernel``, or with ``peer`` "fa4" FlashAttention-4's; the
    first after three warm-up calls' compile), every section, no source import (flashgen's .cu is written beside)."""
    script = _RUN_FA4 if peer == "fa4" else _RUN
    run = [ncu, "--set", "full", "--import-source", "no", "--kernel-name-base", "demangled",
           "--kernel-name", f"regex:{_KERNELS[peer][row['pass']]}", "--launch-count", "1", "-f", "-o", str(out / "profile"),
           sys.executable, "-c", script, json.dumps({**row, "cu": str(out / "kernel.cu")})]
    export = [ncu, "-i", str(out / "profile.ncu-rep"), "--page", "source", "--csv", "--print-source", "sass"]
    return run, export


def record(argv) -> int:
    """Profile the kernel compile("auto") runs for one shape and attribute its samples to its steps (GPU machine)."""
    from flashgen.options import positive_int

    p = argparse.ArgumentParser(prog="ncu_steps.py record", description=record.__doc__)
    p.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd", help="the forward or the backward (default)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--d-head", type=positive_int, default=128)
    p.add_argument("--seq", type=positive_int, default=2048, help="sequence length; batch = 16384 / seq (at least 1)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--top", type=positive_int, default=20, help="also list the N instructions with the most samples")
    p.add_argument("--peer", choices=("fa4",), help="profile FlashAttention-4's kernel of the pass instead (no steps: "
                                                    "prints its opcode mix; compare with `mix`)")
    p.add_argument("-o", "--out", type=Path, default=Path("ncu_steps_out"), help="folder for the report, CSV, .cu, JSON")
    args = p.parse_args(argv)
    if args.peer:
        from flashgen.bench_peers import fa4_version

        if not fa4_version():
            raise SystemExit("--peer fa4: FlashAttention-4 is not installed here (pip install flash-attn-4)")
    ncu = os.environ.get("NCU") or shutil.which("ncu")
    if ncu is None:
        raise SystemExit("record needs Nsight Compute's ncu on PATH (or NCU naming it), on a machine with a CUDA GPU")
    if args.seq > 16384:
        raise SystemExit(f"--seq {args.seq}: at most 16384 (the benchmark's 16k tokens)")
    args.out.mkdir(parents=True, exist_ok=True)
    row = {"pass": args.pass_, "dtype": {"bf16": "bfloat16", "fp16": "float16"}[args.dtype], "d_head": args.d_head,
           "seq": args.seq, "causal": args.causal}
    run, export = record_commands(row, args.out, ncu, args.peer)
    proc = subprocess.run(run, capture_output=True, text=True)
    if proc.returncode != 0 or not (args.out / "profile.ncu-rep").exists():
        raise SystemExit(f"ncu failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    csv_text = subprocess.run(export, check=True, capture_output=True, text=True).stdout
    (args.out / "sass.csv").write_text(csv_text)
    if args.peer:
        return mix([str(args.out / "sass.csv")])
    return main([str(args.out / "sass.csv"), str(args.out / "kernel.cu"), "--top", str(args.top),
                 "--json", str(args.out / "steps.json")])


def mix(argv) -> int:
    """Kernels' source pages side by side: warp instructions executed per opcode, and stall reasons."""
    from flashgen.options import positive_int

    p = argparse.ArgumentParser(prog="ncu_steps.py mix", description=mix.__doc__)
    p.add_argument("csv", type=Path, nargs="+", help="ncu's source page (SASS, as CSV) of each kernel; the first is the base")
    p.add_argument("--rows", type=positive_int, default=25, help="opcodes listed, largest difference first (default 25)")
    args = p.parse_args(argv)
    kernels = [read_samples(path.read_text()) for path in args.csv]
    if not any(s.executed for _, samples in kernels for s in samples):
        raise SystemExit("no instruction counts in the CSVs: profile with ncu's SourceCounters (--set full)")
    print(mix_report(kernels, args.rows))
    return 0


def main(argv=None) -> int:
    from flashgen.options import positive_int

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["record"]:
        return record(argv[1:])
    if argv[:1] == ["mix"]:
        return mix(argv[1:])

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path, help="ncu's source page of one kernel, SASS, as CSV")
    p.add_argument("cu", type=Path, help="the kernel's .cu (flashgen emit), the same config and flashgen version")
    p.add_argument("--arch", default="sm_90a", help="the profiled GPU's target (default: sm_90a)")
    p.add_argument("--top", type=positive_int, default=0, help="also list the N instructions with the most samples")
    p.add_argument("--json", type=Path, default=None, help="also write the steps' samples and stall reasons here")
    args = p.parse_args(argv)
    name, samples = read_samples(args.csv.read_text())
    lines = line_table(disassemble(args.cu, args.arch), section_of(name))
    shares = attribute(samples, lines, steps_by_line(args.cu.read_text()))
    total = sum(s.samples for s in samples)
    executed = sum(s.executed for s in samples)
    print(f"{name}: {total} samples" + (f", {executed} warp instructions executed" if executed else ""))
    print(report(shares, samples, args.top))
    if args.json:
        args.json.write_text(json.dumps({"kernel": name, "samples": total, "steps": [
            {"step": sh.step, "samples": sh.samples, "executed": sh.executed, "stalls": dict(sh.stalls.most_common())}
            for sh in shares]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
