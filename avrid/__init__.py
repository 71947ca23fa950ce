"""avrid — single-controller orchestration for RL post-training of LLMs, in six layers.

workers (ch01) < dispatch (ch02) < results (ch03) < reshard (ch04) < ppo (ch05) < pipeline
(ch06); each layer imports only the layers below it (an import-linter contract in the test
suite checks this).
Import the layer you need, e.g. ``from avrid.workers import RayBackend``.
"""

import importlib.util
import logging
import sys
import warnings

__version__ = "0.1.0"


def _quiet_ray_import_in_notebooks() -> None:
    """In a Jupyter kernel without ipywidgets, ``import ray`` prints two red notices about
    widgets that nothing here uses: tqdm's "IProgress not found" warning (Ray, like
    transformers, imports ``tqdm.auto``) and Ray's "Missing packages: ['ipywidgets']" log
    line (its check for rich notebook output). A notebook's first import is an avrid module,
    so this runs before Ray or transformers import ``tqdm.auto``: it imports ``tqdm.auto``
    once with that warning off (later imports are silent) and sets the logger of Ray's check
    to warnings only. Outside notebooks, or with ipywidgets installed (no notices then), it
    does nothing."""
    if "ipykernel" not in sys.modules or importlib.util.find_spec("ipywidgets") is not None:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found")
        try:
            import tqdm.auto  # noqa: F401
        except ImportError:  # no tqdm, no warning
            pass
    logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)


_quiet_ray_import_in_notebooks()
