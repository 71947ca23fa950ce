"""Chapter 5 — checkpoints: bit-exact round trips, an exact resume of AdamW, the `latest`
pointer, pruning, re-saving a step, a failure midway that leaves nothing behind, checksums
that refuse a tampered file, the newest intact checkpoint offered when the latest is damaged,
leftovers of a killed save cleaned, and write errors that name the file."""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import pytest
import torch

from avrid.ppo.outputs.checkpoint import (
    LATEST,
    Checkpoint,
    CorruptCheckpointError,
    latest_checkpoint,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
)
from avrid.ppo.outputs.manifest import verify_checkpoint
from avrid.ppo.outputs.outdir import WriteError, remove_stale_temp_dirs

pytestmark = pytest.mark.chapter(5)


def save(root: Path, step: int, **kw: object) -> Path:
    args: dict = {"weights": {"actor": {"w": torch.full((2,), float(step))}},
                  "optimizers": {}, "state": {"step": step}}
    args.update(kw)
    return save_checkpoint(root, step, **args)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bytes is bit-equal, NaN payloads and -0.0 included."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_weights_round_trip_bit_equal_with_bf16_views_and_tied_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    embed = torch.randn(8, 4, dtype=torch.bfloat16)
    buffer = torch.randn(6, 3)
    actor = {
        "embed.weight": embed,
        "lm_head.weight": embed,                   # tied: the very same tensor
        "half.a": buffer[:3], "half.b": buffer[3:],  # two views of one storage
        "transposed": torch.randn(3, 5).t(),       # non-contiguous
        "steps": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
    }
    critic = {"v.weight": torch.randn(1, 4, dtype=torch.float16, requires_grad=True)}
    path = save_checkpoint(tmp_path, 12, weights={"actor": actor, "critic": critic},
                           optimizers={}, state={"step": 12})
    assert path == tmp_path / "step_000012"
    ckpt = load_checkpoint(path)
    assert isinstance(ckpt, Checkpoint) and ckpt.step == 12
    assert set(ckpt.weights) == {"actor", "critic"}
    for name, sd in (("actor", actor), ("critic", critic)):
        loaded = ckpt.weights[name]
        assert set(loaded) == set(sd)
        for key, t in sd.items():
            assert loaded[key].dtype == t.dtype and loaded[key].shape == t.shape
            # Bit-equal, NaN-safe: compare the raw bytes.
            assert torch.equal(raw(loaded[key]), raw(t)), (name, key)
    # The caller's tensors were not touched (tied ones still tied).
    assert actor["lm_head.weight"] is actor["embed.weight"]


def test_adamw_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    torch.manual_seed(0)
    xs = [torch.randn(5, 4) for _ in range(4)]

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: list) -> None:
        for x in batch:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    model, opt = make()
    train(model, opt, xs[:2])
    rng = torch.get_rng_state()
    save_checkpoint(tmp_path, 2, weights={"actor": model.state_dict()},
                    optimizers={"actor": [opt.state_dict()]},
                    state={"step": 2, "data_position": 10, "py_rng": list(random.getstate()[1])},
                    extra={"torch_rng": rng})
    train(model, opt, xs[2:])
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    ckpt = load_checkpoint(tmp_path)  # the root: resolved through `latest`
    resumed, opt2 = make()
    resumed.load_state_dict(ckpt.weights["actor"])
    opt2.load_state_dict(ckpt.optimizers["actor"][0])
    train(resumed, opt2, xs[2:])
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, uninterrupted[k]), k
    assert ckpt.state["data_position"] == 10
    assert ckpt.state["py_rng"] == list(random.getstate()[1])
    assert torch.equal(ckpt.extra["torch_rng"], rng)


