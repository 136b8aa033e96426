"""The job's compile cache file: loaded only when sealed with the job's secret and written for this torch, Triton,
device and config; anything else is ignored with one warning (the process compiles from scratch) and nothing of it
reaches torch or inductor's cache directory.

torch's own save and load of the Mega-Cache are stood in for here (what they carry is torch's business; the
file around it is ours); tests/integration/test_compile_once_per_job.py runs the real ones in a job.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from unbroken.job import compile_cache
from unbroken.job.compilation import Compilation
from unbroken.job.compile_cache import CACHE_FILE, load_compile_cache, save_compile_cache

pytestmark = pytest.mark.timeout(60)

SECRET = "the job's secret"
HASH = "config-hash-1"
CPU = torch.device("cpu")
MEGA = b"torch's own serialized artifacts \x00\x01\x02" * 100
KERNEL = "ab/cabcdef.main.so"
"""A kernel's place in inductor's cache directory (``xy/c<key>[.main].so``)."""


class FakeMegaCache:
    """torch.compiler's save and load, recording what was loaded."""

    def __init__(self) -> None:
        self.loaded: list[bytes] = []

    def save(self) -> tuple[bytes, SimpleNamespace]:
        return MEGA, SimpleNamespace(artifacts={"inductor": ["k1", "k2"], "aot_autograd": ["a1"]})

    def load(self, data: bytes) -> SimpleNamespace:
        self.loaded.append(data)
        return SimpleNamespace(artifacts={"inductor": ["k1", "k2"], "aot_autograd": ["a1"]})


@pytest.fixture()
def mega(monkeypatch, tmp_path: Path) -> FakeMegaCache:
    fake = FakeMegaCache()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", fake.save)
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fake.load)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "writer-inductor"))
    return fake


def write(run_dir: Path, **kw: object) -> dict:
    args = {"secret": SECRET, "config_hash": HASH, "device": CPU, "writer": {"worker": 0}, **kw}
    return save_compile_cache(run_dir / CACHE_FILE, **args)


def load(run_dir: Path, **kw: object) -> dict:
    return load_compile_cache(run_dir / CACHE_FILE, **{"secret": SECRET, "config_hash": HASH, "device": CPU, **kw})


def test_a_cache_written_by_the_job_is_loaded_with_the_kernels_its_writer_had_mapped(mega, tmp_path, monkeypatch):
    built = tmp_path / "writer-inductor" / KERNEL
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF a built kernel")
    with open(built, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ):  # as dlopen maps it
        written = write(tmp_path)
    assert written["artifacts"] == {"inductor": 2, "aot_autograd": 1} and written["kernels"] == 1
    assert written["bytes"] == (tmp_path / CACHE_FILE).stat().st_size
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "reader-inductor"))  # another machine's
    got = load(tmp_path)
    assert got["loaded"] and got["artifacts"] == {"inductor": 2, "aot_autograd": 1} and got["kernels"] == 1
    assert got["writer"] == {"worker": 0}
    assert mega.loaded == [MEGA]
    placed = tmp_path / "reader-inductor" / KERNEL
    assert placed.read_bytes() == b"\x7fELF a built kernel" and os.stat(placed).st_mode & 0o777 == 0o755

    placed.write_bytes(b"this machine's own build")  # a kernel inductor already has is never replaced
    assert load(tmp_path)["kernels"] == 0 and placed.read_bytes() == b"this machine's own build"


@pytest.mark.parametrize("field, value", [("torch", "2.0.0"), ("triton", "triton 9.9.9"),
                                          ("device", "NVIDIA H100 80GB HBM3")])
def test_a_cache_of_another_torch_triton_or_device_is_ignored_with_one_warning(mega, tmp_path, monkeypatch, caplog,
                                                                               field, value):
    here = compile_cache.identity(CPU)
    monkeypatch.setattr(compile_cache, "identity", lambda device: {**here, field: value})
    write(tmp_path)
    monkeypatch.setattr(compile_cache, "identity", lambda device: here)
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        got = load(tmp_path)
    assert not got["loaded"] and field in got["why"] and repr(value) in got["why"]
    assert mega.loaded == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "compiling from scratch" in warnings[0].getMessage()


def test_a_cache_of_another_config_is_ignored(mega, tmp_path):
    write(tmp_path, config_hash="another-config")
    got = load(tmp_path)
    assert not got["loaded"] and "config_hash 'another-config'" in got["why"] and mega.loaded == []


