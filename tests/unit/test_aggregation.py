"""The MeCeFO aggregation rule under each takeover policy, on hand-computable cases.

Attention parameters are averaged over the slots computed exactly, every other
parameter over all n slots; per-worker buffers are summed (the all-reduce) and
``apply_step`` divides each group's sum by its weight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from unbroken.mecefo.adapter import LlamaAdapter, component_of
from unbroken.mecefo.gradients import GradLayout, apply_reduced, apply_step, compute_gradient_sums
from unbroken.mecefo.takeover import POLICIES
from unbroken.models import build_model

pytestmark = pytest.mark.timeout(60)

N, MB, T, V = 4, 4, 16, 64


def _batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randint(0, V, (MB, T + 1), generator=g)
    return x[rows[0]:rows[1], :-1], x[rows[0]:rows[1], 1:]


def _reduced(policy: str, live: set[int]) -> tuple[torch.nn.Module, GradLayout, torch.Tensor]:
    """Model, layout and the sum of every live worker's buffer under ``policy``."""
    model = build_model("debug", vocab_size=V, seq_len=T, seed=3)
    adapter = LlamaAdapter(model, rank=4, tau=10)
    layout = GradLayout(model, adapter)
    work = POLICIES[policy].assign(n_slots=N, live=live, micro_batch=MB)
    total = sum(compute_gradient_sums(model, adapter, layout, items, step=0, micro_batch=MB, batch_fn=_batch_fn)
                for _, items in sorted(work.items()))
    return model, layout, total


@pytest.mark.parametrize("policy, live, rest, attention", [
    # one failure: the covering worker approximates its own slot too, so 4 - 2 exact slots
    ("neighbor", {0, 1, 3}, 4.0, 2.0),
    # two adjacent failures: one covering worker (3), one exact slot (0)
    ("neighbor", {0, 3}, 4.0, 1.0),
    # two non-adjacent failures: both survivors cover, no exact slot at all
    ("neighbor", {1, 3}, 4.0, 0.0),
    # spread is exact everywhere: every group weighs n
    ("spread", {0, 1, 3}, 4.0, 4.0),
    ("spread", {0, 3}, 4.0, 4.0),
    # spread-approx: own slots exact, the dead slots' rows approximated
    ("spread-approx", {0, 1, 3}, 4.0, 3.0),
    ("spread-approx", {1, 3}, 4.0, 2.0),
    # no failure: plain data parallelism
    ("neighbor", {0, 1, 2, 3}, 4.0, 4.0),
])
def test_group_weights(policy, live, rest, attention):
    _, layout, total = _reduced(policy, live)
    assert layout.group_names == ("rest", "attention")
    assert layout.weights(total).tolist() == [rest, attention]
    assert layout.token_count(total) == N * MB * T, "the whole global batch is trained"


def test_neighbor_attention_is_mean_over_exact_slots():
    model, layout, total = _reduced("neighbor", {0, 1, 3})  # exact slots: 0 and 1
    apply_reduced(layout, total)
    got = {n: p.grad.clone() for n, p in zip(layout.names, layout.params) if component_of(n) == "attention"}
    model.zero_grad(set_to_none=True)
    xs, ys = zip(*(_batch_fn(0, k, (0, MB)) for k in (0, 1)))
    F.cross_entropy(model(torch.cat(xs)).reshape(-1, V), torch.cat(ys).reshape(-1)).backward()
    assert got, "the model has attention parameters"
    for name, grad in got.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-5, atol=1e-7, msg=name)


def test_neighbor_without_exact_slot_leaves_attention_untouched():
    model, layout, total = _reduced("neighbor", {1, 3})
    apply_reduced(layout, total)
    for name, p in zip(layout.names, layout.params):
        assert (p.grad is None) == (component_of(name) == "attention"), name


# --- apply_step on hand-made buffers --------------------------------------------


class _TwoGroups:
    """A minimal ModelAdapter: parameters under ``attention`` form group 1, the rest group 0."""

    group_names = ("rest", "attention")

    def group_of(self, param_name: str) -> int:
        return 1 if param_name.startswith("attention") else 0

    def dropped_in_approx(self, group_name: str) -> bool:
        return group_name == "attention"

    @contextlib.contextmanager
    def mode(self, mode: str, *, step: int) -> Iterator[None]:
        yield


def _tiny_model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.attention = torch.nn.Linear(2, 1, bias=False)  # 2 elements, group 1
    model.ffn = torch.nn.Linear(3, 1, bias=False)  # 3 elements, group 0
    with torch.no_grad():
        model.attention.weight.fill_(1.0)
        model.ffn.weight.fill_(1.0)
    return model


