"""Chapter 5 — a reward function for `pairs.jsonl`, the README's "your own data" example.

A plain module: no class, no avrid import. ``--set task.reward=chapters/ch05_ppo/data/
pairs_reward.py:score`` calls `score` on every sample with the prompt, the decoded response,
the row's ``answer`` and the row's other columns (here ``double``) as keyword arguments.
"""


def score(prompt: str, response: str, answer: str, double: bool = False,
          **metadata: object) -> dict:
    """A share of one point for each letter of the answer in its place (the digit task's
    partial credit: "ba" for "ab=" scores 1.0, "bb" 0.5); logs the share of prompts whose two
    letters are the same as ``reward/double`` (the row's own column)."""
    right = sum(a == r for a, r in zip(answer, response, strict=False))
    return {"score": right / len(answer), "double": float(double)}
