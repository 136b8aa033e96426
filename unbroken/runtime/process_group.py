"""A process group per view, with collectives that can be abandoned.

Each view ``g`` gets its own group, rendezvoused on the store the job store
hands out for it (:meth:`~unbroken.store.job_store.JobStore.group_store`,
keys ``pg/<g>/...``; gloo on CPU, NCCL on CUDA), built directly rather than through
the global default group so that groups can come and go.

Collectives are started asynchronously and polled for completion on the
device (``work.is_completed()``, never the work's future, which NCCL completes
at enqueue: :meth:`ViewGroup._poll`). Between polls the caller's ``check``
runs (failure detector, view watcher) and may raise to abandon the
collective. Building a group is watched the same way (a member that dies
while the others connect does not hold them for the whole timeout). An
abandoned group is never used again: with no operation pending it is
destroyed at once (its sockets, threads and buffer released); gloo with an
operation still blocked on a silent peer is parked until that peer is fenced
(killed), which unblocks it, and destroyed then; NCCL is aborted, from a
thread given :data:`ABORT_DEADLINE_S` (an abort that hangs makes the worker
leave and rejoin, :class:`AbortHung`). An all-reduce sums in place in the caller's tensor (the step's reduction
buffer, nothing copied); every other collective works on a buffer of its own,
never on the caller's tensor. The group holds the buffer of its last
all-reduce and the output of its last all-gather only while that operation
is pending: an abandoned operation's late write lands in the buffer the
group (or the parked group) still holds, which the caller no longer reads,
never in a later step's; once the operation completes the group lets go,
so a step's buffers die with the caller's last reference, before the next
step allocates its own (with two or more members no second gradient-sized
buffer lives through a step).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from unbroken.completion import completion_error
from unbroken.runtime.membership import Fenced

logger = logging.getLogger(__name__)

CHECK_S = 0.02
"""How often a waiting collective lets the caller's check run."""

POLL_S = 0.001
"""How often a collective on a device (NCCL) is asked whether it has finished: a query costs microseconds."""


ABORT_DEADLINE_S = 10.0
"""The longest an abort of an NCCL group may take (``ncclCommAbort`` can itself hang)."""


class CollectiveFailed(RuntimeError):
    """A collective errored (typically: a peer's connection closed because it died)."""


class AbortHung(Fenced):
    """Aborting an NCCL group outlived :data:`ABORT_DEADLINE_S`: the worker leaves (its agent brings it
    back as a joiner, with the state), as on any failure that leaves it unable to go on."""


