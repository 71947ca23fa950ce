"""Chapter 3 — several timelines' Gantt charts, one above the other on one time scale, in one PNG.

Two runs of the same work compared side by side (a contiguous and a balanced dispatch in
chapter 3's demo; a step's phases one after another and at once in chapter 5) read best
stacked, on one time axis: the longer one then looks longer, and a bubble in one lines up with
the work that fills it in the other. Each chart is `Timeline.gantt_figure`'s own (spans
coloured by name, `avrid.results.colors`, so a phase has one colour in both); this file only
sets their common time scale and stacks the pictures.

Not here: drawing a timeline (`timeline.py`), recording spans. matplotlib and numpy are
imported when a picture is made (matplotlib is a dev/notebook dependency).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path

from avrid.results.timeline import Timeline, atomic_write


def stacked_gantt(timelines: Mapping[str, Timeline], path: str | os.PathLike[str], *,
                  dpi: int = 110) -> Path:
    """Draw each timeline's Gantt chart (titled by its key), all on the time scale of the
    longest, and write them one above the other, in the mapping's order, to the PNG `path`
    (atomically); returns the path.

    Example:
        >>> import tempfile
        >>> from avrid.results.result import Span
        >>> from avrid.results.timeline import Lane
        >>> def one(end):
        ...     return Timeline(lanes=(Lane(label="actor[0]", group="actor",
        ...                                 spans=(Span(name="forward", start=0.0, end=end),)),))
        >>> png = stacked_gantt({"slow": one(2.0), "fast": one(1.0)},
        ...                     Path(tempfile.mkdtemp()) / "both.png")
        >>> png.read_bytes()[:4]
        b'\\x89PNG'
    """
    import matplotlib.image as mpimg
    import numpy as np

    if not timelines:
        raise ValueError("stacked_gantt needs at least one timeline to draw")
    widest = max(tl.end - tl.start for tl in timelines.values())
    images = []
    for title, tl in timelines.items():
        fig = tl.gantt_figure(title=title)
        fig.axes[0].set_xlim(0.0, widest)  # one scale, so the longer run looks longer
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        buf.seek(0)
        images.append(mpimg.imread(buf, format="png"))
    # Charts with different lane labels differ in width: pad each to the widest with white.
    width = max(im.shape[1] for im in images)
    padded = [np.pad(im, ((0, 0), (0, width - im.shape[1]), (0, 0)), constant_values=1.0)
              for im in images]
    stacked = np.concatenate(padded, axis=0)
    return atomic_write(Path(path), lambda f: mpimg.imsave(f, stacked, format="png"))
