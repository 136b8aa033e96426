"""Erasure coding of snapshot stripes: systematic Reed-Solomon through pyeclib (ISA-L).

A stripe (a byte range of the flat state) becomes ``k`` data fragments and
``m`` parity fragments; any ``k`` of them give the stripe back, whichever
were lost: the code is ISA-L's Cauchy Reed-Solomon (``isa_l_rs_cauchy``), every
square submatrix of whose generator is invertible for any ``k + m <=``
:data:`MAX_FRAGMENTS` (ISA-L's Vandermonde code, ``isa_l_rs_vand``, is not: with
``k = 11, m = 5`` it cannot rebuild from 14 of the 4,368 choices of 5 lost
fragments, with ``k = 28, m = 4`` from some choices of 4). It is
systematic, so data
fragment ``i`` *is* bytes ``[i*L, (i+1)*L)`` of the stripe (zero-padded), and
a node holding a data fragment copies those bytes straight from the state
into its snapshot memory: no coding, no staging copy. Only a node holding a
parity fragment runs the encoder; it also keeps the ``k`` 80-byte headers
liberasurecode gives the data fragments, so that a rebuild can hand pyeclib
complete fragments (header + raw bytes) when a data fragment is lost.

With ``m = 0`` (``none`` and ``replica`` redundancy) the fragments are the
stripe cut in ``k`` pieces, nothing else.

Every data-parallel worker holds the whole replicated state, so each node
codes its own fragments from its own replica: no byte crosses the network to
protect a snapshot.
"""

from __future__ import annotations

import functools

__all__ = ["EC_TYPE", "HEADER", "MAX_FRAGMENTS", "Coding", "ErasureError"]

EC_TYPE = "isa_l_rs_cauchy"
"""pyeclib backend: ISA-L Reed-Solomon (Cauchy: any ``k`` fragments decode), bundled with the pyeclib wheel."""
HEADER = 80
"""Bytes of liberasurecode's header at the front of each pyeclib fragment."""
MAX_FRAGMENTS = 256
"""The most fragments (``k + m``) ISA-L's Reed-Solomon codes a stripe into (GF(2^8)): a larger coding is refused
by the backend. A stripe's fragments are one a node of its coding group (:mod:`unbroken.snapshot.plan`)."""


class ErasureError(RuntimeError):
    """A stripe could not be encoded or rebuilt (too few fragments, or a backend failure)."""


@functools.lru_cache(maxsize=32)
def _driver(k: int, m: int):  # noqa: ANN202 - pyeclib's ECDriver
    from pyeclib.ec_iface import ECDriver  # local: importing unbroken.snapshot stays light

    return ECDriver(k=k, m=m, ec_type=EC_TYPE)


@functools.lru_cache(maxsize=8)
def _parity_copies(m: int) -> frozenset[int]:
    sample = bytes(range(256)) * 5 + b"unbroken"
    parity, _ = Coding(1, m).parity(sample, list(range(1, 1 + m)))
    return frozenset(i for i, f in parity.items()
                     if f[HEADER:HEADER + len(sample)] == sample and not any(f[HEADER + len(sample):]))


class Coding:
    """``k`` data fragments and ``m`` parity fragments per stripe.

    Raises:
        ValueError: ``k < 1`` or ``m < 0``, or (``m > 0``) ``k + m`` above :data:`MAX_FRAGMENTS`.
    """

    def __init__(self, k: int, m: int) -> None:
        if k < 1 or m < 0:
            raise ValueError(f"erasure coding needs k >= 1 and m >= 0, got k={k}, m={m}")
        if m and k + m > MAX_FRAGMENTS:
            raise ValueError(f"erasure coding into k + m = {k} + {m} fragments: {EC_TYPE} codes at most "
                             f"{MAX_FRAGMENTS}; code over fewer nodes (snapshot.group_nodes)")
        self.k, self.m = k, m

    @property
    def n(self) -> int:
        return self.k + self.m

    def chunk(self, length: int) -> int:
        """Bytes of each data fragment of a ``length``-byte stripe (the raw slice, padding included)."""
        if self.m == 0 or length == 0:
            return -(-length // self.k)
        return int(_driver(self.k, self.m).get_segment_info(length, length)["fragment_size"]) - HEADER

    def parity_copies_data(self, fragment: int) -> bool:
        """Whether parity fragment ``fragment``, past its :data:`HEADER`, is the stripe's bytes themselves: with
        one data fragment, a parity row of ones (the first, in ISA-L's codes; checked on a sample, once per
        coding), so a node holding it restores without decoding."""
        return self.k == 1 and self.m > 0 and fragment in _parity_copies(self.m)

    def parity(self, stripe: bytes | bytearray | memoryview, which: list[int]) -> tuple[dict[int, bytes], bytes]:
        """The parity fragments ``which`` (indices ``>= k``) of ``stripe`` and the k data headers (joined).

        Raises:
            ErasureError: the backend failed, or its fragments are not the size :meth:`chunk` says.
        """
        try:
            frags = _driver(self.k, self.m).encode(bytes(stripe))
        except Exception as exc:  # pyeclib raises its own ECDriverError family
            raise ErasureError(f"encoding a {len(stripe)}-byte stripe with k={self.k}, m={self.m} failed: {exc}") from exc
        if len(frags[0]) != self.chunk(len(stripe)) + HEADER:
            raise ErasureError(f"pyeclib fragment of {len(frags[0])} bytes, expected {self.chunk(len(stripe)) + HEADER}")
        return {i: frags[i] for i in which}, b"".join(f[:HEADER] for f in frags[:self.k])

    def decode(self, fragments: dict[int, bytes], length: int, headers: bytes | None = None) -> bytes:
        """The stripe of ``length`` bytes from ``k`` of its fragments (data: raw slices; parity: pyeclib's).

        ``headers``: the data fragments' headers a parity holder kept (needed only when a data fragment is lost).

        Raises:
            ErasureError: fewer than ``k`` fragments, or the backend could not rebuild.
        """
        if all(i in fragments for i in range(self.k)):
            return b"".join(bytes(fragments[i]) for i in range(self.k))[:length]
        if self.m == 0 or len(fragments) < self.k:
            raise ErasureError(f"a stripe needs {self.k} of its {self.n} fragments, only {sorted(fragments)} survive")
        if headers is None or len(headers) != self.k * HEADER:
            raise ErasureError("rebuilding from parity needs the data fragments' headers kept with the parity")
        chosen = sorted(fragments)[:self.k]
        whole = [bytes(fragments[i]) if i >= self.k else headers[i * HEADER:(i + 1) * HEADER] + bytes(fragments[i])
                 for i in chosen]
        try:
            out = _driver(self.k, self.m).decode(whole)
        except Exception as exc:
            raise ErasureError(f"rebuilding a stripe from fragments {chosen} failed: {exc}") from exc
        if len(out) != length:
            raise ErasureError(f"rebuilt stripe has {len(out)} bytes, expected {length}")
        return out
