"""SQL work of the query plane (``query_tasks``: plan, a rank's scans, a shipped scan, merge,
finish, warm-up), run where ``routing.route`` says by ``SqlTaskRunner``: what each task does is
``work.py``, where it runs ``executors.py``."""

from .routing import Executor, Facts, route
from .runner import SqlTaskRunner
from .work import NONE, TaskOptions, nodes_arrow

__all__ = ["NONE", "Executor", "Facts", "SqlTaskRunner", "TaskOptions", "nodes_arrow", "route"]
