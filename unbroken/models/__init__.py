"""unbroken.models: pure PyTorch model code (LLaMA-style); never imports torch.distributed."""

from unbroken.models.factory import build_model, resolve_device, validation_loss
from unbroken.models.llama import (
    MODEL_PRESETS,
    Attention,
    FeedForward,
    ModelArgs,
    RMSNorm,
    Transformer,
    TransformerBlock,
    count_parameters,
    model_args,
)

__all__ = [
    "MODEL_PRESETS",
    "Attention",
    "FeedForward",
    "ModelArgs",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "build_model",
    "count_parameters",
    "model_args",
    "resolve_device",
    "validation_loss",
]
