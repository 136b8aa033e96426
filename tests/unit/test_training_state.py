"""One schema of the training state for every optimizer: SGD's momentum, Adagrad's sums, a user's own keys,
numbers and group values come back bit for bit from snapshot memory, from a checkpoint and through a
transfer; a value the schema cannot hold is refused, named."""

from __future__ import annotations

import copy

import pytest
import torch

from test_state_transfer import Loopback
from unbroken.models import build_model
from unbroken.checkpoint.checkpointer import AsyncCheckpointer, load_checkpoint, training_state
from unbroken.runtime.state_transfer import transfer_state
from unbroken.store.view import View
from unbroken.state.training_state import StateNotCapturable, capture, check_capturable
from unbroken.snapshot.restore import decide, inventory, restore_from_memory
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


class Scaled(torch.optim.Optimizer):
    """A user's own optimizer: a state of its own names (a tensor ``velocity``, a count ``seen`` kept as a
    Python int, a flag), and an estimate ``scale`` it updates in its param group, as adaptive methods do."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr, "scale": 1.0, "note": "config"})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["scale"] = group["scale"] * 0.9 + 0.1
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["velocity"], st["seen"], st["warm"] = torch.zeros_like(p), 0, False
                st["velocity"].mul_(0.8).add_(p.grad)
                st["seen"] += 1
                st["warm"] = st["seen"] > 1
                p.add_(st["velocity"], alpha=-group["lr"] * group["scale"])


OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, foreach=False),
    "own": lambda ps: Scaled(ps),
}


def _trained(kind: str, steps: int = 3, seed: int = 0):
    model = build_model("debug", vocab_size=64, seq_len=8, seed=seed)
    opt = OPTIMIZERS[kind](model.parameters())
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _step(model, opt, gen)
    return model, opt


def _step(model, opt, gen: torch.Generator) -> None:
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _fresh(kind: str):
    model = build_model("debug", vocab_size=64, seq_len=8, seed=99)  # other weights, no optimizer state
    return model, OPTIMIZERS[kind](model.parameters())


def _assert_same(a, b) -> None:
    """The same state, bit for bit, with the same Python types, and both go on alike."""
    sa, sb = capture(*a), capture(*b)
    assert list(sa) == list(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    for (pa, pb) in zip(a[0].parameters(), b[0].parameters()):
        for key, va in a[1].state[pa].items():
            assert type(va) is type(b[1].state[pb][key]), key
    for ga, gb in zip(a[1].param_groups, b[1].param_groups):
        assert {k: v for k, v in ga.items() if k != "params"} == {k: v for k, v in gb.items() if k != "params"}
    for model, opt in (a, b):  # one more step each, from the same gradients
        _step(model, opt, torch.Generator().manual_seed(7))
    assert all(torch.equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters()))


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_any_optimizer_state_is_captured_under_its_own_names(kind):
    model, opt = _trained(kind)
    names = [n for n in capture(model, opt) if n.startswith(("optim.", "group."))]
    first = next(n for n, _ in model.named_parameters())
    expected = {"sgd-momentum": ["momentum_buffer"], "adagrad": ["step", "sum"],
                "amsgrad": ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"],
                "own": ["seen=int", "velocity", "warm=bool"]}[kind]
    assert [n.split(f"optim.{first}.")[1] for n in names if n.startswith(f"optim.{first}.")] == expected
    if kind == "own":
        assert [n for n in names if n.startswith("group.")] == ["group.0.lr=float", "group.0.scale=float"]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_from_snapshot_memory_bit_for_bit(kind, job_id):
    model, opt = _trained(kind)
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every=1, redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt), on_event=lambda *a, **k: None)
    snap.take(3, View(gen=1, members=(0,), step=3))
    snap.close()
    spec = decide([inventory(job_id, 0, config_hash="cfg")], checkpoint=None, members_of=lambda nodes: [0])
    assert spec["source"] == "memory" and spec["step"] == 3
    fresh = _fresh(kind)
    restore_from_memory(spec, job=job_id, node=0, node_of={0: 0}, members=(0,), me=0, broadcast=None,
                        model=fresh[0], optimizer=fresh[1], device=CPU)
    _assert_same((model, opt), fresh)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_from_a_checkpoint_bit_for_bit(kind, tmp_path):
    model, opt = _trained(kind)
    saver = AsyncCheckpointer(tmp_path, config_hash="h")
    saver.save(3, training_state(model, opt), {"loss": 0.0})
    saver.wait()
    fresh = _fresh(kind)
    load_checkpoint(tmp_path / "checkpoints" / "step_0000003", *fresh, config_hash="h")
    _assert_same((model, opt), fresh)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_through_a_transfer_bit_for_bit(kind):
    model, opt = _trained(kind)
    link = Loopback()
    transfer_state(link.send, model, opt, src=0, rank=0, receive=False, device=CPU)
    fresh = _fresh(kind)
    transfer_state(link.receive, *fresh, src=0, rank=1, receive=True, device=CPU)
    _assert_same((model, opt), fresh)


def test_a_restore_replaces_the_state_a_worker_already_had():
    """A receiver whose optimizer has state of its own (another step) ends with the source's alone."""
    model, opt = _trained("own", steps=3)
    other = _trained("own", steps=1, seed=5)
    link = Loopback()
    transfer_state(link.send, model, opt, src=0, rank=0, receive=False, device=CPU)
    transfer_state(link.receive, *other, src=0, rank=1, receive=True, device=CPU)
    _assert_same((model, opt), other)


def test_a_state_the_schema_cannot_hold_is_refused_by_name():
    model, opt = _trained("sgd-momentum", steps=1)
    check_capturable(opt)
    bad = copy.deepcopy(opt)
    bad.param_groups[0]["history"] = [0.1, "x"]
    with pytest.raises(StateNotCapturable, match=r"group\.0\.history is a list: the training state holds tensors"):
        check_capturable(bad)
    p = next(iter(opt.state))
    opt.state[p]["trace"] = {"a": 1}
    with pytest.raises(StateNotCapturable, match=r"\.trace is a dict"):
        capture(model, opt)
