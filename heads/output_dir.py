"""Where a run may write, and how: headstart writes into an output directory only when it is new, empty, or headstart's
own for the same kind of run, never through a symbolic link, and with the user's umask.

    kind = RunKind("train:medusa", names=("heads", "checkpoints", ...), markers=("train_log.jsonl", ...))
    with claim_output_dir(Path(out), kind):      # lock, check, manifest: a second run on `out` is refused
        ...                                      # write the names `kind` lists
    write_file(heads_dir / "tree.json", text)    # atomic, never through a link, mode from the umask
    honour_umask(folder)                         # safetensors and mkdtemp write 0600 / 0700 whatever the umask

An output directory headstart owns holds `.headstart-run.json` (MANIFEST): the kind of run ("selfdistill",
"train:<method>", "export:<format>", "bench", "demo") and the top-level entries it writes there. A directory an earlier
headstart version wrote (no manifest) is adopted when every entry in it is a name that kind of run writes and one of
its marker files is there. Anything else is refused with one line naming entries in the way. `owned_entries` is what
an --overwrite may remove: only what the manifest lists. `.headstart.lock` (LOCK_FILE) holds an exclusive fcntl lock
while a run writes, and is removed when it ends.

Standard library only: train/feature_shards.py, which vLLM's own environment imports, uses it too.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

MANIFEST = ".headstart-run.json"
LOCK_FILE = ".headstart.lock"
LOW_SPACE_BYTES = 64 << 20  # a failed write with less free space than this on its filesystem: the disk is full
SHOWN = 3  # entries named in a refusal


class OutputDirError(RuntimeError):
    """An output directory headstart must not write into (someone else's files, a link, another run holds it), or a
    write that failed on a full disk."""


@dataclass(frozen=True)
class RunKind:
    """A kind of run: what it writes at the top of its output directory and what marks a directory as one of its own.

    names: entry names (or fnmatch patterns, e.g. ".*.tmp") the run creates there. markers: glob patterns; a directory
    without a manifest holding one of them (and only `names`) was written by this kind of run. flag: the option that
    names the directory, for the messages."""

    kind: str
    names: tuple[str, ...]
    markers: tuple[str, ...]
    flag: str = "--output_dir"

    def writes(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)

    def exact_names(self) -> list[str]:
        return [n for n in self.names if not any(c in n for c in "*?[")]


# ------------------------------------------------------------------------------------------ ownership


def read_manifest(out: Path) -> dict | None:
    """The manifest of `out`, or None when there is none. OutputDirError when it is unreadable."""
    path = out / MANIFEST
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if path.is_symlink():
            raise ValueError("a symbolic link")
        manifest = json.loads(path.read_text())
        if not (isinstance(manifest, dict) and isinstance(manifest.get("kind"), str)
                and isinstance(manifest.get("entries"), list) and all(isinstance(e, str) for e in manifest["entries"])):
            raise ValueError("not a headstart manifest")
    except (OSError, ValueError) as err:
        raise OutputDirError(f"{path} cannot be read ({err}): delete it if this directory is headstart's own run, or "
                             "pass another directory") from None
    return manifest


def _bookkeeping(name: str) -> bool:
    """The manifest, the lock, and a manifest write a kill cut short: no run's data."""
    return name in (MANIFEST, LOCK_FILE) or fnmatch.fnmatchcase(name, f".{MANIFEST}.*.tmp")


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(sorted(names)[:SHOWN]) + more


def check_output_dir(out: Path, kind: RunKind) -> dict:
    """The manifest `out` gets for a run of `kind` (nothing is written here); OutputDirError when the run must not write
    there: a file, a link where the run writes, another kind of run's directory, or entries headstart did not write."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{kind.flag} {out} is a file, not a directory: pass another {kind.flag}")
    new = {"kind": kind.kind, "entries": sorted(kind.exact_names())}
    if not out.exists():
        return new
    entries = sorted(p.name for p in out.iterdir() if not _bookkeeping(p.name))
    links = [name for name in entries if kind.writes(name) and (out / name).is_symlink()]
    if links:
        raise OutputDirError(f"{out} holds symbolic links where a {kind.kind} run writes ({_shown(links)}): headstart "
                             f"does not write through links; remove them or pass another {kind.flag}")
    manifest = read_manifest(out)
    if manifest is not None:
        if manifest["kind"] != kind.kind:
            raise OutputDirError(f"{out} holds a headstart {manifest['kind']} run, not a {kind.kind} one: pass another "
                                 f"{kind.flag}")
        foreign = [name for name in entries if name in kind.exact_names() and name not in manifest["entries"]]
        if foreign:
            raise OutputDirError(f"{out} holds {_shown(foreign)}, which this {kind.kind} run would replace and headstart "
                                 f"did not write: move them away or pass another {kind.flag}")
        return {"kind": kind.kind, "entries": sorted(set(manifest["entries"]) | set(new["entries"]))}
    if not entries:
        return new
    foreign = [name for name in entries if not kind.writes(name)]
    marked = any(any(out.glob(marker)) for marker in kind.markers)
    if foreign or not marked:
        held = _shown(foreign) if foreign else f"{_shown(entries)} but no {' or '.join(kind.markers)}"
        raise OutputDirError(f"{out} is not empty and not a headstart {kind.kind} run (it holds {held}): pass a new or "
                             f"empty {kind.flag}; headstart never replaces files it did not write")
    return {"kind": kind.kind, "entries": sorted(set(entries) | set(new["entries"]))}  # an earlier version's run


def owned_entries(out: Path, kind: RunKind) -> list[str]:
    """The top-level entries of `out` that headstart's manifest lists for `kind` (what --overwrite may remove)."""
    manifest = read_manifest(out)
    if manifest is None or manifest["kind"] != kind.kind:
        return []
    return [name for name in manifest["entries"] if "/" not in name and name not in ("", ".", "..")]


class OutputDirClaim:
    """A claimed output directory: its lock is held until release() (or the process ends)."""

    def __init__(self, out: Path, lock_fd: int | None):
        self.out, self._fd = out, lock_fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.out / LOCK_FILE)  # while still holding it: a run that opened it before retries (_lock)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "OutputDirClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


