"""Per-slot gradient sums and their aggregation (exact mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, SlotWork, apply_reduced, compute_gradient_sums
from unbroken.models import build_model

pytestmark = pytest.mark.timeout(60)

MB, T, V, N = 4, 16, 64, 3


def _batch_fn(step: int, slot: int, rows: tuple[int, int]):
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randint(0, V, (MB, T + 1), generator=g)
    return x[rows[0]:rows[1], :-1], x[rows[0]:rows[1], 1:]


def _model():
    return build_model("debug", vocab_size=V, seq_len=T, seed=3)


def _global_grads(model):
    xs, ys = zip(*(_batch_fn(0, k, (0, MB)) for k in range(N)))
    logits = model(torch.cat(xs))
    F.cross_entropy(logits.reshape(-1, V), torch.cat(ys).reshape(-1)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_sum_over_slots_equals_global_batch_gradient():
    model = _model()
    adapter = LlamaAdapter(model)
    layout = GradLayout(model, adapter)
    total = sum(
        compute_gradient_sums(model, adapter, layout, [SlotWork(k, (0, MB))], step=0, micro_batch=MB, batch_fn=_batch_fn)
        for k in range(N)
    )
    assert layout.weights(total).tolist() == [N, N]
    assert layout.token_count(total) == N * MB * T
    apply_reduced(layout, total)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want = _global_grads(model)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)


def test_row_ranges_weigh_by_rows_and_reassemble():
    model = _model()
    adapter = LlamaAdapter(model)
    layout = GradLayout(model, adapter)
    whole = compute_gradient_sums(model, adapter, layout, [SlotWork(1, (0, MB))], step=2, micro_batch=MB, batch_fn=_batch_fn)
    parts = [compute_gradient_sums(model, adapter, layout, [SlotWork(1, r)], step=2, micro_batch=MB, batch_fn=_batch_fn)
             for r in [(0, 1), (1, 4)]]
    assert layout.weights(parts[0]).tolist() == [0.25, 0.25]
    assert layout.weights(parts[1]).tolist() == [0.75, 0.75]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-7)


def test_zero_weight_group_leaves_grad_none():
    model = _model()
    layout = GradLayout(model, LlamaAdapter(model))
    buf = layout.new_buffer()
    layout.weights(buf)[0] = 2.0  # "rest" computed, "attention" by nobody
    apply_reduced(layout, buf)
    for name, p in zip(layout.names, layout.params):
        assert (p.grad is None) == (".attention." in name or "attention_norm" in name), name


def test_rows_outside_micro_batch_rejected():
    model = _model()
    adapter = LlamaAdapter(model)
    with pytest.raises(ValueError, match="outside micro-batch"):
        compute_gradient_sums(model, adapter, GradLayout(model, adapter), [SlotWork(0, (2, 9))],
                              step=0, micro_batch=MB, batch_fn=_batch_fn)


def test_the_gradients_are_views_of_the_reduction_buffer_and_nothing_is_copied():
    """Backward accumulates into the flat buffer itself (DDP's gradient_as_bucket_view): after the sums of two
    items, every parameter's .grad shares the buffer's storage at its offset, and the sums are the same as
    those computed item by item."""
    model = _model()
    adapter = LlamaAdapter(model)
    layout = GradLayout(model, adapter)
    assert layout.views_possible
    items = [SlotWork(0, (0, MB)), SlotWork(1, (0, 2))]
    buf = compute_gradient_sums(model, adapter, layout, items, step=1, micro_batch=MB, batch_fn=_batch_fn)
    storage = buf.untyped_storage().data_ptr()
    for i, p in enumerate(layout.params):
        assert p.grad.untyped_storage().data_ptr() == storage, layout.names[i]
        assert p.grad.data_ptr() == layout.grad_view(buf, i).data_ptr(), layout.names[i]
    assert layout.copied_bytes == 0
    one = [compute_gradient_sums(model, adapter, layout, [item], step=1, micro_batch=MB, batch_fn=_batch_fn)
           for item in items]
    torch.testing.assert_close(buf[:layout.n_grad], (one[0] + one[1])[:layout.n_grad], rtol=1e-6, atol=1e-7)
