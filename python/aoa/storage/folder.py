"""The output folder every destination format writes into: locked, staged, published at once.

    out/.aoa-lock            taken by each process writing into ``out``, for as long as it does
    out/.aoa-staging/        the files being written, under their final names; ``.aoa-owner``
                             says whose they are, ``.aoa-done-rank-*`` which ranks are done

**One conversion at a time.** A process writing alone holds the lock exclusively; a second
`aoa convert` into the same folder is refused at once, with the first one's process id.
The ranks of one conversion (``--rank/--world-size``, torchrun) share it: each holds it
shared, tagged with the conversion (`Sharing`), and its own rank exclusively, so a rank
started twice, or a rank of another conversion, is refused. The locks are open-file-
description locks (``F_OFD_SETLK``, POSIX record locks elsewhere): the kernel drops them
when a process dies, so a killed run never leaves a folder locked.

**Nothing visible until whole.** Files are written into the staging folder and published by
one process (rank 0) once all are there: data files renamed into place first, the index (or
metadata) last, the folder fsynced between, so a reader never meets an index naming files
that are not there. A kill between two renames (microseconds) leaves a numbered set with a
member missing, which the readers refuse (`-of-N` counts, index names). A failure, an
interrupt or a kill before that leaves nothing visible: a failing process removes what it
staged (and the output folder, if it made it); a killed one leaves only the hidden staging
folder, which the next run into the folder clears.

**Ranks that do not overlap in time** (``--rank`` runs started one after another): a rank
that finishes leaves its files staged and a marker, and releases the lock; the staging
folder's ``owner`` names the conversion, so a later rank of the same conversion keeps them,
while a run of anything else clears them as stale.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aoa.errors import StorageError

#: this machine's name, as `hostname` says it (`socket.gethostname`'s answer on Linux, without
#: importing socket for it)
_HOST_NAME = os.uname().nodename

LOCK_NAME = ".aoa-lock"
STAGING_NAME = ".aoa-staging"
_OWNER_NAME = ".aoa-owner"
#: Names aoa keeps for itself: no checkpoint file is called so.
_RESERVED = ".aoa-"

# Bytes of the lock file locked as separate locks: a brief guard around every change of
# state, the holders (exclusive: one process alone; shared: the ranks of one conversion),
# and rank r's byte at _RANKS + r.
_GUARD, _HOLDERS, _RANKS = 0, 1, 2


@dataclass(frozen=True)
class Sharing:
    """Rank ``rank`` of the ``world_size`` processes writing one conversion into one folder;
    ``conversion`` names the conversion (the same on every rank, different for any other)."""

    conversion: str
    rank: int
    world_size: int


def output_folder(folder: str | os.PathLike[str]) -> tuple[Path, list[Path]]:
    """``folder``, made (with its parents) if it is not there; and the folders made here,
    deepest first (to remove if the write fails)."""
    folder = Path(folder)
    made: list[Path] = []
    missing = [folder, *folder.parents]
    missing = missing[:next((i for i, p in enumerate(missing) if p.exists()), len(missing))]
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
                made.insert(0, path)
            except FileExistsError:
                pass
    except OSError as error:
        raise StorageError(
            f"{folder}: cannot create the output folder: {error.strerror}"
        ) from error
    if not folder.is_dir():
        raise StorageError(f"{folder}: cannot create the output folder: not a folder")
    return folder, made


def check_output_folder(folder: Path,
                        patterns: Sequence[str] | Callable[[], Sequence[str]]) -> None:
    """Refuse an output that is a file, or a folder holding files named like a checkpoint's
    (``patterns``: globs of every format's files, or what gives them, asked only where the
    folder holds a file that is not hidden: finding them imports every format), other than
    hidden ones: files of two runs would mix."""
    if folder.exists() and not folder.is_dir():
        raise StorageError(f"{folder}: the output is a file, not a folder")
    if not folder.is_dir():
        return
    with os.scandir(folder) as entries:
        if all(entry.name.startswith(".") for entry in entries):
            return
    if callable(patterns):
        patterns = patterns()
    found = sorted({path.name for pattern in patterns for path in folder.glob(pattern)
                    if not path.name.startswith(".")})
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise StorageError(f"{folder}: the output folder already holds a checkpoint ({shown})",
                           hint="Convert into an empty or new folder.")


class OutputFolder:
    """One process's part in writing a checkpoint into ``folder``: `open` (lock, check,
    staging), `stage` each file, then `publish` (one process) or leave them for rank 0, and
    `release` (a failure: `abort`)."""

    def __init__(self, folder: str | os.PathLike[str],
                 patterns: Sequence[str] | Callable[[], Sequence[str]]) -> None:
        self.folder = Path(folder)
        self.staging = self.folder / STAGING_NAME
        #: what `check_output_folder` refuses (or what gives it, asked when needed)
        self.patterns = patterns if callable(patterns) else tuple(patterns)
        self.sharing: Sharing | None = None
        self.published = False
        self._lock: int | None = None
        self._made: list[Path] = []
        self._staged: list[Path] = []

    # -- taking the folder ---------------------------------------------------------------

    def open(self, sharing: Sharing | None = None) -> None:
        """Lock the folder (made if missing) for this process, alone or as a rank of
        ``sharing``; refuse a folder holding a checkpoint; clear a stale staging folder."""
        if self._lock is not None:
            return
        self.sharing = sharing
        self._made = []
        for _ in range(100):  # another process may remove a folder it made: make it again
            _, made = output_folder(self.folder)
            self._made += made
            try:
                self._lock = _open_lock(self.folder / LOCK_NAME)
                break
            except FileNotFoundError:
                continue
        else:
            raise StorageError(f"{self.folder}: cannot lock the output folder: it keeps "
                               "disappearing")
        try:
            self._take(sharing)
            check_output_folder(self.folder, self.patterns)
        except BaseException:
            self._unlock(remove_staging=sharing is None)
            raise
        _lock_byte(self._lock, fcntl.F_UNLCK, _GUARD)

    def _take(self, sharing: Sharing | None) -> None:
        """Under the guard: take the holders' lock (alone, or shared with the ranks of one
        conversion) and this rank's; record who holds it; clear staging left by others."""
        lock = self._lock
        assert lock is not None
        me = {"pid": os.getpid(), "host": _HOST_NAME,
              "since": time.strftime("%Y-%m-%d %H:%M:%S"),
              "conversion": sharing.conversion if sharing else None,
              "world_size": sharing.world_size if sharing else None}
        if _try_lock(lock, fcntl.F_WRLCK, _HOLDERS):  # nobody is writing: take the folder
            owner = _read_json(self.staging / _OWNER_NAME)
            if sharing is None or owner is None or owner.get("conversion") != sharing.conversion:
                _remove_tree(self.staging)  # left by a run that was killed
            _write_json_fd(lock, me)
            if sharing is not None:
                _lock_byte(lock, fcntl.F_RDLCK, _HOLDERS)  # the guard keeps others out meanwhile
        else:
            holder = _read_json_fd(lock) or {}
            if (sharing is None or holder.get("conversion") != sharing.conversion
                    or holder.get("world_size") != sharing.world_size
                    or not _try_lock(lock, fcntl.F_RDLCK, _HOLDERS)):
                raise StorageError(
                    f"{self.folder}: another aoa convert is writing into this folder "
                    f"({_describe_holder(holder)})",
                    hint="Wait for it to finish, or convert into another folder.")
        if sharing is not None and not _try_lock(lock, fcntl.F_WRLCK, _RANKS + sharing.rank):
            raise StorageError(f"{self.folder}: rank {sharing.rank} of this conversion is "
                               "already writing into this folder",
                               hint="Start each rank once.")
        try:
            self.staging.mkdir(exist_ok=True)
            if not (self.staging / _OWNER_NAME).exists():
                write_file(self.staging / _OWNER_NAME,
                           json.dumps({"conversion": me["conversion"]}).encode())
        except OSError as error:
            raise StorageError(f"{self.staging}: cannot create the staging folder: "
                               f"{error.strerror}") from error

    # -- staging and publishing ----------------------------------------------------------

    def stage(self, name: str) -> Path:
        """Where file ``name`` is written until it is published (remembered as this
        process's, to remove on failure)."""
        if self._lock is None:
            raise StorageError(f"{self.folder}: the output folder is not open for writing")
        if Path(name).name != name or name in (".", "..") or name.startswith(_RESERVED):
            raise StorageError(f"{self.folder}: '{name}' is not a file name for the output")
        path = self.staging / name
        self._staged.append(path)
        return path

    def mark_done(self) -> None:
        """Say that this rank's files are staged and complete."""
        assert self.sharing is not None
        marker = self._marker(self.sharing.rank)
        write_file(marker, self.sharing.conversion.encode())

    def wait_for_ranks(self, poll_seconds: float, timeout: float | None) -> None:
        """Wait until every other rank has marked its files done."""
        assert self.sharing is not None
        waiting = set(range(self.sharing.world_size)) - {self.sharing.rank}
        start = time.monotonic()
        while waiting:
            for rank in sorted(waiting):
                with contextlib.suppress(FileNotFoundError):
                    if self._marker(rank).read_bytes() == self.sharing.conversion.encode():
                        waiting.discard(rank)
            if not waiting:
                return
            if timeout is not None and time.monotonic() - start > timeout:
                raise StorageError(f"{self.folder}: ranks {sorted(waiting)} did not finish "
                                   f"within {timeout:.0f} s; nothing is published")
            time.sleep(poll_seconds)

    def _marker(self, rank: int) -> Path:
        assert self.sharing is not None
        return self.staging / f"{_RESERVED}done-rank-{rank:05d}-of-{self.sharing.world_size:05d}"

    def publish(self, data: Sequence[str], last: Sequence[str]) -> None:
        """Move the staged files ``data`` into the folder, then ``last`` (an index, metadata),
        and remove the staging folder. A failure moves back what was moved."""
        missing = [name for name in (*data, *last) if not (self.staging / name).is_file()]
        if missing:
            raise StorageError(
                f"{self.folder}: {missing[0]} is not among the staged files"
                + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""),
                hint="Every rank writes into the same folder: give them a shared file system.")
        moved: list[str] = []
        target = self.folder
        try:
            for group in (data, last):
                for name in group:
                    target = self.folder / name
                    os.replace(self.staging / name, target)
                    moved.append(name)
                target = self.folder
                sync_folder(self.folder)
        except OSError as error:
            for name in reversed(moved):
                with contextlib.suppress(OSError):
                    os.replace(self.folder / name, self.staging / name)
            raise StorageError(f"{target}: cannot publish: {error.strerror}") from error
        self.published = True
        self._staged.clear()
        _remove_tree(self.staging)

    # -- letting go ----------------------------------------------------------------------

    def abort(self) -> None:
        """Remove what this process staged (everything, when it writes alone), then
        release the folder."""
        for path in self._staged:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._staged.clear()
        if self.sharing is not None:
            with contextlib.suppress(FileNotFoundError):
                self._marker(self.sharing.rank).unlink()
        self._unlock(remove_staging=self.sharing is None)

    def release(self) -> None:
        """Let go of the folder: a process writing alone that did not publish removes what
        it staged; a rank leaves its files for rank 0."""
        if self._lock is None:
            return
        if self.sharing is None and not self.published:
            self.abort()
        else:
            self._unlock(remove_staging=False)

    def _unlock(self, remove_staging: bool) -> None:
        """Drop this process's locks. The last holder removes the lock file and a staging
        folder holding no rank's files, and a folder made for this run that stayed empty."""
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            _lock_byte(lock, fcntl.F_WRLCK, _GUARD, wait=True)
            if self.sharing is not None:
                _lock_byte(lock, fcntl.F_UNLCK, _RANKS + self.sharing.rank)
            if _try_lock(lock, fcntl.F_WRLCK, _HOLDERS):  # the last one out
                if remove_staging or _holds_nothing(self.staging):
                    _remove_tree(self.staging)
                if not self.staging.exists():
                    with contextlib.suppress(FileNotFoundError):
                        (self.folder / LOCK_NAME).unlink()
                    for made in self._made:  # deepest first; only if empty
                        with contextlib.suppress(OSError):
                            made.rmdir()
        finally:
            os.close(lock)  # drops every lock this descriptor holds


