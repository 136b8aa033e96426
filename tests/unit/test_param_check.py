"""Silently wrong parameters: the checksum catches every single-bit flip, the majority rule, the region of the
reduction buffer, and one member's side of the check on a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unbroken.config import load_config
from unbroken.mecefo.gradients import GradLayout
from unbroken.runtime.membership import Fenced, MemberDied, Membership
from unbroken.runtime.param_check import HALF, ParamCheck, ParamMismatchStop, checksum, halves, judge
from unbroken.sharding.replica_layout import ReplicaLayout
from unbroken.store.job_store import JobStore

pytestmark = pytest.mark.timeout(120)

WIDTH = {torch.float32: (torch.int32, 32), torch.float64: (torch.int64, 64), torch.bfloat16: (torch.int16, 16),
         torch.float16: (torch.int16, 16)}


def flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """``t`` with bit ``bit`` of element ``index`` flipped (as a bitflip fault flips it)."""
    as_int, _ = WIDTH[t.dtype]
    out = t.clone()
    words = out.view(as_int)
    words[index] ^= torch.tensor(1, dtype=as_int) << bit
    return out


@pytest.mark.parametrize("dtype, n", [(torch.float32, 7), (torch.float64, 5), (torch.bfloat16, 6),
                                      (torch.bfloat16, 5), (torch.float16, 3)])
def test_every_single_bit_flip_changes_the_checksum(dtype: torch.dtype, n: int) -> None:
    """Exhaustive over every bit of a few elements, among them values whose words' sum wraps around 2**32."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(n, generator=g, dtype=torch.float64) * 1e30  # large exponents: the sums wrap
    tensors = [torch.zeros(4, dtype=torch.float32), big.to(dtype), torch.randn(3, generator=g)]
    tensors[1][0] = 0.0
    if n > 2:
        tensors[1][1] = -float("inf") if dtype != torch.bfloat16 else -1.0
    base = checksum(tensors)
    _, width = WIDTH[dtype]
    for index in range(n):
        for bit in range(width):
            bad = [tensors[0], flipped(tensors[1], index, bit), tensors[2]]
            changed = checksum(bad)
            assert int(changed) != int(base), (index, bit)
            assert not torch.equal(halves(changed), halves(base)), (index, bit)


def test_the_checksum_is_the_words_sum_modulo_2_32_whatever_the_order() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(1000, generator=g) * 1e38, torch.randn(17, generator=g)]
    want = sum(int(t.view(torch.int32).to(torch.int64).sum()) for t in tensors) % 2**32
    assert int(checksum(tensors)) % 2**32 == want == int(checksum(tensors[::-1])) % 2**32
    low, high = halves(checksum(tensors)).tolist()
    assert low + HALF * high == want and 0 <= low < HALF and 0 <= high < HALF
    assert int(checksum([])) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_checksum_on_a_gpu_is_the_cpus() -> None:
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(1 << 20, generator=g) * 1e38, torch.randn(33, generator=g).to(torch.bfloat16)]
    on_gpu = checksum([t.cuda() for t in tensors])
    assert on_gpu.device.type == "cuda" and int(on_gpu) == int(checksum(tensors))


@pytest.mark.parametrize("values, want", [
    ({0: 5, 1: 5, 2: 5}, ("agree", ())),
    ({0: 5}, ("agree", ())),
    ({0: 5, 1: 9, 2: 5}, ("fence", (1,))),  # a strict majority: the other is wrong
    ({0: 1, 1: 1, 2: 1, 3: 2, 4: 3}, ("fence", (3, 4))),
    ({0: 5, 1: 9}, ("stop", (0, 1))),  # two workers: nobody can tell which
    ({0: 5, 1: 9, 2: 5, 3: 9}, ("stop", (0, 1, 2, 3))),  # a tie
    ({0: 1, 1: 2, 2: 3}, ("stop", (0, 1, 2))),
    ({0: 1, 2: 1, 3: 2}, ("fence", (3,))),  # members, not ids 0..n-1
])
def test_the_majority_rule(values: dict[int, int], want: tuple[str, tuple[int, ...]]) -> None:
    verdict = judge(values)
    assert (verdict.decision, verdict.wrong) == want


class OneGroup:
    group_names = ("all",)

    def group_of(self, name: str) -> int:
        return 0


def test_the_region_sits_before_the_word_and_leaves_it_alone() -> None:
    layout = GradLayout(torch.nn.Linear(2, 1), OneGroup(), timings=3, checksums=6)
    assert layout.size == layout.n_grad + 1 + 3 + 6 + 3
    buf = layout.new_buffer()
    layout.write_word(buf, admit=True, stop=False)
    layout.checksums(buf).fill_(HALF - 1)
    layout.timings(buf).fill_(0.5)
    assert layout.admitted(buf) and not layout.stopping(buf) and layout.nonfinite_count(buf) == 0
    assert buf[layout.n_grad + 1 + 3 : layout.n_grad + 1 + 3 + 6].eq(HALF - 1).all()


