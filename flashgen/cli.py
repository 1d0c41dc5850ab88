"""The ``flashgen`` command: emit, check, simulate, bench, tune.

Every subcommand that takes configs accepts, for each ``CFG``:

* a YAML file: one config, a list, or a sweep (see :mod:`flashgen.emit.sweep`);
* a short form, quoted: ``"(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"``;
* a named set (:data:`flashgen.dsl.sets.NAMED_SETS`, listed by ``flashgen --help``).

Errors in the input (bad YAML, unknown keys, malformed short forms, unbuildable
configs, unwritable folders, a missing nvcc) print ``flashgen: error: ...`` to stderr
and exit with status 1, without a traceback (set ``FLASHGEN_DEBUG=1`` to get one).
Results go to stdout; progress and notes to stderr (``-q``: errors only). Ctrl-C and
SIGTERM stop the command at once, workers included, with one line on stderr and the
exit status 130 or 143. ``bench`` and ``tune`` are delegated to :mod:`flashgen.bench`
and :mod:`flashgen.tune`, imported only when used.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import yaml

from .dsl import knobs, sets
from .dsl.config import ConfigError
from .options import positive_int, progress, progress_of  # noqa: F401 - used by the subcommands too
from .workers import Terminated, sigterm_raises

EXIT_ERROR = 1
#: exit status of a command stopped by a signal: 128 + its number (the shells' convention)
EXIT_SIGNAL_BASE = 128


def _cfg_help() -> str:
    return (
        "YAML file (one config, a list or a sweep), a quoted short form like "
        "\"(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax\" "
        "or, for the backward kernels, \"bwd(FP16, 128, 64, 64, 4): swizzled+causal\", "
        f"or a named set: {sets.listing()}"
    )


_DESCRIPTION = """\
flashgen: a Python DSL and CUDA code generator for FlashAttention forward kernels
(the FlashAttention-2 family on mma.sync, sm_80+; TMA + wgmma + warp specialization, sm_90a).

  flashgen emit examples/best.yaml -o kernels_out/   write .cu files + manifest.json (CPU only)
  flashgen check defaults hopper                     nvcc + ptxas: registers, spills, smem
  flashgen simulate progression                      coverage / bank-conflict / schedule report (CPU only)
  flashgen bench / flashgen tune                     on a GPU
"""


def _epilog() -> str:
    text = textwrap.fill(
        "CFG may be a YAML file (see examples/) whose keys are the knobs below, a quoted short form "
        "\"(DTYPE, d_head, B_r, B_c, n_warps): flag+flag+...\" with the flags below, or one "
        f"of the named sets {sets.listing()}. The backward kernels (dQ, dK, dV) are named "
        "\"bwd(DTYPE, d_head, B_r, B_c, n_warps): swizzled+causal\" (flags: swizzled and a mask), "
        "or in YAML by 'kind: backward' and those knobs; emit, check, simulate and build take them.",
        width=79, break_on_hyphens=False,
    )
    listing = "\n".join(textwrap.fill(line, width=79, initial_indent="  ", subsequent_indent="      ",
                                      break_on_hyphens=False) for line in knobs.describe())
    return f"{text}\n\nknobs:\n{listing}\n\nRun 'flashgen COMMAND --help' for a command's options.\n"


# Subcommands whose options and implementation live in another module.
_DELEGATED = {
    "build": ("flashgen.prebuild", "build kernels into the cache ahead of time (needs nvcc; a GPU or --arch)"),
    "bench": ("flashgen.bench", "time emitted kernels against PyTorch's SDPA backends (needs a CUDA GPU)"),
    "tune": ("flashgen.tune", "pick the fastest config per sequence length (needs a CUDA GPU)"),
}


class CommandError(Exception):
    """An error of the command line itself (printed as ``flashgen: error: ...``)."""


def _input_errors() -> tuple[type[BaseException], ...]:
    """Exception types that are the user's input, not a flashgen bug."""
    from .check import CheckError
    from .dsl.notation import NotationError
    from .emit.writer import WriteError

    return (ConfigError, NotationError, yaml.YAMLError, OSError, CheckError, WriteError, CommandError)


