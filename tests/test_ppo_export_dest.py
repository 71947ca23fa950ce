"""Chapter 5 — `avrid export --overwrite` never destroys a run or a user's files
(`ppo/outputs/export_dest.py`).

Each destination that once deleted data is refused with exit status 2, and the whole tree
(the run, its checkpoints, logs, the user's own code around it) is byte-for-byte what it was,
with no temporary or trash directory left behind. The places an export may go still work: a
new directory, an earlier export (with --overwrite), and the run's own ``export/``.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest

from avrid.cli import main
from avrid.ppo.engines.models import build_tiny_policy, tiny_spec
from avrid.ppo.outputs.checkpoint import save_checkpoint
from avrid.ppo.outputs.export import WEIGHTS_FILE, export_checkpoint
from avrid.ppo.outputs.export_dest import ExportDestError, check_export_dest
from avrid.ppo.outputs.outdir import LOCK_FILE
from avrid.ppo.setup.config_file import config_to_dict
from avrid.ppo.setup.overrides import with_overrides
from avrid.ppo.setup.presets import preset
from avrid.ppo.setup.tokenizer import CharTokenizer

pytestmark = pytest.mark.chapter(5)

DIGITS = CharTokenizer("0123456789=")


def make_project(tmp_path: Path) -> Path:
    """proj/ with the user's own code and a run in proj/run: a lock file, logs, two
    checkpoints (as `avrid ppo` leaves them, written without training)."""
    proj = tmp_path / "proj"
    run = proj / "run"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "train.py").write_text("print('my own code')\n")
    (proj / "notes.md").write_text("do not delete\n")
    cfg = with_overrides(preset("tiny-grpo"), [f"train.out_dir={run}"])
    policy = build_tiny_policy(tiny_spec(cfg, DIGITS.vocab_size), seed=0)
    for step in (1, 2):
        save_checkpoint(run / "checkpoints", step,
                        weights={"actor": dict(policy.named_parameters())}, optimizers={},
                        state={"step": step, "config": config_to_dict(cfg)})
    (run / LOCK_FILE).write_text('{"pid": 1}\n')
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "samples.jsonl").write_text('{"step": 1}\n')
    (run / "reward.png").write_bytes(b"\x89PNG")
    return proj


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under `root`, with the sha256 of each file."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(["export", *args, "--overwrite"])
    assert done.value.code == 2
    return capsys.readouterr().err


def test_every_destination_over_the_run_or_the_users_files_is_refused_and_nothing_changes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    proj = make_project(tmp_path)
    run = proj / "run"
    other = tmp_path / "other_run"  # another run: a lock file is enough to mark one
    other.mkdir()
    (other / LOCK_FILE).write_text("{}\n")
    before = snapshot(tmp_path)

    cases = {
        str(run): "is the source run",  # the run itself
        str(proj): "contains the source run",  # the user's project around it
        str(run / "checkpoints"): "the source run",  # every checkpoint
        str(run / "checkpoints" / "step_000002"): "the source run",  # the step read from
        str(run / "plots"): "lies inside the source run",
        str(other): "is a run directory",
        str(other / "export"): "lies inside",
        str(proj / "src"): "is not an earlier export",  # the user's code, --overwrite or not
    }
    for dest, why in cases.items():
        err = refused(capsys, str(run), dest)
        assert why in err, (dest, err)
        assert err.count("\n") == 1, err  # one line
    # `.` and a relative path through a symlink are caught like the paths they stand for.
    (tmp_path / "link").symlink_to(run)
    monkeypatch.chdir(run)
    assert "is the source run" in refused(capsys, ".", ".")
    monkeypatch.chdir(tmp_path)
    assert "is the source run" in refused(capsys, "proj/run", "link")
    assert "contains the source run" in refused(capsys, "link/checkpoints", "proj/..")
    (tmp_path / "link").unlink()

    # Byte-for-byte what it was; no .tmp-* or .trash-* left anywhere.
    assert snapshot(tmp_path) == before


def test_the_places_an_export_may_go_still_work(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    proj = make_project(tmp_path)
    run = proj / "run"
    # A new directory; then --overwrite replaces that earlier export.
    dest = tmp_path / "hf"
    main(["export", str(run), str(dest)])
    main(["export", str(run / "checkpoints" / "step_000001"), str(dest), "--overwrite"])
    assert "step 1 of" in capsys.readouterr().out
    # The run's own export/ (where `avrid ppo` publishes its policy), twice.
    export_checkpoint(run, run / "export", overwrite=True)
    export_checkpoint(run, run / "export", overwrite=True)
    assert (run / "export" / WEIGHTS_FILE).read_bytes() == (dest / WEIGHTS_FILE).read_bytes()
    # Without --overwrite an earlier export stays.
    with pytest.raises(ExportDestError, match="exists and is not empty"):
        export_checkpoint(run, dest)
    # An empty existing directory is taken as it is.
    (tmp_path / "empty").mkdir()
    export_checkpoint(run, tmp_path / "empty")
    leftovers = [p for p in tmp_path.rglob(".*") if p.name.startswith((".tmp-", ".trash-"))]
    assert leftovers == []


def test_a_directory_that_cannot_be_set_aside_leaves_no_trash(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """`move_into_place` renames the old export aside before publishing the new one; when
    that rename fails (a busy directory, a mount point: EBUSY) it used to leave an empty
    ``.trash-*`` directory behind."""
    from avrid.ppo.outputs import outdir

    proj = make_project(tmp_path)
    dest = tmp_path / "hf"
    export_checkpoint(proj / "run", dest)
    before = (dest / WEIGHTS_FILE).read_bytes()
    real_rename = os.rename

    def busy(src: object, dst: object) -> None:
        if Path(src) == dest:
            raise OSError(16, "Device or resource busy")
        real_rename(src, dst)

    monkeypatch.setattr(outdir.os, "rename", busy)
    with pytest.raises(OSError, match="busy"):
        export_checkpoint(proj / "run", dest, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "proj"]
    assert (dest / WEIGHTS_FILE).read_bytes() == before  # the old export is intact


def test_a_checkpoint_root_outside_any_run_is_protected_like_a_run(tmp_path: Path) -> None:
    # Checkpoints saved to a folder of their own (not ``run/checkpoints``): no run directory
    # is around them, so the root itself is what must not be written over or into.
    root = tmp_path / "my_ckpts"
    policy = build_tiny_policy(tiny_spec(preset("tiny-grpo"), DIGITS.vocab_size), seed=0)
    for step in (1, 2):
        save_checkpoint(root, step, weights={"actor": dict(policy.named_parameters())},
                        optimizers={}, state={"step": step})
    step_dir = root / "step_000002"
    for dest, why in ((root, f"is the source run ({root})"),
                      (root / "hf", f"lies inside the source run ({root})")):
        with pytest.raises(ExportDestError, match=re.escape(why)):
            check_export_dest(dest, step_dir, overwrite=True)
    assert check_export_dest(tmp_path / "hf", step_dir, overwrite=True) == tmp_path / "hf"


def model_folder(path: Path) -> None:
    path.mkdir(parents=True)
    for name in ("config.json", WEIGHTS_FILE):
        (path / name).write_text("{}")


def adapter_folder(path: Path) -> None:
    path.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (path / name).write_text("{}")


def test_overwrite_replaces_an_export_with_nothing_but_its_own_folders(tmp_path: Path) -> None:
    # An earlier export may hold the adapter folder (and, in a LoRA run's layout, merged/ and
    # base/ model folders) and nothing else: a folder of the user's beside the model files,
    # a stray file in adapter/, or a sub-folder of merged/ makes it not an export.
    def layout(kind: str, *, extra: str | None = None) -> Path:
        d = tmp_path / f"{kind}_{len(list(tmp_path.iterdir()))}"
        if kind.startswith("model"):
            model_folder(d)
        else:  # a LoRA run's export
            adapter_folder(d / "adapter")
            model_folder(d / "merged")
            model_folder(d / "base")
        if kind == "model_with_adapter":
            adapter_folder(d / "adapter")
        if extra is not None:
            (d / extra).parent.mkdir(parents=True, exist_ok=True)
            (d / extra).write_text("mine\n")
        return d

    def refused(d: Path) -> bool:
        try:
            check_export_dest(d, None, overwrite=True)
        except ExportDestError as e:
            return "is not an earlier export" in str(e)
        return False

    for d in (layout("model"), layout("model_with_adapter"), layout("lora")):
        assert check_export_dest(d, None, overwrite=True) == d  # an export: replaced
    not_exports = [layout("model", extra="src/train.py"),
                   layout("model_with_adapter", extra="src/train.py"),
                   layout("model_with_adapter", extra="adapter/notes.md"),
                   layout("lora", extra="merged/src/train.py"),
                   layout("lora", extra="notes/a.md")]
    accepted = [d.name for d in not_exports if not refused(d)]
    assert accepted == [], f"--overwrite would replace (delete) these folders: {accepted}"
