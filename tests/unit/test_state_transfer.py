"""Training state crosses to a joiner as one flat tensor and comes back exactly."""

from __future__ import annotations

import pytest
import torch

from unbroken.config import OptimConfig
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.runtime.state_transfer import pack_state, unpack_state

pytestmark = pytest.mark.timeout(60)


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    o = OptimConfig()
    return build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def _trained(seed: int):
    model = build_model("debug", vocab_size=64, seq_len=8, seed=seed)
    opt = _optimizer(model)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 8))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_is_exact():
    torch.manual_seed(0)
    src_model, src_opt = _trained(1)
    dst_model = build_model("debug", vocab_size=64, seq_len=8, seed=2)
    dst_opt = _optimizer(dst_model)
    unpack_state(pack_state(src_model, src_opt), dst_model, dst_opt)
    for p, q in zip(src_model.parameters(), dst_model.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(src_opt.state[p]["exp_avg"], dst_opt.state[q]["exp_avg"])
        assert torch.equal(src_opt.state[p]["exp_avg_sq"], dst_opt.state[q]["exp_avg_sq"])
        assert float(src_opt.state[p]["step"]) == float(dst_opt.state[q]["step"]) == 2.0
    assert torch.equal(pack_state(src_model, src_opt), pack_state(dst_model, dst_opt))


def test_size_mismatch_is_refused():
    model, opt = _trained(1)
    other = build_model("debug", vocab_size=128, seq_len=8, seed=1)
    with pytest.raises(ValueError, match="does not match"):
        unpack_state(pack_state(model, opt), other, _optimizer(other))
