"""Build a model from a preset name with the run's vocabulary and sequence length; place and evaluate it."""

from __future__ import annotations

import os

from typing import Callable, Iterable

import torch

from unbroken.models.hf_llama import logits_of
from unbroken.models.llama import Transformer, model_args
from unbroken.models.precision import autocast


def build_model(
    preset: str,
    *,
    vocab_size: int,
    seq_len: int,
    max_seq_len: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A freshly initialised model; the same arguments give the same weights anywhere.

    Raises:
        ValueError: unknown preset, or ``seq_len`` longer than the model's
            ``max_seq_len`` (names both).
    """
    overrides: dict[str, object] = {"vocab_size": vocab_size}
    if max_seq_len is not None:
        overrides["max_seq_len"] = max_seq_len
    args = model_args(preset, **overrides)
    if seq_len > args.max_seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than model {preset!r} allows "
            f"(max_seq_len={args.max_seq_len}); lower data.seq_len or raise model.max_seq_len"
        )
    with torch.device("meta"):
        model = Transformer(args)
    # Module.to_empty's empty_like on meta tensors goes through torch._refs, whose first use imports sympy
    # (~0.7 s of every process's start); torch.empty of the same shape is the same storage, uninitialised.
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.init_weights(seed=seed)
    return model


def device_kind(choice: str) -> str:
    """``"cpu"`` when ``train.device = choice`` surely runs on the CPU, else ``"cuda"`` (the device a worker
    resolves with :func:`resolve_device`; for ``auto`` on a machine without a GPU that is the CPU still).

    Decided from the string and how torch was built alone: no ``torch.cuda`` call, so no CUDA driver or NVML
    is loaded and no thread started (a process that forks, the node's template, must have neither).
    """
    if choice == "cpu" or (choice == "auto" and not torch.backends.cuda.is_built()):
        return "cpu"
    return "cuda"


def resolve_device(choice: str, rank: int = 0) -> torch.device:
    """``auto``: the rank's CUDA device when CUDA is available, else CPU.

    Placement: rank ``r`` gets ``cuda:(r % G)`` with ``G`` the visible GPUs. For a
    worker id ``w`` on node ``R`` of ``W`` workers this is its local rank's GPU,
    ``(w - R*W) % G``, whenever ``G`` divides ``W`` (one worker per GPU, the usual
    layout), and it spreads several loopback "nodes" on one machine over all its GPUs.

    Raises:
        ValueError: ``choice`` is ``cuda`` on a machine without CUDA.
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device='cuda' but CUDA is not available; use 'cpu' or 'auto'")
    return torch.device("cuda", rank % torch.cuda.device_count())


def check_placement(choice: str, workers: Iterable[int], backend: str = "auto") -> None:
    """Refuse, before anything starts, a CUDA job whose NCCL groups cannot form on this machine (with
    ``backend='gloo'`` several workers may share a GPU: a test topology).

    ``workers``: the worker ids this machine runs. Each gets ``cuda:(w % G)``
    (:func:`resolve_device`); NCCL refuses two ranks of one communicator on one
    GPU (``Duplicate GPU detected``), which would otherwise surface only as a
    failed first view after the job's timeout.

    Raises:
        ValueError: no GPU is visible to ``train.device='cuda'``, or two workers would share a GPU
            (names both workers and the device).
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return
    if not torch.cuda.is_available():
        raise ValueError(f"train.device='cuda' but no GPU is visible to the workers (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); use 'cpu' or 'auto'")
    problem = placement_problem(list(workers), torch.cuda.device_count()) if backend != "gloo" else None
    if problem:
        raise ValueError(problem)


def placement_problem(workers: list[int], gpus: int) -> str | None:
    """Why ``workers`` cannot each have a GPU of their own among ``gpus`` (None if they can)."""
    seen: dict[int, int] = {}
    for w in sorted(workers):
        index = w % gpus
        if index in seen:
            return (f"workers {seen[index]} and {w} would both run on cuda:{index}: NCCL cannot hold two ranks of "
                    f"one group on one GPU, and this machine has {gpus} visible "
                    f"(cuda:0..cuda:{gpus - 1}) for {len(workers)} workers; run at most {gpus} workers on it "
                    f"(--workers / --workers-per-node), set train.device=cpu, or train.backend=gloo to share "
                    f"the GPUs (a test topology: gloo reduces through the host)")
        seen[index] = w
    return None


def bind_device(choice: str, rank: int = 0) -> torch.device:
    """:func:`resolve_device`, made this process's current CUDA device.

    A worker must call this (not :func:`resolve_device`) before it builds anything
    on the GPU or creates an NCCL group: kernels launched without an explicit
    device, ``torch.cuda`` RNG calls, NCCL's communicator and the CUDA context
    all follow the current device, which otherwise stays ``cuda:0`` for every
    process of a node.
    """
    device = resolve_device(choice, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def place_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move a model built on another device (a warm standby's) onto ``device``, in place.

    The parameter objects stay the same (an optimizer built afterwards sees the
    moved tensors). A no-op when every tensor is already there; otherwise the
    copies made on the old GPU return to it (``empty_cache``).
    """
    if all(t.device == device for t in _tensors(model)):
        return model
    model.to(device)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


@torch.no_grad()
def validation_loss(model: torch.nn.Module, batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                    n_batches: int, device: torch.device, precision: str = "fp32") -> float:
    """Token-mean cross-entropy over validation micro-batches ``batch(0, 0) .. batch(n_batches - 1, 0)``."""
    model.eval()
    loss, tokens = 0.0, 0
    for i in range(n_batches):
        x, y = batch(i, 0)
        with autocast(device, precision):
            logits = logits_of(model(x.to(device)))
        loss += float(torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.to(device).reshape(-1), reduction="sum"))
        tokens += y.numel()
    model.train()
    return loss / tokens
