"""avrid — single-controller orchestration for RL post-training of LLMs, in five layers.

workers (ch01) < dispatch (ch02) < results (ch03) < reshard (ch04) < ppo (ch05); each layer
imports only the layers below it (an import-linter contract in the test suite checks this).
Import the layer you need, e.g. ``from avrid.workers import RayBackend``.
"""

__version__ = "0.1.0"
