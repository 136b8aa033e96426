"""A launch's namespace on etcd: the job's sealed pointer to its current launch, and the launch's keys cleared.

Every launch of a job keeps its keys under ``PREFIX/<namespace>/<launch>/``
(:class:`~unbroken.store.etcd_backend.EtcdBackend`); the job's pointer,
``PREFIX/<namespace>/launch``, names the current launch and who the job is
(its run directory), sealed with a key of the secret alone, so a process that
starts finds its launch and a later job whose secret maps to the same
namespace is refused, naming the job that holds it.

Invariant: the pointer is changed only by a transaction guarded by its revision, and removed only while it
still points at the launch that clears its keys.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Protocol

from unbroken.store.backend import SECRET_ENV
from unbroken.store.seal import Sealer, pointer_key

__all__ = ["clear_launch", "point_here", "range_end", "read_pointer"]


class EtcdBackend(Protocol):
    """What this module uses of :class:`~unbroken.store.etcd_backend.EtcdBackend` (which imports it)."""

    addr: str
    secret: str
    root: str
    ns: str
    launch: str
    kvs: dict[str, dict[str, Any]]

    @property
    def revision(self) -> int: ...
    def call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]: ...
    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]]]: ...
    def txn_rev(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                 failure: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]], str]: ...


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def range_end(prefix: str) -> str:
    """etcd's range end of every key under ``prefix`` (base64)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # prefixes end with "/" or "\x00": never 0xff
    return _b64(bytes(raw))


def clear_launch(backend: EtcdBackend) -> int:
    """Delete every key of ``backend``'s launch, and the job's pointer if it still points there (the job is
    over); returns how many keys went."""
    backend.kvs.clear()
    out = backend.call("kv/deleterange", {"key": _b64(backend.ns), "range_end": range_end(backend.ns)})
    pointer, kv = read_pointer(backend)
    if pointer is not None and pointer.get("launch") == backend.launch:
        guard = {"key": _b64(backend.root + "launch"), "target": "MOD", "result": "EQUAL",
                 "mod_revision": kv["mod_revision"]}  # type: ignore[index]
        backend.txn([guard], [{"request_delete_range": {"key": _b64(backend.root + "launch")}}], [])
    return int(out.get("deleted", 0))


def read_pointer(backend: EtcdBackend) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The job's pointer to its current launch (``PREFIX/<namespace>/launch``: the launch id and who the job
    is, sealed with a key of the secret alone) if authentic, and its kv."""
    out = backend.call("kv/range", {"key": _b64(backend.root + "launch")})
    kv = (out.get("kvs") or [None])[0]
    raw = None if kv is None else Sealer(pointer_key(backend.secret)).open(
        "launch", base64.b64decode(kv.get("value") or ""), int(kv.get("version", 0)),
        int(kv.get("create_revision", 0)))
    return (json.loads(raw) if raw else None), kv


def point_here(backend: EtcdBackend, job: dict[str, Any]) -> None:
    """Point the job at ``backend``'s launch (guarded by the pointer's revision, retried on a race).

    Raises:
        ValueError: the pointer names another job (another run directory) under the same namespace.
    """
    while True:
        current, kv = read_pointer(backend)
        if current is not None and current.get("job", {}).get("run_dir") != job.get("run_dir"):
            raise ValueError(
                f"store {backend.addr}: the prefix {backend.root} already holds the keys of another job "
                f"({json.dumps(current.get('job'), sort_keys=True)}); give this job its own secret ({SECRET_ENV}) "
                f"or prefix (etcd://.../PREFIX), or remove the old keys once that job is over: etcdctl del "
                f"--prefix {backend.root}")
        key = _b64(backend.root + "launch")
        version = int(kv["version"]) + 1 if kv else 1
        guard = ({"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"} if kv is None else
                 {"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]})
        created = int(kv["create_revision"]) if kv else backend.revision + 1
        sealed = Sealer(pointer_key(backend.secret)).seal(
            "launch", json.dumps({"launch": backend.launch, "job": job}), version, created)
        ok, _, revision = backend.txn_rev([guard], [{"request_put": {"key": key, "value": _b64(sealed)}}], [])
        if ok and (kv is not None or int(revision) == created):
            return  # else a create sealed for a revision another write took: written again at version 2
