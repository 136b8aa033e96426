"""unbroken.data: corpus, tokenizer, token cache and the ``batch(step, slot)`` sampler.

Pure data code: no ``torch.distributed``, no notion of failures. Importing it
has no side effects.
"""

from unbroken.data.prepare import CACHE_DIR_ENV, PreparedData, prepare_data
from unbroken.data.sampler import BatchSampler, ValidationSampler
from unbroken.data.tokenizer import EOT_ID, BPETokenizer

__all__ = [
    "CACHE_DIR_ENV",
    "EOT_ID",
    "BPETokenizer",
    "BatchSampler",
    "PreparedData",
    "ValidationSampler",
    "prepare_data",
]
