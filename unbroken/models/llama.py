"""LLaMA-style decoder-only transformer in plain PyTorch.

Parameter names follow Meta's reference implementation key for key
(``layers.0.attention.wq.weight``, ``tok_embeddings.weight``, ...), so real
checkpoints load without renaming. Nothing here knows about processes or
failures: data parallelism and the MeCeFO approximations wrap the model from
outside, which is why attention and FFN are separate submodules of each block.

Invariants:
    - the rotary tables are non-persistent buffers, so ``state_dict()`` holds
      exactly the learnable parameters under Meta's names;
    - construction under ``torch.device("meta")`` allocates nothing;
      ``to_empty(device=...)`` followed by ``init_weights()`` gives a usable model;
    - logits are float32 whatever the parameter dtype, except under autocast: there they keep
      the autocast dtype, and the loss upcasts them (inside the compiled loss when compile is
      on, so no float32 copy of the logits is ever made).

Shape suffixes:
    B batch, T time (sequence), D model dim, H query heads, G key/value heads,
    K head dim, P rotary pairs (K // 2), V vocab, F ffn hidden.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from unbroken.config.choices import MODEL_PRESET_NAMES, check_registry
__all__ = [
    "MODEL_PRESETS",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Rope",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "count_parameters",
    "model_args",
    "precompute_rope",
]

INIT_STD = 0.02


@dataclasses.dataclass(kw_only=True)
class ModelArgs:
    """Shape of a LLaMA-style model.

    Attributes:
        dim: model (residual stream) width D.
        n_layers: number of transformer blocks.
        n_heads: query heads H; must divide ``dim``.
        n_kv_heads: key/value heads G (grouped-query attention); None means H.
        vocab_size: vocabulary size V.
        ffn_hidden_dim: SwiGLU hidden width F; None derives it LLaMA-style from
            ``multiple_of`` and ``ffn_dim_multiplier``.
        multiple_of: F is rounded up to a multiple of this when derived.
        ffn_dim_multiplier: optional scale applied to the derived F.
        norm_eps: epsilon of every RMSNorm.
        rope_theta: rotary base frequency.
        max_seq_len: longest sequence accepted; sizes the rotary tables.
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    ffn_hidden_dim: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048

    def __post_init__(self) -> None:
        # Collect every problem so a bad config is fixed in one round trip.
        errors = []
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) <= 0:
                errors.append(f"{name}={getattr(self, name)} must be > 0")
        for name in ("n_kv_heads", "ffn_hidden_dim", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                errors.append(f"{name}={value} must be > 0 or None")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                errors.append(f"{name}={getattr(self, name)} must be > 0")
        if self.n_heads > 0 and self.dim % self.n_heads:
            errors.append(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        elif self.n_heads > 0 and self.dim > 0 and self.head_dim % 2:
            errors.append(f"head dim dim/n_heads={self.head_dim} must be even for rotary embeddings")
        if self.n_heads > 0 and self.kv_heads > 0 and self.n_heads % self.kv_heads:
            errors.append(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.kv_heads}")
        if errors:
            raise ValueError("invalid ModelArgs: " + "; ".join(errors))

    @property
    def head_dim(self) -> int:
        """Per-head width K."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads G, resolving None to ``n_heads``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden width F, derived as in Meta's reference when not given."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        # 2/3 of 4*dim keeps SwiGLU's three matrices at the cost of a 4x MLP's two.
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def _llama_60m() -> ModelArgs:
    """GaLore/MeCeFO LLaMA-60M: 58,073,600 parameters."""
    return ModelArgs(dim=512, n_layers=8, n_heads=8, ffn_hidden_dim=1376, norm_eps=1e-6, max_seq_len=1024)


def _llama_350m() -> ModelArgs:
    """GaLore/MeCeFO LLaMA-350M: 367,969,280 parameters (the name undercounts by ~5%)."""
    return ModelArgs(dim=1024, n_layers=24, n_heads=16, ffn_hidden_dim=2736, norm_eps=1e-6, max_seq_len=1024)


def _llama_1b() -> ModelArgs:
    """GaLore/MeCeFO LLaMA-1B: 1,339,082,752 parameters.

    The papers call it "1B" but with untied 32000-token embeddings it has ~1.34B.
    """
    return ModelArgs(dim=2048, n_layers=24, n_heads=32, ffn_hidden_dim=5461, norm_eps=1e-6, max_seq_len=1024)


def _llama_7b() -> ModelArgs:
    """LLaMA-7B shape: 6,738,415,616 parameters."""
    return ModelArgs(dim=4096, n_layers=32, n_heads=32, ffn_hidden_dim=11008, norm_eps=1e-6, max_seq_len=2048)


def _debug() -> ModelArgs:
    """Trains on a CPU in seconds: 624,960 parameters."""
    return ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=176, vocab_size=4096, max_seq_len=256)


def _tiny() -> ModelArgs:
    """Small but not trivial: 1,852,544 parameters."""
    return ModelArgs(dim=128, n_layers=4, n_heads=4, ffn_hidden_dim=352, vocab_size=4096, max_seq_len=512)


def _tiny_2l() -> ModelArgs:
    """``tiny``'s block parameters (0.82 M vs 0.80 M) in 2 wider layers, for depth studies."""
    return ModelArgs(dim=184, n_layers=2, n_heads=4, ffn_hidden_dim=496, vocab_size=4096, max_seq_len=512)


def _tiny_8l() -> ModelArgs:
    """``tiny``'s block parameters (0.81 M vs 0.80 M) in 8 narrower layers, for depth studies."""
    return ModelArgs(dim=96, n_layers=8, n_heads=4, ffn_hidden_dim=224, vocab_size=4096, max_seq_len=512)


# Shapes of GaLore's configs/llama_*.json (used again by MeCeFO), rms eps 1e-6 as there.
MODEL_PRESETS: dict[str, Callable[[], ModelArgs]] = {
    "debug": _debug,
    "tiny": _tiny,
    "tiny-2l": _tiny_2l,
    "tiny-8l": _tiny_8l,
    "llama-60m": _llama_60m,
    "llama-350m": _llama_350m,
    "llama-1b": _llama_1b,
    "llama-7b": _llama_7b,
}
check_registry("model.preset", MODEL_PRESETS, MODEL_PRESET_NAMES)


def model_args(name: str, **overrides: Any) -> ModelArgs:
    """Return preset ``name`` with ``overrides`` applied (validated again).

    Raises:
        ValueError: unknown preset or unknown field name, listing the valid ones.
    """
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ModelArgs field(s) {unknown}; valid fields are {sorted(fields)}")
    return dataclasses.replace(MODEL_PRESETS[name](), **overrides)


def count_parameters(args: ModelArgs) -> int:
    """Number of parameters of ``Transformer(args)``, computed without building it."""
    d, k = args.dim, args.head_dim
    attention = d * args.n_heads * k * 2 + d * args.kv_heads * k * 2  # wq, wo; wk, wv
    feed_forward = 3 * d * args.ffn_dim
    block = attention + feed_forward + 2 * d  # two RMSNorm weights
    return args.n_layers * block + 2 * args.vocab_size * d + d  # untied in/out + final norm


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learnable gain (no bias, no centering)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the gain to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: bf16 squares lose too much precision.
        x = x_BTD.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.type_as(x_BTD) * self.weight


Rope = tuple[torch.Tensor, torch.Tensor]
"""Rotary tables ``(cos_TP, sin_TP)`` for the positions of one forward pass."""


def precompute_rope(head_dim: int, max_seq_len: int, theta: float) -> Rope:
    """Cos/sin tables of shape (max_seq_len, head_dim // 2), float32.

    Real-valued rather than complex so it also works on the meta device and on
    backends without complex kernels; allocates on the current default device.
    """
    inv_freq_P = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    pos_T = torch.arange(max_seq_len, dtype=torch.float32)
    angle_TP = torch.outer(pos_T, inv_freq_P)
    return angle_TP.cos(), angle_TP.sin()


def apply_rope(x_BTHK: torch.Tensor, cos_TP: torch.Tensor, sin_TP: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs ``(x[2i], x[2i+1])`` by position-dependent angles.

    Adjacent pairs (not halves) match Meta's complex-number formulation, so
    Meta's wq/wk weights work unpermuted.
    """
    x = x_BTHK.float().unflatten(-1, (-1, 2))
    x0, x1 = x[..., 0], x[..., 1]
    cos, sin = cos_TP[:, None, :], sin_TP[:, None, :]  # broadcast over heads
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x_BTHK)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings and optional GQA."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x_BTD: torch.Tensor, rope: Rope) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.wq(x_BTD).view(B, T, self.n_heads, self.head_dim)
        k_BTGK = self.wk(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        v_BTGK = self.wv(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        q_BTHK = apply_rope(q_BTHK, *rope)
        k_BTGK = apply_rope(k_BTGK, *rope)
        k_BTHK = _repeat_kv(k_BTGK, self.n_heads // self.n_kv_heads)
        v_BTHK = _repeat_kv(v_BTGK, self.n_heads // self.n_kv_heads)
        o_BHTK = F.scaled_dot_product_attention(
            q_BTHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHK.transpose(1, 2), is_causal=True
        )
        return self.wo(o_BHTK.transpose(1, 2).reshape(B, T, -1))


def _repeat_kv(x_BTGK: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Share each kv head with ``n_rep`` consecutive query heads, as Meta's repeat_kv."""
    if n_rep == 1:
        return x_BTGK
    B, T, G, K = x_BTGK.shape
    return x_BTGK[:, :, :, None, :].expand(B, T, G, n_rep, K).reshape(B, T, G * n_rep, K)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class TransformerBlock(nn.Module):
    """Pre-norm block: attention residual, then feed-forward residual."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x_BTD: torch.Tensor, rope: Rope) -> torch.Tensor:
        # Two explicit residuals through the submodules' __call__: MeCeFO
        # replaces or hooks `attention` / `feed_forward` from outside.
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), rope)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Transformer(nn.Module):
    """LLaMA-style decoder: embeddings, ``n_layers`` blocks, final norm, untied output."""

    rope_cos: torch.Tensor  # buffers (not saved): the rotary tables, per position and pair
    rope_sin: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Built under torch.device("meta") (build_model), nothing is drawn: init_weights runs once the
        # parameters have storage. (An embedding's default init on meta imports sympy: ~1 s of every start.)
        meta = torch.empty(0).device.type == "meta"
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim,
                                           _weight=torch.empty(args.vocab_size, args.dim) if meta else None)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, so state_dict keeps Meta's keys only.
        # Note: `.to(dtype)` casts these too; prefer autocast for mixed precision.
        if meta:  # shapes only (arange on meta imports sympy too)
            cos_TP = torch.empty(args.max_seq_len, args.head_dim // 2)
            sin_TP = torch.empty(args.max_seq_len, args.head_dim // 2)
        else:
            cos_TP, sin_TP = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("rope_cos", cos_TP, persistent=False)
        self.register_buffer("rope_sin", sin_TP, persistent=False)
        if not meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter and the rotary tables.

        Linears and embeddings ~ N(0, 0.02); ``wo`` and ``w2`` (the projections
        writing into the residual stream) ~ N(0, 0.02 / sqrt(2 * n_layers)) as in
        GPT-2, so the residual variance does not grow with depth; norms = 1.

        Args:
            seed: if given, draw from a private generator seeded with it, leaving
                the global RNG untouched; otherwise draw from the global RNG.
        """
        rope_device = self.rope_cos.device
        with torch.device(rope_device):
            cos_TP, sin_TP = precompute_rope(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos.copy_(cos_TP)
        self.rope_sin.copy_(sin_TP)
        generators: dict[torch.device, torch.Generator] = {}
        residual_std = INIT_STD / math.sqrt(2 * self.args.n_layers)
        # By name, not by module type, so it still works when MeCeFO has wrapped
        # attention / feed_forward; registration order keeps draws deterministic.
        for name, param in self.named_parameters():
            owner = name.rsplit(".", 2)[-2]
            if owner in ("attention_norm", "ffn_norm", "norm"):
                nn.init.ones_(param)
                continue
            std = residual_std if owner in ("wo", "w2") else INIT_STD
            nn.init.normal_(param, mean=0.0, std=std, generator=_generator(generators, param, seed))

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """Map token ids (B, T) to next-token logits (B, T, V): float32, or under autocast its dtype.

        Raises:
            ValueError: ``tokens_BT`` is not 2-D or T exceeds ``args.max_seq_len``.
        """
        if tokens_BT.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, seq_len), got {tuple(tokens_BT.shape)}")
        T = tokens_BT.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds max_seq_len {self.args.max_seq_len}; "
                "shorten the sequences or raise ModelArgs.max_seq_len"
            )
        rope = (self.rope_cos[:T], self.rope_sin[:T])
        h_BTD = self.tok_embeddings(tokens_BT)
        for layer in self.layers:
            h_BTD = layer(h_BTD, rope)
        logits_BTV = self.output(self.norm(h_BTD))
        if torch.is_autocast_enabled(logits_BTV.device.type):
            return logits_BTV  # the loss upcasts (a float32 copy here: 4 x B x T x V bytes more)
        return logits_BTV.float()

    def num_params(self) -> int:
        """Number of parameters (embeddings included)."""
        return sum(p.numel() for p in self.parameters())


def _generator(
    generators: dict[torch.device, torch.Generator], param: torch.Tensor, seed: int | None
) -> torch.Generator | None:
    """One seeded generator per device, created on first use; None means global RNG."""
    if seed is None or param.is_meta:
        return None
    if param.device not in generators:
        generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
    return generators[param.device]
