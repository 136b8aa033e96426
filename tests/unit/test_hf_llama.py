"""Hugging Face's LlamaForCausalLM as a model of ours (unbroken.models.hf_llama) under MeCeFO.

A small model is written locally with ``save_pretrained`` (nothing is ever
downloaded) from our debug model's weights; the loaded model must give our
logits, train in exact mode exactly as plain autograd does, and in approximate
mode give no attention gradient and the low-rank FFN formula, the same
gradients as our model in the same mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from unbroken.mecefo.adapter import LlamaAdapter, adapter_for, component_of  # noqa: E402
from unbroken.mecefo.gradients import GradLayout, SlotWork, compute_gradient_sums  # noqa: E402
from unbroken.models import build_model, model_args  # noqa: E402
from unbroken.models.hf_llama import (  # noqa: E402
    build_hf_llama,
    hf_config,
    hf_state_dict_from_ours,
    load_hf_llama,
)

pytestmark = pytest.mark.timeout(120)

VOCAB, SEQ, MB = 512, 16, 4
ARGS = model_args("debug", vocab_size=VOCAB)
# Our name -> Hugging Face's, for the parameters whose numbers are the same (all but wq / wk).
_SAME = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head",
         "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj",
         "feed_forward.w2": "mlp.down_proj", "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
         "ffn_norm": "post_attention_layernorm"}


def _hf_name(ours: str) -> str | None:
    stem = ours.removesuffix(".weight")
    if stem in _SAME:
        return f"{_SAME[stem]}.weight"
    _, i, rest = stem.split(".", 2)
    return f"model.layers.{i}.{_SAME[rest]}.weight" if rest in _SAME else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """Our debug model and a directory holding the same weights as a Hugging Face model."""
    ours = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=3)
    hf = build_hf_llama(ARGS, seed=0)
    hf.load_state_dict(hf_state_dict_from_ours(ours.state_dict(), ARGS), strict=True)
    path = tmp_path_factory.mktemp("hf") / "llama"
    hf.save_pretrained(path, safe_serialization=True)
    return ours, path


def _batch(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + slot)
    xy = torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g)[rows[0]:rows[1]]
    return xy[:, :-1], xy[:, 1:]


def _sums(model: torch.nn.Module, mode: str, rank: int = 8) -> tuple[dict[str, torch.Tensor | None], LlamaAdapter]:
    adapter = LlamaAdapter(model, rank=rank, tau=10)
    layout = GradLayout(model, adapter)
    buf = compute_gradient_sums(model, adapter, layout, [SlotWork(slot=0, rows=(0, MB), mode=mode)], step=0,
                                micro_batch=MB, batch_fn=_batch)
    weights = layout.weights(buf)
    grads = {n: layout.grad_view(buf, i).clone() if float(weights[layout.groups[i]]) > 0 else None
             for i, n in enumerate(layout.names)}
    return grads, adapter


def test_same_weights_give_the_same_logits(saved: tuple[torch.nn.Module, Path]) -> None:
    ours, path = saved
    hf = load_hf_llama(path, vocab_size=VOCAB, seq_len=SEQ)
    x, _ = _batch(0, 0, (0, MB))
    with torch.no_grad():
        a, b = ours(x), hf(x).logits
    assert b.dtype == torch.float32 and a.shape == b.shape
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


def test_adapter_finds_self_attn_and_mlp(saved: tuple[torch.nn.Module, Path]) -> None:
    hf = load_hf_llama(saved[1], vocab_size=VOCAB, seq_len=SEQ)
    blocks = LlamaAdapter(hf, rank=8, tau=10).blocks()
    assert [b.attention for b in blocks] == [f"model.layers.{i}.self_attn" for i in range(ARGS.n_layers)]
    assert blocks[0].ffn_linears == tuple(f"model.layers.0.mlp.{w}" for w in ("gate_proj", "down_proj", "up_proj"))
    assert component_of("model.layers.1.input_layernorm.weight") == "attention"
    assert component_of("model.layers.1.mlp.up_proj.weight") == "ffn"
    assert component_of("lm_head.weight") == "rest"


def test_exact_mode_equals_plain_training(saved: tuple[torch.nn.Module, Path]) -> None:
    hf = load_hf_llama(saved[1], vocab_size=VOCAB, seq_len=SEQ)
    x, y = _batch(0, 0, (0, MB))
    logits = hf(x).logits
    (F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / (MB * SEQ)).backward()
    plain = {n: p.grad.clone() for n, p in hf.named_parameters()}
    hf.zero_grad(set_to_none=True)
    sums, _ = _sums(hf, "exact")
    for name, g in plain.items():
        assert torch.equal(sums[name], g), name


def test_approx_mode_drops_attention_and_projects_ffn(saved: tuple[torch.nn.Module, Path]) -> None:
    ours, path = saved
    hf = load_hf_llama(path, vocab_size=VOCAB, seq_len=SEQ)
    exact, _ = _sums(hf, "exact")
    approx, adapter = _sums(hf, "approx")
    for name, g in approx.items():
        assert (g is None) == (component_of(name) == "attention"), name
    # The last block's FFN sees exact upstream gradients and inputs: approx = exact projected on V V^T.
    last = ARGS.n_layers - 1
    for w in ("gate_proj", "down_proj", "up_proj"):
        name = f"model.layers.{last}.mlp.{w}"
        v = adapter.basis.get(name, hf.get_submodule(name).weight, step=0)
        torch.testing.assert_close(approx[f"{name}.weight"], exact[f"{name}.weight"] @ v @ v.T, atol=1e-6, rtol=1e-4)
    # The same approximation as for our model: identical gradients, parameter for parameter.
    mine, _ = _sums(build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=3), "approx")
    compared = 0
    for name, g in mine.items():
        if g is None:
            continue
        torch.testing.assert_close(approx[_hf_name(name)], g, atol=1e-6, rtol=1e-4)
        compared += 1
    assert compared == 2 + 1 + 4 * ARGS.n_layers  # embeddings, output, final norm; per block 3 FFN + ffn_norm


def test_bad_directories_and_vocabulary_are_refused(saved: tuple[torch.nn.Module, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        load_hf_llama(tmp_path / "nowhere", vocab_size=VOCAB, seq_len=SEQ)
    hf_config(ARGS).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no safetensors weights"):
        load_hf_llama(tmp_path, vocab_size=VOCAB, seq_len=SEQ)
    with pytest.raises(ValueError, match=r"vocab_size=512 but the tokenizer of the data has 4096"):
        load_hf_llama(saved[1], vocab_size=4096, seq_len=SEQ)


def test_a_model_without_llama_blocks_trains_exact_only() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    adapter = adapter_for(model, rank=8, tau=10, approximates=False)
    layout = GradLayout(model, adapter)
    buf = compute_gradient_sums(model, adapter, layout, [SlotWork(slot=0, rows=(0, MB))], step=0, micro_batch=MB,
                                batch_fn=_batch)
    assert float(buf[-1]) == MB * SEQ and bool(buf[: layout.n_grad].abs().sum() > 0)
    with pytest.raises(ValueError, match="needs a MeCeFO adapter.*mecefo.policy='spread'"):
        adapter_for(model, rank=8, tau=10, approximates=True, policy="neighbor")
    with pytest.raises(ValueError, match="mode 'approx' needs a MeCeFO adapter"):
        compute_gradient_sums(model, adapter, layout, [SlotWork(slot=0, rows=(0, MB), mode="approx")], step=0,
                              micro_batch=MB, batch_fn=_batch)


def test_the_cli_refuses_a_model_of_another_vocabulary_before_writing(
        saved: tuple[torch.nn.Module, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        corpus_overrides: list[str]) -> None:
    from unbroken.cli import main

    out = tmp_path / "run"
    argv = ["train", "--preset", "debug", "--workers", "2", "--out", str(out), "--model.family=hf-llama",
            f"--model.hf_path={saved[1]}", *[f"--{o}" for o in corpus_overrides]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "has vocab_size=512 but the tokenizer of the data has 4096" in err and "Traceback" not in err
    assert not out.exists()
