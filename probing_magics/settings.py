"""Settings of the notebook side, as traitlets: ``%config ClusterSQL.timeout = 30`` or
``c.ClusterSQL.display_limit = 200`` in an IPython profile."""

from __future__ import annotations

from traitlets import Bool, Float, Int
from traitlets.config import Configurable


class ClusterSQL(Configurable):
    """What ``%%cluster_sql``, ``%cluster_stacks`` and ``%cluster_nodes`` use unless told otherwise."""

    timeout = Float(10.0, help="Seconds a cluster query may take (--timeout overrides it).").tag(config=True)
    display_limit = Int(1000, help="Rows shown under a query; the returned DataFrame keeps every row.").tag(
        config=True)
    strict = Bool(False, help="Refuse partial answers (ranks that failed or timed out) instead of "
                              "showing them with a warning.").tag(config=True)
    widget_interval = Float(2.0, help="Seconds between refreshes of a %cluster_nodes view.").tag(config=True)
    connect_timeout = Float(5.0, help="Seconds to wait for a job's root to answer when connecting.").tag(
        config=True)
