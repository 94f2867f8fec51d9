"""uv's arguments for the package sources pip is configured with on this machine.

``make install`` installs with uv (``uv pip install``: the same resolution as pip, in a
fraction of its time), but uv reads neither pip's configuration files nor its ``PIP_*``
variables. A machine whose pip is pointed at local wheels or indexes (a CPU build of torch
on disk, say) must give uv the same: this prints them as uv's options, one shell word a
line, from ``pip config list`` (files and environment, the environment first, as pip
ranks them). Like pip, uv then takes the best version over every index
(``--index-strategy unsafe-best-match``).

    python tools/pip_sources.py    # e.g. --find-links /opt/wheels --extra-index-url file:///... -c ...
"""

from __future__ import annotations

import re
import subprocess
import sys

# pip's option -> uv's; each a list (space- or newline-separated in pip's configuration)
_AS_UV = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
          "constraint": "--constraint"}
_RANK = {":env:": 0, "install": 1, "global": 2}  # where pip reads a setting first


def uv_options(listing: str) -> list[str]:
    """The uv options for ``pip config list``'s output ``listing`` (lines ``variant.name='value'``)."""
    best: dict[str, tuple[int, list[str]]] = {}
    for line in listing.splitlines():
        m = re.fullmatch(r"([^.]*)\.([a-z-]+)='(.*)'", line.strip())
        if not m or m.group(2) not in _AS_UV:
            continue
        rank = _RANK.get(m.group(1), 3)
        if m.group(2) not in best or rank < best[m.group(2)][0]:
            best[m.group(2)] = (rank, m.group(3).split())
    out = ["--index-strategy", "unsafe-best-match"]
    for name, (_, values) in sorted(best.items()):
        for value in values:
            out += [_AS_UV[name], value]
    return out


def main() -> int:
    got = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    print("\n".join(uv_options(got.stdout if got.returncode == 0 else "")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
