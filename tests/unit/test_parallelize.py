"""Activation checkpointing and torch.compile per block, applied from outside the model.

The compile here uses dynamo with the ``aot_eager`` backend (the same tracing and autograd
graphs as inductor, without generating kernels, so the tests stay fast on a CPU); inductor
itself runs in one test (the loss's fusion of the logits' upcast, a few seconds on a CPU) and in
``python -m benchmarks.throughput_reference`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from unbroken.config import load_config
from unbroken.job.parallelize import check_compile_toolchain, compile_stats, parallelize, resolve_compile
from unbroken.mecefo.adapter import LlamaAdapter, transformer_blocks
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums
from unbroken.models import build_model

pytestmark = pytest.mark.timeout(120)

MB, T, V = 4, 16, 64


def _batch_fn(step: int, slot: int, rows: tuple[int, int]):
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randint(0, V, (MB, T + 1), generator=g)
    return x[rows[0]:rows[1], :-1], x[rows[0]:rows[1], 1:]


def _sums(model: torch.nn.Module, items: list[SlotWork], step: int = 0) -> torch.Tensor:
    adapter = LlamaAdapter(model, rank=4, tau=10)
    layout = GradLayout(model, adapter)
    return compute_gradient_sums(model, adapter, layout, items, step=step, micro_batch=MB, batch_fn=_batch_fn)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_compiled_and_checkpointed_blocks_give_the_plain_models_gradients_in_both_modes(ac: str):
    items = [SlotWork(0, (0, MB)), SlotWork(1, (0, 2), "approx"), SlotWork(2, (1, 4))]
    plain = _sums(build_model("debug", vocab_size=V, seq_len=T, seed=3), items)
    model = parallelize(build_model("debug", vocab_size=V, seq_len=T, seed=3), compile=True,
                        activation_checkpointing=ac, backend="aot_eager")
    fast = _sums(model, items)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)


def test_selective_checkpoints_every_second_block_and_parallelize_applies_once():
    model = build_model("debug", vocab_size=V, seq_len=T, seed=3)
    parallelize(model, compile=False, activation_checkpointing="selective")
    wrapped = [hasattr(b.__dict__.get("forward"), "__wrapped__") for b in transformer_blocks(model)]
    assert wrapped == [i % 2 == 0 for i in range(len(wrapped))] and len(wrapped) >= 2
    before = [b.__dict__["forward"] for b in transformer_blocks(model)]
    parallelize(model, compile=True, activation_checkpointing="full", backend="aot_eager")
    assert [b.__dict__["forward"] for b in transformer_blocks(model)] == before


def test_recompiles_stay_bounded_as_the_rows_a_worker_computes_change():
    model = parallelize(build_model("debug", vocab_size=V, seq_len=T, seed=3), compile=True, backend="aot_eager")
    before = compile_stats()["compiled_frames"]
    for step, rows in enumerate([(0, 4), (0, 2), (1, 4), (0, 1), (2, 3), (0, 4), (1, 2)]):
        _sums(model, [SlotWork(0, rows), SlotWork(1, rows, "approx")], step=step)
    assert compile_stats()["compiled_frames"] - before <= 2, "one graph, then one with a dynamic batch dimension"


def test_compile_defaults_to_cuda_only_and_bad_settings_are_refused():
    assert resolve_compile(None, torch.device("cpu")) is False
    assert resolve_compile(None, torch.device("cuda")) is True
    assert resolve_compile(True, torch.device("cpu")) is True
    with pytest.raises(ValueError, match="activation_checkpointing='some': expected one of none, selective, full"):
        parallelize(torch.nn.Linear(2, 2), compile=False, activation_checkpointing="some")
    with pytest.raises(ValueError, match="needs transformer blocks"):
        parallelize(torch.nn.Linear(2, 2), compile=False, activation_checkpointing="full")
    cfg = load_config(preset_name="debug", overrides=["train.compile=true", "train.activation_checkpointing=full"])
    assert cfg.train.compile is True and cfg.train.activation_checkpointing == "full"
    assert load_config(preset_name="debug", overrides=["train.compile=none"]).train.compile is None


def test_a_missing_toolchain_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match=r"train.compile=true on CPU needs a C\+\+ compiler .* set train.compile=false"):
        check_compile_toolchain("cpu")


def test_hugging_face_llama_blocks_compile_and_checkpoint_to_the_same_gradients():
    pytest.importorskip("transformers")
    from unbroken.models.hf_llama import build_hf_llama
    from unbroken.models.llama import model_args

    args = model_args("debug", vocab_size=V, max_seq_len=T)
    items = [SlotWork(0, (0, MB)), SlotWork(1, (1, 3), "approx")]
    plain = _sums(build_hf_llama(args, seed=0), items)
    model = parallelize(build_hf_llama(args, seed=0), compile=True, activation_checkpointing="full",
                        backend="aot_eager")
    assert len(transformer_blocks(model)) == args.n_layers
    torch.testing.assert_close(_sums(model, items), plain, rtol=1e-5, atol=1e-6)


def _big_allocations(loss_fn, logits_of_model, y, at_least: int) -> list[tuple[str, int]]:
    """Operators that allocated ``at_least`` bytes or more at once in one bf16 forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(logits_of_model(), y)
        loss.backward()
    return [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage >= at_least]


def test_under_autocast_the_compiled_loss_makes_no_float32_copy_of_the_logits():
    """The model returns bf16 logits under autocast, and inductor fuses the loss's upcast into the
    cross-entropy: no allocation the size of float32 logits anywhere in the loss's forward or backward
    (eager makes four: the upcast, log-softmax and both their gradients)."""
    try:
        check_compile_toolchain("cpu")
    except ValueError as exc:
        pytest.skip(str(exc))
    from unbroken.mecefo.gradients import token_loss_sum

    b, t, v = 8, 64, 4096
    model = build_model("debug", vocab_size=v, seq_len=t, seed=3)
    head = model.output.weight.numel() * 4  # its gradient: must stay below the logits' size
    fp32_logits = b * t * v * 4
    assert head < fp32_logits
    x = torch.randint(0, v, (b, t))
    y = torch.randint(0, v, (b, t))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.bfloat16
    assert model(x).dtype == torch.float32  # without autocast: float32 as ever
    compiled = torch.compile(token_loss_sum)
    _big_allocations(compiled, lambda: model(x), y, fp32_logits)  # compiles (forward and backward)
    assert _big_allocations(compiled, lambda: model(x), y, fp32_logits) == []
    eager = _big_allocations(token_loss_sum, lambda: model(x), y, fp32_logits)
    assert len(eager) >= 3, eager
