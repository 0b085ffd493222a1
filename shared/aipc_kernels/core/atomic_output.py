"""Output directories that appear whole or not at all and never lose a file this package did
not write.

:func:`atomic_output_dir` hands out a staging directory ``DEST.partial-<pid>`` beside ``dest`` (same
filesystem) and, when the block ends without an exception, moves what was written there into
``dest``: one ``rename`` when ``dest`` is absent or empty; else, with ``keep_others=True``, file by
file, replacing only the files this package wrote there before and leaving every other file alone.
The record :data:`RECORD_NAME` in the directory lists the files this package wrote and says whether
the writing finished; loaders call :func:`check_complete`. On an exception, SIGINT or SIGTERM the
staging directory is removed; a SIGKILL leaves it, and the next write to ``dest`` refuses, naming
it and the command that removes it. Standard library only (the import hooks use it).
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

#: per output directory: which files this package wrote there, and whether the writing finished
RECORD_NAME = "aipc_output.json"
PARTIAL_MARK = ".partial-"
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM") if hasattr(signal, n))


class OutputDirError(ValueError):
    """The destination cannot be written as asked (it holds files this package did not write, or
    an earlier run left its staging directory beside it)."""


class IncompleteOutputError(ValueError):
    """A directory whose writing did not finish."""


def staging_dir(dest: str | os.PathLike, pid: int | None = None) -> Path:
    """The staging directory of ``dest`` for process ``pid`` (default: this one)."""
    dest = Path(dest)
    return dest.with_name(f"{dest.name}{PARTIAL_MARK}{os.getpid() if pid is None else pid}")


def _pid_alive(pid: int) -> bool | None:
    """Whether process ``pid`` runs (None: cannot tell on this OS)."""
    if os.name == "nt":  # os.kill(pid, 0) would terminate it there
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists under another user
        return True
    return True


def _pid_of(path: Path, mark: str) -> int | None:
    tail = path.name.rpartition(mark)[2].split("_")[0]
    return int(tail) if tail.isdigit() else None


def _size(path: Path) -> str:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    return f"{total / 2**20:.1f} MiB"


def leftover_staging_dirs(dest: str | os.PathLike) -> list[Path]:
    """Staging directories of ``dest`` that exist now (left by an interrupted run, or in use)."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return []
    prefix = dest.name + PARTIAL_MARK
    return sorted(p for p in dest.parent.iterdir()
                  if p.name.startswith(prefix) and p.name[len(prefix):].isdigit())


def abandoned_staging_dirs(dest: str | os.PathLike) -> list[Path]:
    """Staging directories of ``dest`` whose writing process no longer runs (a cache may remove them and
    write again; a user's output directory is reported instead, see :func:`atomic_output_dir`)."""
    return [p for p in leftover_staging_dirs(dest) if _pid_alive(_pid_of(p, PARTIAL_MARK)) is False]


def _label(dest: Path, param: str | None) -> str:
    return f"{param}={str(dest)!r}" if param else str(dest)


def _leftover_error(dest: Path, found: list[Path], redo: str, param: str | None) -> OutputDirError:
    running = [p for p in found if _pid_alive(_pid_of(p, PARTIAL_MARK)) is True]
    rm = "rm -rf " + " ".join(shlex.quote(str(p)) for p in found)
    if running:
        return OutputDirError(
            f"{_label(dest, param)} is being written by another run right now (process "
            f"{_pid_of(running[0], PARTIAL_MARK)}, staging directory {running[0]}); wait for it "
            f"to finish, or stop it, remove its staging directory with `{rm}` and {redo}")
    listed = ", ".join(f"{p} ({_size(p)})" for p in found)
    return OutputDirError(f"an earlier run writing {_label(dest, param)} was interrupted and "
                          f"left {listed}; remove it with `{rm}` and {redo}")