def test_param_check_every_auto_is_every_step_under_hsdp_too() -> None:
    assert load_config(preset_name="debug").param_check_interval == 1
    assert load_config(preset_name="debug", overrides=["fault.param_check_every=4"]).param_check_interval == 4
    hsdp = load_config(preset_name="debug", overrides=["train.workers=4", "train.shard_degree=2"])
    assert hsdp.param_check_interval == 1
    assert load_config(preset_name="debug", overrides=["train.workers=4", "train.shard_degree=2",
                                                        "fault.param_check_every=2"]).param_check_interval == 2
    with pytest.raises(ValueError, match="fault.param_check_every=-1: must be auto"):
        load_config(preset_name="debug", overrides=["fault.param_check_every=-1"])


@pytest.fixture
def store():
    host = JobStore.host("127.0.0.1", 0, clients=4, secret="test")
    client = JobStore.connect(f"127.0.0.1:{host.port}", timeout_s=20, secret="test")
    yield client
    host.close()


def reduce_three(layout: GradLayout, models: list[torch.nn.Module], store: JobStore, step: int,
                 every: int = 1) -> tuple[list[ParamCheck], torch.Tensor, list[list[dict]]]:
    """Workers 0..2 of ``models`` stamp their checksums into their buffers, summed as the all-reduce sums them."""
    checks, logs, bufs = [], [], []
    for w, model in enumerate(models):
        log: list[dict] = []
        logs.append(log)
        check = ParamCheck(Membership(store, w, heartbeat_timeout_s=2.0), layout, list(model.parameters()),
                           every=every, event=lambda name, log=log, **fields: log.append({"event": name, **fields}))
        buf = layout.new_buffer()
        check.stamp(step, buf)
        checks.append(check)
        bufs.append(buf)
    return checks, bufs[0] + bufs[1] + bufs[2], logs


def test_the_members_agree_on_equal_parameters_and_fence_the_odd_one(store: JobStore) -> None:
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    layout = GradLayout(models[0], OneGroup(), checksums=6)
    checks, reduced, logs = reduce_three(layout, models, store, step=3)
    for check in checks:
        check.settle(3, 0, check.find(3, reduced, (0, 1, 2)))  # they agree: nothing raised
    assert not any(logs)

    with torch.no_grad():
        models[1].weight.view(-1)[5:6].view(torch.int32).__ixor__(1 << 27)
    checks, reduced, logs = reduce_three(layout, models, store, step=3)
    with pytest.raises(Fenced, match="worker 1: its parameters at step 3 differ"):
        checks[1].settle(3, 0, checks[1].find(3, reduced, (0, 1, 2)))
    for w in (0, 2):
        with pytest.raises(MemberDied, match="worker 1 disagrees with the majority and is fenced"):
            checks[w].settle(3, 0, checks[w].find(3, reduced, (0, 1, 2)))
    assert store.is_marked_dead(1) and not store.is_marked_dead(0)
    assert json.loads(store.dead_mark(1) or "{}")["how"] == "param-mismatch"
    assert [e["event"] for e in logs[1]] == ["param_mismatch", "param_mismatch_fenced"]
    assert [(e["event"], e["decision"], e["wrong"]) for e in logs[0]] == [("param_mismatch", "fence", [1])]

    # a step without the check carries no checksums: nothing compared
    checks, reduced, logs = reduce_three(layout, models, store, step=3, every=2)
    assert not layout.checksums(reduced).any()
    checks[0].settle(3, 0, checks[0].find(3, reduced, (0, 1, 2)))


def test_where_parameters_are_replicated_a_mismatch_is_repaired_once_a_step_then_fenced(store: JobStore) -> None:
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    with torch.no_grad():
        models[2].bias.view(-1)[1:2].view(torch.int32).__ixor__(1 << 29)
    layout = GradLayout(models[0], OneGroup(), checksums=6)
    checks, reduced, logs = reduce_three(layout, models, store, step=4)
    for check in checks:
        check.repairs = True
    found = [c.find(4, reduced, (0, 1, 2)) for c in checks]
    verdicts = [c.settle(4, 0, f) for c, f in zip(checks, found)]
    assert all(v is not None and (v.decision, v.wrong) == ("repair", (2,)) for v in verdicts)
    assert [e["event"] for e in logs[2]] == ["param_mismatch", "attempt_aborted"] and not store.is_marked_dead(2)
    with pytest.raises(Fenced, match="worker 2: its parameters at step 4 differ"):  # again at that step
        checks[2].settle(4, 0, found[2])
    assert checks[0].settle(5, 0, checks[0].find(4, reduced, (0, 1, 2))).decision == "repair", "a later step's"


