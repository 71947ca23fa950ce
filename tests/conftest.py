"""Shared test harness: hardware markers, the session Ray fixture and the leak check.

- `@pytest.mark.gpu(count=N)` / `@pytest.mark.vllm` tests skip with a reason where CUDA, N GPUs
  or the vllm package are missing (the logic is `tests.helpers.hardware_skip_reason`).
- `ray_session` starts one local Ray for the whole session (auth off, no dashboard); a test
  that runs its own multi-node cluster stops it, and `ray_cluster` starts it again.
- `ray_cluster` is what a test asks for: after the test it fails the test if any actor or
  placement group the test created is still alive, then restarts Ray so the leak cannot
  poison later tests.
- `backend` runs a test on both backends: Ray (with `ray_cluster`) and in-process.
- The user's shell stays out: RAY_ADDRESS and AVRID_DEBUG (`tests.helpers.SESSION_UNSET`) are
  removed from the environment for the session and put back after it, so no test joins an
  outside Ray cluster or prints tracebacks it did not ask for; a subprocess a test starts gets
  `tests.helpers.child_env()` (no RAY_* or AVRID_* variable of the user's at all).
- Chapters: each test file says which chapter's layer it tests (``pytestmark =
  pytest.mark.chapter(2)``), or that it checks the project itself (``pytest.mark.project``:
  the import contract, packaging, the GPU test scheduler); a docstring example in avrid/
  belongs to the chapter its module's docstring opens with. ``pytest --chapter 2`` (``make
  test CH=2``) runs chapter 2's tests only; a test with neither marker fails collection.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray worker processes inherit this, so they can import `tests.helpers` and `chapters.*`.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

from tests.helpers import SESSION_UNSET, hardware_skip_reason  # noqa: E402  (the path above)

# Shared CI machines are noisy: a per-example deadline would flake, the test timeout guards.
settings.register_profile("avrid", deadline=None, max_examples=50)
settings.load_profile("avrid")

RAY_CPUS = 16  # logical scheduling slots, not cores: enough for 2 roles x 8 workers
CHAPTERS = range(1, 8)  # the chapters that have a layer (and tests) so far (7: being built)
_CHAPTER_LINE = re.compile(r"\s*Chapter (\d+)\b")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--chapter", type=int, default=None, metavar="N",
                     help=f"run only chapter N's tests (N in {CHAPTERS.start}.."
                          f"{CHAPTERS.stop - 1}); `make test CH=N`")


def chapter_of(item: pytest.Item) -> int | None:
    """The chapter a test belongs to: its `chapter(N)` marker, or for a docstring example,
    the "Chapter N" its module's docstring opens with; None for the project's own tests."""
    marker = item.get_closest_marker("chapter")
    if marker is not None:
        return int(marker.args[0])
    dtest = getattr(item, "dtest", None)  # a doctest item: read its module's docstring
    if dtest is not None:
        found = _CHAPTER_LINE.match(dtest.globs.get("__doc__") or "")
        return int(found.group(1)) if found else None
    if item.get_closest_marker("project") is None:
        raise pytest.UsageError(f"{item.nodeid} says neither which chapter it tests nor that "
                                f"it tests the project: add `pytestmark = "
                                f"pytest.mark.chapter(N)` (or `pytest.mark.project`) to "
                                f"{item.path.name}")
    return None


_USER_ENV = pytest.StashKey[pytest.MonkeyPatch]()


def pytest_configure(config: pytest.Config) -> None:
    """Unset the user's RAY_ADDRESS and AVRID_DEBUG for the session (put back at its end, for
    a caller that runs pytest inside its own process): a test that starts Ray without an
    address would otherwise join the user's cluster (`start_ray` reads RAY_ADDRESS)."""
    scrub = pytest.MonkeyPatch()
    for name in SESSION_UNSET:
        scrub.delenv(name, raising=False)
    config.stash[_USER_ENV] = scrub


def pytest_unconfigure(config: pytest.Config) -> None:
    if _USER_ENV in config.stash:
        config.stash[_USER_ENV].undo()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Check every test's chapter; with --chapter N keep only chapter N's."""
    wanted = config.getoption("--chapter")
    if wanted is not None and wanted not in CHAPTERS:
        raise pytest.UsageError(f"--chapter {wanted}: the chapters are "
                                f"{CHAPTERS.start}..{CHAPTERS.stop - 1}")
    chapters = {item.nodeid: chapter_of(item) for item in items}
    if wanted is None:
        return
    keep = [item for item in items if chapters[item.nodeid] == wanted]
    config.hook.pytest_deselected(items=[i for i in items if chapters[i.nodeid] != wanted])
    items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    gpu = item.get_closest_marker("gpu")
    needs_gpus = 0
    if gpu is not None:
        needs_gpus = int(gpu.kwargs.get("count", gpu.args[0] if gpu.args else 1))
    needs_vllm = item.get_closest_marker("vllm") is not None
    if not needs_gpus and not needs_vllm:
        return
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = hardware_skip_reason(needs_gpus=needs_gpus, needs_vllm=needs_vllm,
                                  cuda_devices=cuda,
                                  vllm_installed=importlib.util.find_spec("vllm") is not None)
    if reason:
        pytest.skip(reason)


def _start_ray() -> None:
    from avrid.workers import start_ray

    # "local": the tests' own Ray, never a cluster named by RAY_ADDRESS in the shell.
    start_ray(address="local", num_cpus=RAY_CPUS)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One Ray for the whole session; shut down in a finalizer even when tests fail."""
    import ray

    _start_ray()
    try:
        yield
    finally:
        ray.shutdown()


def _alive() -> tuple[set[str], set[str]]:
    """Ids of live actors and placement groups, read straight from Ray's control store
    (the public state API needs the dashboard, which tests keep off)."""
    import ray
    from ray._private import state

    actors = {aid for aid, a in state.actors().items() if a["State"] != "DEAD"}
    pgs = {pid for pid, p in ray.util.placement_group_table().items()
           if p["state"] != "REMOVED"}
    return actors, pgs


@pytest.fixture
def ray_cluster(ray_session: None) -> Iterator[None]:
    """Ray for one test, failing the test if it leaks actors or placement groups."""
    import ray

    if not ray.is_initialized():  # a test that ran its own cluster left Ray stopped
        _start_ray()
    actors_before, pgs_before = _alive()
    yield
    # ray.kill and remove_placement_group are asynchronous: give them a moment to land.
    deadline = time.monotonic() + 10
    while True:
        actors, pgs = _alive()
        leaked_actors, leaked_pgs = actors - actors_before, pgs - pgs_before
        if not (leaked_actors or leaked_pgs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if leaked_actors or leaked_pgs:
        ray.shutdown()  # a clean slate for the tests after this one
        _start_ray()
        pytest.fail(f"test leaked {len(leaked_actors)} actors and {len(leaked_pgs)} "
                    f"placement groups", pytrace=False)


@pytest.fixture(params=["inprocess", "ray"])
def backend(request: pytest.FixtureRequest):  # noqa: ANN201 - avrid.workers.Backend
    """Runs the test twice: on Ray (leak-checked) and in-process (one thread per rank)."""
    from avrid.workers import InProcessBackend

    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        from avrid.workers import RayBackend

        return RayBackend(placement_timeout_s=30)
    return InProcessBackend(concurrent=True)