def read_record(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The record of ``directory`` (None when it has none; an unreadable one reads as unfinished)."""
    path = Path(directory) / RECORD_NAME
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {"complete": False, "files": []}
    return data if isinstance(data, dict) else {"complete": False, "files": []}


def check_complete(directory: str | os.PathLike, what: str, redo: str) -> None:
    """Raises :class:`IncompleteOutputError` when ``directory`` was written by this package and
    the writing did not finish (its record says so, or a file it lists is missing). ``what``
    names the output ("export"), ``redo`` the fix ("export again"). No record: nothing to say."""
    directory = Path(directory)
    record = read_record(directory)
    if record is None:
        return
    if record.get("complete") is not True:
        pid = record.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and _pid_alive(pid) is True:
            raise IncompleteOutputError(f"incomplete {what}: {directory} is being written by "
                                        f"process {pid}; wait for it to finish")
        raise IncompleteOutputError(f"incomplete {what}: writing {directory} was interrupted "
                                    f"before it finished; delete {directory} and {redo}")
    missing = [f for f in record.get("files", ()) if not (directory / f).exists()]
    if missing:
        raise IncompleteOutputError(
            f"incomplete {what}: {directory} lacks {', '.join(missing[:3])}"
            f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} (listed in "
            f"{RECORD_NAME}); delete {directory} and {redo}")


def _write_record(path: Path, files: Iterable[str], complete: bool) -> None:
    data: dict[str, Any] = {"writer": "aipc-plugins", "complete": complete, "files": sorted(files)}
    if not complete:
        data["pid"] = os.getpid()
    path.write_text(json.dumps(data, indent=1) + "\n")


def _owned(dest: Path, legacy_owned: Callable[[Path], set[str]] | None) -> set[str]:
    """Names in ``dest`` that this package wrote: its record's, else ``legacy_owned(dest)``."""
    record = read_record(dest)
    if record is not None:
        return {f for f in record.get("files", ())
                if isinstance(f, str) and Path(f).name == f and f not in (".", "..")}
    return set(legacy_owned(dest)) if legacy_owned is not None else set()


def _foreign(dest: Path, owned: set[str]) -> set[str]:
    return set(os.listdir(dest)) - owned - {RECORD_NAME}


def _clash_error(dest: Path, clash: list[str], what: str, param: str | None) -> OutputDirError:
    return OutputDirError(
        f"{_label(dest, param)} holds {', '.join(clash)}, which this package did not write and "
        f"the {what} would overwrite; move {'them' if len(clash) > 1 else 'it'} away or write "
        "to another directory")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """SIGINT/SIGTERM held back (delivered after the block) where the OS allows it."""
    if not hasattr(signal, "pthread_sigmask") or \
            threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _interruption(signum: int) -> BaseException:
    """What a delivered SIGINT / SIGTERM raises: ``KeyboardInterrupt`` / ``SystemExit(128 + signum)``."""
    if signum == getattr(signal, "SIGINT", None):
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Inside the block, SIGTERM (and SIGINT, where it would kill the process) raise
    ``SystemExit(128 + signum)`` / ``KeyboardInterrupt`` in the main thread, so ``finally`` blocks
    run; handlers an application installed are left alone; the previous ones come back after.
    Native code can swallow the handler's exception and fail with another one (torch turns it
    into a ``ValueError``): any exception leaving the block after a signal arrived is re-raised
    as that signal's interruption, so the process still ends as interrupted."""
    installed: dict[int, Any] = {}
    received: list[int] = []

    def _raise_for(signum: int, frame: Any) -> None:
        received.append(signum)
        raise _interruption(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _raise_for)
    try:
        yield
    except Exception as e:
        if received:
            raise _interruption(received[0]) from e
        raise
    finally:
        with _signals_blocked():  # a signal arriving now is delivered to the restored handler
            for sig, handler in installed.items():
                signal.signal(sig, handler)


def _rename_dir(staging: Path, dest: Path) -> None:
    try:
        os.rename(staging, dest)  # POSIX replaces an empty directory atomically
    except OSError:
        if not (dest.is_dir() and not any(dest.iterdir())):
            raise OutputDirError(f"{dest} was written to by someone else while this run wrote "
                                 f"{staging}; nothing was changed in {dest}") from None
        dest.rmdir()  # Windows: rename does not replace a directory
        os.rename(staging, dest)


