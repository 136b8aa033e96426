"""unbroken.snapshot: per-step snapshots in the nodes' shared memory, erasure-coded across nodes.

- :mod:`~unbroken.snapshot.segment`: the shared-memory buffers, sealed last, every byte checksummed;
- :mod:`~unbroken.snapshot.state_bytes`: the training state as a JSON layout plus raw bytes;
- :mod:`~unbroken.snapshot.plan`: coding groups, stripes, fragments and who writes which under a view;
- :mod:`~unbroken.snapshot.erasure`: systematic Reed-Solomon through pyeclib (ISA-L);
- :mod:`~unbroken.snapshot.snapshotter`: the worker's asynchronous per-step writer;
- :mod:`~unbroken.snapshot.restore`: inventory, decision and load of the newest complete snapshot;
- :mod:`~unbroken.snapshot.capacity`: shared memory needed per node, checked before a job starts;
- :mod:`~unbroken.snapshot.protection`: each group's coder built, and what the snapshots survive said, at start.

Invariants: a snapshot is the state of exactly one step; a buffer is trusted only
under an intact seal of its own job and only for bytes that match their checksums;
the newest complete snapshot is at most one step behind the newest commit.
"""

from unbroken.snapshot.segment import SnapshotCorrupt
from unbroken.snapshot.snapshotter import Snapshotter

__all__ = ["SnapshotCorrupt", "Snapshotter"]
