"""``snapshot.every = auto``: proposals, their agreement through a summed buffer, and the snapshotter under it."""

from __future__ import annotations

import threading

import pytest
import torch

from unbroken.mecefo.adapter import adapter_for
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums
from unbroken.models import build_model
from unbroken.store.view import View
from unbroken.snapshot.cadence import MARGIN, VETO, VOTE_SLOTS, Cadence, cast, due, tally
from unbroken.snapshot.restore import decide, inventory, restore_from_memory
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

pytestmark = pytest.mark.timeout(120)


def _summed(proposals: list[int]) -> torch.Tensor:
    """What an all-reduce of the workers' vote slots gives."""
    total = torch.zeros(VOTE_SLOTS)
    for p in proposals:
        mine = torch.zeros(VOTE_SLOTS)
        cast(mine, p)
        total += mine
    return total


def test_the_summed_votes_say_the_largest_proposal():
    assert tally(_summed([3, 7, 1, 7])) == 7
    assert tally(_summed([1])) == 1
    assert tally(_summed([2, VETO, 5])) == VETO
    assert tally(torch.zeros(VOTE_SLOTS)) == 0  # nobody proposed: no snapshot
    with pytest.raises(ValueError, match="outside 1..64"):
        cast(torch.zeros(VOTE_SLOTS), 0)
    with pytest.raises(ValueError, match="outside 1..64"):
        cast(torch.zeros(VOTE_SLOTS), VETO + 1)


def test_a_snapshot_is_due_on_the_agreed_grid_and_never_under_the_veto():
    assert [s for s in range(1, 13) if due(s, 4)] == [4, 8, 12]
    assert [s for s in range(1, 13) if due(s, 1)] == list(range(1, 13))
    assert not any(due(s, VETO) for s in range(1, 200))
    assert not any(due(s, 0) for s in range(1, 20))


def test_a_proposal_is_the_smallest_interval_that_covers_the_write_with_margin():
    c = Cadence()
    assert c.proposal(in_flight=False) == 1  # nothing measured: take one, to measure it
    assert c.proposal(in_flight=True) == VETO
    for s in (0.10, 0.12, 0.10, 0.11, 0.10):
        c.observe_step(s)
    c.observe_write(0.5)
    assert c.proposal(in_flight=False) == 7  # 1.25 * 0.5 / 0.10 = 6.25 -> 7
    c.observe_write(0.05)
    assert c.proposal(in_flight=False) == 7  # the slowest recent write counts
    for _ in range(4):
        c.observe_write(0.45)
    assert c.proposal(in_flight=False) == 7  # 1.25 * 0.45 / 0.10 -> 6: not lower by a clear margin, kept
    for _ in range(4):
        c.observe_write(0.05)
    assert c.proposal(in_flight=False) == 1  # 1.25 * 0.05 / 0.10 < 1
    c.observe_write(1000.0)
    assert c.proposal(in_flight=False) == VETO - 1  # the longest interval the slots carry
    cpu = Cadence(shares_cores=True)  # the write takes cores from training: at most BUDGET of the steps
    for s in (0.10, 0.10, 0.10):
        cpu.observe_step(s)
    cpu.observe_write(0.01)
    assert cpu.proposal(in_flight=False) == 5  # 0.01 / (0.02 * 0.10) = 5 (the fit alone would say 1)
    c.observe_write(float("nan"))
    c.observe_step(-1.0)
    assert c.proposal(in_flight=False) == VETO - 1  # nonsense measurements are ignored
    assert MARGIN > 1


def test_on_a_gpu_a_snapshot_may_slow_the_steps_around_it_by_at_most_the_budget():
    """A snapshot's cost to the training (GPU): the step that took it and the next one, against the median of
    the steps near no snapshot; measured once the writes are steady and 3 such steps were seen, and taken as
    the median of the last 3 snapshots' once there are 3."""
    c = Cadence()
    for s in (0.100, 0.101):
        c.observe_step(s)
    c.observe_write(0.3)
    assert c.proposal(in_flight=False) == 4  # 1.25 * 0.3 / 0.1 = 3.75: the fit alone
    c.observe_step(0.115, "taken")
    c.observe_step(0.1205, "after")
    assert not c.costs  # two plain steps: no baseline yet
    c.observe_step(0.099)
    for n in (1, 2, 3):
        c.observe_step(0.115, "taken")
        c.observe_step(0.1205, "after")
        if n < 3:
            assert len(c.costs) == n and c.cost is None and c.proposal(in_flight=False) == 4
    # 0.115 + 0.1205 - 2 * 0.100 = 0.0355 s per snapshot, within 2 % of 0.100 s steps: 17.75 of them
    assert c.cost == pytest.approx(0.0355) and c.proposal(in_flight=False) == 18
    for _ in range(2):  # the copies got cheap: the median of the last three costs follows, the interval too
        c.observe_step(0.101, "taken")
        c.observe_step(0.099, "after")
    assert c.cost == 0.0 and c.proposal(in_flight=False) == 4
    c.observe_step(0.400, "taken")  # one slow step (a pause) is outvoted by the two before it
    c.observe_step(0.100, "after")
    assert c.cost == 0.0 and c.proposal(in_flight=False) == 4
    every = Cadence()  # a snapshot every step: each step takes one, none is "after" only: nothing to measure
    every.observe_write(0.01)
    for _ in range(8):
        every.observe_step(0.2, "taken")
    assert every.cost is None and every.proposal(in_flight=False) == 1
    early = Cadence()  # the first snapshots allocate their buffers: their steps are not measured
    for s in (0.1, 0.1, 0.1):
        early.observe_step(s)
    early.observe_step(0.9, "taken")
    early.observe_step(0.5, "after")
    assert not early.costs
    cpu = Cadence(shares_cores=True)  # on the CPU the write's own seconds are its cost
    cpu.observe_write(0.03)
    assert cpu.cost == 0.03


