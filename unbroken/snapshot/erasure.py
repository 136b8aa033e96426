"""Erasure coding of snapshot stripes: Reed-Solomon through pyeclib (ISA-L), or plain pieces.

A stripe (a byte range of the flat state) becomes ``k + m`` fragments; any
``k`` of them give the stripe back. With ``m > 0`` the fragments are
pyeclib's (``isa_l_rs_vand``: ISA-L's Vandermonde Reed-Solomon; each fragment
carries liberasurecode's header); with ``m = 0`` they are the stripe cut in
``k`` equal pieces (the last one padded), which is what ``none`` and
``replica`` redundancy store.

Every data-parallel worker holds the whole replicated state, so each node
encodes its own fragments from its own replica: no byte crosses the network
to protect a snapshot.
"""

from __future__ import annotations

import functools

__all__ = ["EC_TYPE", "Coding", "ErasureError"]

EC_TYPE = "isa_l_rs_vand"
"""pyeclib backend: ISA-L Reed-Solomon (Vandermonde), bundled with the pyeclib wheel."""


class ErasureError(RuntimeError):
    """A stripe could not be encoded or rebuilt (too few fragments, or a backend failure)."""


@functools.lru_cache(maxsize=32)
def _driver(k: int, m: int):  # noqa: ANN202 - pyeclib's ECDriver
    from pyeclib.ec_iface import ECDriver  # local: importing unbroken.snapshot stays light

    return ECDriver(k=k, m=m, ec_type=EC_TYPE)


class Coding:
    """``k`` data fragments and ``m`` parity fragments per stripe.

    Raises:
        ValueError: ``k < 1`` or ``m < 0``.
    """

    def __init__(self, k: int, m: int) -> None:
        if k < 1 or m < 0:
            raise ValueError(f"erasure coding needs k >= 1 and m >= 0, got k={k}, m={m}")
        self.k, self.m = k, m

    @property
    def n(self) -> int:
        return self.k + self.m

    def encode(self, stripe: bytes | memoryview, which: list[int]) -> dict[int, bytes]:
        """The fragments ``which`` of ``stripe`` (indices in ``0..n-1``)."""
        if self.m == 0:
            size = -(-len(stripe) // self.k) if len(stripe) else 0
            return {i: bytes(stripe[i * size:(i + 1) * size]).ljust(size, b"\0") for i in which}
        try:
            frags = _driver(self.k, self.m).encode(bytes(stripe))
        except Exception as exc:  # pyeclib raises its own ECDriverError family
            raise ErasureError(f"encoding a {len(stripe)}-byte stripe with k={self.k}, m={self.m} failed: {exc}") from exc
        return {i: frags[i] for i in which}

    def decode(self, fragments: dict[int, bytes | memoryview], length: int) -> bytes:
        """The stripe of ``length`` bytes from at least ``k`` of its fragments.

        Raises:
            ErasureError: fewer than ``k`` fragments, or the backend could not rebuild.
        """
        if len(fragments) < self.k:
            raise ErasureError(f"a stripe needs {self.k} of its {self.n} fragments, only "
                               f"{sorted(fragments)} survive")
        if self.m == 0:
            return b"".join(bytes(fragments[i]) for i in range(self.k))[:length]
        chosen = sorted(fragments)[:self.k] if all(i in fragments for i in range(self.k)) else sorted(fragments)
        try:
            out = _driver(self.k, self.m).decode([bytes(fragments[i]) for i in chosen])
        except Exception as exc:
            raise ErasureError(f"rebuilding a stripe from fragments {chosen} failed: {exc}") from exc
        if len(out) != length:
            raise ErasureError(f"rebuilt stripe has {len(out)} bytes, expected {length}")
        return out
