"""MeCeFO's approximate graphs compiled at a worker's start (unbroken.mecefo.warm_up): the first takeover step then
compiles nothing, and the warm-up changes no bit of what is trained.

A real job of the debug preset with ``train.compile`` on (CPU: inductor's kernels, as a worker builds it), the
worker's plan (:class:`~unbroken.sharding.work_plan.SlotPlan`) and the worker's derivation of what to warm; the
steps are the ones worker 0 computes and applies when worker 1 is lost (its own slot and the lost one's, both
approximated under ``neighbor``).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from unbroken.config import load_config
from unbroken.job import Job, build_job
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, compute_gradient_sums
from unbroken.mecefo.takeover import takeover_policy
from unbroken.mecefo.warm_up import takeover_rows, warm_up
from unbroken.models import build_model
from unbroken.models.llama import Attention, TransformerBlock
from unbroken.runtime.digest import param_digest
from unbroken.sharding.work_plan import SlotPlan

pytestmark = pytest.mark.timeout(600)

CPU = torch.device("cpu")
MB = 2
LIVE_BY_STEP = ([0, 1], [0], [0])
"""Worker 1 is lost from step 1 on: worker 0's first takeover step is step 1."""


def _cfg(corpus_overrides: list[str]):
    return load_config(preset_name="debug", overrides=[
        *corpus_overrides, "train.workers=2", f"data.micro_batch={MB}", "train.device=cpu", "train.compile=true",
        "mecefo.policy=neighbor"])


def _plan(job: Job) -> SlotPlan:
    return SlotPlan(takeover_policy(job.cfg.mecefo.policy), job.n_slots, job.micro_batch)


def _warm(job: Job) -> dict | None:
    """What a worker's start does (runtime/worker_entry.py), for worker 0 of 2."""
    assert isinstance(job.adapter, LlamaAdapter)
    rows = takeover_rows(lambda live: _plan(job).assign(0, live), 0, 2)
    return warm_up(job.adapter, job.layout, rows, micro_batch=job.micro_batch, batch_fn=job.sampler.batch,
                   device=job.device, precision=job.cfg.train.precision, loss_fn=job.loss_fn)


def _train(job: Job, step: int) -> int:
    """Worker 0's step ``step``; returns the graphs dynamo captured during it."""
    before = counters["stats"]["unique_graphs"]
    items = _plan(job).assign(0, LIVE_BY_STEP[step])
    job.apply(step, job.gradient_sums(step, items))
    return counters["stats"]["unique_graphs"] - before


def test_the_first_takeover_step_compiles_nothing_after_the_warm_up_and_trains_the_same_bits(corpus_overrides):
    cfg = _cfg(corpus_overrides)
    # Without the warm-up: the takeover step (1) compiles the approximate graphs.
    torch._dynamo.reset()
    cold = build_job(cfg, CPU)
    compiled_cold = [_train(cold, step) for step in range(len(LIVE_BY_STEP))]
    assert compiled_cold[1] > 0, "the takeover compiles without a warm-up (else this test shows nothing)"

    torch._dynamo.reset()  # graphs are cached per function: the warmed job starts from none, as a new process
    warmed = build_job(cfg, CPU)
    params = [p.detach().clone() for p in warmed.layout.params]
    rng = torch.get_rng_state()
    done = _warm(warmed)
    assert done is not None and done["rows"] == [MB] and done["compiled"] and done["graphs"] > 0
    # Nothing of the training state changed: parameters, gradients, optimizer, RNG.
    assert all(torch.equal(a, p) for a, p in zip(params, warmed.layout.params))
    assert all(p.grad is None for p in warmed.layout.params)
    assert not warmed.optimizer.state
    assert torch.equal(torch.get_rng_state(), rng)

    compiled_warm = [_train(warmed, step) for step in range(len(LIVE_BY_STEP))]
    assert compiled_warm[1:] == [0, 0], "the first takeover step compiled nothing new"
    assert param_digest(warmed.layout.params) == param_digest(cold.layout.params)


@pytest.mark.parametrize(("policy", "world", "expected"), [
    ("neighbor", 2, [MB]),
    ("neighbor", 4, [MB]),
    ("spread", 4, []),  # exact: nothing to warm
    ("spread-approx", 3, [1]),  # a lost slot's 2 rows split over 2 survivors
    ("spread-approx", 2, [MB]),
])
def test_what_a_worker_warms_is_what_it_approximates_when_any_one_peer_is_lost(policy, world, expected):
    plan = SlotPlan(takeover_policy(policy), world, MB)
    assert takeover_rows(lambda live: plan.assign(0, live), 0, world) == expected


def test_spread_approx_takeovers_of_several_row_counts_compile_nothing_after_the_warm_up():
    """Eight rows over three survivors (3, 3, 2): one static graph and one with a dynamic batch dimension, warmed."""
    torch._dynamo.reset()
    model = build_model("debug", vocab_size=64, seq_len=16, seed=3)
    adapter = LlamaAdapter(model, rank=4, tau=10, compile_backend="aot_eager")
    layout = GradLayout(model, adapter)
    plan = SlotPlan(takeover_policy("spread-approx"), 4, 8)

    def batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1000 * step + slot))
        return x[rows[0]:rows[1], :-1], x[rows[0]:rows[1], 1:]

    rows = takeover_rows(lambda live: plan.assign(0, live), 0, 4)
    assert rows == [3, 2]
    warm_up(adapter, layout, rows, micro_batch=8, batch_fn=batch_fn, device=CPU, precision="fp32",
            loss_fn=_loss)
    for dead in (1, 2, 3):
        before = counters["stats"]["unique_graphs"]
        items = plan.assign(0, [w for w in range(4) if w != dead])
        compute_gradient_sums(model, adapter, layout, items, step=dead, micro_batch=8, batch_fn=batch_fn,
                              loss_fn=_loss)
        assert counters["stats"]["unique_graphs"] == before, f"a takeover of worker {dead}'s rows compiled"


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                                             reduction="sum")


class _DataDependentAttention(Attention):
    """A user's attention that branches on a tensor's value: dynamo cannot trace it as one graph."""

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = super().forward(x_BTD, rope)
        if out.abs().max() > 1e6:  # a Python branch on data
            out = out.clamp(-1e6, 1e6)
        return out


def test_a_block_that_cannot_compile_falls_back_at_the_start_with_one_warning(caplog: pytest.LogCaptureFixture):
    model = build_model("debug", vocab_size=64, seq_len=16, seed=3)
    for block in model.modules():
        if isinstance(block, TransformerBlock):
            block.attention = _DataDependentAttention(model.args)
    adapter = LlamaAdapter(model, rank=4, tau=10, compile_backend="aot_eager")
    layout = GradLayout(model, adapter)

    def batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, 64, (MB, 17), generator=torch.Generator().manual_seed(slot))
        return x[rows[0]:rows[1], :-1], x[rows[0]:rows[1], 1:]

    with caplog.at_level(logging.WARNING, logger="unbroken.mecefo.compiled"):
        done = warm_up(adapter, layout, [MB], micro_batch=MB, batch_fn=batch_fn, device=CPU, precision="fp32",
                       loss_fn=_loss)
    assert done is not None and not done["compiled"] and "data" in done["fallback"].lower()
    assert len([r for r in caplog.records if r.name == "unbroken.mecefo.compiled"]) == 1
    assert not adapter.approx_path.compiled  # the takeover runs eager, and warns no more
    assert warm_up(adapter, layout, [MB], micro_batch=MB, batch_fn=batch_fn, device=CPU, precision="fp32",
                   loss_fn=_loss) is None