def test_latest_pointer_and_fallback(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None
    save(tmp_path, 1)
    save(tmp_path, 10)
    assert (tmp_path / LATEST).read_text().strip() == "step_000010"
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    # Without the pointer: the highest complete step dir; tmp dirs never count.
    (tmp_path / LATEST).unlink()
    (tmp_path / ".tmp-step_000099-abc").mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    # A pointer to a step dir that is gone falls back too.
    (tmp_path / LATEST).write_text("step_000050\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    assert load_checkpoint(tmp_path).step == 10


def test_keep_last_prunes_older_steps_only(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep_last=2)
    assert listing(tmp_path) == [LATEST, "step_000003", "step_000004"]
    # Resumed from step 3 and saving step 3 again: step 4 (a later step) is never deleted.
    save(tmp_path, 3, keep_last=1)
    assert listing(tmp_path) == [LATEST, "step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000003"
    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, 5, keep_last=0)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 5, state={"step": 5, "run": "first"},
         optimizers={"actor": {"old": 1}})
    save(tmp_path, 5, state={"step": 5, "run": "second"})
    ckpt = load_checkpoint(tmp_path / "step_000005")
    assert ckpt.state["run"] == "second"
    assert ckpt.optimizers == {}  # nothing of the first save survives
    assert not (tmp_path / "step_000005" / "actor.optim.pt").exists()
    assert listing(tmp_path) == [LATEST, "step_000005"]  # no tmp or trash dir left


@pytest.mark.parametrize("bad", [
    {"optimizers": {"actor": lambda: 0}},                       # unpicklable
    {"state": {"step": 2, "loss": float("nan")}},               # not JSON
    {"weights": {"actor": {"w": torch.ones(1)}, "critic": {"w": "not a tensor"}}},
])
def test_failure_midway_leaves_nothing(tmp_path: Path, bad: dict) -> None:
    save(tmp_path, 1)
    before = listing(tmp_path)
    latest = (tmp_path / LATEST).read_text()
    with pytest.raises(Exception):  # noqa: B017  (whatever the writer raised)
        save(tmp_path, 2, **bad)
    assert listing(tmp_path) == before  # no step_000002, no .tmp-* dir
    assert (tmp_path / LATEST).read_text() == latest
    assert load_checkpoint(tmp_path).step == 1


def test_failed_resave_keeps_the_old_step(tmp_path: Path) -> None:
    save(tmp_path, 3, state={"step": 3, "v": 1})
    with pytest.raises(Exception):  # noqa: B017
        save(tmp_path, 3, optimizers={"actor": lambda: 0})
    assert load_checkpoint(tmp_path).state == {"step": 3, "v": 1}
    assert listing(tmp_path) == [LATEST, "step_000003"]


def test_missing_or_corrupt_files_are_named(tmp_path: Path) -> None:
    path = save(tmp_path, 1, optimizers={"actor": {"a": 1}})
    (path / "actor.optim.pt").unlink()
    with pytest.raises(FileNotFoundError, match="actor.optim.pt"):
        load_checkpoint(path)
    path = save(tmp_path, 2)
    data = (path / "actor.safetensors").read_bytes()
    (path / "actor.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="actor.safetensors"):
        load_checkpoint(path)
    path = save(tmp_path, 3)
    (path / "state.json").write_text("{not json")
    with pytest.raises(ValueError, match="state.json"):
        load_checkpoint(path)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    with pytest.raises(ValueError, match="format"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nowhere")


def test_bad_arguments_rejected_before_any_io(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step"):
        save(tmp_path / "a", -1)
    with pytest.raises(ValueError, match="name"):
        save(tmp_path / "b", 1, weights={"../evil": {"w": torch.ones(1)}})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- integrity, damaged checkpoints, leftovers and write errors (issue 11) ---------------------

def tamper(path: Path, model: str = "actor") -> None:
    """Change the weights in place, keeping a perfectly valid safetensors file."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / f"{model}.safetensors"))
    save_file({k: v + 1 for k, v in sd.items()}, str(path / f"{model}.safetensors"))


def test_the_manifest_checksums_every_file_and_a_tampered_one_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path, 4, optimizers={"actor": {"m": torch.ones(3)}}, extra={"r": 1})
    files = json.loads((path / "manifest.json").read_text())["files"]
    assert sorted(files) == ["actor.optim.pt", "actor.safetensors", "extra.pt", "state.json"]
    tamper(path)
    with pytest.raises(ValueError, match=r"actor\.safetensors does not match the checksum"):
        load_checkpoint(path)
    with pytest.raises(ValueError, match=r"actor\.safetensors"):
        verify_checkpoint(path)


def test_a_damaged_latest_checkpoint_names_the_newest_intact_one(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save(tmp_path, step)
    tamper(tmp_path / "step_000003")
    (tmp_path / "step_000002" / "state.json").write_text('{"step": 99}')  # edited by hand
    with pytest.raises(CorruptCheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "latest checkpoint" in message and "step_000003" in message
    assert f"newest intact earlier checkpoint is {tmp_path / 'step_000001'}" in message
    assert err.value.intact == tmp_path / "step_000001"
    assert newest_intact_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert load_checkpoint(err.value.intact).step == 1  # and it loads by its path


def test_a_garbage_latest_pointer_is_named_not_decoded(tmp_path: Path) -> None:
    save(tmp_path, 1)
    (tmp_path / LATEST).write_bytes(b"\xff\xfe\x00garbage\x9c")
    with pytest.raises(CorruptCheckpointError,
                       match=rf"checkpoint pointer {tmp_path / LATEST} is unreadable or corrupt"
                             r".*step_000001"):
        latest_checkpoint(tmp_path)
    (tmp_path / LATEST).write_text("../../etc\n")
    with pytest.raises(CorruptCheckpointError, match="not a step directory name"):
        load_checkpoint(tmp_path)


def test_leftovers_of_a_killed_save_are_removed_and_a_set_aside_step_is_put_back(
        tmp_path: Path) -> None:
    save(tmp_path, 1)
    save(tmp_path, 3)
    (tmp_path / ".tmp-step_000004-dead").mkdir()
    (tmp_path / ".tmp-step_000004-dead" / "actor.safetensors").write_bytes(b"half")
    # Killed inside move_into_place: step 3 set aside, its replacement not yet renamed in.
    trash = tmp_path / ".trash-step_000003-dead"
    trash.mkdir()
    (tmp_path / "step_000003").rename(trash / "step_000003")
    (tmp_path / ".latest.x1.tmp").write_text("step_0")
    removed = remove_stale_temp_dirs(tmp_path)
    assert {p.name for p in removed} == {".tmp-step_000004-dead", ".trash-step_000003-dead",
                                         ".latest.x1.tmp"}
    assert listing(tmp_path) == [LATEST, "step_000001", "step_000003"]
    assert load_checkpoint(tmp_path).step == 3


def test_a_full_disk_names_the_file_and_leaves_nothing(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import avrid.ppo.outputs.outdir as outdir

    save(tmp_path, 1)
    before = listing(tmp_path)

    def full(obj: object, path: object) -> None:  # what torch.save says on ENOSPC
        raise RuntimeError("basic_ios::clear: iostream error")

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(outdir, "_free_bytes", lambda path: 0)
    with pytest.raises(WriteError, match=r"could not write .*\.tmp-step_000002-\w+/"
                                         r"actor\.optim\.pt: No space left on device") as err:
        save(tmp_path, 2, optimizers={"actor": {"m": 1}})
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
    assert listing(tmp_path) == before


def test_an_unwritable_root_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(WriteError, match=rf"could not write {tmp_path / 'file' / 'ckpt'}: "):
        save(tmp_path / "file" / "ckpt", 1)
