"""GPU check: fused AdamW (unbroken's optimizer on CUDA) keeps workers given the same gradient bit-identical.

Run on a machine with CUDA: ``python scripts/gpu/fused_adamw.py``. Two copies of the ``tiny``
model, built alike, take 5 fused AdamW steps on the same reduced gradients (as two workers of
one view do); every parameter and moment must be equal bit for bit. Also reports the largest
difference to ``foreach=False`` AdamW (the CPU setting), which needs only be small. Prints one
JSON line.
"""

from __future__ import annotations

import json

import torch

from unbroken.models import build_model
from unbroken.models.optim import build_optimizer


def _worker(dev: torch.device, fused: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model("tiny", vocab_size=4096, seq_len=128, seed=7, device=dev)
    return model, build_optimizer(model, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    workers = [_worker(dev, True), _worker(dev, True), _worker(dev, False)]
    gen = torch.Generator(device=dev).manual_seed(0)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=gen, device=dev) for p in workers[0][0].parameters()]
        for model, opt in workers:
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
            opt.step()
    (a, oa), (b, ob), (c, _) = workers
    same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())) and all(
        torch.equal(oa.state[x][k], ob.state[y][k]) for x, y in zip(a.parameters(), b.parameters())
        for k in ("exp_avg", "exp_avg_sq", "step"))
    diff = max(float((x - y).abs().max()) for x, y in zip(a.parameters(), c.parameters()))
    step_device = str(oa.state[next(a.parameters())]["step"].device)
    print(json.dumps({"check": "fused_adamw", "bit_identical": same, "max_diff_vs_foreach_false": diff,
                      "step_count_on": step_device, "ok": same and diff < 1e-4}))


if __name__ == "__main__":
    main()
