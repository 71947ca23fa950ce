"""Chapter 5 — the worked example of a user's policy loss in chapters/ch05_ppo/README.md
("Your own policy loss") is right: it meets the `PolicyLossOut` contract and, as the README
says, computes exactly the built-in `ppo` loss without dual clip (value, clip flags and
gradient), so a learner who copies it trains what the text claims.

The block is read from the README itself (the ```python block that starts with
``# my_loss.py``), so the text and this test cannot drift apart.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from avrid.ppo.algo.losses import policy_loss
from avrid.ppo.algo.registry import PolicyLossInputs, compute_policy_loss
from avrid.ppo.setup.config import AlgoConfig

pytestmark = pytest.mark.chapter(5)

README = Path(__file__).resolve().parents[1] / "chapters" / "ch05_ppo" / "README.md"


def readme_loss() -> types.FunctionType:
    """`clipped_ratio` as the README's ``my_loss.py`` block defines it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    [code] = [b for b in blocks if b.lstrip().startswith("# my_loss.py")]
    module = types.ModuleType("my_loss")
    exec(compile(re.sub(r"(?m)^  ", "", code), str(README), "exec"), module.__dict__)
    return module.clipped_ratio


def test_the_readmes_policy_loss_is_ppos_clipped_surrogate() -> None:
    fn = readme_loss()
    gen = torch.Generator().manual_seed(0)
    lens = torch.tensor([5, 1, 3, 5])
    mask = (torch.arange(5)[None] < lens[:, None]).float()
    old = -torch.rand(4, 5, generator=gen) * 2
    logp = (old + torch.randn(4, 5, generator=gen) * 0.3).requires_grad_(True)
    adv = torch.randn(4, 5, generator=gen)
    algo = AlgoConfig(clip_low=0.2, clip_high=0.28)
    # Padding holds garbage: the loss must not read it (inf there must stay out of the result).
    garbage = torch.where(mask.bool(), 0.0, float("inf"))
    out = compute_policy_loss(fn, "my_loss:clipped_ratio", PolicyLossInputs(
        logp=logp + garbage, old_logp=old, advantages=adv, mask=mask, algo=algo))
    want = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(out.per_token, want.per_token)
    assert torch.equal(out.clipped, want.clipped) and bool(out.clipped.any())
    assert not out.dual_clipped.any()
    grad, = torch.autograd.grad(out.per_token.sum(), logp)
    want_grad, = torch.autograd.grad(want.per_token.sum(), logp)
    torch.testing.assert_close(grad, want_grad)
