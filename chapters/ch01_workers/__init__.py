"""Chapter 1 — workers: Ray basics, worker identity, the mesh, placement and two backends.

Run the demo with ``python -m chapters.ch01_workers``; read ``README.md`` beside this file for
the reading order and the exercises. The worker classes the demo and the notebook use live in
``workers.py`` (an importable module, so Ray's worker processes can unpickle them).
"""
