"""Per-slot gradient sums and the aggregation rule shared by simulator and runtime.

A worker is handed a list of :class:`SlotWork` items: "rows ``[a, b)`` of slot
``k``'s micro-batch of this step, in mode ``exact`` or ``approx``". It computes
their gradients into one flat buffer of **sums**, plus, per parameter group, the
**weight** (in slot-equivalents, ``rows / micro_batch``) that contributed to that
group. Buffers from all workers are summed (all-reduce, or plain addition in the
single-process simulator) and each group's gradient is ``sum / weight``.

Invariants:
- a slot computed exactly adds ``rows / micro_batch`` to every group's weight;
- a slot computed in ``approx`` mode adds nothing to groups the approximation
  leaves without gradient (attention), and ``rows / micro_batch`` to the others;
- with no failure every group's weight is ``n`` and the result is the mean of
  the per-slot gradients: plain data-parallel training on the global batch.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F

from unbroken.mecefo.adapter import ModelAdapter
from unbroken.models.hf_llama import logits_of
from unbroken.models.precision import autocast
from unbroken.state.parts import laid_out_as, local_of

logger = logging.getLogger(__name__)

_ADMIT, _STOP = 1, 2
"""The bits of a reduction buffer's leader's word (:meth:`GradLayout.write_word`)."""
_NONFINITE = 4
"""What a worker adds to the word when its own sums are not finite (:meth:`GradLayout.count_nonfinite`)."""

Mode = Literal["exact", "approx"]
BatchFn = Callable[[int, int, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``loss_fn(logits_BTV, y_BT)``: the summed token cross-entropy (a float32 scalar)."""
"""``batch_fn(step, slot, (a, b)) -> (x_BT, y_BT)``."""
ScalarsDone = Callable[[torch.Tensor], Callable[[], object] | None]
"""``scalars_done(buf)``: the buffer's scalars are final (its gradients not yet); may start work on them and
return what waits for that work (called before the buffer is returned)."""


@dataclass(frozen=True)
class SlotWork:
    """Rows ``[rows[0], rows[1])`` of slot ``slot``'s micro-batch, in ``mode``."""

    slot: int
    rows: tuple[int, int]
    mode: Mode = "exact"

    @property
    def n_rows(self) -> int:
        return self.rows[1] - self.rows[0]


def slot_rows(items: Sequence[SlotWork]) -> list[list[object]]:
    """Items as ``[slot, first_row, end_row, mode]`` rows: the format of the ledger, the exchange and the metrics."""
    return [[i.slot, *i.rows, i.mode] for i in items]


