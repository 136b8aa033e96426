"""The job's compile cache: compiled once per job, loaded by every later process of it.

After its first compiled step the view's leader saves what ``torch.compile`` made
(``torch.compiler.save_cache_artifacts``, the Mega-Cache: AOTAutograd and inductor
graph entries, with the Triton kernels bundled on a GPU) into ``RUN/compile_cache``;
every later worker, joiner, standby and replacement node loads it
(``torch.compiler.load_cache_artifacts``) before its first step, so it traces its
frames but builds no kernel. On the CPU inductor's graph entries hold the kernels'
C++ source, not the built libraries: the kernels the writer has mapped from
inductor's cache directory travel in the same file and are placed at the same
relative path in the reader's (a key of inductor's that differs there, from
another compiler or include path, only makes it build them again).

File: ``MAGIC | header length (u32 LE) | header (JSON) | MAC (32) | payload``,
``MAC = HMAC-SHA256(key, MAGIC | header length | header | payload)`` with
:func:`cache_key` of the job's secret (derived as the snapshot seals' key is, under
a label of its own). The header names the torch and Triton versions, the device
(a GPU's name; on the CPU its vector ISA), the config hash, and the payload's
parts: the Mega-Cache bytes, then each kernel's bytes.

Invariants: nothing of the file is unpickled, placed or run unless its MAC verifies
under this job's secret and its header matches this process's torch, Triton, device
and config; anything else is refused with one warning and the process compiles from
scratch. The file is replaced atomically (tmp + rename): a reader sees a whole file
or the previous one. A placed kernel never replaces a file inductor already has.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import json
import logging
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.store.derived_keys import derive_key

__all__ = ["CACHE_FILE", "cache_key", "identity", "load_compile_cache", "save_compile_cache"]

logger = logging.getLogger(__name__)

CACHE_FILE = "compile_cache"
"""The job's compile cache, in the run directory (shared by every node, as the run directory is)."""
MAGIC = b"UBCOMP1\0"
FORMAT = 1
_MAC_LEN = 32
_KERNEL = re.compile(r"[A-Za-z0-9_]+/[A-Za-z0-9_.]+\.so")
"""A kernel's path relative to inductor's cache directory (``xy/c<key>[.main].so``): nothing else is placed."""
TRITON_PACKAGES = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


class CacheRefused(ValueError):
    """The file is not this job's cache for this process (the message says why)."""


def cache_key(secret: str) -> bytes:
    """The key of the cache file's MAC, derived from the job's secret (never the secret itself)."""
    return derive_key(secret, b"unbroken-compile-cache")


def identity(device: torch.device) -> dict[str, str | None]:
    """What a compiled artifact depends on besides the code: torch, Triton and the device."""
    triton = None
    for package in TRITON_PACKAGES:  # read from the install's metadata: importing Triton is slow
        try:
            triton = f"{package} {importlib.metadata.version(package)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:  # a kernel built for AVX-512 must not reach a CPU without it
        name = f"{device.type} {torch.backends.cpu.get_cpu_capability()}"
    return {"torch": torch.__version__, "triton": triton, "device": name}