@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_apply_step_equals_manual_formula(grad_clip):
    model = _tiny_model()
    layout = GradLayout(model, _TwoGroups())
    assert layout.n_grad == 5 and layout.size == 5 + 2 + 3
    # Three workers of a 4-slot neighbor step with slot 2 dead: workers 0 and 1 exact,
    # worker 3 covers slot 2, both approximated (no attention sum, weight 0 for it).
    # Layout: [attention (2), ffn (3), weight rest, weight attention, admit, loss_sum, tokens].
    bufs = [
        torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 5.0, 10.0]),
        torch.tensor([3.0, 6.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.0, 7.0, 10.0]),
        torch.tensor([0.0, 0.0, 9.0, 9.0, 9.0, 2.0, 0.0, 0.0, 8.0, 20.0]),
    ]
    total = sum(bufs)
    assert layout.weights(total).tolist() == [4.0, 2.0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norm = apply_step(layout, total, opt, lr=0.5, grad_clip=grad_clip)
    # attention: (1+3, 2+6) / 2 = (2, 4); ffn: (1+2+9) / 4 = 3 each; norm sqrt(4+16+27) ~ 6.86.
    want_att, want_ffn = torch.tensor([[2.0, 4.0]]), torch.full((1, 3), 3.0)
    assert norm == pytest.approx((4 + 16 + 27) ** 0.5)
    clip = min(1.0, grad_clip / norm) if grad_clip else 1.0
    torch.testing.assert_close(model.attention.weight.grad, want_att * clip)
    torch.testing.assert_close(model.ffn.weight.grad, want_ffn * clip)
    torch.testing.assert_close(model.attention.weight.detach(), 1.0 - 0.5 * want_att * clip)
    torch.testing.assert_close(model.ffn.weight.detach(), 1.0 - 0.5 * want_ffn * clip)
    assert layout.loss_sum(total) / layout.token_count(total) == pytest.approx(20.0 / 40.0)


# --- a fused optimizer divides inside its kernel ------------------------------------------


def _fused_case(policy: str, live: set[int], grad_clip: float):
    """The reduced step of ``policy`` with ``live`` slots applied twice to copies of one model: by
    ``apply_step`` with a fused AdamW (the CUDA optimizer; torch runs it on the CPU too), and by hand
    (each group's sum over its weight, ``clip_grad_norm_``, the same fused AdamW)."""
    model, layout, total = _reduced(policy, live)
    twin = build_model("debug", vocab_size=V, seq_len=T, seed=3)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, twin)]
    norm = apply_step(layout, total.clone(), opts[0], lr=1e-2, grad_clip=grad_clip)
    twin_layout = GradLayout(twin, LlamaAdapter(twin, rank=4, tau=10))
    apply_reduced(twin_layout, total.clone())
    params = [p for p in twin.parameters() if p.grad is not None]
    want = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip else float("inf"), foreach=False)
    opts[1].step()
    assert not hasattr(opts[0], "grad_scale")  # the scale was the step's only
    return model, twin, norm, float(want), layout, total


@pytest.mark.parametrize("grad_clip", [0.0, 1e-3])
def test_a_fused_optimizer_given_equal_weights_scales_the_sums_in_its_kernel_as_division_and_clip_would(grad_clip):
    model, twin, norm, want, layout, total = _fused_case("neighbor", set(range(N)), grad_clip)
    assert layout.weights(total).tolist() == [N, N]  # every slot exact: one weight
    assert norm == pytest.approx(want, rel=1e-6)
    if grad_clip:
        assert want > 10 * grad_clip  # the clip acts
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-6, msg=name)
        # the parameter's gradient is its slice of the buffer, divided in place by the kernel
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8, msg=name)
    grads = [p.grad for p in model.parameters()]
    assert all(g.untyped_storage().data_ptr() == grads[0].untyped_storage().data_ptr() for g in grads)
    assert layout.loss_sum(total) / layout.token_count(total) > 0


def test_a_fused_optimizer_given_groups_of_different_weights_divides_each_by_its_own():
    model, twin, norm, want, layout, total = _fused_case("neighbor", {0, 1, 3}, 0.0)
    w = layout.weights(total).tolist()
    assert w[0] != w[1]  # slot 2 approximated: attention has fewer slot-equivalents
    assert norm == want
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a.detach(), b.detach()), name  # the same divisions, the same kernel


def test_only_a_fused_torch_optimizer_of_plain_tensors_is_given_the_scale():
    from unbroken.mecefo.gradients import _scales_gradients

    model = _tiny_model()
    layout = GradLayout(model, _TwoGroups())
    assert _scales_gradients(torch.optim.AdamW(model.parameters(), fused=True), layout)
    assert not _scales_gradients(torch.optim.AdamW(model.parameters(), foreach=False), layout)
    assert not _scales_gradients(torch.optim.RMSprop(model.parameters()), layout)
