"""Chapter 4/5 into the real vLLM engine: a weight sync is ONE `reload_weights`, fed lazily.

Every vLLM `reload_weights` call moves every module of the model to the meta device and
back, rebuilds the parameter-name set and resets the LoRA state, however few tensors it
carries (vLLM 0.32's `model_loader/reload`). A sync that called it once per load group paid
(groups x modules): about 130 x 350 at 7B. Here the sync's groups come from a generator that
the one reload consumes (`VllmSink.load_stream` -> `avrid_load_stream`), and this file counts,
inside the real engine (vLLM's CPU build here):

- reload calls per sync, and modules moved to meta per sync: one call, each module once,
  however many groups (measured on chapter 5's `WeightSync`, which also checks the
  fingerprints of what the engine then holds);
- the groups are pulled one at a time, as the engine loads (never all made up front);
- a stream that fails part-way (a transfer that died) raises its error, and the engine is
  left whole (no module on the meta device: it still generates).

One engine at a time (vLLM's parallel state is process-global), so each test closes its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from avrid.ppo.roles.weight_sync import WeightSync
from tests.test_reshard_vllm import GREEDY, PROMPTS, engine, save

pytestmark = [pytest.mark.chapter(4), pytest.mark.vllm]

GROUP_BYTES = 64 << 10
"""Bucket bound of the syncs here: the tiny policy (1.2 MB in fp32) in many load groups."""


class Counts:
    """Calls to the engine's `reload_weights` and modules moved to meta, by vLLM itself."""

    def __init__(self, eng: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.model_executor.model_loader.reload import layerwise

        self.reloads, self.to_meta = 0, 0
        # The engine's one worker runs in this process: a callable reaches it directly.
        runner = eng.llm.collective_rpc(lambda worker: worker.model_runner)[0]
        self.modules = len(list(runner.get_model().modules()))
        reload, to_meta = runner.reload_weights, layerwise.restore_layer_on_meta

        def counted_reload(*args: Any, **kwargs: Any) -> None:
            self.reloads += 1
            reload(*args, **kwargs)

        def counted_to_meta(*args: Any, **kwargs: Any) -> Any:
            self.to_meta += 1
            return to_meta(*args, **kwargs)

        monkeypatch.setattr(runner, "reload_weights", counted_reload)
        monkeypatch.setattr(layerwise, "restore_layer_on_meta", counted_to_meta)


def test_a_sync_is_one_reload_touching_each_module_once(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path / "a", seed=0)
    b = save(tmp_path / "b", seed=1)
    shapes = {n: (tuple(t.shape), "float32") for n, t in b.items()}
    sync = WeightSync(b, shapes, rank=0, world_size=1, engine_dtype=torch.float32,
                      bucket_bytes=GROUP_BYTES)
    assert len(sync.groups) >= 8  # what one call per group would have cost 8+ reloads for
    eng = engine(tmp_path / "a")
    try:
        counts = Counts(eng, monkeypatch)
        for _ in range(2):  # each sync: ONE reload, each module to meta and back once
            before = (counts.reloads, counts.to_meta)
            sync.run(b, eng.sink, None)  # raises if the fingerprints differ from b's
            assert counts.reloads - before[0] == 1, f"{len(sync.groups)} groups"
            assert counts.to_meta - before[1] == counts.modules
        got = eng.generate(PROMPTS, GREEDY)
    finally:
        eng.close()
    fresh = engine(tmp_path / "b")
    try:
        want = fresh.generate(PROMPTS, GREEDY)
    finally:
        fresh.close()
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_the_groups_are_pulled_one_at_a_time_and_a_failed_stream_leaves_a_whole_engine(
        tmp_path: Path) -> None:
    save(tmp_path / "a", seed=0)
    b = save(tmp_path / "b", seed=1)
    names = list(b)
    pulled: list[int] = []
    loaded: list[int] = []

    def groups(fail_after: int | None) -> Iterator[dict[str, torch.Tensor]]:
        for i, name in enumerate(names):
            if fail_after is not None and i == fail_after:
                raise RuntimeError("injected transfer failure")
            pulled.append(i)
            yield {name: b[name]}

    eng = engine(tmp_path / "a")
    try:
        before = [c.token_ids for c in eng.generate(PROMPTS, GREEDY)]
        runner = eng.llm.collective_rpc(lambda worker: worker.model_runner)[0]
        model = runner.get_model()
        load = model.load_weights

        def watching(weights: Any) -> Any:  # what vLLM's loader has taken when we are asked
            def taken() -> Iterator[Any]:
                for pair in weights:
                    loaded.append(len(pulled))
                    yield pair
            return load(taken())

        model.load_weights = watching
        try:
            eng.sink.load_stream(groups(None))
            # Lazily: group i was made only after vLLM had taken group i - 1.
            assert loaded == list(range(1, len(names) + 1))
            with pytest.raises(RuntimeError, match="injected transfer failure"):
                eng.sink.load_stream(groups(fail_after=5))
        finally:
            del model.load_weights
        on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
        assert on_meta == []
        after = eng.generate(PROMPTS, GREEDY)  # the engine still runs
    finally:
        eng.close()
    assert len(after) == len(before)