def _commit(staging: Path, dest: Path, what: str, param: str | None, keep_others: bool,
            legacy_owned: Callable[[Path], set[str]] | None) -> None:
    new = sorted(n for n in os.listdir(staging) if n != RECORD_NAME)
    _write_record(staging / RECORD_NAME, new, complete=True)
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        _rename_dir(staging, dest)
        return
    if not keep_others:
        raise OutputDirError(f"{_label(dest, param)} is not empty any more (written while this "
                             "run worked); pass a new or empty directory")
    owned = _owned(dest, legacy_owned)
    clash = sorted(_foreign(dest, owned) & set(new))
    if clash:
        raise _clash_error(dest, clash, what, param)
    # dest reads as unfinished until the complete record replaces this one, last
    merging = staging / (RECORD_NAME + ".merging")
    _write_record(merging, owned | set(new), complete=False)
    os.replace(merging, dest / RECORD_NAME)
    for name in sorted(owned - set(new)):
        _remove(dest / name)
    for name in new:
        target = dest / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(staging / name, target)
    os.replace(staging / RECORD_NAME, dest / RECORD_NAME)
    staging.rmdir()


@contextlib.contextmanager
def atomic_output_dir(dest: str | os.PathLike, *, what: str, redo: str, param: str | None = None,
                      keep_others: bool = False,
                      always_writes: Iterable[str] = (),
                      legacy_owned: Callable[[Path], set[str]] | None = None) -> Iterator[Path]:
    """Yields a staging directory to write the output into; on success moves it to ``dest``.

    ``what`` names the output in errors ("lowbit2 checkpoint"), ``redo`` the command to run after
    a fix ("convert again"), ``param`` the argument that gave ``dest`` ("out_dir").
    ``keep_others=False``: ``dest`` must be absent or empty. ``keep_others=True``: files
    already in ``dest`` that this package wrote (its record's, or for a directory written before
    records existed ``legacy_owned(dest)``) are replaced or removed, every other file stays; the
    output refuses, before any work for names in ``always_writes``
    and at the end for the rest, to overwrite a file it did not write. Raises
    :class:`OutputDirError` when a staging directory of ``dest`` is left from an earlier run."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise OutputDirError(f"{_label(dest, param)} is a file; pass a directory path")
    found = leftover_staging_dirs(dest)
    if found:
        raise _leftover_error(dest, found, redo, param)
    if dest.is_dir():
        if not keep_others and any(dest.iterdir()):
            names = sorted(os.listdir(dest))
            raise OutputDirError(f"{_label(dest, param)} is not empty (holds "
                                 f"{', '.join(names[:5])}{', ...' if len(names) > 5 else ''}); "
                                 "pass a new or empty directory")
        if keep_others:
            clash = sorted(_foreign(dest, _owned(dest, legacy_owned)) & set(always_writes))
            if clash:
                raise _clash_error(dest, clash, what, param)
    staging = staging_dir(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with signals_raise():
        staging.mkdir()
        try:
            _write_record(staging / RECORD_NAME, (), complete=False)
            yield staging
            with _signals_blocked():
                _commit(staging, dest, what, param, keep_others, legacy_owned)
        finally:
            with _signals_blocked():
                shutil.rmtree(staging, ignore_errors=True)


def temporary_output_dir(prefix: str) -> tempfile.TemporaryDirectory:
    """A ``TemporaryDirectory`` named ``<prefix><pid>_*`` in the system temp dir. Warns, naming
    them and the command that removes them, about earlier ones whose process is gone (a process
    killed with SIGKILL cannot remove its own)."""
    root = Path(tempfile.gettempdir())
    stale = [p for p in root.glob(f"{prefix}*")
             if p.is_dir() and (pid := _pid_of(p, prefix)) is not None and _pid_alive(pid) is False]
    if stale:
        warnings.warn(f"left by interrupted runs: {', '.join(f'{p} ({_size(p)})' for p in stale)}; "
                      f"remove with `rm -rf {' '.join(shlex.quote(str(p)) for p in stale)}`",
                      RuntimeWarning, stacklevel=2)
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}_")
