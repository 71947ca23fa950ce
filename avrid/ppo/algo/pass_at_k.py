"""Chapter 5 — pass@k: the chance that at least one of k samples passes, estimated without bias.

Drawing exactly k samples per prompt and counting the prompts where one passes gives a noisy
estimate; drawing n >= k samples and counting the c that pass gives an unbiased one (Chen et
al. 2021, "Evaluating Large Language Models Trained on Code", the HumanEval paper): the
chance that k of the n, drawn without replacement, are all failures is C(n-c, k) / C(n, k),
so

    pass@k = 1 - C(n-c, k) / C(n, k)
           = 1 - prod_{i = n-c+1}^{n} (1 - k / i)        (and 1 when n - c < k)

The binomials overflow a float long before n reaches a few hundred; the product is their
ratio written term by term, each factor in [0, 1), so it is computed stably for any n.
`avrid eval` (`driver/evaluate.py`) averages it over the prompts.

Pure Python on purpose: an evaluation counts passes once per prompt, no tensors needed.
Not here: what "passes" means (a reward threshold; the evaluator decides).
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` passed.

    Example:
        >>> pass_at_k(n=4, c=1, k=2)   # 1 - C(3, 2) / C(4, 2) = 1 - 3/6
        0.5
        >>> pass_at_k(n=4, c=0, k=2), pass_at_k(n=4, c=3, k=2)  # no pass; n - c < k
        (0.0, 1.0)

    Raises:
        ValueError: not 1 <= k <= n, or not 0 <= c <= n.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (samples per prompt); got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"the passing samples c must be in [0, n={n}], got {c}")
    if n - c < k:  # every draw of k holds a pass
        return 1.0
    fail_all = 1.0
    for i in range(n - c + 1, n + 1):
        fail_all *= 1.0 - k / i
    return 1.0 - fail_all


def mean_pass_at_k(passed: Sequence[int], n: int, k: int) -> float:
    """pass@k averaged over prompts, `passed[p]` being how many of prompt p's `n` samples
    passed.

    Example:
        >>> mean_pass_at_k([0, 1, 4], n=4, k=2)   # (0 + 0.5 + 1) / 3
        0.5
    """
    if not passed:
        raise ValueError("pass@k over no prompts is undefined")
    return sum(pass_at_k(n, c, k) for c in passed) / len(passed)