def claim_output_dir(out: Path, kind: RunKind, take: bool = True) -> OutputDirClaim:
    """Claim `out` for a run of `kind`. take (the run's main process): create it, take its lock, check it and write
    its manifest; otherwise (the other processes of one launch, which share the directory) only check it.
    OutputDirError when it must not be written or another run holds it."""
    if not take:
        check_output_dir(out, kind)
        return OutputDirClaim(out, None)
    check_output_dir(out, kind)  # before anything is created
    with disk_full_is_one_line(out, "free space and rerun"):
        out.mkdir(parents=True, exist_ok=True)
        claim = OutputDirClaim(out, _lock(out))
    try:
        manifest = check_output_dir(out, kind)  # again under the lock
        with disk_full_is_one_line(out, "free space and rerun"):
            write_file(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    except BaseException:
        claim.release()
        raise
    return claim


def export_subdir(out: Path, n: int, heads_dir: str | Path, suffix: str) -> Path:
    """Where an engine check puts the export of its n-th heads dir (1-based): out/export-N-NAME-SUFFIX, NAME the run's
    name (the folder holding a `heads` dir, else the heads dir's own name); N keeps two heads dirs of one name
    apart, so no export replaces another's."""
    path = Path(heads_dir).resolve()
    name = path.parent.name if path.name == "heads" else path.name
    return out / f"export-{n}-{name}-{suffix}"


def record_entries(out: Path, kind: RunKind, entries: list[str]) -> None:
    """Set the manifest's entries to exactly `entries` (what the run now has there)."""
    write_file(out / MANIFEST, json.dumps({"kind": kind.kind, "entries": sorted(set(entries))}, indent=1) + "\n")


def _lock(out: Path) -> int:
    """An exclusive fcntl lock on out/LOCK_FILE holding this process's id. A file unlinked by the run that held it
    between our open and our lock is opened again; on a full disk the file is removed and the error is one line."""
    path = out / LOCK_FILE
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputDirError(f"another headstart run (pid {holder}) is writing {out}: wait for it to finish (rerun "
                                 "then to resume it), or pass another directory") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.write(fd, str(os.getpid()).encode())
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            raise OutputDirError(f"could not write {path}: {disk_full(err, path) or err}; free space and rerun") from err
        return fd


# ------------------------------------------------------------------------------------------ writing files


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def honour_umask(path: Path) -> None:
    """Give `path` (a file, or a folder and everything in it) the modes a plain open/mkdir gives under the user's umask:
    safetensors writes its files 0600 and tempfile.mkdtemp its folders 0700, which would keep a shared cache or heads
    directory from other users. Links are left alone."""
    mask = current_umask()
    paths = [Path(path)]
    if Path(path).is_dir() and not Path(path).is_symlink():
        paths += list(Path(path).rglob("*"))
    for p in paths:
        mode = os.lstat(p).st_mode
        if stat.S_ISDIR(mode):
            os.chmod(p, 0o777 & ~mask)
        elif stat.S_ISREG(mode):
            os.chmod(p, (0o777 if mode & 0o111 else 0o666) & ~mask)


def refuse_link(path: Path) -> None:
    if Path(path).is_symlink():
        raise OutputDirError(f"{path} is a symbolic link: headstart does not write through links; remove it, or pass "
                             "another directory")


def write_file(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` atomically (a new file renamed over it): never through a symbolic link (OutputDirError),
    mode from the umask."""
    path = Path(path)
    refuse_link(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)  # replaces a name, never writes through one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ------------------------------------------------------------------------------------------ a full disk


def disk_full(err: BaseException, path: Path) -> str | None:
    """'no space left on device ...' when `err`, raised writing under `path`, came from a full disk, else None.
    torch.save reports a full disk only as 'basic_ios::clear: iostream error' or 'unexpected pos': then the free space
    left on the filesystem (read before the partial files are removed) tells."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device"
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    free = shutil.disk_usage(existing).free if existing is not None else None
    if free is not None and free < LOW_SPACE_BYTES:
        return f"no space left on device ({free} bytes free there; {type(err).__name__}: {str(err).splitlines()[0][:120]})"
    return None


@contextlib.contextmanager
def disk_full_is_one_line(path: Path, then: str) -> Iterator[None]:
    """Inside: an error a full disk caused while writing under `path` becomes OutputDirError 'could not write PATH: no
    space left on device; THEN'; other errors, and headstart's own (a refusal that happens on a nearly full disk),
    pass unchanged."""
    try:
        yield
    except Exception as err:
        if type(err).__module__.split(".")[0] in ("headstart", "scripts"):
            raise
        full = disk_full(err, Path(path))
        if full is None:
            raise
        raise OutputDirError(f"could not write {path}: {full}; {then}") from err
