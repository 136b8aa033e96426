"""Unit tests for MeCeFO's approximate mode (unbroken.mecefo.adapter / approx / lowrank).

Debug preset, CPU, fixed seeds. Exact mode is compared bit for bit; approximate
gradients against hand-written references of the same math.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from unbroken.mecefo.adapter import LlamaAdapter, component_of
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums
from unbroken.mecefo.lowrank import LowRankBasis, lowrank_linear
from unbroken.models import Transformer, model_args
from unbroken.models.llama import TransformerBlock

pytestmark = pytest.mark.timeout(120)

VOCAB = 4096
D = 64  # debug dim
MICRO_BATCH = 2
SEQ = 16


def _model(seed: int = 0) -> Transformer:
    model = Transformer(model_args("debug"))
    model.init_weights(seed=seed)
    return model


def _tokens(batch: int = MICRO_BATCH, seq: int = SEQ, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return xy[:, :-1], xy[:, 1:]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _rope(model: Transformer, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    return model.rope_cos[:seq], model.rope_sin[:seq]


def _block_input(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MICRO_BATCH, SEQ, D, generator=g).requires_grad_()


class _SavedCounter:
    """Saved-for-backward tensors during a forward: count and unique activation bytes."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._persistent = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self.count = 0
        self.storages: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count += 1
        storage = t.untyped_storage()
        if storage._cdata not in self._persistent:
            self.storages[storage._cdata] = storage.nbytes()
        return t

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self._pack, lambda t: t)


# ---- exact mode ---------------------------------------------------------------------------


def test_exact_mode_is_bit_identical_to_plain_model() -> None:
    plain, adapted = _model(), _model()
    adapter = LlamaAdapter(adapted)
    x, y = _tokens()
    loss_plain = _loss(plain, x, y)
    loss_plain.backward()
    with adapter.mode("exact", step=3):
        loss_exact = _loss(adapted, x, y)
        loss_exact.backward()
    assert torch.equal(loss_plain, loss_exact)
    expected, got = _grads(plain), _grads(adapted)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # Outside any context the adapter is exact too, and nothing was rebuilt.
    assert list(adapted.state_dict()) == list(plain.state_dict())
    assert torch.equal(_loss(adapted, x, y), loss_plain)


def test_approx_mode_keeps_forward_values_and_parameters() -> None:
    model = _model()
    params_before = [p for p in model.parameters()]
    adapter = LlamaAdapter(model)
    x, y = _tokens()
    exact = _loss(model, x, y)
    with adapter.mode("approx", step=0):
        approx = _loss(model, x, y)
    assert torch.equal(exact, approx)
    assert all(a is b for a, b in zip(params_before, model.parameters()))


def test_modes_nest_and_restore() -> None:
    model = _model()
    first, second = LlamaAdapter(model), LlamaAdapter(model, rank=4)
    switch = first._switch
    assert second._switch is switch  # one switch per model, whatever the number of adapters
    with first.mode("approx", step=0):
        assert switch.active is not None and switch.active.adapter is first
        with second.mode("exact", step=0):
            assert switch.active is None
        assert switch.active.adapter is first
    assert switch.active is None
    with pytest.raises(ValueError, match="mode 'fast'"):
        with first.mode("fast", step=0):
            pass


# ---- low-rank weight gradients ------------------------------------------------------------


