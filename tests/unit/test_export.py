"""unbroken export --hf: a committed checkpoint of a debug run loaded by transformers gives the run's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unbroken.cli import main
from unbroken.config import OptimConfig, config_hash, load_config
from unbroken.models import build_model
from unbroken.export import export_hf
from unbroken.models.optim import build_optimizer
from unbroken.checkpoint.checkpointer import AsyncCheckpointer, CheckpointError, checkpoint_dir, training_state

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

VOCAB, SEQ = 64, 16


def _run(tmp_path: Path, steps: int = 2) -> tuple[Path, torch.nn.Module]:
    """A debug run's directory with a checkpoint after each of ``steps`` AdamW steps; returns the model."""
    cfg = load_config(preset_name="debug")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    torch.manual_seed(1)
    model = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=1)
    o = OptimConfig()
    opt = build_optimizer(model, lr=1e-2, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    ckpt = AsyncCheckpointer(run, config_hash=config_hash(cfg))
    for done in range(1, steps + 1):
        model(torch.randint(0, VOCAB, (2, SEQ))).sum().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(done, training_state(model, opt), {})
        ckpt.wait()
    return run, model


def test_exported_run_loads_in_transformers_with_the_same_logits(tmp_path):
    run, model = _run(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(run), "--hf", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = (hf(tokens).logits - model(tokens)).abs().max().item()
    assert diff <= 1e-5, diff
    assert not list(tmp_path.glob(".hf.tmp-*"))


def test_step_and_dtype(tmp_path):
    run, _ = _run(tmp_path)
    export_hf(run, tmp_path / "bf16", dtype="bf16", step=1)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as h:
        assert h.get_tensor("lm_head.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"committed steps: \[1, 2\]"):
        export_hf(run, tmp_path / "none", step=7)
    assert not (tmp_path / "none").exists()


def test_damaged_or_uncommitted_checkpoint_is_named_and_nothing_written(tmp_path):
    run, _ = _run(tmp_path)
    (checkpoint_dir(run, 2) / "commit.json").unlink()  # step 2 uncommitted now
    with pytest.raises(ValueError, match=r"committed steps: \[1\]"):
        export_hf(run, tmp_path / "a", step=2)
    shard = next(checkpoint_dir(run, 1).glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        export_hf(run, tmp_path / "b", step=1)
    with pytest.raises(CheckpointError, match=shard.name):
        export_hf(run, tmp_path / "c")
    assert main(["export", str(run), "--hf", str(tmp_path / "d")]) == 2
    assert not [p for p in tmp_path.iterdir() if p.name != "run"]


def test_init_from_round_trip_gives_identical_parameters(tmp_path):
    from unbroken.models.hf_import import load_hf_weights

    run, model = _run(tmp_path)
    export_hf(run, tmp_path / "hf")
    fresh = build_model("debug", vocab_size=VOCAB, seq_len=SEQ, seed=9)
    assert not torch.equal(fresh.output.weight, model.output.weight)
    for source in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors"):
        load_hf_weights(fresh, source)
        for name, p in model.named_parameters():
            assert torch.equal(dict(fresh.named_parameters())[name], p), name


def test_init_from_refuses_other_shapes_naming_tensor_and_field(tmp_path):
    from unbroken.models.hf_import import load_hf_weights

    run, _ = _run(tmp_path)
    export_hf(run, tmp_path / "hf")
    other = build_model("debug", vocab_size=VOCAB * 2, seq_len=SEQ, seed=9)
    before = {n: p.clone() for n, p in other.named_parameters()}
    with pytest.raises(ValueError, match=r"tok_embeddings.weight has shape \(64, 64\), the model has \(128, 64\)"
                                         r".*data.vocab_size"):
        load_hf_weights(other, tmp_path / "hf")
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    with pytest.raises(ValueError, match="model.init_from=.*neither"):
        load_hf_weights(other, tmp_path / "missing")


def test_init_from_is_a_llama_field_and_the_job_builds_from_it(tmp_path):
    with pytest.raises(ValueError, match="model.init_from"):
        load_config(preset_name="debug", overrides=["model.family=hf-llama", f"model.init_from={tmp_path}"])
    from types import SimpleNamespace

    from unbroken.job.builder import _build_model

    run, model = _run(tmp_path)
    export_hf(run, tmp_path / "hf")
    cfg = load_config(preset_name="debug", overrides=[f"model.init_from={tmp_path / 'hf'}", f"data.seq_len={SEQ}"])
    built = _build_model(cfg, SimpleNamespace(vocab_size=VOCAB), torch.device("cpu"))  # only its vocabulary is read
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in built.named_parameters())


def test_the_runs_tokenizer_json_is_copied_in(tmp_path):
    run, _ = _run(tmp_path, steps=1)
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    saved = json.loads((run / "config.json").read_text())
    saved["data"]["tokenizer"] = str(tokenizer.parent)  # a model directory holding one, as data.tokenizer allows
    (run / "config.json").write_text(json.dumps(saved))
    export_hf(run, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
