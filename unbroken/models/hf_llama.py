"""Hugging Face's ``LlamaForCausalLM`` as a model of ours: built from a preset, or loaded from a local directory.

``transformers`` is an optional dependency (``pip install unbroken[hf]``): it is
imported only when a function here is called, never when the package is.

Mapping (:func:`hf_config`): a preset's :class:`~unbroken.models.llama.ModelArgs`
become a ``LlamaConfig`` with the same shapes (``hidden_size = dim``,
``intermediate_size = ffn_dim``, ...), untied output, no biases, SiLU, no KV
cache. :func:`hf_state_dict_from_ours` maps our weights onto Hugging Face's
keys: the same numbers except ``wq``/``wk``, whose rows are permuted per head
because we rotate adjacent pairs (Meta's layout) and Hugging Face rotates
halves; with it the two models give the same logits.

Invariants:
    - nothing is ever downloaded: loading is ``local_files_only`` and needs
      safetensors weights in the directory;
    - :func:`build_hf_llama` is a pure function of its arguments (a private
      generator seeded with ``seed``, the global RNG untouched);
    - parameters are float32 (master weights); mixed precision is autocast's job.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from unbroken.models.llama import INIT_STD, ModelArgs

__all__ = ["HF_EXTRA", "build_hf_llama", "check_hf_dir", "hf_config", "hf_state_dict_from_ours", "load_hf_llama",
           "logits_of", "require_transformers"]

logger = logging.getLogger(__name__)

HF_EXTRA = "pip install 'unbroken[hf]'"
"""How to install the optional dependency (named in the error when it is missing)."""


def require_transformers() -> Any:
    """The ``transformers`` module.

    Raises:
        ValueError: it is not installed (a config asking for ``hf-llama`` cannot run here; names the extra).
    """
    try:
        import transformers
    except ImportError as exc:
        raise ValueError(f"model.family='hf-llama' needs transformers, which is not installed: {HF_EXTRA}") from exc
    return transformers


def hf_config(args: ModelArgs) -> Any:
    """A ``transformers.LlamaConfig`` with the shapes of ``args`` (untied output, no biases, no KV cache)."""
    t = require_transformers()
    return t.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, hidden_act="silu", max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, use_cache=False, initializer_range=INIT_STD,
    )


def build_hf_llama(args: ModelArgs, *, seed: int = 0, device: torch.device | str = "cpu") -> torch.nn.Module:
    """A freshly initialised ``LlamaForCausalLM`` of shape ``args``; the same arguments give the same weights.

    Weights as ours: linears and embeddings ~ N(0, 0.02), the projections into
    the residual stream (``o_proj``, ``down_proj``) ~ N(0, 0.02 / sqrt(2 L)),
    norms = 1; drawn in parameter order from a generator seeded with ``seed``.
    """
    t = require_transformers()
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = t.LlamaForCausalLM(hf_config(args))
    _init_weights(model, seed=seed, n_layers=args.n_layers)
    return model.to(device).train()


@torch.no_grad()
def _init_weights(model: torch.nn.Module, *, seed: int, n_layers: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * n_layers)
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 2)[-2]
        if p.dim() == 1:
            p.fill_(1.0)
            continue
        std = residual_std if owner in ("o_proj", "down_proj") else INIT_STD
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def check_hf_dir(path: str | Path, *, vocab_size: int, seq_len: int, field: str = "model.hf_path") -> Any:
    """Check a ``save_pretrained`` directory without loading its weights; returns its ``LlamaConfig``.

    Raises:
        ValueError: the directory is missing, holds no ``config.json`` or no
            ``*.safetensors`` weights, is not a Llama model, or its vocabulary
            or context does not fit the data (each message names the value and the fix).
    """
    t = require_transformers()
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValueError(f"{field}={str(path)!r} is not a directory; give a local directory written by "
                         "LlamaForCausalLM.save_pretrained (nothing is downloaded)")
    if not (root / "config.json").is_file():
        raise ValueError(f"{field}={str(path)!r} has no config.json; write it with save_pretrained")
    if not any(root.glob("*.safetensors")):
        raise ValueError(f"{field}={str(path)!r} has no safetensors weights (*.safetensors); "
                         "save with save_pretrained(dir, safe_serialization=True): pickled .bin weights are refused")
    config = t.AutoConfig.from_pretrained(str(root), local_files_only=True)
    if config.model_type != "llama":
        raise ValueError(f"{field}={str(path)!r} holds a {config.model_type!r} model; model.family='hf-llama' "
                         "loads Llama models only")
    if config.vocab_size != vocab_size:
        raise ValueError(f"{field}={str(path)!r} has vocab_size={config.vocab_size} but the tokenizer of the data "
                         f"has {vocab_size}; use data whose vocabulary is {config.vocab_size} (data.vocab_size) "
                         "or a model saved for this tokenizer")
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"data.seq_len={seq_len} is longer than {field}={str(path)!r} allows "
                         f"(max_position_embeddings={config.max_position_embeddings}); lower data.seq_len")
    return config


def load_hf_llama(path: str | Path, *, vocab_size: int, seq_len: int, device: torch.device | str = "cpu",
                  field: str = "model.hf_path") -> torch.nn.Module:
    """Load a ``LlamaForCausalLM`` written by ``save_pretrained`` from a local directory, in float32.

    Args:
        vocab_size: the tokenizer's vocabulary; the model's must be the same.
        seq_len: tokens per row; at most the model's ``max_position_embeddings``.
        field: the config field named in errors.

    Raises:
        ValueError: see :func:`check_hf_dir`.
    """
    t = require_transformers()
    config = check_hf_dir(path, vocab_size=vocab_size, seq_len=seq_len, field=field)
    config.use_cache = False
    model = t.LlamaForCausalLM.from_pretrained(str(Path(path).expanduser()), config=config, local_files_only=True,
                                               use_safetensors=True, dtype=torch.float32)
    logger.info("loaded LlamaForCausalLM from %s", path)
    return model.to(device).train()


def hf_state_dict_from_ours(ours: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our ``Transformer`` state dict under Hugging Face's keys (``wq``/``wk`` rows permuted to the halves layout)."""
    out = {"model.embed_tokens.weight": ours["tok_embeddings.weight"], "model.norm.weight": ours["norm.weight"],
           "lm_head.weight": ours["output.weight"]}
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for i in range(args.n_layers):
        for ours_name, hf_name in names.items():
            w = ours[f"layers.{i}.{ours_name}.weight"]
            if ours_name == "attention.wq":
                w = _pairs_to_halves(w, args.n_heads)
            elif ours_name == "attention.wk":
                w = _pairs_to_halves(w, args.kv_heads)
            out[f"model.layers.{i}.{hf_name}.weight"] = w
    return out


def _pairs_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head reordered from ``(x0, x1), (x2, x3), ...`` pairs to ``x0 x2 ... | x1 x3 ...`` halves."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, or a Hugging Face output's ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__}; a model must return logits (B, T, V) "
                        "or an object with a .logits tensor")
    return logits
