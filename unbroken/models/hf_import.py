"""``model.init_from``: the built-in llama starts from Hugging Face Llama weights instead of a random draw.

The source is a directory written by ``unbroken export --hf`` or ``save_pretrained``
(its ``*.safetensors`` files) or one safetensors file, with Hugging Face's names
(``model.layers.0.self_attn.q_proj.weight``...). Each tensor is mapped to ours
by the inverse of :func:`unbroken.models.hf_llama.hf_state_dict_from_ours`
(``q_proj``/``k_proj`` rows permuted back from halves to adjacent pairs).

Invariants:
    - only safetensors are read (raw bytes, no pickle);
    - every parameter of the model is given, with the shape the config gives
      it, or the load is refused before any parameter changes (a ValueError
      naming the tensor, both shapes and the config field to change);
    - parameters keep their dtype and device; the values are copied in.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from unbroken.models.llama import ModelArgs, Transformer

__all__ = ["load_hf_weights", "ours_from_hf_names"]

logger = logging.getLogger(__name__)

_LAYER_NAMES = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
                "post_attention_layernorm": "ffn_norm"}
_TOP_NAMES = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
              "lm_head.weight": "output.weight"}
# Which config field sets each dimension of our tensors (named when a shape disagrees).
_FIELDS = {"tok_embeddings": "data.vocab_size (or data.tokenizer) and model.preset's dim",
           "output": "data.vocab_size (or data.tokenizer) and model.preset's dim"}


def _files(source: Path, field: str) -> list[Path]:
    if source.is_file():
        if source.suffix != ".safetensors":
            raise ValueError(f"{field}={str(source)!r} is not a .safetensors file; give a directory written by "
                             "unbroken export --hf or save_pretrained, or a .safetensors file")
        return [source]
    files = sorted(source.glob("*.safetensors")) if source.is_dir() else []
    if not files:
        raise ValueError(f"{field}={str(source)!r} is neither a .safetensors file nor a directory holding "
                         "*.safetensors weights (pickled .bin weights are refused)")
    return files


def _halves_to_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`unbroken.models.hf_llama._pairs_to_halves`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def ours_from_hf_names(hf: dict[str, torch.Tensor], n_heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """Hugging Face's Llama tensors under our names (unknown names are left out)."""
    out = {ours: hf[name] for name, ours in _TOP_NAMES.items() if name in hf}
    for name, w in hf.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"] or len(parts) < 5:
            continue
        ours = _LAYER_NAMES.get(".".join(parts[3:-1]))
        if ours is None:
            continue
        if ours == "attention.wq" and w.dim() == 2 and w.shape[0] % (2 * n_heads) == 0:
            w = _halves_to_pairs(w, n_heads)
        elif ours == "attention.wk" and w.dim() == 2 and w.shape[0] % (2 * kv_heads) == 0:
            w = _halves_to_pairs(w, kv_heads)
        out[f"layers.{parts[2]}.{ours}.{parts[-1]}"] = w
    return out


@torch.no_grad()
def load_hf_weights(model: Transformer, source: str | Path, *, field: str = "model.init_from") -> None:
    """Copy the Hugging Face Llama weights of ``source`` into ``model``.

    Raises:
        ValueError: ``source`` holds no safetensors, lacks a parameter, or a tensor's shape differs from the
            model's (names the tensor, both shapes and the config field to change).
    """
    from safetensors import safe_open

    path = Path(source).expanduser()
    hf: dict[str, torch.Tensor] = {}
    for f in _files(path, field):
        with safe_open(str(f), framework="pt") as h:
            hf.update({k: h.get_tensor(k) for k in h.keys()})
    args = model.args
    ours = ours_from_hf_names(hf, args.n_heads, args.kv_heads)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(ours))
    if missing:
        raise ValueError(f"{field}={str(source)!r} lacks {len(missing)} of the model's tensors (first: "
                         f"{missing[0]}); model.preset (the model is {_shape(args)}) must match the weights' shape")
    for name, p in params.items():
        if tuple(ours[name].shape) != tuple(p.shape):
            why = _FIELDS.get(name.split(".")[0], "model.preset (its dim, n_layers, heads, ffn_hidden_dim)")
            raise ValueError(f"{field}={str(source)!r}: {name} has shape {tuple(ours[name].shape)}, the model "
                             f"has {tuple(p.shape)}; change {why} to match the weights, or give other weights")
    for name, p in params.items():
        p.copy_(ours[name].to(dtype=p.dtype, device=p.device))
    logger.info("model initialised from %s", source)


def _shape(args: ModelArgs) -> str:
    """The model's shape in words, for errors."""
    return f"dim={args.dim}, n_layers={args.n_layers}, n_heads={args.n_heads}, vocab_size={args.vocab_size}"
