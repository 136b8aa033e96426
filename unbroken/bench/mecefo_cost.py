"""What covering a failed slot costs under each takeover policy, in FLOPs and saved bytes.

In one process on the CPU, deterministic: the **cost**, FLOPs (FlopCounterMode, forward + backward, recompute and
   low-rank math included; SVDs added from Golub & Van Loan's count, amortised
   over tau) and activation bytes saved for backward, of the covering worker
   relative to a normal worker (one exact micro-batch), per policy and n:
   ``neighbor`` = own + failed micro-batch, both approximate; ``spread`` = own
   exact + 1/(n-1) of a micro-batch exact; ``spread-approx`` = the same with
   the share approximate. FLOPs and bytes are linear in rows, so the 1/(n-1)
   share is scaled exactly; presets deeper than 4 layers are measured at 1
   and 2 layers and extrapolated linearly (identical blocks: exact); and the
   neighbor FLOP ratio per (``--ranks``, ``--taus``).

Saved bytes are reported two ways: ``peak`` (micro-batches one after the
other, as ``compute_gradient_sums`` runs them: the largest one counts) and
``both`` (all of a worker's rows in one forward, the paper's setting).

How wrong MeCeFO's gradient is by rank and tau, and the covering worker's step in wall-clock time, is a study
in the repository: ``python -m benchmarks.mecefo_grad_error``. On the job's own model and device:
``unbroken bench takeover``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
import torch

from unbroken.config import MecefoConfig
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.costs import SavedBytes, count_flops, svd_flops_per_refresh
from unbroken.mecefo.gradients import BatchFn, GradLayout, Mode, SlotWork, compute_gradient_sums
from unbroken.mecefo.takeover import POLICIES  # the policies this benchmark reports (its callers read it here)
from unbroken.models import Transformer, model_args

DEFAULT_OUT = "benchmarks/results/mecefo_cost.json"
TARGETS = {"neighbor_flops": 1.75, "neighbor_saved_bytes": 1.3}
# (micro_batch, seq_len) when not given: CPU-sized, state in the JSON.
DEFAULT_SHAPES = {"debug": (4, 128), "tiny": (4, 128), "llama-350m": (1, 256)}
MAX_MEASURED_LAYERS = 4


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m unbroken.bench.mecefo_cost", description=__doc__.split("\n")[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    names = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    p.add_argument("--presets", type=names, default=["debug", "tiny", "llama-350m"], help="cost presets")
    p.add_argument("--n", type=ints, default=[4, 8], help="data-parallel sizes")
    p.add_argument("--seq-len", type=int, default=None, help="override every preset's sequence length")
    p.add_argument("--micro-batch", type=int, default=None, help="override every preset's micro-batch")
    p.add_argument("--rank", type=int, default=MecefoConfig().rank)
    p.add_argument("--tau", type=int, default=MecefoConfig().tau)
    p.add_argument("--ranks", type=ints, default=[2, 4, 8, 16, 32])
    p.add_argument("--taus", type=ints, default=[1, 10, 50, 200])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads; 1 keeps timings stable on a shared machine")
    p.add_argument("--out", default=DEFAULT_OUT)
    a = p.parse_args(argv)
    errors = [f"--n {n}: must be >= 3 (neighbor needs an exact slot left)" for n in a.n if n < 3]
    errors += [f"--{k} {v}: must be >= 1" for k, v in
               (("rank", a.rank), ("tau", a.tau), ("threads", a.threads)) if v < 1]
    if errors:
        p.error("; ".join(errors))
    return a


def _shape(preset: str, a: argparse.Namespace) -> tuple[int, int]:
    mb, seq = DEFAULT_SHAPES.get(preset, (1, 128))
    return a.micro_batch or mb, a.seq_len or seq


def _random_batches(vocab: int, micro_batch: int, seq: int, seed: int) -> BatchFn:
    def batch_fn(step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + slot)
        xy = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)[rows[0]:rows[1]]
        return xy[:, :-1], xy[:, 1:]
    return batch_fn



def _model(preset: str, seq: int, seed: int, **overrides: int) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(model_args(preset, max_seq_len=max(seq, 16), **overrides))
    model.init_weights(seed=seed)
    return model


def _run(model: Transformer, adapter: LlamaAdapter, work: list[SlotWork], *, step: int, micro_batch: int,
         batch_fn: BatchFn, layout: GradLayout | None = None) -> torch.Tensor:
    layout = layout or GradLayout(model, adapter)
    return compute_gradient_sums(model, adapter, layout, work, step=step, micro_batch=micro_batch,
                                 batch_fn=batch_fn)


# ---- 1. FLOPs and saved bytes -------------------------------------------------------------


def _measure_modes(preset: str, n_layers: int, mb: int, seq: int, a: argparse.Namespace, *, rank: int,
                   full: bool = True) -> dict[str, float]:
    """FLOPs and saved bytes of one micro-batch per mode; SVD FLOPs of one refresh apart.

    With ``full``, also: approximate mode without recomputation (its extra bytes
    per block are what recomputation rebuilds transiently in backward) and one
    exact row (FLOPs must be linear in rows for the spread share to scale).
    """
    model = _model(preset, seq, a.seed, n_layers=n_layers)
    adapter = LlamaAdapter(model, rank=rank, tau=a.tau)
    adapter.prepare(0)  # SVDs outside the counted region; they are added analytically
    kinds: dict[str, tuple[LlamaAdapter, Mode, int]] = {"approx": (adapter, "approx", mb)}
    if full:
        stored = LlamaAdapter(model, rank=rank, tau=a.tau, recompute=False)
        stored.basis = adapter.basis  # same rank and tau: share the bases instead of redoing the SVDs
        kinds.update(exact=(adapter, "exact", mb), approx_norecompute=(stored, "approx", mb),
                     exact_row=(adapter, "exact", 1))
    batch_fn = _random_batches(model.args.vocab_size, mb, seq, a.seed)
    out = {"svd_flops": float(svd_flops_per_refresh(adapter))}
    for kind, (adp, mode, rows) in kinds.items():
        work = [SlotWork(0, (0, rows), mode)]
        with SavedBytes(model) as saved:
            out[f"{kind}_flops"] = float(count_flops(lambda: _run(model, adp, work, step=0, micro_batch=mb,
                                                                   batch_fn=batch_fn)))
        out[f"{kind}_bytes"] = float(saved.bytes)
    if full:
        out["recompute_transient_bytes"] = (out["approx_norecompute_bytes"] - out["approx_bytes"]) / n_layers
    return out


def _cost(preset: str, a: argparse.Namespace) -> dict:
    mb, seq = _shape(preset, a)
    full_layers = model_args(preset).n_layers
    layers = [full_layers] if full_layers <= MAX_MEASURED_LAYERS else [1, 2]
    measured = [_measure_modes(preset, n, mb, seq, a, rank=a.rank) for n in layers]
    if len(measured) == 1:
        m = measured[0]
    else:  # cost(L) = cost(1) + (L - 1) * (cost(2) - cost(1)), exact for identical blocks
        m = {k: measured[0][k] + (full_layers - 1) * (measured[1][k] - measured[0][k]) for k in measured[0]}
        m["recompute_transient_bytes"] = measured[0]["recompute_transient_bytes"]  # per block, not per model
    sweep = _rank_tau_flops(preset, mb, seq, layers[0], full_layers, measured[0], m, a)
    svd_per_step = m["svd_flops"] / a.tau
    ef, eb, af = m["exact_flops"], m["exact_bytes"], m["approx_flops"]
    ab = m["approx_bytes"] + m["recompute_transient_bytes"]  # one block's FFN is rebuilt at a time
    policies: dict[str, dict] = {}
    for n in a.n:
        share = 1.0 / (n - 1)
        # (flops, peak bytes with micro-batches in sequence, bytes with all rows in one forward)
        rows = {
            "neighbor": (2 * af + svd_per_step, ab, 2 * ab),
            "spread": (ef * (1 + share), eb, eb * (1 + share)),
            "spread-approx": (ef + share * af + svd_per_step, eb, eb + share * ab),
        }
        policies[f"n={n}"] = {
            name: {"flops_ratio": f / ef, "flops_ratio_without_svd": (f - (svd_per_step if "approx" in name or
                                                                           name == "neighbor" else 0)) / ef,
                   "saved_bytes_ratio_peak": pk / eb, "saved_bytes_ratio_both": both / eb}
            for name, (f, pk, both) in rows.items()
        }
    nb = policies[f"n={a.n[0]}"]["neighbor"]
    return {
        "shape": {"micro_batch": mb, "seq_len": seq, "layers": full_layers, "layers_measured": layers,
                  "extrapolated": len(layers) > 1, "device": "cpu", "dtype": "float32"},
        "rank": a.rank, "tau": a.tau,
        "normal": {"flops": ef, "saved_bytes": eb},
        "approx_microbatch": {"flops": af, "saved_bytes": m["approx_bytes"],
                              "recompute_transient_bytes": m["recompute_transient_bytes"],
                              "saved_bytes_without_recompute": m["approx_norecompute_bytes"],
                              "flops_ratio": af / ef, "saved_bytes_ratio": ab / eb},
        "rows_linearity": m["exact_row_flops"] * mb / ef,
        "svd": {"flops_per_refresh": m["svd_flops"], "flops_per_step": svd_per_step,
                "share_of_neighbor_step": svd_per_step / (2 * af + svd_per_step)},
        "policies": policies,
        "sweep": sweep,
        "targets": {"neighbor_flops<=1.75": nb["flops_ratio"] <= TARGETS["neighbor_flops"],
                    "neighbor_saved_bytes_both<=1.3": nb["saved_bytes_ratio_both"] <= TARGETS["neighbor_saved_bytes"],
                    "spread<=1+1/(n-1)": all(policies[f"n={n}"]["spread"]["flops_ratio"] <= 1 + 1 / (n - 1) + 1e-9
                                            for n in a.n)},
    }


def _rank_tau_flops(preset: str, mb: int, seq: int, layers: int, full_layers: int, at_rank: dict[str, float],
                    full: dict[str, float], a: argparse.Namespace) -> list[dict]:
    """Neighbor FLOP ratio per (rank, tau); rank changes only block costs, so deeper presets scale a
    ``layers``-deep measurement by ``full_layers / layers``."""
    approx = {a.rank: full["approx_flops"]}
    for r in a.ranks:
        if r not in approx:
            m = _measure_modes(preset, layers, mb, seq, a, rank=r, full=False)
            approx[r] = full["approx_flops"] + (m["approx_flops"] - at_rank["approx_flops"]) * full_layers / layers
    return [{"rank": r, "tau": tau, "neighbor_flops_ratio": (2 * approx[r] + full["svd_flops"] / tau)
             / full["exact_flops"]} for r in a.ranks for tau in a.taus]


# ---- CLI ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print a table, write the JSON to ``--out`` and return it."""
    a = _parse(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        return _main(a)
    finally:
        torch.set_num_threads(threads)


def _main(a: argparse.Namespace) -> dict:
    result: dict = {"config": {k: v for k, v in vars(a).items()}, "method": _METHOD, "cost": {}}
    t_start = time.perf_counter()
    timings = result["timings_s"] = {}
    for preset in a.presets:
        result["cost"][preset] = _cost(preset, a)
    timings["cost"] = time.perf_counter() - t_start
    result["elapsed_s"] = time.perf_counter() - t_start
    _print_table(result, a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


_METHOD = {
    "flops": "FlopCounterMode (2 per multiply-add) over forward+backward of compute_gradient_sums; CPU flash "
             "attention counted with FlopCounterMode's SDPA formulas, halved for causal; SVD (not counted by "
             "FlopCounterMode) added as Golub-Van Loan R-SVD 6*p*q^2+20*q^3 per FFN weight (p=max, q=min of its "
             "shape), once per tau steps per covering worker",
    "saved_bytes": "distinct storages packed by saved_tensors_hooks during one micro-batch, parameters and "
                   "buffers excluded; an approximate micro-batch adds the recompute transient (one block's FFN "
                   "intermediates, measured as the no-recompute excess per block); peak = micro-batches in "
                   "sequence (the largest counts), both = all of a worker's rows in one forward (sum)",
    "spread_share": "1/(n-1) of a micro-batch: FLOPs and bytes scaled from the full micro-batch (exactly "
                    "linear in rows); wall time uses ceil(micro_batch/(n-1)) real rows",
    "extrapolation": "presets deeper than 4 layers are measured with 1 and 2 layers, cost(L) = "
                     "cost(1) + (L-1)*(cost(2)-cost(1))",
}


def _fmt(x: float) -> str:
    return f"{x:6.3f}"


def _print_table(r: dict, a: argparse.Namespace) -> None:
    print("== cost of covering a failed slot (covering worker / normal worker) ==")
    print(f"{'preset':<11}{'n':>3} {'policy':<14}{'FLOPs':>7}{'-svd':>7}{'bytes pk':>9}{'bytes both':>11}  shape")
    for preset, c in r["cost"].items():
        sh = c["shape"]
        for n_key, pol in c["policies"].items():
            for name, v in pol.items():
                print(f"{preset:<11}{n_key[2:]:>3} {name:<14}{_fmt(v['flops_ratio']):>7}"
                      f"{_fmt(v['flops_ratio_without_svd']):>7}{_fmt(v['saved_bytes_ratio_peak']):>9}"
                      f"{_fmt(v['saved_bytes_ratio_both']):>11}  mb={sh['micro_batch']} T={sh['seq_len']}"
                      f"{' (extrapolated)' if sh['extrapolated'] else ''}")
        print(f"{'':14} approx micro-batch alone: FLOPs {_fmt(c['approx_microbatch']['flops_ratio'])}, "
              f"bytes {_fmt(c['approx_microbatch']['saved_bytes_ratio'])}; SVD share of neighbor step "
              f"{c['svd']['share_of_neighbor_step']:.1%}; targets {c['targets']}")
    for preset, c in r["cost"].items():
        print(f"{preset:<11} neighbor FLOPs by (rank, tau): " + " ".join(
            f"{x['rank']}/{x['tau']}={x['neighbor_flops_ratio']:.3f}" for x in c["sweep"]))
    print(f"elapsed {r['elapsed_s']:.1f}s")


if __name__ == "__main__":
    main()
