"""probing_magics: a running distributed PyTorch job, from Jupyter.

- ``%load_ext probing_magics`` registers the IPython magics (``probing_magics.magics``):
  ``%cluster_connect``, ``%%cluster_sql``, ``%cluster_stacks``, ``%cluster_nodes``.
- Installed into a Jupyter server, it adds the server extension (``probing_magics.server``)
  that feeds the JupyterLab "Cluster" panel (built from ``labextension/``).

Everything here uses ``kernel_probe``'s public API only. Importing this package is cheap:
the magics, the widget and the server extension are imported when first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext probing_magics``."""
    from .magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    from .magics import unload_ipython_extension as _unload

    _unload(ipython)


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "probing_magics.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "probing-magics"}]