def test_two_members_that_differ_stop_the_job(store: JobStore) -> None:
    models = [torch.nn.Linear(4, 3) for _ in range(3)]
    layout = GradLayout(models[0], OneGroup(), checksums=6)
    _, reduced, logs = reduce_three(layout, models, store, step=2)
    check = ParamCheck(Membership(store, 0, heartbeat_timeout_s=2.0), layout, list(models[0].parameters()), every=1,
                       event=lambda name, **fields: logs[0].append({"event": name, **fields}))
    with pytest.raises(ParamMismatchStop, match=r"step 2: the parameters of workers 0 and 1 differ .* no strict "
                                                r"majority"):
        check.settle(2, 4, check.find(2, reduced, (0, 1)))
    assert [e["event"] for e in logs[0]] == ["param_mismatch", "attempt_aborted", "param_mismatch_stop"]
    assert not store.is_marked_dead(0)


def hsdp_round(store: JobStore, shards: list[torch.Tensor], k: int, step: int = 5) -> tuple[list, list[dict]]:
    """Workers ``0..len(shards)-1`` in replicas of ``k`` ranks, worker ``w`` holding ``shards[w]``: each stamps its
    checksum, its shard index's buffers are summed (the cross-replica reduction), each rank finds, the ranks of a
    replica sum their marks (the replica's word), and each settles: what each raised (None: nothing), and its
    events."""
    n, replicas = len(shards), ReplicaLayout(len(shards), k)
    layout = GradLayout(torch.nn.Linear(2, 2), OneGroup(), checksums=2 * n)
    logs: list[list[dict]] = [[] for _ in range(n)]
    checks = [ParamCheck(Membership(store, w, heartbeat_timeout_s=2.0), layout, [shards[w]], every=1,
                         event=lambda name, log=logs[w], **fields: log.append({"event": name, **fields}),
                         replicas=replicas) for w in range(n)]
    bufs = [layout.new_buffer() for _ in range(n)]
    for check, buf in zip(checks, bufs):
        check.stamp(step, buf)
    reduced = {i: sum(bufs[w] for w in replicas.shard_peers(i, range(n))) for i in range(k)}
    found = [checks[w].find(step, reduced[replicas.index_of(w)], range(n)) for w in range(n)]
    marks = [checks[w].marks(found[w]) for w in range(n)]
    pooled = {r: [sum(col) for col in zip(*(marks[w] for w in replicas.replica_members(r)))]
              for r in range(replicas.replicas)}
    raised: list = []
    for w in range(n):
        try:
            checks[w].settle(step, 7, found[w], pooled[replicas.replica_of(w)])
            raised.append(None)
        except (Fenced, MemberDied, ParamMismatchStop) as exc:
            raised.append(exc)
    return raised, logs


def test_under_hsdp_a_replica_with_one_wrong_shard_leaves_whole_and_every_rank_knows(store: JobStore) -> None:
    """3 replicas of 2 ranks: a bit flipped in worker 3's shard (replica 1, index 1) is seen by index 1's ranks
    only; the replica's word carries it to index 0's, so both ranks of replica 1 leave and every other rank moves
    on without them. With equal shards nothing is raised."""
    shards = [torch.arange(6.0) + 10 * (w % 2) for w in range(6)]  # a shard index's shards are equal
    raised, logs = hsdp_round(store, [s.clone() for s in shards], k=2)
    assert raised == [None] * 6 and not any(logs)
    shards[3] = flipped(shards[3], 4, 30)
    raised, logs = hsdp_round(store, shards, k=2)
    assert [type(e).__name__ for e in raised] == ["MemberDied", "MemberDied", "Fenced", "Fenced", "MemberDied",
                                                  "MemberDied"]
    assert all("workers 2 and 3 disagree with the majority" in str(raised[w]) for w in (0, 1, 4, 5))
    assert store.is_marked_dead(2) and store.is_marked_dead(3) and not store.is_marked_dead(1)
    assert [e["event"] for e in logs[2]] == ["param_mismatch", "param_mismatch_fenced"]
    assert (logs[2][0]["decision"], logs[2][0]["wrong"]) == ("fence", [2, 3])
    assert len(set(logs[2][0]["checksums"].values())) == 1, "index 0's checksums agree: it learnt it from the word"
    assert set(logs[3][0]["checksums"]) == {"1", "3", "5"}


def test_under_hsdp_two_replicas_that_differ_in_one_shard_stop_every_rank(store: JobStore) -> None:
    shards = [torch.ones(4) for _ in range(4)]
    shards[1] = flipped(shards[1], 0, 3)
    raised, logs = hsdp_round(store, shards, k=2)
    assert all(isinstance(e, ParamMismatchStop) for e in raised)
    assert "workers 1 and 3 differ" in str(raised[1]) and "replicas differ in one shard" in str(raised[0])
    assert not any(store.is_marked_dead(w) for w in range(4))


def test_the_cost_benchmark_times_the_checksum_beside_one_slots_compute(tmp_path: Path,
                                                                       corpus_overrides: list[str]) -> None:
    from benchmarks.param_check import main

    result = main(["--presets", "debug", "--steps", "1", "--out", str(tmp_path / "out.json"), *corpus_overrides])
    (row,) = result["rows"]
    assert row["preset"] == "debug" and row["param_bytes"] > 0 and row["check_s"] > 0 < row["compute_one_slot_s"]
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == [row]