def save_compile_cache(path: Path, *, secret: str, config_hash: str, device: torch.device,
                       writer: dict[str, Any]) -> dict[str, Any] | None:
    """Write what this process compiled to ``path`` (atomically); returns what was written, None if nothing was.

    ``writer`` (who wrote it: worker, pid, step) goes into the header as it is.

    Raises:
        OSError: the file could not be written (no partial file is left).
    """
    t0 = time.perf_counter()
    got = torch.compiler.save_cache_artifacts()
    if got is None:
        return None
    mega, info = got
    kernels = _mapped_kernels()
    header = {"format": FORMAT, **identity(device), "config_hash": config_hash, "megacache": len(mega),
              "kernels": [[rel, len(data)] for rel, data in kernels], "writer": writer}
    head = json.dumps(header, sort_keys=True).encode()
    lead = MAGIC + struct.pack("<I", len(head)) + head
    payload = [mega, *(data for _, data in kernels)]
    mac = hmac.new(cache_key(secret), lead, hashlib.sha256)
    for part in payload:
        mac.update(part)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            for part in (lead, mac.digest(), *payload):
                fh.write(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    size = len(lead) + _MAC_LEN + sum(len(p) for p in payload)
    return {"bytes": size, "artifacts": _counts(info), "kernels": len(kernels),
            "seconds": round(time.perf_counter() - t0, 3)}


def load_compile_cache(path: Path, *, secret: str, config_hash: str, device: torch.device) -> dict[str, Any]:
    """Load the job's cache at ``path`` into this process's compile caches, if it is one for this process.

    Returns ``{"loaded": True, "artifacts": {kind: n}, "kernels": n, "bytes": n, "seconds": s}``, or
    ``{"loaded": False, "why": ...}`` (``why`` is ``"absent"`` when there is no file yet; any other refusal
    is also logged once as a warning).
    """
    t0 = time.perf_counter()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {"loaded": False, "why": "absent"}
    except OSError as exc:
        return _refused(path, f"unreadable: {exc}")
    try:
        header, mega, kernels = _open(raw, secret, config_hash, device)
    except CacheRefused as exc:
        return _refused(path, str(exc))
    try:
        info = torch.compiler.load_cache_artifacts(mega)
    except Exception as exc:  # sealed by this job, yet torch cannot read it: compile, and say so
        return _refused(path, f"torch could not load it: {type(exc).__name__}: {exc}")
    if info is None:
        return _refused(path, "torch could not load it (see its warning above)")
    placed = _place(kernels)
    return {"loaded": True, "artifacts": _counts(info), "kernels": placed, "bytes": len(raw),
            "writer": header.get("writer"), "seconds": round(time.perf_counter() - t0, 3)}


def _open(raw: bytes, secret: str, config_hash: str,
          device: torch.device) -> tuple[dict[str, Any], bytes, list[tuple[str, bytes]]]:
    """Header, Mega-Cache bytes and kernels of a file whose MAC and header check out.

    Raises:
        CacheRefused: not this format, a bad MAC, or written for another torch, Triton, device or config.
    """
    if raw[:len(MAGIC)] != MAGIC or len(raw) < len(MAGIC) + 4:
        raise CacheRefused("not a compile cache of unbroken")
    n = struct.unpack_from("<I", raw, len(MAGIC))[0]
    at = len(MAGIC) + 4 + n
    if len(raw) < at + _MAC_LEN:
        raise CacheRefused("truncated")
    mac = raw[at:at + _MAC_LEN]
    want = hmac.new(cache_key(secret), raw[:at], hashlib.sha256)
    want.update(raw[at + _MAC_LEN:])
    if not hmac.compare_digest(mac, want.digest()):
        raise CacheRefused("not sealed with this job's secret")
    try:
        header = json.loads(raw[len(MAGIC) + 4:at])
        sizes = [int(header["megacache"]), *(int(size) for _, size in header["kernels"])]
        names = [str(rel) for rel, _ in header["kernels"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise CacheRefused(f"its header does not parse ({exc})") from None
    if header.get("format") != FORMAT:
        raise CacheRefused(f"format {header.get('format')!r}, expected {FORMAT}")
    here = {**identity(device), "config_hash": config_hash}
    differ = [f"{k} {header.get(k)!r} (here {v!r})" for k, v in here.items() if header.get(k) != v]
    if differ:
        raise CacheRefused("written for another " + ", ".join(differ))
    body = raw[at + _MAC_LEN:]
    if sum(sizes) != len(body) or any(s < 0 for s in sizes):
        raise CacheRefused("its parts do not add up to its length")
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    parts = [body[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
    return header, parts[0], list(zip(names, parts[1:]))


def _refused(path: Path, why: str) -> dict[str, Any]:
    logger.warning("compile cache %s ignored (%s): compiling from scratch", path, why)
    return {"loaded": False, "why": why}


def _counts(info: Any) -> dict[str, int]:
    """Artifacts per kind of torch's ``CacheInfo`` (a dict of kinds; one list per kind in older torch)."""
    kinds = getattr(info, "artifacts", None)
    if isinstance(kinds, dict):
        return {kind: len(keys) for kind, keys in kinds.items()}
    lists = {name.removesuffix("_artifacts"): getattr(info, name, None) for name in dir(info)
             if name.endswith("_artifacts")}
    return {kind: len(keys) for kind, keys in lists.items() if isinstance(keys, list) and keys}


def _inductor_dir() -> Path:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # older torch
        from torch._inductor.codecache import cache_dir  # type: ignore[attr-defined,no-redef]
    return Path(cache_dir())


def _mapped_kernels() -> list[tuple[str, bytes]]:
    """The kernel libraries this process has mapped from inductor's cache directory (the CPU's; a GPU's
    Triton kernels travel inside the Mega-Cache), by path relative to it."""
    root = _inductor_dir()
    roots = (root, root.resolve())  # the maps name the resolved path
    found: dict[str, bytes] = {}
    try:
        with open("/proc/self/maps") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue  # anonymous memory
        where = Path(fields[5])
        rel = next((where.relative_to(r).as_posix() for r in roots if where.is_relative_to(r)), None)
        if rel is None or rel in found or not _KERNEL.fullmatch(rel):
            continue
        try:
            found[rel] = where.read_bytes()
        except OSError:
            continue  # removed since it was mapped: a reader builds it
    return sorted(found.items())


def _place(kernels: list[tuple[str, bytes]]) -> int:
    """Put each kernel where inductor looks for it, unless a file is already there; returns how many were put."""
    root = _inductor_dir()
    placed = 0
    for rel, data in kernels:
        if not _KERNEL.fullmatch(rel) or ".." in rel:
            continue
        dest = root / rel
        if dest.exists():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
        placed += 1
    return placed