def test_votes_sit_between_the_weights_and_the_loss_and_leave_both_alone():
    torch.manual_seed(0)
    model = build_model("debug", vocab_size=64, seq_len=8)
    adapter = adapter_for(model, rank=4, tau=10, approximates=False, policy="spread")
    plain, voting = GradLayout(model, adapter), GradLayout(model, adapter, votes=VOTE_SLOTS)
    assert voting.size == plain.size + VOTE_SLOTS and voting.n_votes == VOTE_SLOTS and plain.n_votes == 0
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, 64, (2, 9), generator=gen)

    def batch(step, slot, rows):
        return data[rows[0]:rows[1], :-1], data[rows[0]:rows[1], 1:]

    bufs = [compute_gradient_sums(model, adapter, lay, [SlotWork(0, (0, 2))], step=0, micro_batch=2, batch_fn=batch)
            for lay in (plain, voting)]
    cast(voting.votes(bufs[1]), 5)
    assert torch.equal(bufs[0][:plain.n_grad], bufs[1][:voting.n_grad])
    assert torch.equal(plain.weights(bufs[0]), voting.weights(bufs[1]))
    assert plain.loss_sum(bufs[0]) == voting.loss_sum(bufs[1]) and plain.token_count(bufs[0]) == 16
    assert voting.token_count(bufs[1]) == 16 and tally(voting.votes(bufs[1])) == 5


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = build_model("debug", vocab_size=256, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def test_under_auto_the_fence_waits_for_the_staging_only_and_the_write_goes_on(job_id, monkeypatch):
    """The write is held back on purpose (a slow /dev/shm): the fence returns once the live state is copied,
    the state may then change, and the sealed snapshot is still the state of its step."""
    model, opt = _model_and_optimizer(0)
    events: list[dict] = []
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt),
                       on_event=lambda name, **f: events.append({"event": name, **f}), write_threads=2)
    assert snap.auto and snap.vote() == 1
    release, writing = threading.Event(), threading.Event()
    real_write = Snapshotter._write

    def slow_write(self, *args, **kwargs):
        writing.set()
        assert release.wait(30)
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Snapshotter, "_write", slow_write)
    want = {k: v.clone() for k, v in tensors_of(model, opt).items()}
    view = View(gen=1, members=(0,), step=3)
    snap.take(3, view, _summed([1]))
    snap.fence()
    assert writing.wait(30) and not snap._pending.done(), "the fence returned while the write is still held"
    assert snap.vote() == VETO  # a write in flight: the next due snapshot is skipped, not waited for
    snap.take(4, view, _summed([VETO]))
    assert snap.last_step == 3
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next optimizer step, while the write of step 3 goes on
    release.set()
    snap.wait()
    assert snap.taken == 1 and snap.summary()["interval"] == 1
    assert [e["interval"] for e in events if e["event"] == "snapshot_interval"] == [1]
    spec = decide([inventory(job_id, 0, config_hash="cfg")], checkpoint=None, members_of=lambda nodes: [0])
    assert spec is not None and spec["step"] == 3
    fresh, fresh_opt = _model_and_optimizer(5)
    restore_from_memory(spec, job=job_id, node=0, node_of={0: 0}, members=(0,), me=0, broadcast=None,
                        model=fresh, optimizer=fresh_opt, device=torch.device("cpu"))
    got = tensors_of(fresh, fresh_opt)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    snap.close()


def test_under_auto_buffers_alternate_starting_away_from_the_newest_sealed_snapshot(job_id):
    model, opt = _model_and_optimizer(0)

    def snapshotter() -> Snapshotter:
        return Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none",
                           parity=1, config_hash="cfg", state=lambda: tensors_of(model, opt),
                           on_event=lambda name, **f: None)

    snap = snapshotter()
    view = View(gen=1, members=(0,), step=0)
    for done in (2, 4, 6):
        snap.take(done, view, _summed([2]))
        snap.wait()
    snap.close()
    assert decide([inventory(job_id, 0, config_hash="cfg")], checkpoint=None, members_of=lambda nodes: [0])["step"] == 6
    again = snapshotter()  # a restarted worker: its first write must not overwrite step 6
    again.take(8, view, _summed([2]))
    again._pending.result()  # sealed, not yet joined
    seals = sorted(int(s["step"]) for s in inventory(job_id, 0, config_hash="cfg")["seals"])
    assert seals == [6, 8]
    again.close()


