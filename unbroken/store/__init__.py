"""unbroken.store: the job's coordination store, every key it holds and the backends that hold them.

- :mod:`~unbroken.store.job_store`: every coordination key, behind typed methods
  (:class:`~unbroken.store.job_store.JobStore`), with its parts
  :mod:`~unbroken.store.worker_keys` (the workers' and agents' keys) and
  :mod:`~unbroken.store.standby_keys` (the warm standby's keys);
- :mod:`~unbroken.store.view`: a membership view, as the store records it;
- :mod:`~unbroken.store.backend`: the backend interface and the embedded
  store (:mod:`~unbroken.store.server`, :mod:`~unbroken.store.client`, their
  wire format :mod:`~unbroken.store.wire` and the keys derived from the job's
  secret, :mod:`~unbroken.store.derived_keys`);
- :mod:`~unbroken.store.etcd_backend` on :mod:`~unbroken.store.etcd_client`,
  every value sealed by :mod:`~unbroken.store.seal`, a key's history read by
  :mod:`~unbroken.store.etcd_history`, the launch's namespace kept by
  :mod:`~unbroken.store.etcd_launch`, process groups' rendezvous on
  :mod:`~unbroken.store.etcd_group_store`.

It imports nothing else from the package: everything above reaches the store
through :class:`~unbroken.store.job_store.JobStore`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use (PEP 562): a process that needs one key's helper does not import the rest.
_WHERE = {
    "JobStore": "job_store", "StoreBackend": "backend", "EmbeddedBackend": "backend", "View": "view",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"unbroken.store.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'unbroken.store' has no attribute {name!r}")


__all__ = ["EmbeddedBackend", "JobStore", "StoreBackend", "View"]