# -- the lock file -------------------------------------------------------------------------


def _open_lock(path: Path) -> int:
    """The lock file, opened (made if missing), with its guard byte locked: the file at
    ``path`` when the guard is taken (the last holder may have removed the one opened)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            if isinstance(error, FileNotFoundError):
                raise  # the folder is gone: make it again
            raise StorageError(f"{path.parent}: cannot lock the output folder: "
                               f"{error.strerror}") from error
        try:
            _lock_byte(fd, fcntl.F_WRLCK, _GUARD, wait=True)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


_OFD = getattr(fcntl, "F_OFD_SETLK", None), getattr(fcntl, "F_OFD_SETLKW", None)


def _lock_byte(fd: int, kind: int, offset: int, wait: bool = False) -> None:
    """Lock (F_RDLCK, F_WRLCK) or unlock (F_UNLCK) one byte of the lock file; raises
    BlockingIOError (or PermissionError) where another holds it and ``wait`` is False."""
    set_lock, set_lock_wait = _OFD
    if set_lock is None or set_lock_wait is None:  # no OFD locks: POSIX record locks
        command = {fcntl.F_RDLCK: fcntl.LOCK_SH, fcntl.F_WRLCK: fcntl.LOCK_EX,
                   fcntl.F_UNLCK: fcntl.LOCK_UN}[kind]
        fcntl.lockf(fd, command | (0 if wait else fcntl.LOCK_NB), 1, offset)
        return
    record = struct.pack("hhqqi4x", kind, os.SEEK_SET, offset, 1, 0)  # struct flock
    fcntl.fcntl(fd, set_lock_wait if wait else set_lock, record)


def _try_lock(fd: int, kind: int, offset: int) -> bool:
    try:
        _lock_byte(fd, kind, offset)
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _describe_holder(holder: dict) -> str:
    pid, host, since = holder.get("pid"), holder.get("host"), holder.get("since")
    if pid is None:
        return "its process could not be named"
    where = f"process {pid}" + (f" on {host}" if host and host != _HOST_NAME else "")
    return where + (f", since {since}" if since else "")


def _write_json_fd(fd: int, value: dict) -> None:
    data = json.dumps(value).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read_json_fd(fd: int) -> dict | None:
    try:
        value = json.loads(os.pread(fd, 65536, 0) or b"null")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _holds_nothing(staging: Path) -> bool:
    """Whether a staging folder holds no staged file (only its owner record), or is gone."""
    try:
        return all(entry.name == _OWNER_NAME for entry in staging.iterdir())
    except FileNotFoundError:
        return True


def _remove_tree(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


# -- small files -------------------------------------------------------------------------


def write_file(path: Path, data: bytes) -> None:
    """Write a small file in full and fsync it (in the staging folder: it becomes visible
    when published)."""
    try:
        with open(path, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        raise StorageError(f"{path}: cannot write: {error.strerror}") from error


def sync_folder(folder: Path) -> None:
    """fsync a folder so that renames in it survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
