"""The machine a benchmark ran on, as its JSON records it."""

from __future__ import annotations

import os
import platform
from typing import Any

__all__ = ["machine_description"]


def machine_description() -> dict[str, Any]:
    """Cores, platform, Python, torch and the GPU (None without one)."""
    import torch

    return {
        "cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
