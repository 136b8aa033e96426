"""Gray failures a worker inflicts on itself: slow compute, a flipped bit, a NaN.

Installed by the worker's entry point with its other phase faults
(:class:`~unbroken.faults.injector.PhaseFaults`) on the step protocol's hook
points, from outside the runtime:

* ``slow:factor=F``: at ``forward`` the hook notes the time; at ``backward``
  it sleeps ``F - 1`` times the compute time it measured, so this process's
  compute takes ``F`` times as long, for the steps ``step .. step + for - 1``
  (to the end without ``for=``); on a GPU the device is synchronized at both
  points, so the time is the device's. A retried step's extra compute is
  stretched too. It ends with the process: a new incarnation does not carry it on
  (:meth:`~unbroken.faults.injector.NodeFaults.worker_faults` drops it).
* ``bitflip:target=grad``: after the backward pass of ``step``, one bit of
  one element of this worker's local gradient is flipped (the parameters'
  ``.grad``, views of the buffer it all-reduces; under HSDP, whose gradient
  shards are copied into that buffer and dropped, the buffer's slice of each
  parameter's local shard, through ``sums``); ``target=param``: before
  the forward pass of ``step``, of one of its parameters (one such spec per
  forward pass: given twice, it flips the parameters of the step's first two
  computations, the second after the first was repaired:
  :mod:`unbroken.runtime.param_check`).
* ``nan``: after the backward pass of ``step``, one element of this worker's
  local gradient is set to NaN. One ``nan`` spec fires per backward pass: the
  same spec given twice makes the step's first two computations on this worker
  non-finite (the step is done again once a reduction is found not finite:
  :mod:`unbroken.runtime.nonfinite`), three times the first three.

Which element and which bit are drawn from a generator seeded by the spec's
text: the same spec hits the same element of the same model every time. The
bit is one of the exponent's, the kind of flip that changes a value by orders
of magnitude. Each fault writes one event ``fault_injected`` (``by``:
``worker``) naming the spec, the parameter, the element's flat index, the bit
and the values before and after (for ``slow``: at its first slowed step).

Nothing here detects or undoes anything: the job trains through a slow
worker and applies a wrong gradient as it would any other; a non-finite one is
caught by the step's agreement (:mod:`unbroken.runtime.nonfinite`).
"""

from __future__ import annotations

import logging
import random
import time
import zlib
from typing import Any, Callable

import torch

from unbroken.faults.fail_at import GRAY, FaultSpec, format_fail_at

__all__ = ["GrayFaults", "is_gray"]

logger = logging.getLogger(__name__)

_EXPONENT_BITS = {torch.float32: range(23, 31), torch.float64: range(52, 63), torch.bfloat16: range(7, 15),
                  torch.float16: range(10, 15)}
"""The exponent's bits of each floating dtype (bit 0 is the mantissa's lowest)."""
_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_gray(spec: FaultSpec) -> bool:
    """A slow, bit-flipping or NaN-making worker: it neither dies nor hangs."""
    return spec.how in GRAY