class ViewGroup:
    """The process group of one view."""

    def __init__(self, rendezvous: dist.Store, *, gen: int, rank: int, size: int, device: torch.device,
                 timeout_s: float, check: Callable[[], None] = lambda: None, backend: str = "auto") -> None:
        """Build the group; ``check`` runs while the members connect and may raise to give up. ``backend``:
        ``auto`` (NCCL on CUDA, gloo else), or ``gloo`` on CUDA too (:func:`collective_backend`).

        Raises:
            CollectiveFailed: the members did not all connect within the timeout.
        """
        self.gen, self.rank, self.size, self.device = gen, rank, size, device
        self.nccl = collective_backend(device, backend) == "nccl"
        self.timeout = timedelta(seconds=timeout_s)
        self._buf: torch.Tensor | None = None  # the tensor of an all-reduce posted, until it completes
        self._pending: dist.Work | None = None
        self._gathered: torch.Tensor | None = None  # an all-gather's output, until it completes (late_gather)
        self._side: list[dist.Work] = []
        self._aborted = False
        t0 = time.perf_counter()
        self.pg: dist.ProcessGroup = self._connect(rendezvous, check)
        self.build_s = time.perf_counter() - t0

    def _connect(self, rendezvous: dist.Store, check: Callable[[], None]) -> dist.ProcessGroup:
        """Rendezvous in a side thread, watched: a member that dies meanwhile must not hold us for the timeout.

        A construction given up on is not left behind: whatever it built is
        released (NCCL: aborted, which also ends a connection stuck on a dead
        peer), now if it exists, else by the thread itself when it returns.
        """
        built: dict[str, object] = {}  # "pg" from the moment it exists; "given_up" once the caller left
        lock = threading.Lock()

        def build() -> None:
            try:
                if self.nccl:
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = self.timeout
                    nccl_pg = dist.ProcessGroupNCCL(rendezvous, self.rank, self.size, opts)
                    with lock:
                        built["pg"] = nccl_pg
                        if "given_up" in built:
                            return
                    # NCCL connects lazily, inside the first collective, which would block the caller
                    # beyond any check if a peer died meanwhile: connect here, in the watched thread.
                    nccl_pg.eager_connect_single_device(self.device)
                else:
                    gloo_pg = dist.ProcessGroupGloo(rendezvous, self.rank, self.size, self.timeout)
                    with lock:
                        built["pg"] = gloo_pg
            except Exception as exc:  # handed to the caller below
                built["error"] = exc
            finally:
                with lock:
                    late = built.pop("pg", None) if "given_up" in built else None
                if late is not None:
                    _dispose(late, self.nccl, self.gen)  # type: ignore[arg-type]

        thread = threading.Thread(target=build, name=f"group-g{self.gen}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout.total_seconds()
        try:
            while True:
                thread.join(CHECK_S)
                if not thread.is_alive():
                    break
                self._tick(check, deadline, "group construction")
        except BaseException:
            with lock:
                built["given_up"] = True
                stuck = built.pop("pg", None)
            if stuck is not None:
                _dispose(stuck, self.nccl, self.gen)  # type: ignore[arg-type]
            raise
        if "error" in built:
            raise CollectiveFailed(f"group of view {self.gen} could not be built: "
                                   f"{str(built['error']).splitlines()[0]}")
        return built["pg"]  # type: ignore[return-value]

    def allreduce(self, tensor: torch.Tensor, check: Callable[[], None],
                  after_post: Callable[[], None] | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; ``check`` may raise to abandon.

        Returns ``tensor`` holding the sum (a tensor on another device than the group's is moved first). No
        copy is made: once posted, ``tensor`` is the collective's, and if the attempt is given up on, its
        contents are undefined (partly reduced) and whatever arrives late lands in it: the caller starts the
        next attempt from a copy it made before posting, or computes its sums again into a new tensor, and
        never reuses this one (the parked group keeps it). ``after_post`` runs once the collective is in flight (fault injection hook).
        """
        if _PARKED:
            release_parked()  # every step all-reduces: a parked group goes as soon as its operation ended
        buf = tensor.detach()
        buf = buf if buf.device == self.device else buf.to(self.device)
        if self.size == 1:  # no collective, so nothing can write late: the sum is the tensor itself
            if after_post is not None:
                after_post()
            return buf
        self._buf = buf
        work = self._pending = self._post(lambda: self.pg.allreduce([buf]), "all-reduce")
        if after_post is not None:
            after_post()
        self._poll(work, check, "all-reduce")
        self._buf = None  # completed: nothing writes into it any more, the caller alone holds the sum
        return buf

    def broadcast(self, tensor: torch.Tensor, src: int, check: Callable[[], None]) -> torch.Tensor:
        """Broadcast from group rank ``src``; returns the received tensor (a copy)."""
        buf = tensor.detach().clone().to(self.device)
        if self.size == 1:
            return buf
        work = self._post(lambda: self.pg.broadcast(buf, src), "broadcast")
        self._poll(work, check, "broadcast")
        return buf

    def allgather(self, shard: torch.Tensor, padded: int, check: Callable[[], None],
                  after_post: Callable[[], None] | None = None) -> torch.Tensor:
        """Every rank's ``shard`` (at most ``padded`` elements, zero-padded to it), in rank order.

        Returns a new ``(size * padded,)`` tensor: rank ``r``'s shard starts at ``r * padded``.
        ``after_post`` runs once the collective is in flight (fault injection hook).
        """
        inp = torch.zeros(padded, dtype=shard.dtype, device=self.device)
        inp[:shard.numel()].copy_(shard.reshape(-1))
        if self.size == 1:
            if after_post is not None:
                after_post()
            return inp
        out = self._gathered = torch.empty(self.size * padded, dtype=shard.dtype, device=self.device)
        parts = list(out.view(self.size, padded).unbind(0))
        work = self._post(lambda: self.pg.allgather([parts], [inp]), "all-gather")
        if after_post is not None:
            after_post()
        self._poll(work, check, "all-gather")
        self._gathered = None  # completed: the caller alone holds it
        return out

    def post_alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                      in_splits: list[int]) -> dist.Work:
        """Start an all-to-all: ``in_splits[r]`` elements of ``inp`` go to rank ``r`` (in rank order),
        ``out_splits[r]`` elements from rank ``r`` land in ``out``. Wait with :meth:`wait_side`.

        (An all-to-all rather than sends and receives: gloo closes the pair when a timed wait on
        a send or receive expires, so those could not be polled.)
        """
        work = self._post(lambda: self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()),
                          "all-to-all")
        self._side.append(work)
        return work

    def wait_side(self, works: list[dist.Work], check: Callable[[], None], what: str) -> None:
        """Wait for collectives started with ``post_*`` (``check`` runs meanwhile)."""
        for work in works:
            self._poll(work, check, what)
        self._side = [w for w in self._side if not w.is_completed()]

    def _poll(self, work: dist.Work, check: Callable[[], None], what: str) -> None:
        """Wait until ``work`` has finished on its device, running ``check`` every ``CHECK_S``.

        One rule for every backend and every collective: a collective is done
        when ``work.is_completed()`` says so, never when its future does. NCCL
        completes ``work.get_future()`` when the collective is *enqueued* (the
        ``Work.get_future`` docstring: ``fut.done()`` only means enqueued for GPU
        work), so a vote cast on it could commit a reduction that a peer's
        death later leaves half done. ``is_completed()`` queries the event NCCL
        records after the collective on its stream (and the communicator's
        errors); gloo's is true once the operation ran. Between queries this
        thread sleeps: in gloo's timed ``wait`` (it returns the moment the
        collective finishes; its "timed out" error leaves the operation
        running), on NCCL ``POLL_S`` (a timed NCCL wait aborts the communicator
        when it expires). Once completed, an error the work recorded fails it.

        Raises:
            CollectiveFailed: the work failed, the group was aborted, or it outlived the timeout.
            Whatever ``check`` raises.
        """
        self._pending = work  # until it completes: an abandoned group with pending work is parked, not destroyed
        now = time.monotonic()
        deadline, next_check = now + self.timeout.total_seconds(), now + CHECK_S
        while not work.is_completed():
            if time.monotonic() >= next_check:
                self._tick(check, deadline, what)
                next_check = time.monotonic() + CHECK_S
            self._nap(work)
        self._pending = None
        self._raise_if_failed(work, what)

    def _nap(self, work: dist.Work) -> None:
        """Sleep a little while ``work`` runs (see :meth:`_poll`)."""
        if not self.nccl:  # gloo (CPU tensors or CUDA ones): a timed wait returns as soon as it finished
            try:
                work.wait(timedelta(seconds=CHECK_S))
            except RuntimeError:
                pass  # timed out, failed, or completed just after timing out: is_completed() decides
        else:
            time.sleep(POLL_S)

    def _raise_if_failed(self, work: dist.Work, what: str) -> None:
        """A completed ``work`` that errored, or that belongs to an aborted group, failed.

        After an abort NCCL skips its error check, so an aborted work whose end
        event fires reads as completed without error: the group's own flag,
        set before the abort, decides then.
        """
        if self._aborted:
            raise CollectiveFailed(f"{what} of view {self.gen} was aborted")
        error = completion_error(work, self.nccl)
        if error is not None:
            raise CollectiveFailed(f"{what} of view {self.gen} failed: {error.splitlines()[0]}") from None

    def _post(self, start: Callable[[], dist.Work], what: str) -> dist.Work:
        """Start a collective; an error raised at once (NCCL checks synchronously) is a failed collective."""
        try:
            return start()
        except RuntimeError as exc:
            raise CollectiveFailed(f"{what} of view {self.gen} failed: {str(exc).splitlines()[0]}") from None

    def late_result(self, timeout_s: float) -> torch.Tensor | None:
        """The reduced buffer of an all-reduce given up on, if it completes well within ``timeout_s``.

        A member that gave up waiting (a false alarm) may learn that the others
        committed the step: its own contribution was posted, so its all-reduce
        may still complete, and then the buffer holds the same reduced gradient
        as everybody's. None if it failed or is still pending.
        """
        if self._buf is None or not self._late(timeout_s, "all-reduce"):
            return None
        buf, self._buf = self._buf, None  # handed out once: the caller alone holds it now
        return buf

    def late_gather(self, timeout_s: float) -> torch.Tensor | None:
        """The output of an all-gather given up on, if it completes well within ``timeout_s`` (see
        :meth:`late_result`: with a sharded optimizer the vote follows the all-gather)."""
        if self._gathered is None or not self._late(timeout_s, "all-gather"):
            return None
        out, self._gathered = self._gathered, None
        return out

    def _late(self, timeout_s: float, what: str) -> bool:
        """Did the pending collective, given up on, complete (without error) within ``timeout_s``?"""
        work, deadline = self._pending, time.monotonic() + timeout_s
        if work is None or self._aborted:
            return False
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if not work.is_completed():
            return False
        try:
            self._raise_if_failed(work, what)
        except CollectiveFailed:
            return False
        self._pending = None
        return True

    def _tick(self, check: Callable[[], None], deadline: float, what: str) -> None:
        check()
        if time.monotonic() > deadline:
            raise CollectiveFailed(f"{what} of view {self.gen} did not finish within {self.timeout}")

    def abandon(self) -> None:
        """Stop using this group: destroyed now unless an operation is still pending (module docstring).

        NCCL is aborted first, from a watched thread (:meth:`_abort`). A group
        whose last operation is still running (blocked on a silent peer) is
        parked until that operation ends (the peer is fenced, its connections
        close), then destroyed by the next all-reduce of any group (every step
        has one) or the next :meth:`abandon` (:func:`release_parked`); so a worker holds at most the
        groups whose peers are still being fenced, not one per view it ever saw.

        Raises:
            AbortHung: the NCCL abort did not return within :data:`ABORT_DEADLINE_S`.
        """
        if self.nccl and self.pg is not None:
            self._abort()
        release_parked()
        if not self._busy():
            self._release()
        else:
            _PARKED.append(self)

    def _abort(self, deadline_s: float | None = None) -> None:
        """``pg.abort()`` in a thread of its own, waited for at most ``deadline_s`` (default
        :data:`ABORT_DEADLINE_S`); the group counts as aborted from before the call on.

        Raises:
            AbortHung: the abort is still running at the deadline (the thread is left to it: the
                worker is about to leave, and ``os._exit`` does not wait for it).
        """
        self._aborted = True
        limit = ABORT_DEADLINE_S if deadline_s is None else deadline_s
        if not _abort_watched(self.pg, self.gen, limit):
            raise AbortHung(f"the abort of view {self.gen}'s NCCL group did not return within {limit} s; "
                            f"this worker leaves and rejoins")

    def _busy(self) -> bool:
        """An operation of this group is still running (a collective or a point-to-point transfer)."""
        return any(w is not None and not w.is_completed() for w in [self._pending, *self._side])

    def _release(self) -> None:
        """Drop the group, its buffer and its last operation: gloo closes its sockets and joins its threads."""
        self.pg, self._buf, self._pending, self._side = None, None, None, []  # type: ignore[assignment]
        self._gathered = None

    def broadcast_into(self, tensor: torch.Tensor, src: int, check: Callable[[], None]) -> torch.Tensor:
        """Broadcast from group rank ``src`` in place: ``src`` sends ``tensor``, every other rank receives into it.

        Unlike the other collectives this works on the caller's tensor (the state
        transfer, :mod:`unbroken.runtime.state_transfer`, streams a joiner's state
        straight into its own tensors, chunk by chunk, with no copy of the state):
        ``src`` only reads it; a receiver's tensor is meaningful only once the
        transfer has completed, and a late write by an abandoned transfer carries
        the same bytes the next attempt sends. Returns ``tensor``.

        Raises:
            ValueError: ``tensor`` is not contiguous or not on the group's device.
            CollectiveFailed: the broadcast failed or outlived the group's timeout.
        """
        if tensor.device.type != self.device.type or not tensor.is_contiguous():
            raise ValueError(f"broadcast_into needs a contiguous tensor on {self.device}, got one on {tensor.device}"
                             f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
        if self.size == 1:
            return tensor
        work = self._post(lambda: self.pg.broadcast(tensor, src), "broadcast")
        self._poll(work, check, "broadcast")
        return tensor


_PARKED: list[ViewGroup] = []
"""Abandoned groups whose last operation is still pending: referenced until it ends, so no destructor
blocks on a stuck operation."""


def release_parked() -> int:
    """Destroy the parked groups whose operation has ended; returns how many are still parked.

    Called at every all-reduce's start and every abandon, so a parked group
    goes as soon as its peer is fenced, not one view change later.
    """
    for parked in [g for g in _PARKED if not g._busy()]:
        _PARKED.remove(parked)
        parked._release()
    return len(_PARKED)


def _abort_watched(pg: dist.ProcessGroup, gen: int, limit_s: float) -> bool:
    """``pg.abort()`` in a thread of its own; whether it returned within ``limit_s`` (if not, the thread is
    left to it: ``ncclCommAbort`` can itself hang, and ``os._exit`` does not wait for it)."""
    returned = threading.Event()

    def abort() -> None:
        try:
            pg.abort()
        except Exception as exc:  # best effort: the group is never used again
            logger.warning("abort of view %d's group failed: %s", gen, exc)
        finally:
            returned.set()

    threading.Thread(target=abort, name=f"abort-g{gen}", daemon=True).start()
    return returned.wait(limit_s)


def collective_backend(device: torch.device, choice: str = "auto") -> str:
    """``nccl`` or ``gloo`` for a group on ``device`` (``train.backend``: ``auto`` is NCCL on CUDA)."""
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return choice


def _dispose(pg: dist.ProcessGroup, nccl: bool, gen: int) -> None:
    """Release a group whose construction was given up on: NCCL is aborted (watched, which ends a
    connection blocked on a dead peer); gloo is dropped (its sockets close, its threads end)."""
    if nccl and not _abort_watched(pg, gen, ABORT_DEADLINE_S):
        logger.warning("the abort of view %d's half-built NCCL group did not return within %s s", gen,
                       ABORT_DEADLINE_S)
