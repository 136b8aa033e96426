"""Host memory about to be overwritten whole: mapped in one call, and never copied on write first.

A worker forked from its node's template (:mod:`unbroken.agent.template`)
shares the template's model parameters copy-on-write. A restore overwrites
every byte of them: without care each page is first copied from the
template's page (a fault per 4 KiB page that reads what is thrown away next),
which made loading 0.7 GB into a forked worker three times slower than into
a process of its own (about 0.7 s against 0.22 s on two cores). Before a load
writes a range, :func:`ready_to_overwrite` drops the range's whole pages that
are shared with another process (``MADV_DONTNEED``: they read as zeros until
written; ``/proc/self/pagemap`` tells which are shared) and maps every page
of it for writing in one call (``MADV_POPULATE_WRITE``, Linux 5.14), so the
copy into it takes no page fault.

Invariants: only pages wholly inside the range are touched (a page shared
with a neighbouring tensor keeps its bytes), and only a range the caller
overwrites entirely before anyone reads it may be given; where a call is not
supported (another system, an older kernel, no ``/proc``) nothing is done and
the pages fault in as the copy writes them, as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
from typing import Callable

__all__ = ["ready_to_overwrite"]

_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23
_PRESENT = 1 << 63
_EXCLUSIVE = 1 << 56
PAGE = mmap.PAGESIZE


def _madvise() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_CALL = _madvise()


def _shared(page: int) -> bool:
    """Whether the page at address ``page`` is mapped and shared with another process (copy-on-write after a
    fork); False where ``/proc/self/pagemap`` cannot tell."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return False
    try:
        raw = os.pread(fd, 8, (page // PAGE) * 8)
    except OSError:
        return False
    finally:
        os.close(fd)
    if len(raw) != 8:
        return False
    flags = struct.unpack("<Q", raw)[0]
    return bool(flags & _PRESENT) and not flags & _EXCLUSIVE


def ready_to_overwrite(address: int, nbytes: int) -> None:
    """Make host bytes ``[address, address + nbytes)``, which the caller overwrites next, cheap to write (see
    the module docstring). The first whole page decides for the range: a tensor's pages are shared, or not,
    together (a template's parameter, or memory of this process's own)."""
    if _CALL is None:
        return
    lo = -(-address // PAGE) * PAGE
    hi = (address + nbytes) // PAGE * PAGE
    if hi <= lo:
        return
    if _shared(lo):
        _CALL(lo, hi - lo, _MADV_DONTNEED)  # zeros until written: nothing is copied from the other process's pages
    _CALL(lo, hi - lo, _MADV_POPULATE_WRITE)  # EINVAL before Linux 5.14: the copy then faults them in
