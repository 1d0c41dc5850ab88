"""Writing emitted kernels to a folder: ``<name>.cu``, ``manifest.json``.

``<name>`` is :meth:`KernelConfig.mangle`. ``manifest.json`` lists every kernel of the
folder in emission order (fields: :func:`manifest_entry`), JSON with sorted keys, so
the same configs give the same bytes.

The manifest describes the whole folder: an emit *replaces* the previous emit's
kernels (files listed in the old manifest and not in the new one are removed).
A folder that holds other files (anything but a manifest, the files it lists and
``README.md``) is refused unless ``force=True``, so ``-o`` pointed at the wrong place
clobbers nothing; with ``force`` such files are left alone (same names are replaced).

Atomicity: everything is rendered in memory first, written into a temporary folder
next to the output (in its parent, or inside it when the parent is read-only), then
moved in file by file with ``os.replace`` (manifest last). If a move fails, the files
already moved are put back as they were, so a failure leaves the old folder intact and
never a half-written file.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import attrs

from ..dsl import configs
from ..dsl.configs import AnyConfig
from ..workers import run_parallel
from ..engines import emit_named
from .source import KernelSource

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
#: Files an output folder may hold besides flashgen's own (the checked-in README).
FOREIGN_OK = frozenset({"README.md", ".gitignore"})

Progress = Callable[[str], None]


class WriteError(OSError):
    """The output folder cannot be written; nothing was changed."""


def kernel_files(src: KernelSource) -> dict[str, str]:
    """File name -> text of one kernel: its translation unit (kernel + C launcher, see flashgen.emit.abi)."""
    return {f"{src.name}.cu": src.text}


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def manifest_entry(src: KernelSource) -> dict:
    """One kernel's manifest record: ``KernelSource.meta`` plus its files and their sha256.

    Fields: name, kind (forward or backward), short_form, config (the knobs), hash (of the
    config), threads, smem_bytes (dynamic), grid (rule of the main kernel), launcher (C symbol),
    requires (shape rules), files {kernel}, sha256 {file name: digest of its text}; a backward
    kernel adds arguments (the launcher's struct), workspace (its C symbol) and kernels (the
    ``__global__`` functions the launcher runs, in order); a kernel built with a score_mod / mask_mod adds
    mods (``KernelMods.manifest``: the functions, the ``mod_words`` layout, ``max_seq``).
    """
    files = kernel_files(src)
    (cu,) = files
    entry = dict(src.meta)
    entry["files"] = {"kernel": cu}
    entry["sha256"] = {name: _sha256(text) for name, text in files.items()}
    return entry


def manifest_text(sources: Sequence[KernelSource]) -> str:
    from .. import __version__

    doc = {
        "format": MANIFEST_FORMAT,
        "generator": f"flashgen {__version__}",
        "kernels": [manifest_entry(s) for s in sources],
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _emit_dict(task: tuple) -> KernelSource:  # worker of run_parallel (top level: picklable)
    knobs, mods = task
    return emit_named(configs.from_dict(knobs), mods)


def emit_all(cfgs: Sequence[AnyConfig], jobs: int = 1, progress: Progress | None = None,
             mods: tuple = (None, None)) -> list[KernelSource]:
    """The sources of ``cfgs`` in order; ``jobs > 1`` emits in that many processes, which Ctrl-C
    and SIGTERM stop at once (:func:`flashgen.workers.run_parallel`). ``mods``: the (score_mod, mask_mod)
    specs every kernel is built with (:mod:`flashgen.mods.spec`; None: none)."""
    done = itertools.count(1)

    def report(i: int, src: KernelSource) -> None:
        progress(f"[{next(done)}/{len(cfgs)}] emitted {src.name}")  # type: ignore[misc]

    tasks = [(configs.to_record(c), tuple(mods)) for c in cfgs]
    return run_parallel(_emit_dict, tasks, jobs, report if progress else None)


def render(sources: Sequence[KernelSource]) -> dict[str, bytes]:
    """Every file of an output folder (file name -> bytes), the manifest last."""
    files: dict[str, bytes] = {}
    for src in sources:
        for name, text in kernel_files(src).items():
            files[name] = text.encode()
    files[MANIFEST] = manifest_text(sources).encode()
    return files


@attrs.frozen
class WriteReport:
    out_dir: Path
    written: tuple[str, ...]  # new or changed
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]  # stale files of the previous emit


def _previous_files(out: Path) -> set[str]:
    """Files listed by an existing manifest (empty when there is none or it is unreadable)."""
    try:
        doc = json.loads((out / MANIFEST).read_text())
        return {f for k in doc.get("kernels", []) for f in k.get("files", {}).values() if isinstance(f, str) and "/" not in f}
    except (OSError, ValueError, AttributeError, TypeError):
        return set()


def check_output_folder(out_dir: "str | Path", force: bool = False) -> set[str]:
    """Raise WriteError when ``out_dir`` cannot take an emit; return the previous emit's files.

    Cheap, so callers run it before emitting: a folder that is not one, holds files
    flashgen did not write (unless ``force``), or is not writable is refused up front.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise WriteError(f"cannot write to {out}: it exists and is not a folder; nothing was written")
    if not out.exists():
        anc = out.parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir():
            raise WriteError(f"cannot create {out}: {anc} is not a folder; nothing was written")
        if not os.access(anc, os.W_OK | os.X_OK):
            raise WriteError(f"cannot create {out}: {anc} is not writable; nothing was written")
        return set()
    try:
        present = {p.name for p in out.iterdir()}
    except OSError as exc:
        raise WriteError(f"cannot write to {out}: {exc.strerror or exc}; nothing was written") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise WriteError(f"cannot write to {out}: the folder is not writable; nothing was written")
    old = _previous_files(out)
    foreign = sorted(n for n in present - old - {MANIFEST} - FOREIGN_OK if not n.startswith(".flashgen-"))
    if foreign and not force:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise WriteError(
            f"{out} holds files that a flashgen emit did not write ({shown}); "
            "choose an empty or new folder, or pass --force to write there anyway"
        )
    return old & present