@pytest.mark.parametrize("spoil", ["payload", "header", "other secret"])
def test_a_cache_whose_mac_does_not_verify_is_ignored_and_nothing_of_it_is_unpickled_or_placed(
        mega, tmp_path, monkeypatch, caplog, spoil):
    built = tmp_path / "writer-inductor" / KERNEL
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF a built kernel")
    with open(built, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ):
        write(tmp_path, secret="someone else's" if spoil == "other secret" else SECRET)
    path = tmp_path / CACHE_FILE
    raw = bytearray(path.read_bytes())
    if spoil == "payload":
        raw[-5] ^= 0x01
    elif spoil == "header":  # a header made to match another reader: the MAC covers it
        raw[:] = raw.replace(b'"config_hash": "config-hash-1"', b'"config_hash": "config-hash-2"')
    path.write_bytes(bytes(raw))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "reader-inductor"))
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        got = load(tmp_path, config_hash="config-hash-2" if spoil == "header" else HASH)
    assert got == {"loaded": False, "why": "not sealed with this job's secret"}
    assert mega.loaded == [] and not (tmp_path / "reader-inductor" / KERNEL).exists()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("content", [b"", b"UBCOMP1\0", b"not a cache at all", b"UBCOMP1\0\xff\xff\xff\xff{}"])
def test_a_file_that_is_not_a_cache_is_ignored(mega, tmp_path, content):
    (tmp_path / CACHE_FILE).write_bytes(content)
    got = load(tmp_path)
    assert not got["loaded"] and got["why"] in ("not a compile cache of unbroken", "truncated")
    assert mega.loaded == []


def test_no_cache_yet_is_no_warning(mega, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=compile_cache.__name__):
        assert load(tmp_path) == {"loaded": False, "why": "absent"}
    assert caplog.records == []


def test_nothing_compiled_writes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    assert write(tmp_path) is None and not (tmp_path / CACHE_FILE).exists()


def test_a_process_counts_the_frames_it_compiled_and_the_seconds_it_spent():
    compilation = Compilation(CPU)
    try:
        before = compilation.stats()
        f = torch.compile(lambda x: (x.sin() * 3).sum(), backend="aot_eager")
        f(torch.randn(8, requires_grad=True)).backward()
        after = compilation.stats()
    finally:
        compilation.close()
    assert after["frames"] - before["frames"] == 1
    assert after["seconds"] > before["seconds"]
    assert after["cache"] == {"loaded": False, "why": "not looked for"} and after["written"] is None


def test_the_leader_writes_the_cache_the_job_lacks_then_again_only_once_it_built_a_graph_no_cache_held(
        mega, tmp_path, monkeypatch):
    import collections

    import torch._dynamo.utils

    counters: collections.defaultdict = collections.defaultdict(collections.Counter)  # this process's, from zero
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    compilation = Compilation(CPU)
    frames, aot = counters["frames"], counters["aot_autograd"]
    try:
        assert not compilation.should_write(), "nothing compiled yet"
        frames["ok"] += 1  # a frame whose graph came from the machine's own cache: the job still has none
        aot["autograd_cache_hit"] += 1
        assert compilation.should_write()
        assert compilation.save(tmp_path, secret=SECRET, config_hash=HASH, writer={})["artifacts"]
        assert not compilation.should_write()
        aot["autograd_cache_hit"] += 1  # a graph found in a cache: the file holds it already
        assert not compilation.should_write()
        aot["autograd_cache_miss"] += 1  # a validation pass's graph, say
        assert compilation.should_write()

        loaded = Compilation(CPU)  # a later process: loaded the job's cache, then built nothing new
        try:
            assert loaded.load(tmp_path, secret=SECRET, config_hash=HASH)["loaded"]
            assert not loaded.should_write()
            aot["autograd_cache_miss"] += 1
            assert loaded.should_write()
        finally:
            loaded.close()
    finally:
        compilation.close()


def test_a_cache_that_cannot_be_written_for_any_reason_is_logged_once_and_never_ends_the_writer(
        tmp_path, monkeypatch, caplog):
    """The cache is an optimisation: torch failing to serialise its artifacts (not an OSError) must not end the
    view's leader after its vote, nor the next leader after it."""
    import collections

    import torch._dynamo.utils

    from unbroken.job import compilation as compilation_module

    def save_fails() -> None:
        raise RuntimeError("an artifact torch cannot serialise")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", save_fails)
    counters: collections.defaultdict = collections.defaultdict(collections.Counter)
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    counters["frames"]["ok"] += 1
    compilation = Compilation(CPU)
    try:
        with caplog.at_level(logging.DEBUG, logger=compilation_module.__name__):
            for _ in range(3):  # each time after a graph no cache held
                counters["aot_autograd"]["autograd_cache_miss"] += 1
                assert compilation.should_write()
                assert compilation.save(tmp_path, secret=SECRET, config_hash=HASH, writer={"worker": 0}) is None
                assert not compilation.should_write(), "not tried again before another graph is built"
    finally:
        compilation.close()
    assert compilation.written == {"error": "RuntimeError: an artifact torch cannot serialise"}
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "could not write the job's compile cache" in warnings[0].getMessage()
    assert not (tmp_path / CACHE_FILE).exists() and list(tmp_path.iterdir()) == []