class GradLayout:
    """Where each trainable parameter's gradient sits in the flat buffer.

    The buffer is ``[grads..., weight per group..., votes..., timings..., checksums..., admit, loss_sum,
    token_count]``,
    all float32, so one all-reduce carries everything a step needs. ``votes``
    slots (none unless asked) carry small non-negative counts every worker adds
    to (:mod:`unbroken.snapshot.cadence`: the snapshot interval's proposals);
    ``timings`` (one per worker, none unless asked) each worker's compute seconds per
    row in its own, 0 in the others' (:mod:`unbroken.runtime.stragglers`);
    ``checksums`` (one per worker, none unless asked) each worker's checksum of its
    parameters in its own, 0 in the others' (:mod:`unbroken.runtime.param_check`);
    ``admit`` is the view leader's word (:mod:`unbroken.runtime.view_changes`):
    1 if the boundary after the step admits joiners, plus 2 if the job stops
    after the step (a preemption's); every other member adds 0, so every member
    that holds the reduced buffer reads the same word (small integers sum
    exactly in float32). In an attempt that retries a non-finite step every
    member whose own sums are not finite adds 4 more (:mod:`unbroken.runtime.nonfinite`).
    """

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter, *, votes: int = 0, timings: int = 0,
                 checksums: int = 0) -> None:
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        self.groups: list[int] = []
        self.offsets: list[int] = []
        offset = 0
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            self.names.append(name)
            self.params.append(p)
            self.groups.append(adapter.group_of(name))
            self.offsets.append(offset)
            offset += local_of(p).numel()
        self.group_names = adapter.group_names
        self.n_grad = offset
        self.n_votes = votes
        self.n_timings = timings
        self.n_checksums = checksums
        self.size = offset + len(self.group_names) + votes + timings + checksums + 3
        self._host: tuple[weakref.ref, int, torch.Tensor] | None = None  # (buffer, version, its scalars on the host)
        self.copied: set[int] = set()
        """Parameters whose gradient autograd kept apart from the buffer (:meth:`replaced`)."""
        self.copied_bytes = 0
        """Bytes of those gradients: copied into the buffer every step (0 when every gradient is a view)."""

    def new_buffer(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32, device=device)

    def weights(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.n_grad : self.n_grad + len(self.group_names)]

    def votes(self, buf: torch.Tensor) -> torch.Tensor:
        at = self.n_grad + len(self.group_names)
        return buf[at : at + self.n_votes]

    def scalars(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf``'s weights, votes, loss sum and token count: the host copy :func:`apply_step` made of them
        (no wait for the device) when it is of this very buffer, else a view of ``buf``."""
        if self._host is not None and self._host[0]() is buf and self._host[1] == buf._version:
            return self._host[2]
        return buf[self.n_grad :]

    def host_votes(self, buf: torch.Tensor) -> torch.Tensor:
        at = len(self.group_names)
        return self.scalars(buf)[at : at + self.n_votes]

    def timings(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf``'s timings (a view; empty unless asked): worker ``w``'s seconds per row at ``w``."""
        at = self.n_grad + len(self.group_names) + self.n_votes
        return buf[at : at + self.n_timings]

    def host_timings(self, buf: torch.Tensor) -> list[float]:
        """Reduced ``buf``'s timings, from the host copy of its scalars (:meth:`scalars`)."""
        at = len(self.group_names) + self.n_votes
        return self.scalars(buf)[at : at + self.n_timings].tolist()

    def checksums(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf``'s parameter checksums (a view; empty unless asked): worker ``w``'s at ``w``."""
        at = self.n_grad + len(self.group_names) + self.n_votes + self.n_timings
        return buf[at : at + self.n_checksums]

    def word(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf``'s leader's word (one element, a view): written by every member before the reduction."""
        at = self.n_grad + len(self.group_names) + self.n_votes + self.n_timings + self.n_checksums
        return buf[at : at + 1]

    def write_word(self, buf: torch.Tensor, *, admit: bool, stop: bool) -> None:
        """Before the reduction: the view's leader says whether the boundary after the step admits joiners and
        whether the job stops after the step (every other member writes both False)."""
        self.word(buf).fill_(float(_ADMIT * admit + _STOP * stop))

    def admitted(self, buf: torch.Tensor) -> bool:
        """Whether reduced ``buf`` says the boundary after its step admits joiners (read from the host copy
        :func:`apply_step` made, when it is of ``buf``)."""
        return bool(round(float(self.scalars(buf)[-3])) & _ADMIT)

    def stopping(self, buf: torch.Tensor) -> bool:
        """Whether reduced ``buf`` says the job stops after its step (read before the step is applied)."""
        return bool(round(float(self.scalars(buf)[-3])) & _STOP)

    def count_nonfinite(self, buf: torch.Tensor) -> None:
        """Before the reduction, after :meth:`write_word`: this worker's own sums are not finite (counted)."""
        self.word(buf).add_(_NONFINITE)

    def nonfinite_count(self, buf: torch.Tensor) -> int:
        """How many members of reduced ``buf`` counted their own sums not finite (:meth:`count_nonfinite`)."""
        return round(float(self.scalars(buf)[-3])) // _NONFINITE

    def loss_sum(self, buf: torch.Tensor) -> float:
        return float(self.scalars(buf)[-2])

    def token_count(self, buf: torch.Tensor) -> float:
        return float(self.scalars(buf)[-1])

    def grad_view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s gradient in ``buf``: its local shard's, for a parameter sharded by FSDP2."""
        local = local_of(self.params[i])
        return buf[self.offsets[i] : self.offsets[i] + local.numel()].view_as(local)

    @property
    def views_possible(self) -> bool:
        """Gradients can be views of the buffer: every parameter is a plain tensor (FSDP2's sharded ones get
        gradients of their own, reduce-scattered into their shards, and are copied in)."""
        return not any(local_of(p) is not p for p in self.params)

    def grads_as_views(self, buf: torch.Tensor) -> None:
        """Make each parameter's ``.grad`` its view of ``buf`` (zeroed): backward accumulates into the buffer."""
        for i, p in enumerate(self.params):
            p.grad = self.grad_view(buf, i)

    def replaced(self, i: int) -> None:
        """Autograd replaced parameter ``i``'s view by a tensor of its own (a gradient of another layout): its
        gradient is copied in, every step; said once, and counted (:attr:`copied_bytes`)."""
        if i not in self.copied:
            self.copied.add(i)
            self.copied_bytes += 4 * local_of(self.params[i]).numel()
            logger.warning("the gradient of %s is not a view of the reduction buffer (autograd replaced it): it "
                           "is copied in every step (%d bytes)", self.names[i], 4 * local_of(self.params[i]).numel())

    def set_grad(self, i: int, grad: torch.Tensor | None) -> None:
        """Make ``grad`` (a plain tensor shaped as :meth:`grad_view`) parameter ``i``'s gradient: as the
        local shard of a DTensor gradient laid out as the parameter, for a parameter sharded by FSDP2."""
        p = self.params[i]
        p.grad = laid_out_as(p, grad) if grad is not None else None


def compute_gradient_sums(
    model: torch.nn.Module,
    adapter: ModelAdapter,
    layout: GradLayout,
    work: Sequence[SlotWork],
    *,
    step: int,
    micro_batch: int,
    batch_fn: BatchFn,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    loss_fn: LossFn | None = None,
    scalars_done: ScalarsDone | None = None,
) -> torch.Tensor:
    """Compute the gradient sums of ``work`` for ``step`` into a fresh flat buffer.

    Each item's loss is the token-mean cross-entropy over a full micro-batch,
    restricted to the item's rows, so an item of ``rows`` rows carries weight
    ``rows / micro_batch`` of one slot. Each parameter's ``.grad`` is its view of
    the buffer (:meth:`GradLayout.grads_as_views`, as DDP's
    ``gradient_as_bucket_view``): autograd accumulates into the buffer itself,
    nothing is copied and no second gradient-sized tensor exists; a parameter
    whose ``.grad`` autograd replaced anyway, or one sharded by FSDP2 (its own
    gradients), is copied in.
    With ``precision="bf16"`` the forward runs under bfloat16 autocast; the
    loss, the gradients and the buffer stay float32
    (:mod:`unbroken.models.precision`). ``loss_fn`` (default
    :func:`token_loss_sum`) may be a compiled version of it. Nothing here waits
    for the device: the loss is summed on it. ``scalars_done`` runs once the
    buffer's scalars (loss, tokens, weights) are final: after the last item's
    forward pass, before its backward (HSDP sums them over the replica
    meanwhile); what it returns is called before the buffer is returned.
    """
    for p in layout.params:
        p.grad = None  # before the new buffer: the last step's gradients (views of its buffer) are freed first
    views = layout.views_possible
    buf = (torch.zeros if views else torch.empty)(layout.size, dtype=torch.float32, device=device)
    if views:
        layout.grads_as_views(buf)  # autograd accumulates into the zeroed buffer from the first backward on
    else:
        buf[layout.n_grad :].zero_()  # the gradients are copied in whole below: only the scalars start at zero
    weights = layout.weights(buf)
    loss_fn = loss_fn or token_loss_sum
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # as a Python float would sum
    tokens = 0
    waiting = None
    for k, item in enumerate(work):
        if not 0 <= item.rows[0] < item.rows[1] <= micro_batch:
            raise ValueError(f"rows {item.rows} outside micro-batch of {micro_batch} rows")
        x, y = batch_fn(step, item.slot, item.rows)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with adapter.mode(item.mode, step=step):
            with autocast(torch.device(device), precision):
                loss_tok = loss_fn(logits_of(model(x)), y)
            loss_sum += loss_tok.detach()
            tokens += y.numel()
            share = item.n_rows / micro_batch
            for g, name in enumerate(layout.group_names):
                if item.mode == "exact" or not adapter.dropped_in_approx(name):
                    weights[g] += share
            if k == len(work) - 1:
                waiting = _scalars_final(buf, loss_sum, tokens, scalars_done)
            (loss_tok / (micro_batch * y.size(1))).backward()
    if not work:
        waiting = _scalars_final(buf, loss_sum, tokens, scalars_done)
    into, grads = [], []
    for i, p in enumerate(layout.params):
        view = layout.grad_view(buf, i)
        if views and p.grad is not None and p.grad.data_ptr() == view.data_ptr():
            continue  # accumulated in place: already the buffer
        if p.grad is not None:
            into.append(view)
            grads.append(local_of(p.grad))
            if views:
                layout.replaced(i)
            p.grad = None
        elif not views:
            view.zero_()  # no item reached it (a frozen path, an approximated group)
    if into:
        torch._foreach_copy_(into, grads)  # one launch for every tensor on a GPU
    del grads
    if waiting is not None:
        waiting()
    return buf


def _scalars_final(buf: torch.Tensor, loss_sum: torch.Tensor, tokens: int,
                   scalars_done: ScalarsDone | None) -> Callable[[], object] | None:
    buf[-2] = loss_sum
    buf[-1] = tokens
    return scalars_done(buf) if scalars_done is not None else None


def token_loss_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed float32 cross-entropy of ``logits`` (B, T, V) against ``y`` (B, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum")


def apply_step(
    layout: GradLayout, buf: torch.Tensor, optimizer: torch.optim.Optimizer, *, lr: float | None, grad_clip: float
) -> float:
    """Apply one reduced step: gradients from ``buf``, clip, set lr (None: the optimizer keeps its own), optimizer
    step.

    A fused torch optimizer given a buffer whose groups share one weight divides and clips inside its
    kernel (:func:`_step_scaled`); otherwise each group's sum is divided into new tensors and clipped
    with ``clip_grad_norm_`` first (bit for bit the single-process reference's order on the CPU).

    Returns:
        The global gradient norm before clipping.
    """
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if _scales_gradients(optimizer, layout):
        norm_of_mean = _step_scaled(layout, buf, optimizer, max_norm)
        if norm_of_mean is not None:
            return norm_of_mean
    cuda = buf.is_cuda
    if cuda:
        _apply_reduced_queued(layout, buf)
    else:
        apply_reduced(layout, buf)
    params = [p for p in layout.params if p.grad is not None]
    # foreach on a GPU (one kernel launch per tensor list, not per tensor); on CPU the per-tensor order
    # stays the one every worker and the single-process reference use
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=bool(params) and cuda)
    if not cuda:  # (under HSDP a DTensor: its float() is the collective that totals it)
        optimizer.step()
        return float(norm)
    norm_host = _to_host(norm)  # queued before the optimizer step: reading it waits for the clip, not the step
    optimizer.step()
    return float(norm_host())


def _to_host(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Copy ``t`` to the host, queued now behind the work before it on a GPU (pinned memory, no wait);
    returns what waits for the copy and gives it."""
    cuda = t.is_cuda
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
    host.copy_(t, non_blocking=cuda)
    if not cuda:
        return lambda: host
    landed = torch.cuda.Event()
    landed.record()

    def wait() -> torch.Tensor:
        landed.synchronize()
        return host

    return wait


def _scales_gradients(optimizer: torch.optim.Optimizer, layout: GradLayout) -> bool:
    """Whether ``optimizer`` divides each gradient by a scale inside its own kernel (torch's fused
    Adam, AdamW and SGD read ``optimizer.grad_scale``, as :class:`torch.amp.GradScaler` sets it), for
    plain tensors (not FSDP2's DTensors)."""
    return (isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))
            and all(g.get("fused") for g in optimizer.param_groups)
            and not any(local_of(p) is not p for p in layout.params))


def _step_scaled(layout: GradLayout, buf: torch.Tensor, optimizer: torch.optim.Optimizer,
                 max_norm: float) -> float | None:
    """The optimizer step of a reduced buffer whose groups all have one weight ``w`` (every step
    without an approximated slot), in one pass over the gradients: each parameter's gradient is its
    sum in ``buf`` itself, and the fused kernel divides it by ``w / clip`` (``clip`` as
    ``clip_grad_norm_`` computes it, from the norm of the sums over ``w``) as it reads it. The
    division into new tensors and the clip's multiplication are not made. Nothing waits for the
    device but the scalars' copy (queued, with the norm, before the wait) and, after the step is
    queued, the norm's. Returns the norm of the mean gradient, or None (nothing done) when the
    groups' weights differ or are zero: each group is then divided by its own."""
    scalars = _to_host(buf[layout.n_grad :])
    views = [layout.grad_view(buf, i) for i in range(len(layout.params))]
    total = torch.nn.utils.get_total_norm(views, 2.0, foreach=buf.is_cuda)  # of the sums
    host = scalars()
    weights = host[: len(layout.group_names)].tolist()
    w = weights[0] if weights else 0.0
    if not w > 0 or any(x != w for x in weights):
        return None
    for i, view in enumerate(views):
        layout.set_grad(i, view)
    norm = total / w
    clip = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s coefficient
    norm_host = _to_host(norm)
    optimizer.grad_scale = w / clip  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
    # the kernel wrote the quotients back into buf's gradients; its scalars are untouched and on the host
    layout._host = (weakref.ref(buf), buf._version, host)
    return float(norm_host())


def _apply_reduced_queued(layout: GradLayout, buf: torch.Tensor) -> None:
    """:func:`apply_reduced` on a CUDA device without idling it: the scalars' copy to the host and every
    division (by the weight on the device) are queued before the host waits for the reduction; a group of
    zero weight then drops its (discarded) quotients. The scalars stay on the host for the step's loss and
    votes (:meth:`GradLayout.scalars`)."""
    scalars = _to_host(buf[layout.n_grad :])
    weights_dev = layout.weights(buf)
    quotients = [layout.grad_view(buf, i) / weights_dev[layout.groups[i]] for i in range(len(layout.params))]
    host = scalars()
    layout._host = (weakref.ref(buf), buf._version, host)
    weights = host[: len(layout.group_names)].tolist()
    for i in range(len(layout.params)):
        layout.set_grad(i, quotients[i] if weights[layout.groups[i]] > 0 else None)


def apply_reduced(layout: GradLayout, buf: torch.Tensor) -> None:
    """Turn a reduced buffer into ``.grad`` of each parameter (``sum / weight``).

    A group with zero weight (no slot computed it) gets ``grad = None`` so the
    optimizer leaves it untouched this step.
    """
    weights = layout.weights(buf).tolist()  # one read of the device, not one per parameter
    for i in range(len(layout.params)):
        w = weights[layout.groups[i]]
        layout.set_grad(i, layout.grad_view(buf, i) / w if w > 0 else None)  # the division makes a new tensor