# ---- config arguments ---------------------------------------------------------------------


def resolve_configs(specs: Sequence[str], verbose: bool = False, forward_only: str = ""):
    """The SweepResult of the CFG arguments; CommandError (with the reasons) when no config is valid,
    or (``forward_only``: the command, which runs forward attention) when one is a backward config."""
    from .dsl.configs import kind_of
    from .emit.sweep import merge, resolve

    result = merge(resolve(s) for s in specs)
    if not result.configs:
        head = f"no valid config in {' '.join(specs)}: all {len(result.skipped)} combination(s) skipped:"
        raise CommandError("\n".join([head, *skip_lines(result.skipped, verbose)]))
    backward = [c for c in result.configs if kind_of(c) == "backward"]
    if forward_only and backward:
        more = f" (and {len(backward) - 1} more)" if len(backward) > 1 else ""
        raise CommandError(f"{forward_only} runs forward kernels; {backward[0].short_form()}{more} is a backward config "
                           "(flashgen emit, check, simulate and build take those)")
    return result


def skip_lines(skipped: Sequence, verbose: bool = False) -> list[str]:
    """Skipped combinations for the reader: how many per reason, or (``verbose``) each with its knobs."""
    if verbose:
        return [f"  {s.describe()}" for s in skipped]
    counts = Counter(s.category for s in skipped).most_common()
    width = len(str(counts[0][1])) if counts else 0
    return [f"  {n:>{width}} {reason}" for reason, n in counts]


def _wrap(text: str) -> str:
    return textwrap.fill(text, width=79)


def _print_skipped(result, args: argparse.Namespace, stream) -> None:
    if not result.skipped or args.quiet:
        return
    hint = "" if args.verbose or len(result.skipped) == 1 else " (-v lists each)"
    lines = [f"skipped {len(result.skipped)} combination(s){hint}:", *skip_lines(result.skipped, args.verbose)]
    print("\n".join(lines), file=stream)


_QUIET = "print no progress and no notes: stderr gets errors only"
_VERBOSE = "list each skipped combination with its knobs, origin and reason (default: a count per reason)"


def _add_common(p: argparse.ArgumentParser, quiet: str = _QUIET, verbose: str = _VERBOSE) -> None:
    """The CFG arguments and the output options (-q, -v) of the commands that take configs."""
    p.add_argument("cfg", nargs="+", metavar="CFG", help=_cfg_help())
    loud = p.add_mutually_exclusive_group()
    loud.add_argument("-q", "--quiet", action="store_true", help=quiet)
    loud.add_argument("-v", "--verbose", action="store_true", help=verbose)


def _add_mods(p: argparse.ArgumentParser) -> None:
    """--score-mod / --mask-mod: every kernel built with these functions (flashgen.mods.spec)."""
    for kind, example in (("score", "examples/mods.py:softcap"), ("mask", "examples/mods.py:document_mask")):
        p.add_argument(f"--{kind}-mod", metavar="SPEC", default=None,
                       help=f"build every kernel with this {kind}_mod: FILE.py:NAME or package.module:NAME, the "
                            f"function itself or a factory whose arguments all have defaults (e.g. {example})")


def _mods_specs(args: argparse.Namespace) -> tuple:
    """The (score_mod, mask_mod) specs of the options, each loaded once here so a bad one fails before any work."""
    specs = (args.score_mod, args.mask_mod)
    if specs == (None, None):
        return specs
    from .mods.errors import ModError
    from .mods.spec import kernel_mods

    try:
        kernel_mods(*specs)
    except ModError as exc:
        raise CommandError(str(exc)) from None
    return specs


# ---- emit ---------------------------------------------------------------------------------


