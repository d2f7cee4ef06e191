"""Dropping a read-only file mapping's pages from this process's resident memory (RSS).

A checkpoint reader (safetensors, GGUF) maps its files; every page a tensor read touches stays in the
process's RSS (RssFile on disk, RssShmem on tmpfs) until the file is closed. MappedPages.release(path,
address, nbytes) drops the whole pages inside [address, address + nbytes) once the caller has copied or
packed them. They stay in the page cache: a later read faults them back in, from memory. Only ranges inside
path's own mapping are dropped, so a tensor that is a copy (or lives elsewhere) is left alone.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path


class MappedPages:
    """Address ranges at which files are mapped into this process, read from /proc/self/maps (Linux;
    elsewhere none, so nothing is released). A file is matched by device and inode, or by its real path
    (overlay filesystems may show the layer below's inode); the ranges are read again on a miss."""

    def __init__(self):
        self._maps: list[tuple[int, int, tuple[int, int], str]] = []

    def release(self, path: str | Path, address: int, nbytes: int) -> None:
        start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and self.contains(path, start, end):
            _dontneed(start, end - start)

    def contains(self, path: str | Path, start: int, end: int) -> bool:
        st = os.stat(path)
        file = ((st.st_dev, st.st_ino), os.path.realpath(path))
        if not self._cached_contains(file, start, end):
            self._maps = _read_maps()
        return self._cached_contains(file, start, end)

    def _cached_contains(self, file: tuple[tuple[int, int], str], start: int, end: int) -> bool:
        return any(lo <= start and end <= hi and (key == file[0] or name == file[1])
                   for lo, hi, key, name in self._maps)


def _read_maps() -> list[tuple[int, int, tuple[int, int], str]]:
    """(start, end, (device, inode), path) of every file mapping."""
    maps = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                # start-end perms offset major:minor inode [path]
                fields = line.split(maxsplit=5)
                if int(fields[4]) == 0:
                    continue
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                path = fields[5].rstrip("\n") if len(fields) > 5 else ""
                maps.append((lo, hi, (os.makedev(major, minor), int(fields[4])), path))
    except OSError:
        pass
    return maps


def _dontneed(start: int, length: int) -> None:
    # MADV_DONTNEED on a file mapping unmaps the pages from this process only; nothing is lost, since the
    # mapping is never written (a written private page would be).
    _libc.madvise(start, length, mmap.MADV_DONTNEED)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
