"""Training state crosses to a joiner, tensor by tensor, and arrives exactly (one process, no group).

The source's broadcasts are recorded and replayed into the receiver (:class:`Loopback`);
the real two-process group is in ``test_state_stream.py``.
"""

from __future__ import annotations

import pytest
import torch

from unbroken.config import OptimConfig
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.runtime.state_transfer import transfer_state
from unbroken.state.training_state import capture

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


class Loopback:
    """Broadcasts of a source recorded, then replayed in order into receivers and bystanders."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.at = 0

    def send(self, t: torch.Tensor, src: int) -> None:
        self.sent.append(t.clone())

    def receive(self, t: torch.Tensor, src: int) -> None:
        got = self.sent[self.at]
        assert got.dtype == t.dtype and got.shape == t.shape, "both sides run the same broadcasts"
        t.copy_(got)
        self.at += 1


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    o = OptimConfig()
    return build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def _trained(seed: int, vocab: int = 64, steps: int = 2, dtype: torch.dtype = torch.float32):
    model = build_model("debug", vocab_size=vocab, seq_len=8, seed=seed).to(dtype)
    opt = _optimizer(model)
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 8))
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _send(model, opt, chunk: int = 1 << 16) -> Loopback:
    link = Loopback()
    transfer_state(link.send, model, opt, src=0, rank=0, receive=False, device=CPU, chunk_bytes=chunk)
    return link


def _receive(link: Loopback, model, opt, chunk: int = 1 << 16, receive: bool = True):
    return transfer_state(link.receive, model, opt, src=0, rank=1, receive=receive, device=CPU, chunk_bytes=chunk)


def test_round_trip_is_exact():
    torch.manual_seed(0)
    src_model, src_opt = _trained(1, vocab=4096)  # embeddings and output (1 MiB each) cross in place
    rng = torch.get_rng_state()
    link = _send(src_model, src_opt)
    torch.rand(7)  # the receiver's RNG differs from the source's before the transfer
    dst_model = build_model("debug", vocab_size=4096, seq_len=8, seed=2)
    dst_opt = _optimizer(dst_model)
    _receive(link, dst_model, dst_opt)
    assert torch.equal(torch.get_rng_state(), rng)
    for p, q in zip(src_model.parameters(), dst_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(src_opt.state[p]["exp_avg"], dst_opt.state[q]["exp_avg"])
        assert torch.equal(src_opt.state[p]["exp_avg_sq"], dst_opt.state[q]["exp_avg_sq"])
        assert float(src_opt.state[p]["step"]) == float(dst_opt.state[q]["step"]) == 2.0
        assert dst_opt.state[q]["step"].dtype == src_opt.state[p]["step"].dtype
    back = _send(dst_model, dst_opt)
    assert len(back.sent) == len(link.sent)
    assert all(torch.equal(a, b) for a, b in zip(back.sent, link.sent)), "the receiver now sends the same state"


def test_size_mismatch_is_refused():
    model, opt = _trained(1)
    other = build_model("debug", vocab_size=128, seq_len=8, seed=1)
    with pytest.raises(ValueError, match="does not match"):
        _receive(_send(model, opt), other, _optimizer(other))


def test_each_tensor_crosses_in_its_own_dtype_in_chunks_no_larger_than_asked():
    model, opt = _trained(1, vocab=4096, dtype=torch.bfloat16)
    chunk = 100_000
    link = _send(model, opt, chunk)
    params = [p for p in model.parameters()]
    groups = sum(t.nbytes for name, t in capture(model, opt).items() if name.startswith("group."))
    assert groups == 2 * (8 + 16 + 8 + 8), "lr, betas, eps and weight decay of its two groups (flags are config)"
    expected = sum(p.nbytes for p in params) + sum(
        t.nbytes for p in params for t in opt.state[p].values()) + torch.get_rng_state().nbytes + groups
    data = link.sent[2:]  # after the header's length and bytes
    assert sum(t.numel() for t in data) == expected, "bf16 parameters and moments: 2 bytes a value"
    assert max(t.numel() for t in data) <= chunk and len(data) >= expected // chunk
    dst_model = build_model("debug", vocab_size=4096, seq_len=8, seed=3).to(torch.bfloat16)
    dst_opt = _optimizer(dst_model)
    stats = _receive(link, dst_model, dst_opt, chunk)
    assert stats.buffer_bytes <= chunk and stats.largest <= chunk and stats.bytes == expected
    for p, q in zip(params, dst_model.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q)
        assert dst_opt.state[q]["exp_avg"].dtype == opt.state[p]["exp_avg"].dtype
        assert torch.equal(dst_opt.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])


def test_a_bystander_takes_part_but_keeps_its_state():
    src_model, src_opt = _trained(1, vocab=4096)
    link = _send(src_model, src_opt)
    model, opt = _trained(5, vocab=4096, steps=1)
    before = [p.clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    stats = _receive(link, model, opt, receive=False)
    assert link.at == len(link.sent), "every broadcast of the source was matched"
    assert stats.buffer_bytes <= 1 << 16
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_source_without_optimizer_state_clears_the_receivers():
    """Admitted before the first step: no moments yet anywhere, so the joiner must hold none either."""
    fresh = build_model("debug", vocab_size=64, seq_len=8, seed=1)
    link = _send(fresh, _optimizer(fresh))
    model, opt = _trained(2)
    _receive(link, model, opt)
    assert len(opt.state) == 0
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))


def test_the_source_cannot_receive():
    model, opt = _trained(1)
    with pytest.raises(ValueError, match="cannot receive"):
        transfer_state(Loopback().send, model, opt, src=0, rank=0, receive=True, device=CPU)