class GrayFaults:
    """One worker's gray failures on its model.

    Args:
        specs: this worker's gray specs.
        model: the worker's model (its parameters and their ``.grad``).
        record: called with each ``fault_injected`` event.
        clock: the time source of ``slow`` (seconds).
        sleep: how ``slow`` waits.
        sums: the flat buffer of gradient sums this worker just computed (the step protocol's ``sums`` during
            its ``backward`` hook point): where a gradient fault writes when no parameter holds a ``.grad``
            (HSDP); its first elements are the trainable parameters' local gradients, in order.
    """

    def __init__(self, specs: tuple[FaultSpec, ...], model: torch.nn.Module,
                 record: Callable[[dict[str, Any]], None], *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep,
                 sums: Callable[[], torch.Tensor | None] = lambda: None) -> None:
        self.specs, self.model, self.record = specs, model, record
        self.clock, self.sleep, self.sums = clock, sleep, sums
        self._t0: float | None = None
        self._done: set[int] = set()  # indices of specs whose event was written (each fires once)

    def install(self, on: Callable[[Any, Callable[[int], None]], None]) -> None:
        """Register the ``forward`` and ``backward`` hooks the specs need."""
        if self.specs:
            on("forward", self._forward)
            on("backward", self._backward)

    def slow_factor(self, step: int) -> float | None:
        """The factor by which compute is slowed during ``step`` (None: not slowed)."""
        for s in self.specs:
            if s.how == "slow" and s.step <= step and (s.for_steps is None or step < s.step + s.for_steps):
                return s.factor
        return None

    def _forward(self, step: int) -> None:
        for i, s in enumerate(self.specs):  # one per forward pass: the spec given twice flips two computations
            if s.how == "bitflip" and s.tensor == "param" and s.step == step and i not in self._done:
                self._flip(i, s, step)
                break
        if self.slow_factor(step) is not None:
            self._sync()  # what was queued before the step is not its compute
            self._t0 = self.clock()

    def _backward(self, step: int) -> None:
        nan = False  # one nan spec per backward pass (module docstring)
        for i, s in enumerate(self.specs):
            if s.step != step or i in self._done or (s.how == "nan" and nan):
                continue
            if s.how == "nan" or (s.how == "bitflip" and s.tensor == "grad"):
                nan = nan or s.how == "nan"
                self._flip(i, s, step)
        factor, t0 = self.slow_factor(step), self._t0
        self._t0 = None
        if factor is None or t0 is None:
            return
        self._sync()
        compute_s = self.clock() - t0
        for i, s in enumerate(self.specs):
            if s.how == "slow" and i not in self._done and s.step <= step:
                self._done.add(i)
                self._event(s, step, factor=s.factor, for_steps=s.for_steps, compute_s=compute_s)
        self.sleep((factor - 1.0) * compute_s)

    def _sync(self) -> None:
        """On a GPU the compute is done when the device says so, not when the host has queued it."""
        device = next(self.model.parameters()).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def _flip(self, i: int, spec: FaultSpec, step: int) -> None:
        """Flip one seeded bit of one seeded element (``nan``: set it to NaN) of the spec's tensor."""
        self._done.add(i)
        grad = spec.how == "nan" or spec.tensor == "grad"
        named: list[tuple[str, torch.Tensor]] = []
        for n, p in self.model.named_parameters():
            t = p.grad if grad else p
            if t is not None and t.numel() and t.dtype in _EXPONENT_BITS:
                named.append((n, _local(t).detach()))
        if grad and not named:
            named = self._in_sums()
        if not named:
            logger.warning("fault %s at step %d: this worker holds no %s to change", format_fail_at([spec]), step,
                           "gradient" if grad else "parameter")
            self._event(spec, step, applied=False)
            return
        rng = random.Random(zlib.crc32(format_fail_at([spec]).encode()))
        k = rng.randrange(sum(t.numel() for _, t in named))
        name, t = named[0]
        for name, t in named:
            if k < t.numel():
                break
            k -= t.numel()
        flat = t.view(-1)
        before = float(flat[k])
        bit = None
        with torch.no_grad():
            if spec.how == "nan":
                flat[k] = float("nan")
            else:
                bit = rng.choice(_EXPONENT_BITS[t.dtype])
                ints = flat.view(_INT_OF_SIZE[t.element_size()])
                top = 8 * t.element_size() - 1  # the sign bit: its mask is the type's smallest integer
                mask = -(1 << top) if bit == top else 1 << bit
                ints[k : k + 1].bitwise_xor_(torch.tensor([mask], dtype=ints.dtype, device=ints.device))
        after = float(flat[k])
        logger.warning("fault %s at step %d: %s[%d] %r -> %r", format_fail_at([spec]), step, name, k, before, after)
        self._event(spec, step, applied=True, tensor="grad" if grad else "param", param=name, index=k, bit=bit,
                    before=before, after=after)

    def _in_sums(self) -> list[tuple[str, torch.Tensor]]:
        """Each trainable parameter's local gradient as its slice of the sums buffer (empty without one)."""
        buf = self.sums()
        if buf is None:
            return []
        named, offset = [], 0
        for n, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            local = _local(p)
            if local.numel() and offset + local.numel() <= buf.numel():
                named.append((n, buf[offset : offset + local.numel()]))
            offset += local.numel()
        return named

    def _event(self, spec: FaultSpec, step: int, **detail: Any) -> None:
        self.record({"kind": "event", "event": "fault_injected", "by": "worker", "worker": spec.index,
                     "step": step, "spec": format_fail_at([spec]), "how": spec.how, **detail})


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