def test_a_finished_write_is_joined_at_the_next_proposal_and_its_seconds_count(job_id):
    """Nobody waits for a write under auto: the next proposal joins it, counts it, and proposes from it."""
    model, opt = _model_and_optimizer(0)
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt), on_event=lambda name, **f: None)
    for _ in range(5):
        snap.observe_step(0, 1e-6)  # steps far shorter than any write: the proposal must grow
    view = View(gen=1, members=(0,), step=0)
    for done in (1, 2, 3):  # the first two write fresh buffers: not steady, not counted
        snap.take(done, view, _summed([1]))
        snap._pending.result()
        assert snap.taken == done - 1, "a finished write is not joined until the next proposal"
        proposal = snap.vote()
        assert snap.taken == done and snap._pending is None
    assert len(snap.cadence.writes) == 1 and proposal == VETO - 1
    snap.close()


def test_the_snapshotter_tells_the_cadence_which_steps_took_a_snapshot_and_which_followed_one(job_id):
    model, opt = _model_and_optimizer(0)
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt), on_event=lambda name, **f: None)
    view = View(gen=1, members=(0,), step=0)
    for done in (1, 2, 3):  # the third write is the first steady one
        snap.take(done, view, _summed([1]))
        snap._pending.result()
        snap.vote()
    for done in (4, 5, 6, 7):  # step 4 follows the snapshot of step 3 (taken before any baseline); then plain
        snap.observe_step(done, 0.10)
    assert list(snap.cadence.plain) == [0.10] * 3 and not snap.cadence.costs
    assert snap.take(8, view, _summed([1]))
    snap.observe_step(8, 0.13)
    snap.observe_step(9, 0.12)
    assert list(snap.cadence.plain) == [0.10] * 3 and list(snap.cadence.costs) == [pytest.approx(0.05)]
    snap.close()


def test_with_write_threads_the_other_buffer_is_mapped_beside_the_first_write_and_the_second_is_steady(job_id):
    """Mapping a fresh buffer costs about 0.7 s per GB: with several write threads, one maps the second buffer
    while the first write goes on, so the second write is already a steady figure (one thread: the third)."""
    model, opt = _model_and_optimizer(0)
    view = View(gen=1, members=(0,), step=0)
    counted = {}
    for threads in (2, 1):
        snap = Snapshotter(job_id=f"{job_id}{threads}", node=0, worker=0, node_of={0: 0}, every="auto",
                           redundancy="none", parity=1, config_hash="cfg", state=lambda: tensors_of(model, opt),
                           on_event=lambda name, **f: None, write_threads=threads)
        first = snap._next
        snap.take(1, view, _summed([1]))
        snap.wait()
        assert snap.buffers[first].mapped, "the first write mapped its own buffer"
        if threads > 1:
            index, work = snap._reserving
            assert index == 1 - first
            work.result()
            assert snap.buffers[1 - first].is_mapped, "the other buffer, mapped beside it"
        else:
            assert snap._reserving is None and not snap.buffers[1 - first].is_mapped
        writes = []
        for done in (2, 3):
            snap.take(done, view, _summed([1]))
            snap.wait()
            writes.append(len(snap.cadence.writes))
        counted[threads] = writes
        snap.close()
        remove_segments(f"{job_id}{threads}")
    assert counted == {2: [1, 2], 1: [0, 1]}


def test_the_summary_says_when_the_interval_is_not_settled_and_the_recovery_point_follows_the_spacing(job_id):
    """Until a steady write is measured the interval is 1 and writes in flight veto the snapshots in between:
    the recovery point is then the spacing the snapshots really had, not twice the interval."""
    model, opt = _model_and_optimizer(0)
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt), on_event=lambda name, **f: None)
    view = View(gen=1, members=(0,), step=0)
    assert snap.take(1, view, _summed([1]))
    assert not snap.take(2, view, _summed([VETO]))  # the first write still in flight (fresh memory)
    snap.wait()
    assert snap.take(9, view, _summed([1]))
    snap.wait()
    s = snap.summary()
    assert (s["interval"], s["settled"], s["spacing_steps"], s["recovery_point_steps"],
            s["skipped"]) == (1, False, 8, 16, 1)
    assert snap.take(10, view, _summed([1]))  # both buffers written once: this write is steady
    snap.wait()
    s = snap.summary()
    assert (s["interval"], s["settled"], s["spacing_steps"], s["recovery_point_steps"]) == (1, True, 1, 2)
    snap.close()
