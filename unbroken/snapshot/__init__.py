"""unbroken.snapshot: per-step in-memory snapshots, erasure coding, restore (the state layer).

Not built yet: the package exports nothing. Persistent checkpoints live in
:mod:`unbroken.runtime.checkpoint` until it is.
"""

__all__: list[str] = []
