"""``flashgen build``: fill the kernel cache ahead of time, so a deployment prebuilds once.

    flashgen build hopper defaults --arch sm_90a -j 16

Each (config, arch) pair becomes one cached kernel library (:func:`flashgen.build.build`);
a line per kernel reports its build time or that it was already cached. Pairs an arch
cannot run (wgmma configs on anything but sm_90a) are skipped with a note.
"""
from __future__ import annotations

import sys

from . import build, cache
from .targets import TARGETS, of_capability
from .cli import CommandError, resolve_configs
from .options import positive_int

#: --arch names: the targets flashgen builds for (:data:`flashgen.targets.TARGETS`), by name.
ARCH_NAMES = {name: t.capability for name, t in TARGETS.items()}


def add_arguments(p) -> None:
    p.description = ("Build kernels into the cache ahead of time (FLASHGEN_CACHE, default ~/.cache/flashgen), so "
                     "later flashgen.compile() calls of these configs only load them. Prints a line per kernel.")
    p.add_argument("configs", nargs="+", metavar="CFG",
                   help="YAML file, quoted short form, or named set (e.g. hopper, defaults)")
    p.add_argument("--arch", action="append", choices=sorted(ARCH_NAMES),
                   help="target GPU architecture; repeat for several (default: this machine's GPU). "
                        "Configs build only for the targets their engine runs on")
    p.add_argument("-j", "--jobs", type=positive_int, default=None,
                   help="kernels built at once (default: the number of CPU cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def main(args) -> int:
    capabilities = [ARCH_NAMES[a] for a in args.arch] if args.arch else [_native_capability()]
    jobs, skipped = [], []
    for cfg in resolve_configs(args.configs).configs:
        for cap in capabilities:
            try:
                build.check_capability(cfg, cap)
                jobs.append((cfg, cap))
            except build.BuildError as exc:
                skipped.append(str(exc))
    if not jobs:
        raise CommandError("nothing to build for " + ", ".join(of_capability(c).name for c in capabilities) + ": "
                           + (skipped[0] if skipped else "no config"))
    if skipped and not args.quiet:
        cache.warn(f"skipped {len(skipped)} (config, arch) pair(s) the arch cannot run, e.g. {skipped[0]}")
    try:
        cache.writable_root()
    except cache.CacheError as exc:
        raise CommandError(str(exc)) from None
    failures = build.build_jobs(jobs, args.jobs, progress=not args.quiet)
    for job, err in failures.items():
        print(f"flashgen: FAILED {build.job_label(*job)}:\n{err}", file=sys.stderr)
    print(f"{len(jobs) - len(failures)} of {len(jobs)} kernel(s) in the cache {cache.root()}")
    return 1 if failures else 0


def _native_capability() -> tuple[int, int]:
    try:
        return build._current_capability()
    except build.BuildError:
        raise CommandError("no CUDA device here: name the target with --arch (" + ", ".join(sorted(ARCH_NAMES)) + ")") from None
