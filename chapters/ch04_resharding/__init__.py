"""Chapter 4 — resharding: from the trainer's FSDP shards to the rollout engine's
tensor-parallel slices, moving only the bytes each rank lacks, and proving they arrived.

Run the demo with ``python -m chapters.ch04_resharding``; read ``README.md`` beside this file
for the reading order and the exercises. The example decoder and the sync worker the demo and
the notebook share live in ``workers.py`` (an importable module, so Ray's worker processes
can unpickle the worker class).
"""
