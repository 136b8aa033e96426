"""GPU check: fused AdamW (unbroken's optimizer on CUDA) keeps workers given the same gradient bit-identical.

Run on a machine with CUDA: ``python scripts/gpu/fused_adamw.py``. Two copies of the ``tiny``
model, built alike, take 5 fused AdamW steps on the same reduced gradients (as two workers of
one view do); every parameter and moment must be equal bit for bit. Also reports the largest
difference to ``foreach=False`` AdamW (the CPU setting), which needs only be small. Then two more
copies take 5 steps through ``apply_step`` on the same reduced buffer (the runtime's path: the fused
kernel divides each gradient sum by the weight over the clip coefficient as it reads it) and must end
bit-identical too, and close to dividing and clipping by hand. Prints one JSON line.
"""

from __future__ import annotations

import json

import torch

from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, apply_step
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
    same, diff = _compare(workers)
    step_device = str(workers[0][1].state[next(workers[0][0].parameters())]["step"].device)
    scaled_same, scaled_diff, norms = _through_apply_step(dev)
    print(json.dumps({"check": "fused_adamw", "bit_identical": same, "max_diff_vs_foreach_false": diff,
                      "step_count_on": step_device, "apply_step_bit_identical": scaled_same,
                      "apply_step_max_diff_vs_divided": scaled_diff, "grad_norms": norms,
                      "ok": same and diff < 1e-4 and scaled_same and scaled_diff < 1e-5}))


def _compare(workers: list[tuple[torch.nn.Module, torch.optim.Optimizer]]) -> tuple[bool, float]:
    """Whether the first two workers are bit-identical (parameters, moments, step counts); the largest
    parameter difference between the first and the third."""
    (a, oa), (b, ob), (c, _) = workers
    same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())) and all(
        torch.equal(oa.state[x][k], ob.state[y][k]) for x, y in zip(a.parameters(), b.parameters())
        for k in ("exp_avg", "exp_avg_sq", "step"))
    return same, max(float((x - y).detach().abs().max()) for x, y in zip(a.parameters(), c.parameters()))


def _through_apply_step(dev: torch.device) -> tuple[bool, float, list[float]]:
    """Two workers applying the same reduced buffers with :func:`apply_step` (clip 1.0, weight 4: four
    slots), and a third dividing and clipping by hand before the same fused step."""
    workers = [_worker(dev, True) for _ in range(3)]
    layouts = [GradLayout(m, LlamaAdapter(m, rank=4, tau=10)) for m, _ in workers]
    gen = torch.Generator(device=dev).manual_seed(1)
    norms = []
    for _ in range(5):
        buf = layouts[0].new_buffer(dev)
        buf[: layouts[0].n_grad].normal_(generator=gen)
        layouts[0].weights(buf).fill_(4.0)
        buf[-2:] = torch.tensor([100.0, 50.0], device=dev)
        norms.append(apply_step(layouts[0], buf.clone(), workers[0][1], lr=1e-3, grad_clip=1.0))
        apply_step(layouts[1], buf.clone(), workers[1][1], lr=1e-3, grad_clip=1.0)
        model, opt = workers[2]
        for i, p in enumerate(layouts[2].params):
            p.grad = layouts[2].grad_view(buf, i) / 4.0
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        for group in opt.param_groups:
            group["lr"] = 1e-3
        opt.step()
    same, diff = _compare(workers)
    return same, diff, [round(n, 3) for n in norms]


if __name__ == "__main__":
    main()