def _lowrank_case(m: int, n: int, rank: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(m, n, generator=g, dtype=torch.float64).requires_grad_()
    x = torch.randn(3, 5, n, generator=g, dtype=torch.float64).requires_grad_()
    g_y = torch.randn(3, 5, m, generator=g, dtype=torch.float64)
    v = torch.linalg.svd(weight.detach(), full_matrices=False)[2][:rank].T
    return weight, x, g_y, v


def test_lowrank_full_rank_equals_exact_gradient() -> None:
    weight, x, g_y, v = _lowrank_case(m=12, n=8, rank=8)  # n <= m: V spans every input direction
    lowrank_linear(x, weight, v).backward(g_y)
    g_w, g_x = weight.grad.clone(), x.grad.clone()
    weight.grad = x.grad = None
    F.linear(x, weight).backward(g_y)
    torch.testing.assert_close(g_w, weight.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(g_x, x.grad)


@pytest.mark.parametrize("m, n", [(12, 8), (8, 12)])
def test_lowrank_gradient_is_the_projection_formula(m: int, n: int) -> None:
    rank = 3
    weight, x, g_y, v = _lowrank_case(m=m, n=n, rank=rank)
    y = lowrank_linear(x, weight, v)
    assert torch.equal(y, F.linear(x, weight))
    y.backward(g_y)
    g_mat, x_mat = g_y.reshape(-1, m), x.detach().reshape(-1, n)
    expected = g_mat.T @ x_mat @ v @ v.T  # G_y^T X V1 V1^T
    torch.testing.assert_close(weight.grad, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, g_y @ weight.detach(), rtol=1e-12, atol=1e-12)  # exact


def test_lowrank_saves_xv_instead_of_x() -> None:
    weight, x, _, v = _lowrank_case(m=12, n=8, rank=2)
    shapes = []
    with saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        lowrank_linear(x, weight, v)
    assert (3, 5, 2) in shapes and (3, 5, 8) not in shapes


def _manual_approx_block(block: TransformerBlock, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                         bases: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """Reference: attention as a constant, plain FFN; ``bases`` project each FFN weight's gradient."""
    with torch.no_grad():
        attn = block.attention(block.attention_norm(x), rope)
    h = x + attn
    ff = block.feed_forward
    if bases is None:
        return h + ff(block.ffn_norm(h))
    z = block.ffn_norm(h)
    gate = F.silu(lowrank_linear(z, ff.w1.weight, bases["w1"])) * lowrank_linear(z, ff.w3.weight, bases["w3"])
    return h + lowrank_linear(gate, ff.w2.weight, bases["w2"])


def test_full_rank_block_matches_reference_up_to_row_space_projection() -> None:
    model = _model()
    adapter = LlamaAdapter(model, rank=D)  # D = min(m, n) of every FFN weight
    block, rope, x = model.layers[0], _rope(model), _block_input()
    g_out = torch.randn(MICRO_BATCH, SEQ, D, generator=torch.Generator().manual_seed(2))
    with adapter.mode("approx", step=0):
        block(x, rope).backward(g_out)
    got = {w: getattr(block.feed_forward, w).weight.grad.clone() for w in ("w1", "w2", "w3")}
    model.zero_grad(set_to_none=True)
    _manual_approx_block(block, x.detach().requires_grad_(), rope, bases=None).backward(g_out)
    ref = {w: getattr(block.feed_forward, w).weight.grad for w in ("w1", "w2", "w3")}
    # w1, w3 are (176, 64): 64 right singular vectors span R^64, so the gradient is exact.
    for w in ("w1", "w3"):
        torch.testing.assert_close(got[w], ref[w], rtol=1e-4, atol=1e-6)
    # w2 is (64, 176): rank 64 projects onto the weight's row space.
    v2 = torch.linalg.svd(block.feed_forward.w2.weight.detach(), full_matrices=False)[2].T
    torch.testing.assert_close(got["w2"], ref["w2"] @ v2 @ v2.T, rtol=1e-4, atol=1e-6)


# ---- skip-connected attention -------------------------------------------------------------


def test_skip_attention_drops_attention_gradients_only() -> None:
    model = _model()
    adapter = LlamaAdapter(model)
    x, y = _tokens()
    with adapter.mode("approx", step=0):
        _loss(model, x, y).backward()
    for name, grad in _grads(model).items():
        if component_of(name) == "attention":
            assert grad is None, name
        else:
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_block_input_gradient_flows_through_identity_and_ffn_only() -> None:
    model = _model()
    adapter = LlamaAdapter(model, rank=4)
    block, rope = model.layers[0], _rope(model)
    g_out = torch.randn(MICRO_BATCH, SEQ, D, generator=torch.Generator().manual_seed(2))
    x = _block_input()
    with adapter.mode("approx", step=0):
        out = block(x, rope)
        out.backward(g_out)
    x_ref = _block_input()
    out_ref = _manual_approx_block(block, x_ref, rope, bases=None)
    out_ref.backward(g_out)
    assert torch.equal(out, out_ref)
    # Low rank touches weight gradients only, so d out / d x is the plain reference's.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-7)
    # ... which is not the exact block's: the attention path really is cut.
    x_exact = _block_input()
    block.forward.exact_forward(x_exact, rope).backward(g_out)
    assert not torch.allclose(x.grad, x_exact.grad, rtol=1e-3, atol=1e-5)


def _saved_in_block(model: Transformer, adapter: LlamaAdapter, mode: str) -> tuple[int, list[tuple[int, ...]]]:
    """(tensors saved while inside attention/attention_norm, shapes of saved non-parameter tensors)."""
    block = model.layers[0]
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    inside = [False]
    in_attention = [0]
    shapes = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        in_attention[0] += inside[0]
        if t.untyped_storage()._cdata not in params:
            shapes.append(tuple(t.shape))
        return t

    handles = []
    for sub in (block.attention_norm, block.attention):
        handles.append(sub.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        handles.append(sub.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    try:
        with adapter.mode(mode, step=0), saved_tensors_hooks(pack, lambda t: t):
            block(_block_input(), _rope(model))
    finally:
        for h in handles:
            h.remove()
    return in_attention[0], shapes


@pytest.mark.parametrize("recompute", [True, False])
def test_no_attention_activations_saved_in_approx_mode(recompute: bool) -> None:
    model = _model()
    adapter = LlamaAdapter(model, rank=8, recompute=recompute)
    exact_attn, exact_shapes = _saved_in_block(model, adapter, "exact")
    approx_attn, approx_shapes = _saved_in_block(model, adapter, "approx")
    assert exact_attn > 0 and approx_attn == 0
    assert len(approx_shapes) < len(exact_shapes)
    if recompute:
        # Only the FFN branch's input and w2's r-wide projection gate @ V2.
        assert sorted(approx_shapes) == [(MICRO_BATCH, SEQ, 8), (MICRO_BATCH, SEQ, D)]


# ---- recomputation -----------------------------------------------------------------------


def test_recompute_gives_same_gradients_with_fewer_saved_bytes() -> None:
    x, y = _tokens()
    results = {}
    for recompute in (True, False):
        model = _model()
        adapter = LlamaAdapter(model, rank=8, recompute=recompute)
        counter = _SavedCounter(model)
        with adapter.mode("approx", step=0):
            with counter.hooks():
                loss = _loss(model, x, y)
            loss.backward()
        results[recompute] = (_grads(model), counter.bytes)
    (with_grads, with_bytes), (without_grads, without_bytes) = results[True], results[False]
    for name, grad in without_grads.items():
        if grad is None:
            assert with_grads[name] is None, name
        else:
            torch.testing.assert_close(with_grads[name], grad, rtol=1e-6, atol=1e-8)
    assert with_bytes < without_bytes


def test_approx_saves_fewer_bytes_than_exact() -> None:
    x, y = _tokens()
    model = _model()
    adapter = LlamaAdapter(model)
    saved = {}
    for mode in ("exact", "approx"):
        counter = _SavedCounter(model)
        with adapter.mode(mode, step=0), counter.hooks():
            _loss(model, x, y)
        saved[mode] = counter.bytes
    assert saved["approx"] < saved["exact"]


# ---- SVD refresh -------------------------------------------------------------------------


def test_svd_refreshes_exactly_when_step_crosses_a_multiple_of_tau(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_svd = torch.linalg.svd

    def counting_svd(a: torch.Tensor, *args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        calls.append(tuple(a.shape))
        return real_svd(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting_svd)
    model = _model()
    adapter = LlamaAdapter(model, rank=4, tau=3)
    n_ffn = 3 * len(adapter.blocks())
    x, y = _tokens()
    # (step, SVDs expected): a refresh exactly when step // 3 changes, also going back.
    for step, count in [(0, n_ffn), (1, 0), (2, 0), (3, n_ffn), (5, 0), (6, n_ffn), (8, 0), (12, n_ffn), (1, n_ffn)]:
        before = len(calls)
        with adapter.mode("approx", step=step):
            _loss(model, x, y).backward()  # backward recomputes the FFN: must not refresh
        assert len(calls) - before == count, f"step {step}"
        assert adapter.basis.svd_count == len(calls)
    assert set(calls) == {(176, 64), (64, 176)}


def test_basis_is_float32_svd_of_detached_weight() -> None:
    basis = LowRankBasis(rank=3, tau=10)
    w = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    v = basis.get("w", w, step=0)
    expected = torch.linalg.svd(w.detach(), full_matrices=False)[2][:3].T
    assert v.shape == (8, 3) and not v.requires_grad
    assert torch.equal(v, expected)
    assert basis.get("w", w * 2, step=9) is v  # same period: cached, even though the weight changed


# ---- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, "rank=0 must be >= 1"),
    ({"tau": 0}, "tau=0 must be >= 1"),
    ({"rank": D + 1}, r"rank=65 exceeds min\(m, n\)=64 of layers\.0\.feed_forward\.w1\.weight "
                      r"\(shape \(176, 64\)\); use a rank <= 64"),
])
def test_bad_settings_are_rejected(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaAdapter(_model(), **kwargs)


def test_non_llama_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="no TransformerBlock"):
        LlamaAdapter(torch.nn.Linear(3, 3))


# ---- gradient aggregation with mixed modes ----------------------------------------------


def _batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _tokens(seed=1000 * step + slot)
    return x[rows[0]:rows[1]], y[rows[0]:rows[1]]


def _sums(model: Transformer, adapter: LlamaAdapter, work: list[SlotWork]) -> tuple[GradLayout, torch.Tensor]:
    layout = GradLayout(model, adapter)
    buf = compute_gradient_sums(model, adapter, layout, work, step=4, micro_batch=MICRO_BATCH, batch_fn=_batch_fn)
    return layout, buf


def _attention_indices(layout: GradLayout) -> Iterator[int]:
    return (i for i, g in enumerate(layout.groups) if layout.group_names[g] == "attention")


def test_mixed_exact_and_approx_work_items() -> None:
    model = _model()
    adapter = LlamaAdapter(model)
    full = (0, MICRO_BATCH)
    mixed = [SlotWork(0, full, "exact"), SlotWork(1, full, "approx"), SlotWork(2, (0, 1), "exact"),
             SlotWork(3, full, "approx")]
    layout, buf = _sums(model, adapter, mixed)
    weights = dict(zip(layout.group_names, layout.weights(buf).tolist()))
    assert weights == {"attention": 1.5, "rest": 3.5}  # attention counts exact items only
    _, exact_only = _sums(model, adapter, [w for w in mixed if w.mode == "exact"])
    _, approx_only = _sums(model, adapter, [w for w in mixed if w.mode == "approx"])
    for i in _attention_indices(layout):
        view = layout.grad_view(buf, i)
        assert torch.equal(view, layout.grad_view(exact_only, i)), layout.names[i]
        assert not layout.grad_view(approx_only, i).any(), layout.names[i]
    # Every other parameter sums both kinds of item.
    rest = [i for i, g in enumerate(layout.groups) if layout.group_names[g] == "rest"]
    for i in rest:
        torch.testing.assert_close(layout.grad_view(buf, i),
                                   layout.grad_view(exact_only, i) + layout.grad_view(approx_only, i),
                                   rtol=1e-5, atol=1e-8)
    assert layout.loss_sum(buf) == pytest.approx(layout.loss_sum(exact_only) + layout.loss_sum(approx_only))
