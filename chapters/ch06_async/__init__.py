"""Chapter 6 — asynchronous RL: one-step-off pipelining and bounded staleness.

Run the demo with ``python -m chapters.ch06_async``; read ``README.md`` beside this file for
the bubble picture, the staleness rule, the corrections and the exercises. The library layer
is `avrid.pipeline`; `figure.py` here draws two timelines one above the other.
"""
