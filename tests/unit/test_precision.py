"""bf16 mixed precision (train.precision): autocast engaged, float32 master state, bf16-close to float32,
and checkpoints that give every tensor back in its own dtype, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.config import Config
from unbroken.job import build_job
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.models.precision import check_precision
from unbroken.checkpoint.checkpointer import AsyncCheckpointer, latest_checkpoint, load_checkpoint, training_state

pytestmark = pytest.mark.timeout(120)

VOCAB, SEQ, MB = 512, 16, 4
BF16_RTOL = 2e-2
"""bf16 keeps 8 bits of mantissa (relative spacing 2^-8 = 0.4%); sums of many products stay within a few times that."""


def _batch(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + slot)
    xy = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)[rows[0]:rows[1]]
    return xy[:, :-1], xy[:, 1:]


@pytest.mark.parametrize("mode", ["exact", "approx"])
def test_bf16_gradients_are_float32_and_close_to_fp32(mode: str) -> None:
    model = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=0)
    adapter = LlamaAdapter(model, rank=8, tau=10)
    layout = GradLayout(model, adapter)
    seen: list[torch.dtype] = []
    model.layers[0].attention.wq.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    sums = {p: compute_gradient_sums(model, adapter, layout, [SlotWork(0, (0, MB), mode)], step=0, micro_batch=MB,
                                     batch_fn=_batch, precision=p) for p in ("fp32", "bf16")}
    assert seen == [torch.float32, torch.bfloat16], "the bf16 forward ran under autocast"
    a, b = sums["fp32"], sums["bf16"]
    assert b.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(a, b)
    assert float((a - b).norm() / a.norm()) < BF16_RTOL
    assert abs(float(a[-2]) - float(b[-2])) < BF16_RTOL * float(a[-2])  # the loss sum


class _Rows:
    """A map-style dataset of 64 seeded random token rows (a repeated few, so the loss can fall)."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.rows = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0)).repeat(8, 1)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def random_rows(ctx: object) -> _Rows:
    return _Rows()


def _job(precision: str) -> object:
    cfg = Config()
    cfg.train.workers, cfg.train.steps, cfg.train.device, cfg.train.precision = 2, 6, "cpu", precision
    cfg.data.factory, cfg.data.micro_batch, cfg.data.seq_len = f"{__file__}:random_rows", 4, SEQ
    cfg.optim.warmup_steps = 1
    return build_job(cfg, torch.device("cpu"))


def test_bf16_training_follows_fp32_with_float32_master_state() -> None:
    jobs = {p: _job(p) for p in ("fp32", "bf16")}
    losses: dict[str, list[float]] = {p: [] for p in jobs}
    for p, job in jobs.items():
        for step in range(job.cfg.train.steps):
            reduced = job.gradient_sums(step, [SlotWork(0, (0, 4)), SlotWork(1, (0, 4))])
            job.apply(step, reduced)
            losses[p].append(job.loss(reduced))
    torch.testing.assert_close(torch.tensor(losses["bf16"]), torch.tensor(losses["fp32"]), rtol=BF16_RTOL, atol=0)
    assert losses["bf16"][-1] < losses["bf16"][0]
    bf = jobs["bf16"]
    for p in bf.model.parameters():
        assert p.dtype == torch.float32
        assert bf.optimizer.state[p]["exp_avg"].dtype == torch.float32
        assert bf.optimizer.state[p]["exp_avg_sq"].dtype == torch.float32
    # Adam normalises each element's step, so a tiny gradient's rounding can flip its sign: compare the
    # whole update (measured: 3.6% apart after 6 steps, while the losses agree to 2e-4).
    init = _job("fp32").model.parameters()
    diff = sum(float((p - q).detach().norm()) ** 2 for p, q in zip(bf.model.parameters(), jobs["fp32"].model.parameters()))
    update = sum(float((q - i).detach().norm()) ** 2 for q, i in zip(jobs["fp32"].model.parameters(), init))
    assert (diff / update) ** 0.5 < 0.1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_gives_each_tensor_back_in_its_dtype(tmp_path: Path) -> None:
    """A model mixing float32 and bfloat16 parameters (a user's may) round-trips bit for bit."""
    model = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=1)
    model.layers[1].to(torch.bfloat16)
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randint(0, VOCAB, (2, SEQ))).float().sum()
    loss.backward()
    opt.step()
    ckpt = AsyncCheckpointer(tmp_path, config_hash="h")
    ckpt.save(1, training_state(model, opt), {"loss": 0.0})
    ckpt.wait()
    other = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=2)
    other.layers[1].to(torch.bfloat16)
    other_opt = build_optimizer(other, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    load_checkpoint(latest_checkpoint(tmp_path), other, other_opt, config_hash="h")
    dtypes = set()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert q.dtype == p.dtype and torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt.state[p][key], other_opt.state[q][key]
            assert a.dtype == b.dtype and torch.equal(a, b), (name, key)
        dtypes.add(p.dtype)
    assert dtypes == {torch.float32, torch.bfloat16}


def test_bf16_on_a_gpu_without_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="train.precision='fp16': expected one of fp32, bf16"):
        check_precision("fp16", torch.device("cpu"))
    check_precision("bf16", torch.device("cpu"))
    # No such GPU here: the capability query answers as a pre-Ampere card's would.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(ValueError, match=r"'bf16' but Tesla V100 \(cuda:0\) has no bfloat16 support.*'fp32'"):
        check_precision("bf16", torch.device("cuda", 0))