def _temp_dir(out: Path) -> Path:
    parent = out.parent
    for where in (parent, out):
        try:
            return Path(tempfile.mkdtemp(prefix=".flashgen-", dir=where))
        except OSError:
            continue
    reason = f"neither {parent} nor {out} is writable" if out.exists() else f"{parent} is not writable"
    raise WriteError(f"cannot write to {out}: {reason}; nothing was written")


def write_files(files: dict[str, bytes], out_dir: "str | Path", force: bool = False) -> WriteReport:
    """Put ``files`` into ``out_dir`` atomically (see the module docstring)."""
    out = Path(out_dir)
    stale = check_output_folder(out, force) - set(files)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WriteError(f"cannot create {out.parent}: {exc.strerror or exc}; nothing was written") from None
    tmp = _temp_dir(out)
    try:
        staged = tmp / "new"
        staged.mkdir()
        for name, data in files.items():
            (staged / name).write_bytes(data)
        if not out.exists():
            try:
                os.rename(staged, out)
            except OSError as exc:
                raise WriteError(f"cannot create {out}: {exc.strerror or exc}; nothing was written") from None
            return WriteReport(out, tuple(files), (), ())
        written, unchanged = _move_in(staged, tmp / "old", out, files)
        removed = []
        for name in sorted(stale):
            try:
                (out / name).unlink()
                removed.append(name)
            except OSError:
                pass  # a stale file that cannot be removed is harmless: the manifest no longer lists it
        return WriteReport(out, tuple(written), tuple(unchanged), tuple(removed))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_in(staged: Path, backup: Path, out: Path, files: dict[str, bytes]) -> tuple[list[str], list[str]]:
    """Replace files in ``out`` one by one (manifest last); on failure restore what was moved."""
    backup.mkdir()
    moved: list[tuple[str, bool]] = []  # (name, had an old version)
    written, unchanged = [], []
    try:
        for name, data in files.items():
            target = out / name
            had_old = target.exists()
            if had_old and target.is_file() and target.read_bytes() == data:
                unchanged.append(name)
                continue
            if had_old:
                try:
                    os.link(target, backup / name)
                except OSError:
                    shutil.copy2(target, backup / name)
            os.replace(staged / name, target)
            moved.append((name, had_old))
            written.append(name)
    except OSError as exc:
        for name, had_old in reversed(moved):
            try:
                if had_old:
                    os.replace(backup / name, out / name)
                else:
                    (out / name).unlink()
            except OSError:
                pass
        where = exc.filename or out
        raise WriteError(f"cannot write to {out}: {exc.strerror or exc} ({where}); nothing was changed") from None
    return written, unchanged


def emit_to_folder(
    cfgs: Sequence[AnyConfig],
    out_dir: "str | Path",
    force: bool = False,
    jobs: int = 1,
    progress: Progress | None = None,
) -> WriteReport:
    """Emit ``cfgs`` and write them (with the manifest) into ``out_dir``."""
    return write_files(render(emit_all(cfgs, jobs, progress)), out_dir, force)
