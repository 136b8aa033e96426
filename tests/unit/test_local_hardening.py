"""What another local user can no longer do: read a run directory, plant the secret's file, shadow a module
through a user script's folder (the threat model in docs/design.md)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from unbroken.config import load_config
from unbroken.job.references import anchor_references, resolve
from unbroken.job.run_dir import prepare_out_dir
from unbroken.store.backend import SECRET_FILE, StoreAccessDenied, save_secret

pytestmark = pytest.mark.timeout(30)


def test_a_new_run_directory_is_the_owners_alone_even_one_that_existed(tmp_path: Path):
    cfg = load_config(preset_name="debug")
    fresh, existing = tmp_path / "a" / "run", tmp_path / "b"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    for run in (fresh, existing):
        prepare_out_dir(run, cfg, overwrite=False)
        assert stat.S_IMODE(run.stat().st_mode) == 0o700


def test_the_secret_is_never_written_through_a_planted_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    monkeypatch.setattr("secrets.token_hex", lambda n: "ab" * n)  # the temporary name an attacker would guess
    planted = tmp_path / f".{SECRET_FILE}.{os.getpid()}.{'ab' * 4}"
    planted.symlink_to(victim)
    with pytest.raises(StoreAccessDenied, match="exists .planted..; the job secret is not written through it"):
        save_secret(tmp_path, "s3cret")
    assert victim.read_text() == "untouched\n" and not (tmp_path / SECRET_FILE).exists()
    planted.unlink()
    save_secret(tmp_path, "s3cret")
    assert (tmp_path / SECRET_FILE).read_text() == "s3cret\n"
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600


def test_a_user_scripts_folder_never_shadows_an_installed_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    shared = tmp_path / "shared"  # a folder others can write, such as /tmp
    shared.mkdir()
    (shared / "script.py").write_text("import json\ndef build(ctx=None):\n    return json.__name__\n")
    (shared / "json.py").write_text("raise RuntimeError('shadowed')\n")  # planted by someone else
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "json")  # as in a fresh worker that has not imported it yet
    build = resolve(f"{shared / 'script.py'}:build", field="model.factory")
    assert build() == "json"
    assert sys.modules["json"].__file__ != str(shared / "json.py")
    assert sys.path.index(str(shared)) == len(sys.path) - 1, "the script's folder comes last"


def test_a_relative_script_reference_means_the_launching_directory(tmp_path: Path):
    cfg = load_config(preset_name="debug", overrides=["model.family=custom", "model.factory=lib/model.py:build"])
    anchor_references(cfg, base=tmp_path)
    assert cfg.model.factory == f"{(tmp_path / 'lib' / 'model.py').resolve()}:build"
    with pytest.raises(ValueError, match="is a relative path; the job makes it absolute where it is launched"):
        resolve("lib/model.py:build", field="model.factory")


def test_a_user_script_that_does_not_load_is_refused_once_naming_the_error_and_line(tmp_path: Path):
    script = tmp_path / "model.py"
    script.write_text("x = 1\nimport not_a_module_anywhere\ndef build(ctx):\n    return None\n")
    with pytest.raises(ValueError, match=r"model.factory: loading .*model.py \(line 2\) failed: ModuleNotFoundError: "
                                         r"No module named 'not_a_module_anywhere'"):
        resolve(f"{script}:build", field="model.factory")
