"""Chapter 1 — the seed's three layouts of RLHF's four models, as placement plans, drawn.

Actor, reference, critic and reward model on the same four one-GPU bundles, laid out three
ways:

- DeepSpeed-Chat: everything colocated; each bundle holds a quarter-GPU worker of each model,
  which take turns on it;
- OpenRLHF: every model on a device of its own: four pools of one bundle each;
- NeMo-Aligner: the actor and its reference share two bundles, the critic and the reward
  model the other two (each half a GPU).

`seed_layouts` builds them with chapter 1's own types (`ResourcePool`, `RoleSpec`,
`plan_placement`; `plan_placement` checks each before it is drawn); `main` prints each plan's
`describe()` and writes `placement_layouts.png` next to this file (`placement_figure`). Planning
needs no GPU and nothing is started. Run it with ``python -m chapters.ch01_workers.layouts``.

Chapter 5 gives the trainer's own placement fields for these layouts; this file stays within
chapter 1: no training config, only pools, roles and shares.
"""

from __future__ import annotations

import sys
from pathlib import Path

from avrid.workers import Mesh, PlacementPlan, ResourcePool, RoleSpec, plan_placement
from avrid.workers.placement_figure import placement_figure
from chapters.ch01_workers.workers import TrainerWorker

MODELS = ("actor", "reference", "critic", "reward")
"""The four models of RLHF with a learned reward, in the order every layout lists them."""
GPUS = 4
"""Every layout places the four models on the same four one-GPU bundles."""
CPUS_PER_BUNDLE = 4
FIGURE = Path(__file__).resolve().parent / "placement_layouts.png"
"""Where `main` writes the figure (the chapter's README shows it)."""


def _role(model: str, pool: str, ranks: int, share: float) -> RoleSpec:
    """`ranks` workers of `model` in `pool`, each reserving `share` of its bundle's GPU and
    as large a share of its CPUs."""
    return RoleSpec(role=model, worker=TrainerWorker, mesh=Mesh.of(dp=ranks), pool=pool,
                    cpus=CPUS_PER_BUNDLE * share, gpus=share)


def _pool(name: str, bundles: int) -> ResourcePool:
    return ResourcePool.uniform(name, bundles, cpus=CPUS_PER_BUNDLE, gpus=1,
                                strategy="STRICT_PACK")


def deepspeed_chat() -> PlacementPlan:
    """Everything colocated: one pool, every model on every bundle, a quarter GPU each."""
    return plan_placement([_pool("all", GPUS)],
                          [_role(m, "all", GPUS, 1 / len(MODELS)) for m in MODELS])


def openrlhf() -> PlacementPlan:
    """Every model on devices of its own: one pool per model, one whole GPU each."""
    per_model = GPUS // len(MODELS)
    return plan_placement([_pool(m, per_model) for m in MODELS],
                          [_role(m, m, per_model, 1.0) for m in MODELS])


def nemo_aligner() -> PlacementPlan:
    """The actor with its reference on half the bundles, the critic with the reward model on
    the other half: two pools of two models, half a GPU each."""
    half = GPUS // 2
    return plan_placement(
        [_pool("policy", half), _pool("critic", half)],
        [_role("actor", "policy", half, 0.5), _role("reference", "policy", half, 0.5),
         _role("critic", "critic", half, 0.5), _role("reward", "critic", half, 0.5)])


def seed_layouts() -> dict[str, PlacementPlan]:
    """The three layouts by the system that uses them, each checked by `plan_placement`."""
    return {"DeepSpeed-Chat: everything colocated": deepspeed_chat(),
            "OpenRLHF: every model on devices of its own": openrlhf(),
            "NeMo-Aligner: actor + reference, critic + reward": nemo_aligner()}


def main(path: Path = FIGURE) -> Path:
    """Print each layout's plan and draw all three into one figure at `path`; returns it."""
    layouts = seed_layouts()
    for name, plan in layouts.items():
        print(f"== {name} ==\n{plan.describe()}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    placement_figure(layouts).savefig(path, dpi=110)
    print(f"figure: {path}")
    return path


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIGURE)
