"""MeCeFO's approximate blocks under ``torch.compile`` (unbroken.mecefo.compiled): same gradients as eager, one
graph of their own, and eager with one warning where a block cannot compile.

Debug preset, CPU, fixed seeds. The comparison with eager runs inductor itself (the CPU's C++ kernels); the others
use ``aot_eager`` (dynamo's and AOTAutograd's graphs without kernels), so they stay quick.
"""

from __future__ import annotations

import logging

import pytest
import torch

from unbroken.job.parallelize import compile_stats, parallelize
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.costs import relative_errors
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums
from unbroken.models import build_model
from unbroken.models.llama import Attention, TransformerBlock

pytestmark = pytest.mark.timeout(300)

MB, T, V = 4, 16, 64
APPROX = [SlotWork(0, (0, MB), "approx"), SlotWork(1, (0, MB), "approx")]


def _batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randint(0, V, (MB, T + 1), generator=g)
    return x[rows[0]:rows[1], :-1], x[rows[0]:rows[1], 1:]


def _sums(model: torch.nn.Module, items: list[SlotWork], step: int = 0,
          compile_backend: str | None = None) -> tuple[torch.Tensor, LlamaAdapter]:
    adapter = LlamaAdapter(model, rank=4, tau=10, compile_backend=compile_backend)
    layout = GradLayout(model, adapter)
    sums = compute_gradient_sums(model, adapter, layout, items, step=step, micro_batch=MB, batch_fn=_batch_fn)
    return sums, adapter


def test_inductor_compiled_approximations_give_the_eager_gradient_and_grad_error():
    items = [SlotWork(0, (0, MB)), *APPROX]  # exact and approximate slots in one step
    exact_items = [SlotWork(w.slot, w.rows) for w in items]
    eager, adapter_e = _sums(build_model("debug", vocab_size=V, seq_len=T, seed=3), items)
    exact, _ = _sums(adapter_e.model, exact_items)
    model = parallelize(build_model("debug", vocab_size=V, seq_len=T, seed=3), compile=True, backend="inductor")
    compiled, adapter = _sums(model, items)
    assert adapter.approx_path.compiled and adapter.approx_path.fallback_reason is None
    # float32 throughout; inductor fuses and reorders sums, so agreement is to rounding, not bit for bit.
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    # bench mecefo-cost's grad_error, ||g~ - g|| / ||g|| per component: the same figures compiled as eager
    layout = GradLayout(adapter_e.model, adapter_e)
    errors_eager, errors_compiled = relative_errors(layout, eager, exact), relative_errors(layout, compiled, exact)
    assert errors_eager["attention"] > 0.01 and errors_eager["ffn"] > 0.01  # the approximation is visible
    assert errors_compiled == pytest.approx(errors_eager, rel=1e-4, abs=1e-6)


def test_approximate_blocks_are_one_graph_without_breaks_and_recompiles_stay_bounded_as_rows_change():
    # dynamo caches graphs per function: one another test in this process compiled with the same backend would
    # be reused here, and nothing counted (the count depended on which tests ran before)
    torch._dynamo.reset()
    model = build_model("debug", vocab_size=V, seq_len=T, seed=3)
    adapter = LlamaAdapter(model, rank=4, tau=10, compile_backend="aot_eager")
    layout = GradLayout(model, adapter)
    before = compile_stats()
    for step, rows in enumerate([(0, 4), (0, 2), (1, 4), (0, 1), (2, 3), (0, 4)]):
        compute_gradient_sums(model, adapter, layout, [SlotWork(0, rows, "approx")], step=step, micro_batch=MB,
                              batch_fn=_batch_fn)
    after = compile_stats()
    assert after["graph_breaks"] == before["graph_breaks"]
    # every block shares one graph, then one with a dynamic batch dimension, and one for a single row (dynamo
    # specialises sizes 0 and 1); steps past tau (new bases) add none
    assert 1 <= after["graphs"] - before["graphs"] <= 3
    assert adapter.approx_path.compiled


class _DataDependentAttention(Attention):
    """A user's attention that branches on a tensor's value: dynamo cannot trace it as one graph."""

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        out = super().forward(x_BTD, rope)
        if out.abs().max() > 1e6:  # a Python branch on data
            out = out.clamp(-1e6, 1e6)
        return out


def _user_model(seed: int) -> torch.nn.Module:
    model = build_model("debug", vocab_size=V, seq_len=T, seed=seed)
    for block in model.modules():
        if isinstance(block, TransformerBlock):
            user = _DataDependentAttention(model.args)
            user.load_state_dict(block.attention.state_dict())
            block.attention = user
    return model


def test_a_block_that_cannot_compile_runs_eager_with_one_warning_and_the_same_gradient(
        caplog: pytest.LogCaptureFixture):
    eager, _ = _sums(_user_model(seed=3), APPROX)
    with caplog.at_level(logging.WARNING, logger="unbroken.mecefo.compiled"):
        first, adapter = _sums(_user_model(seed=3), APPROX, compile_backend="aot_eager")
        again = compute_gradient_sums(adapter.model, adapter, GradLayout(adapter.model, adapter), APPROX, step=1,
                                      micro_batch=MB, batch_fn=_batch_fn)
    warnings = [r.getMessage() for r in caplog.records if r.name == "unbroken.mecefo.compiled"]
    assert len(warnings) == 1, warnings
    assert "TransformerBlock" in warnings[0] and "run eager" in warnings[0]
    assert "data" in adapter.approx_path.fallback_reason.lower()  # dynamo's reason, named
    assert not adapter.approx_path.compiled
    torch.testing.assert_close(first, eager, rtol=0, atol=0)  # eager after the fallback: bit for bit
    assert torch.isfinite(again).all()
