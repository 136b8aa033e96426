"""unbroken: data-parallel LLM pre-training that keeps running through failures."""

__version__ = "0.1.0"
__all__ = ["__version__"]
