"""Chapter 2 — token-aware dispatch: balanced shards, token-budget micro-batches, a plan that
puts every output back where it came from.

Run the demo with ``python -m chapters.ch02_dispatch``; read ``README.md`` beside this file for
the reading order and the exercises. The example worker and the example rollout batch that the
demo and the notebook share live in ``workers.py`` (an importable module, so Ray's worker
processes can unpickle the worker class).
"""
