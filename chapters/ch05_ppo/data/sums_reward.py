"""Chapter 5 — a reward function for `sums.jsonl`, the README's "your own data" example.

A plain module: no class, no avrid import. ``--set task.reward=chapters/ch05_ppo/data/
sums_reward.py:score`` calls `score` on every sample with the prompt, the decoded response,
the row's ``answer`` and the row's other columns (here ``carry``) as keyword arguments.
"""


def score(prompt: str, response: str, answer: str, carry: bool = False, **metadata: object) -> dict:
    """Full marks for the exact sum, half for its last digit alone; logs the share of
    prompts that needed a carry as ``reward/carry`` (the row's own column)."""
    said = response.strip()
    last_digit = 0.5 if said[-1:] == answer[-1:] else 0.0
    return {"score": 1.0 if said == answer else last_digit, "carry": float(carry)}
