"""The Jupyter server extension behind the JupyterLab "Cluster" panel.

Enabled by the wheel's ``jupyter-config`` (``jupyter_server_config.d/probing_magics.json``);
``probing_magics._jupyter_server_extension_points`` points jupyter_server here. The routes
live under ``<base_url>/probing/api/`` (``handlers``); the clients of the jobs, one per
job and reused, in ``clients``; the MCP server for agents at ``<base_url>/probing/mcp``
(``mcp_route``).
"""

from __future__ import annotations

from typing import Any

from .handlers import API_VERSION, STATE_KEY, setup_handlers

__all__ = ["API_VERSION", "STATE_KEY", "setup_handlers"]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    setup_handlers(serverapp.web_app)
    from .mcp_route import setup_mcp_route

    setup_mcp_route(serverapp.web_app)
    serverapp.log.info("probing_magics: cluster routes at %sprobing/api/, MCP at %sprobing/mcp",
                       serverapp.base_url, serverapp.base_url)