def _add_emit(sub) -> None:
    p = sub.add_parser(
        "emit",
        help="write one .cu per config and a manifest.json (CPU only)",
        description=_wrap(
            "Emit the CUDA source of each config: <name>.cu (the kernel and its C launcher, no torch headers) "
            "and manifest.json describing every kernel "
            "(config, short form, hash, threads, shared memory, grid rule, launcher symbol, files). "
            "<name> is the config's mangled name. Invalid combinations of a sweep are skipped and "
            "counted per reason (-v lists each); if nothing is valid the command fails. Files are written "
            "atomically (a failure leaves the folder as it was); afterwards the folder holds exactly "
            "this emit's kernels: those of a previous emit that are not in this one are removed."
        ),
        epilog="examples:\n  flashgen emit examples/tuning_space.yaml -o kernels_out/\n"
        "  flashgen emit defaults\n  flashgen emit \"(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax\"\n"
        "  flashgen emit hopper --score-mod examples/mods.py:softcap --mask-mod examples/mods.py:document_mask",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(p, quiet="print only the summary line: no file list, no progress, no notes (stderr gets errors only)")
    p.add_argument("-o", "--out", type=Path, default=Path("kernels_out"), metavar="DIR",
                   help="output folder (default: kernels_out/)")
    p.add_argument("--force", action="store_true",
                   help="write even into a folder holding files that flashgen did not write (they are left alone)")
    p.add_argument("-j", "--jobs", type=positive_int, default=None, metavar="N",
                   help="emit in N processes (default: the number of CPUs)")
    _add_mods(p)
    p.set_defaults(run=_cmd_emit)


def _cmd_emit(args: argparse.Namespace) -> int:
    from .emit.writer import check_output_folder, emit_all, render, write_files

    result = resolve_configs(args.cfg, args.verbose)
    mods = _mods_specs(args)
    check_output_folder(args.out, force=args.force)  # refuse a bad folder before the (slow) emission
    cfgs = list(result.configs)
    jobs = args.jobs or os.cpu_count() or 1
    progress = progress_of(args)
    if progress:
        progress(f"emitting {len(cfgs)} kernel(s)" + (f" in {min(jobs, len(cfgs))} processes" if jobs > 1 and len(cfgs) > 1 else ""))
    files = render(emit_all(cfgs, jobs, progress, mods))
    report = write_files(files, args.out, force=args.force)
    out = report.out_dir
    if not args.quiet:
        for name in report.written:
            print(f"wrote {out / name}")
        for name in report.unchanged:
            print(f"unchanged {out / name}")
        for name in report.removed:
            print(f"removed {out / name} (not in this emit)")
    _print_skipped(result, args, sys.stdout)
    parts = [f"{len(cfgs)} kernel(s) in {out}/ ({len(report.written)} file(s) written, {len(report.unchanged)} unchanged)"]
    if result.invalid:
        parts.append(f"{len(result.invalid)} invalid combination(s) skipped")
    if result.pruned:
        parts.append(f"{len(result.pruned)} pruned")
    if result.duplicates:
        parts.append(f"{result.duplicates} duplicate(s) dropped")
    print("emitted " + "; ".join(parts))
    return 0


# ---- check --------------------------------------------------------------------------------


def _add_check(sub) -> None:
    from . import check

    p = sub.add_parser(
        "check",
        help="compile with nvcc for sm_80 and sm_90a; report registers, spills, stack, smem",
        description=_wrap(
            "Compile each config's kernel alone with nvcc (-O3 -std=c++17 --expt-relaxed-constexpr "
            "-Xptxas -v -c; device code only after a config's first arch) for every --arch, in parallel, "
            "and print ptxas's registers, spill "
            "stores/loads, stack frame and shared memory (static + the config's dynamic) as a table. "
            "A failing compile prints the .cu path and the exact nvcc command; the exit status is "
            "then non-zero. Needs nvcc, not a GPU."
        ),
        epilog="examples:\n  flashgen check defaults\n  flashgen check examples/progression.yaml --arch sm_90a -j 4 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(p, verbose=_VERBOSE + "; likewise each config that an --arch cannot take")
    check.add_arguments(p)
    _add_mods(p)
    p.set_defaults(run=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    from . import check

    result = resolve_configs(args.cfg, args.verbose)
    args.mods = _mods_specs(args)
    _print_skipped(result, args, sys.stderr)
    return check.run(list(result.configs), args)


# ---- simulate -----------------------------------------------------------------------------


def _add_simulate(sub) -> None:
    p = sub.add_parser(
        "simulate",
        help="CPU simulation of the plan: coverage, bank conflicts, fragments, schedule (no GPU)",
        description=_wrap(
            "Evaluate each config's plan with the Numba simulator (flashgen.sim). mma.sync configs: "
            "copy coverage, shared-memory bank conflicts per instruction and MMA fragment checks. "
            "wgmma configs: the schedule's barrier and hazard check, one CTA with tails against "
            "float64, and the wave-tail split's merge. Backward configs: copy coverage and bank conflicts, "
            "and the whole backward pass (every CTA) against float64 gradients."
        ),
        epilog="example:\n  flashgen simulate defaults --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common(p)
    p.add_argument("--json", action="store_true", help="print the reports as JSON")
    p.set_defaults(run=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    report = _import_feature("flashgen.sim.report", "simulate")
    from . import engines

    result = resolve_configs(args.cfg, args.verbose)
    _print_skipped(result, args, sys.stderr)
    cfgs = list(result.configs)
    progress = progress_of(args)
    reports = []
    for i, cfg in enumerate(cfgs, 1):
        if progress:
            progress(f"[{i}/{len(cfgs)}] simulating {cfg.mangle()}")
        reports.append(engines.simulate_config(cfg))
    if args.json:
        print(json.dumps(reports, indent=2, sort_keys=True, default=str))
    else:
        print(report.format_report(reports))
    failed = [r["config"] for r in reports if not r.get("ok", True)]
    for name in failed:
        print(f"flashgen: simulation FAILED for {name}", file=sys.stderr)
    return 1 if failed else 0


# ---- bench / tune (delegated) ----------------------------------------------------------------


def _import_feature(module: str, command: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module or module.startswith(exc.name + ".")):
            raise CommandError(f"'flashgen {command}' is not available: {module} is not part of this installation") from None
        raise CommandError(f"'flashgen {command}' needs the Python package '{exc.name}', which is not installed") from None


def _add_delegated(sub, name: str, module) -> None:
    modname, summary = _DELEGATED[name]
    p = sub.add_parser(name, help=summary, description=(module.__doc__ or summary).strip().splitlines()[0] if module else summary)
    if module is not None:
        module.add_arguments(p)
        p.set_defaults(run=module.main)
    else:
        p.set_defaults(run=lambda args, _n=name, _m=modname: _import_feature(_m, _n).main(args))


# ---- parser and main --------------------------------------------------------------------------


def build_parser(delegated: dict | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``delegated`` maps bench/tune to their imported modules (or None)."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="flashgen",
        description=_DESCRIPTION,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    sub.required = True
    _add_emit(sub)
    _add_check(sub)
    _add_simulate(sub)
    for name in _DELEGATED:
        _add_delegated(sub, name, (delegated or {}).get(name))
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    for tok in argv:
        if not tok.startswith("-"):
            return tok
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``flashgen`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    errors = _input_errors()
    try:
        with sigterm_raises():
            return _run(argv)
    except errors as exc:
        if os.environ.get("FLASHGEN_DEBUG"):
            raise
        print(f"flashgen: error: {_message(exc)}", file=sys.stderr)
        return EXIT_ERROR
    # the workers are gone already (flashgen.workers.run_parallel)
    except Terminated:
        print("flashgen: terminated", file=sys.stderr)
        return EXIT_SIGNAL_BASE + signal.SIGTERM
    except KeyboardInterrupt:
        print("flashgen: interrupted", file=sys.stderr)
        return EXIT_SIGNAL_BASE + signal.SIGINT


def _run(argv: list[str]) -> int:
    delegated = {}
    cmd = _command_of(argv)
    if cmd in _DELEGATED:
        delegated[cmd] = _import_feature(_DELEGATED[cmd][0], cmd)
    args = build_parser(delegated).parse_args(argv)
    return int(args.run(args) or 0)


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


if __name__ == "__main__":  # pragma: no cover
    # run the package's module, not this __main__ copy: subcommands raise flashgen.cli's own error types
    from flashgen.cli import main as _main

    sys.exit(_main())
