"""The Python API's parts in one process: references to user code, the job built from a user's factories,
the map-style dataset wrapper, and the cross-worker consistency checks (through a real hosted job store).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken import BuildContext, Config, MapDatasetSource, job_config
from unbroken.agent.preflight import preflight
from unbroken.job import build_job
from unbroken.job.consistency import InconsistentJob, LayoutMismatch, check_consistency
from unbroken.job.references import reference_of, resolve
from unbroken.mecefo.adapter import ExactOnlyAdapter
from unbroken.mecefo.gradients import SlotWork
from unbroken.store.job_store import JobStore

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bring_your_own.py"


def _example(name: str) -> str:
    return f"{EXAMPLE}:{name}"


def _cfg(**sections: dict[str, object]) -> Config:
    cfg = Config()
    cfg.train.workers, cfg.train.steps, cfg.train.device = 2, 5, "cpu"
    cfg.data.micro_batch, cfg.data.seq_len = 4, 64
    for section, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, section), k, v)
    return job_config(cfg, model=_example("build_model"), data=_example("build_data"),
                      optimizer=_example("build_optimizer"))


def top_level(ctx: BuildContext) -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def test_references_name_importable_code_only() -> None:
    assert reference_of(top_level, field="model") == f"{__name__}:top_level"
    assert resolve(f"{__name__}:top_level", field="model") is top_level
    assert resolve(_example("build_model"), field="model") is resolve(_example("build_model"), field="model")

    def nested(ctx: BuildContext) -> None: ...

    for bad in (lambda ctx: None, nested):
        with pytest.raises(ValueError, match="top level of a module"):
            reference_of(bad, field="model")
    with pytest.raises(ValueError, match="expected 'module:function'"):
        reference_of("no_colon", field="model")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve(_example("nope"), field="model")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_x'"):
        resolve("no_such_module_x:f", field="data.factory")


def test_a_job_from_user_factories_trains_exact_and_is_the_same_twice() -> None:
    cfg = _cfg()
    assert cfg.model.family == "custom" and cfg.model.factory == _example("build_model")
    a, b = build_job(cfg, torch.device("cpu")), build_job(cfg, torch.device("cpu"))
    assert type(a.model).__name__ == "TinyLM" and isinstance(a.adapter, ExactOnlyAdapter)
    assert type(a.optimizer) is torch.optim.AdamW and a.val_sampler is None
    assert a.sampler.tokens_per_step == 2 * 4 * 64
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    items = [SlotWork(slot=0, rows=(0, 4)), SlotWork(slot=1, rows=(0, 2))]
    assert torch.equal(a.gradient_sums(3, items), b.gradient_sums(3, items))
    loss = a.loss(a.gradient_sums(0, [SlotWork(slot=0, rows=(0, 4))]))
    assert 4.5 < loss < 6.5  # about ln(256) for a fresh byte model


def test_an_approximating_policy_needs_an_adapter_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="mecefo.policy='neighbor'.* needs a MeCeFO adapter.*TinyLM"):
        preflight(_cfg(mecefo={"policy": "neighbor"}))


def test_map_dataset_rows_are_a_seeded_partition_of_every_epoch() -> None:
    rows = [torch.arange(i, i + 9) for i in range(10)]
    src = MapDatasetSource(rows, seed=3, n_slots=2, micro_batch=4)
    x, y = src.batch(0, 1)
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    parts = [src.batch(0, 1, (0, 1)), src.batch(0, 1, (1, 3)), src.batch(0, 1, (3, 4))]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    # 10 rows, 8 per step: steps 0 and the first 2 rows of step 1 are epoch 0, a permutation of all rows.
    firsts = [int(r) for s in range(2) for k in range(2) for r in src.batch(s, k)[0][:, 0]][:10]
    assert sorted(firsts) == list(range(10))
    assert torch.equal(MapDatasetSource(rows, seed=3, n_slots=2, micro_batch=4).batch(5, 0)[0], src.batch(5, 0)[0])
    with pytest.raises(ValueError, match=r"row \d of the dataset has 3 token ids; every row needs 9"):
        MapDatasetSource([rows[0], torch.arange(3)] * 4, seed=0, n_slots=1, micro_batch=8).batch(0, 0)


class _Noisy:
    def batch(self, step: int, slot: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        xy = torch.randint(0, 50, (rows[1] - rows[0], 9))
        return xy[:, :-1], xy[:, 1:]


def test_workers_that_build_different_jobs_are_caught_through_the_store() -> None:
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="s" * 32)
    job = build_job(_cfg(), torch.device("cpu"))
    named = list(job.model.named_parameters())
    check_consistency(store, "h", named, job.sampler.batch, 4, joining=False)  # the first sets the fingerprints
    check_consistency(store, "h", named, job.sampler.batch, 4, joining=True)  # the same job passes
    other = [(n, torch.nn.Parameter(torch.zeros(3, 3)) if n == "mix.weight" else p) for n, p in named]
    with pytest.raises(LayoutMismatch, match=r"parameter 1 is mix.weight \(3, 3\) float32 here but mix.weight "
                                             r"\(64, 64, 4\) float32 in the job"):
        check_consistency(store, "h", other, job.sampler.batch, 4, joining=True)
    with pytest.raises(InconsistentJob, match=r"_Noisy.batch\(step, slot, rows\) is not deterministic: two calls"):
        check_consistency(store, "h2", named, _Noisy().batch, 4, joining=False)
    with pytest.raises(InconsistentJob, match="another worker got different rows"):
        check_consistency(store, "h", named, lambda s, k, r: (torch.ones(2, 8).long(), torch.ones(2, 8).long()), 4,
                          joining=False)
