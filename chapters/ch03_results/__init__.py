"""Chapter 3 — canonical results: one result format whatever a worker did locally, a checked
merge back into the original order with exact metric reduction, and the timeline of who did
what when.

Run the demo with ``python -m chapters.ch03_results``; read ``README.md`` beside this file for
the reading order and the exercises. The example worker the demo and the notebook share lives
in ``workers.py`` (an importable module, so Ray's worker processes can unpickle the worker
class); the example batch is chapter 2's ``rollout_batch``.
"""
