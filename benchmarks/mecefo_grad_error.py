"""How wrong MeCeFO's gradient is, and what a covering worker's step costs in wall-clock time, on the CPU:
``python -m benchmarks.mecefo_grad_error`` (the study that chose the default rank and tau; FLOPs and saved
bytes per policy: ``unbroken bench mecefo-cost``).

1. **grad_error**: ``||g~ - g|| / ||g||`` per component (attention, ffn, rest,
   total) of one approximate micro-batch, and of the aggregated n-slot
   gradient with one slot covered, along a short exact training run on real
   text, with a sweep over rank and tau (bases taken from the weights tau/2
   and tau-1 steps before, the mid and the end of a refresh period).
2. **wall**: step time of the covering worker over a normal one, timed
   interleaved in the same run (ratio of medians; the ratio of minima is
   also given, as it resists bursts of other load on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from unbroken.bench.machine import machine_description
from unbroken.bench.mecefo_cost import _model, _random_batches, _run, _shape
from unbroken.config import MecefoConfig
from unbroken.mecefo.adapter import LlamaAdapter, linear_weight
from unbroken.mecefo.costs import COMPONENTS, relative_errors
from unbroken.mecefo.gradients import BatchFn, GradLayout, Mode, SlotWork, apply_reduced
from unbroken.models import Transformer, model_args

logger = logging.getLogger(__name__)

METHOD = ("||g~-g||/||g|| per component; per micro-batch (failed slot, approx) and aggregated over n slots "
          "(neighbor: failed + covering slot approx, attention over the n-2 exact slots; spread-approx: failed "
          "slot approx); bases from the weights (tau-1)//2 and tau-1 steps earlier (mid / end of a refresh "
          "period), mean and max over both and all checkpoints")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.mecefo_grad_error", description=__doc__.split("\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    names = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--n", type=ints, default=[4, 8], help="data-parallel sizes")
    p.add_argument("--seq-len", type=int, default=None, help="override every preset's sequence length (wall)")
    p.add_argument("--micro-batch", type=int, default=None, help="override every preset's micro-batch")
    p.add_argument("--rank", type=int, default=MecefoConfig().rank)
    p.add_argument("--tau", type=int, default=MecefoConfig().tau)
    p.add_argument("--error-presets", type=names, default=["debug", "tiny"])
    p.add_argument("--train-steps", type=int, default=200, help="exact training steps before/between checks")
    p.add_argument("--checkpoints", type=int, default=2, help="gradient checks, evenly spaced up to train-steps")
    p.add_argument("--error-seq-len", type=int, default=64, help="sequence length of the grad_error runs")
    p.add_argument("--ranks", type=ints, default=[2, 4, 8, 16, 32])
    p.add_argument("--taus", type=ints, default=[1, 10, 50, 200])
    p.add_argument("--wall-presets", type=names, default=["debug", "tiny"])
    p.add_argument("--wall-reps", type=int, default=15)
    p.add_argument("--data", choices=("stdlib", "random"), default="stdlib", help="tokens for grad_error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 1 keeps timings stable on a shared machine")
    p.add_argument("--out", default="benchmarks/results/mecefo_grad_error.json")
    a = p.parse_args(argv)
    errors = [f"--n {n}: must be >= 3 (neighbor needs an exact slot left)" for n in a.n if n < 3]
    errors += [f"--{k} {v}: must be >= 1" for k, v in
               (("rank", a.rank), ("tau", a.tau), ("train-steps", a.train_steps), ("checkpoints", a.checkpoints),
                ("wall-reps", a.wall_reps), ("error-seq-len", a.error_seq_len), ("threads", a.threads)) if v < 1]
    if errors:
        p.error("; ".join(errors))
    return a


def _window_batches(tokens: torch.Tensor, micro_batch: int, seq: int, seed: int) -> BatchFn:
    """Random windows of a token stream, a pure function of (step, slot)."""
    def batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + slot)
        starts = torch.randint(0, len(tokens) - seq - 1, (micro_batch,), generator=g)[rows[0]:rows[1]]
        xy = torch.stack([tokens[s:s + seq + 1] for s in starts.tolist()])
        return xy[:, :-1], xy[:, 1:]
    return batch_fn



# ---- gradient error ----------------------------------------------------------------------


def _stdlib_tokens(vocab: int) -> torch.Tensor:
    """~0.5M BPE tokens of the interpreter's standard library (the project's default corpus)."""
    from unbroken.data.corpus import open_stdlib_corpus
    from unbroken.data.tokenizer import EOT_ID, BPETokenizer, train_bpe

    texts = list(open_stdlib_corpus().truncate(2_000_000).texts())
    tok = BPETokenizer(train_bpe(texts, vocab_size=vocab, length=len(texts)))
    ids: list[int] = []
    for doc in tok.encode_batch(texts):
        ids.extend(doc)
        ids.append(EOT_ID)
    return torch.tensor(ids, dtype=torch.long)


def _summary(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {c: {"mean": statistics.fmean(s[c] for s in samples), "max": max(s[c] for s in samples)}
            for c in samples[0]}


def _set_ffn(model: Transformer, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, w in weights.items():
            linear_weight(model, name).copy_(w)


def _ffn_weights(model: Transformer, adapter: LlamaAdapter) -> dict[str, torch.Tensor]:
    return {name: linear_weight(model, name).detach().clone()
            for parts in adapter.blocks() for name in parts.ffn_linears}


def _grad_error(preset: str, tokens: torch.Tensor | None, a: argparse.Namespace) -> dict:
    mb, seq = _shape(preset, a)[0], a.error_seq_len
    model = _model(preset, seq, a.seed)
    vocab = model.args.vocab_size
    batch_fn = (_window_batches(tokens, mb, seq, a.seed) if tokens is not None
                else _random_batches(vocab, mb, seq, a.seed))
    adapters = {r: LlamaAdapter(model, rank=r, tau=a.tau) for r in sorted({*a.ranks, a.rank})}
    layout = GradLayout(model, adapters[a.rank])
    checks = sorted({round(a.train_steps * (i + 1) / a.checkpoints) for i in range(a.checkpoints)})
    ages = sorted({age for tau in {*a.taus, a.tau} for age in ((tau - 1) // 2, tau - 1)})
    wanted = {c - min(age, c) for c in checks for age in ages}
    train_slots = 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    losses: dict[int, float] = {}
    samples: dict[tuple[int, int], list[dict]] = {}  # (rank, basis age) -> error dicts
    f_slot = 1
    for step in range(checks[-1] + 1):
        if step in wanted:
            snapshots[step] = _ffn_weights(model, adapters[a.rank])
        if step in checks:
            _check(model, adapters, layout, snapshots, step, ages, samples, batch_fn, mb, f_slot, a)
        buf = _run(model, adapters[a.rank], [SlotWork(s, (0, mb)) for s in range(train_slots)], step=step,
                   micro_batch=mb, batch_fn=batch_fn, layout=layout)
        losses[step] = layout.loss_sum(buf) / layout.token_count(buf)
        apply_reduced(layout, buf)  # every item exact: each weight is train_slots
        opt.step()
    sweep = []
    for r in a.ranks:
        for tau in a.taus:
            mid, worst = (tau - 1) // 2, tau - 1
            per_mb = [s["microbatch"] for age in (mid, worst) for s in samples[(r, age)]]
            row = {"rank": r, "tau": tau, "ffn_microbatch": _summary(per_mb)["ffn"],
                   "total_microbatch": _summary(per_mb)["total"]}
            for n in a.n:
                for policy in ("neighbor", "spread-approx"):
                    agg = [s[f"n={n}"][policy] for age in (mid, worst) for s in samples[(r, age)]]
                    summary = _summary(agg)
                    row[f"{policy}_n={n}_ffn"] = summary["ffn"]
                    row[f"{policy}_n={n}_total"] = summary["total"]
            sweep.append(row)
    default = [s for age in ((a.tau - 1) // 2, a.tau - 1) for s in samples[(a.rank, age)]]
    return {
        "shape": {"micro_batch": mb, "seq_len": seq, "train_slots": train_slots, "failed_slot": f_slot,
                  "covering_slot": f_slot + 1, "optimizer": "AdamW lr 1e-3 betas (0.9, 0.95) wd 0.1"},
        "checkpoints": checks, "loss": {str(s): losses[s] for s in (0, *checks) if s in losses},
        "default": {"rank": a.rank, "tau": a.tau, "microbatch": _summary([s["microbatch"] for s in default]),
                    "aggregated": {f"n={n}": {p: _summary([s[f"n={n}"][p] for s in default])
                                              for p in ("neighbor", "spread-approx")} for n in a.n}},
        "sweep": sweep,
    }


def _check(model: Transformer, adapters: dict[int, LlamaAdapter], layout: GradLayout,
           snapshots: dict[int, dict[str, torch.Tensor]], step: int, ages: list[int],
           samples: dict[tuple[int, int], list[dict]], batch_fn: BatchFn, mb: int, f_slot: int,
           a: argparse.Namespace) -> None:
    """Errors at ``step`` for every rank and basis age; appends to ``samples[(rank, age)]``."""

    def run(slot: int, mode: Mode, adapter: LlamaAdapter) -> torch.Tensor:
        return _run(model, adapter, [SlotWork(slot, (0, mb), mode)], step=step, micro_batch=mb,
                    batch_fn=batch_fn, layout=layout)

    any_adapter = next(iter(adapters.values()))
    exact = [run(s, "exact", any_adapter) for s in range(max(a.n))]
    current = _ffn_weights(model, any_adapter)
    refs = {n: torch.stack(exact[:n]).sum(0) for n in a.n}  # the all-reduced buffer with no failure
    for r, adapter in adapters.items():
        for age in ages:
            # The basis a covering worker would hold: computed `age` steps ago, at its period's first use.
            _set_ffn(model, snapshots[step - min(age, step)])
            adapter.basis.clear()
            adapter.prepare(step)
            _set_ffn(model, current)
            approx = {s: run(s, "approx", adapter) for s in (f_slot, f_slot + 1)}
            sample: dict[str, Any] = {"microbatch": relative_errors(layout, approx[f_slot], exact[f_slot])}
            for n in a.n:
                ref = refs[n]
                neighbor = ref - exact[f_slot] - exact[f_slot + 1] + approx[f_slot] + approx[f_slot + 1]
                spread_approx = ref - exact[f_slot] + approx[f_slot]
                sample[f"n={n}"] = {"neighbor": relative_errors(layout, neighbor, ref),
                                    "spread-approx": relative_errors(layout, spread_approx, ref)}
            samples.setdefault((r, age), []).append(sample)


# ---- wall-clock --------------------------------------------------------------------------


def _wall(preset: str, a: argparse.Namespace) -> dict:
    mb, seq = _shape(preset, a)
    model = _model(preset, seq, a.seed)
    adapter = LlamaAdapter(model, rank=a.rank, tau=a.tau)
    batch_fn = _random_batches(model.args.vocab_size, mb, seq, a.seed)
    layout = GradLayout(model, adapter)
    t0 = time.perf_counter()
    adapter.prepare(0)
    svd_s = time.perf_counter() - t0
    full = (0, mb)
    work: dict[str, list[SlotWork]] = {"normal": [SlotWork(0, full)],
                                       "neighbor": [SlotWork(0, full, "approx"), SlotWork(1, full, "approx")]}
    for n in a.n:
        rows = (0, math.ceil(mb / (n - 1)))  # the largest share a survivor gets
        work[f"spread n={n}"] = [SlotWork(0, full), SlotWork(1, rows)]
        work[f"spread-approx n={n}"] = [SlotWork(0, full), SlotWork(1, rows, "approx")]
    times: dict[str, list[float]] = {k: [] for k in work}
    for rep in range(a.wall_reps + 2):  # two warm-up rounds
        for name, items in work.items():  # interleaved, so drifts hit every policy alike
            t0 = time.perf_counter()
            _run(model, adapter, items, step=0, micro_batch=mb, batch_fn=batch_fn, layout=layout)
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}  # less sensitive to a shared machine's bursts
    svd_per_step = svd_s / a.tau
    out: dict[str, Any] = {"shape": {"micro_batch": mb, "seq_len": seq, "threads": torch.get_num_threads(),
                                     "reps": a.wall_reps},
           "normal_s": med["normal"], "svd_refresh_s": svd_s, "ratios": {}}
    for name in work:
        if name == "normal":
            continue
        uses_svd = "approx" in name or name == "neighbor"
        ratio = med[name] / med["normal"]
        out["ratios"][name] = {"ratio": ratio, "ratio_with_svd": ratio + (svd_per_step / med["normal"]) * uses_svd,
                               "ratio_of_minima": best[name] / best["normal"],
                               "rows": [it.n_rows for it in work[name]]}
    return out

# ---- CLI ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Run the study, print its tables, write the JSON to ``--out`` and return it."""
    a = _parse(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return _main(a)
    finally:
        torch.set_num_threads(threads)


def _main(a: argparse.Namespace) -> dict:
    result: dict = {"config": dict(vars(a)), "method": METHOD, "grad_error": {}, "wall": {},
                    "machine": machine_description()}
    t_start = time.perf_counter()
    tokens, source = None, "random tokens"
    if a.error_presets and a.data == "stdlib":
        try:
            tokens = _stdlib_tokens(model_args(a.error_presets[0]).vocab_size)
            source = f"stdlib sources, BPE vocab {model_args(a.error_presets[0]).vocab_size}, {len(tokens)} tokens"
        except (OSError, ValueError) as e:  # no readable stdlib: the error figures still mean something
            logger.warning("stdlib corpus unavailable (%s); using random tokens", e)
            source = f"random tokens (stdlib corpus failed: {e})"
    result["grad_error_data"] = source
    for preset in a.error_presets:
        use = tokens if tokens is not None and model_args(preset).vocab_size >= int(tokens.max()) + 1 else None
        result["grad_error"][preset] = _grad_error(preset, use, a)
    for preset in a.wall_presets:
        result["wall"][preset] = _wall(preset, a)
    result["elapsed_s"] = time.perf_counter() - t_start
    _print_tables(result, a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _print_tables(r: dict, a: argparse.Namespace) -> None:
    print(f"== gradient error, rank {a.rank} tau {a.tau} ({r['grad_error_data']}): mean / max ==")
    for preset, g in r["grad_error"].items():
        rows = [("micro-batch", g["default"]["microbatch"])]
        rows += [(f"{p} n={n[2:]}", v) for n, d in g["default"]["aggregated"].items() for p, v in d.items()]
        for label, comps in rows:
            print(f"{preset:<7}{label:<20}" + "".join(f"{c}={comps[c]['mean']:.3f}/{comps[c]['max']:.3f}  "
                                                       for c in COMPONENTS))
    print("\n== sweep (means): per micro-batch ffn/total | neighbor aggregated ffn/total ==")
    for preset, g in r["grad_error"].items():
        for row in g["sweep"]:
            agg = "  ".join(f"n={n}: {row[f'neighbor_n={n}_ffn']['mean']:.3f}/"
                            f"{row[f'neighbor_n={n}_total']['mean']:.3f}" for n in a.n)
            print(f"{preset:<7}r={row['rank']:<3} tau={row['tau']:<4} {row['ffn_microbatch']['mean']:.3f}/"
                  f"{row['total_microbatch']['mean']:.3f} | {agg}")
    print("\n== wall-clock (median, interleaved): covering / normal ==")
    for preset, w in r["wall"].items():
        for name, v in w["ratios"].items():
            print(f"{preset:<7}{name:<20}{v['ratio']:6.3f}  with amortised SVD {v['ratio_with_svd']:6.3f}"
                  f"  (ratio of minima {v['ratio_of_minima']:6.3f})  rows {v['rows']}")
    print(f"elapsed {r['elapsed_s']:.1f}s")


if __name__ == "__main__":
    main()
