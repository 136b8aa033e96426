"""A process group's rendezvous on etcd: a ``torch.distributed.Store`` over the job's etcd backend.

gloo and NCCL call its ``set``/``get``/``wait`` from C++; every call goes
through :class:`~unbroken.store.etcd_backend.EtcdBackend` under the group's
prefix (``pg/<g>[name]/``), so its values are sealed like every other key of
the job and the rendezvous survives the loss of an etcd member, and another
writer's delete of a rendezvous key: gloo and NCCL only ``set`` its keys, never
``add`` to them, so the backend's waiting reads read one found gone from its
etcd history (:data:`unbroken.store.etcd_history.WRITE_ONCE`).

Invariant: every key it reads or writes is under its prefix.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import torch.distributed as dist


class EtcdBackend(Protocol):
    """What this module uses of :class:`~unbroken.store.etcd_backend.EtcdBackend` (which imports it)."""

    def get(self, key: str) -> bytes: ...
    def set(self, key: str, value: str | bytes) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    def delete_key(self, key: str) -> bool: ...
    def num_keys(self) -> int: ...
    def wait_values(self, keys: list[str], timeout_s: float | None = None) -> list[bytes]: ...

__all__ = ["EtcdGroupStore"]


class EtcdGroupStore(dist.Store):
    """A ``torch.distributed.Store`` over :class:`EtcdBackend` under ``prefix``: a process group's rendezvous."""

    def __init__(self, backend: EtcdBackend, prefix: str) -> None:
        super().__init__()
        self.backend, self.prefix = backend, prefix

    def set(self, key: str, value: str | bytes) -> None:
        self.backend.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return self.backend.get(self.prefix + key)

    def add(self, key: str, amount: int) -> int:
        return self.backend.add(self.prefix + key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.backend.compare_set(self.prefix + key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.backend.check([self.prefix + k for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.backend.wait_values([self.prefix + k for k in keys],
                                  None if timeout is None else timeout.total_seconds())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.backend.multi_get([self.prefix + k for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.backend.delete_key(self.prefix + key)

    def num_keys(self) -> int:
        return self.backend.num_keys()
