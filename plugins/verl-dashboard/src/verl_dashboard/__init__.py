"""A web dashboard for verl runs: ``verl dashboard RUN_DIR ...`` serves it live, ``verl report`` writes it
as one HTML file. It only reads run directories (see :mod:`verl_dashboard.runs`).

The server is the standard library's ``http.server`` (nothing to install); the charts are uPlot
(MIT, vendored in ``static/vendor``), so the page works offline.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
