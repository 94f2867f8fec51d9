"""The IPython magics: ``%cluster_connect``, ``%%cluster_sql``, ``%cluster_stacks``, ``%cluster_nodes``,
``%cluster_dump``, ``%cluster_diagnose``, ``%cluster_profile``.

State lives on the magics instance of one shell (its client, its live views), never on
the class. Every cluster failure is shown as one line (``ClusterError``), bad options as
IPython's ``UsageError``; an interrupted query prints one line and leaves the
connection usable.
"""

from __future__ import annotations

import getpass
import sys
import time
from typing import Any

from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand

import kernel_probe
from kernel_probe.frontend import NATIVE_NOTES_SQL, group_stacks, native_notes, reason_lines, stacks_sql

from .command import parse_options, parse_profile_command, parse_sql_command, ranks_option, seconds_option
from .display import ClusterError, ClusterFrame, ExplainText, StacksView
from .settings import ClusterSQL

CONNECT_USAGE = "usage: %cluster_connect [TARGET] [--token-env VAR] [--timeout S]"
STACKS_USAGE = "usage: %cluster_stacks [--ranks SPEC] [--timeout S] [--native] [--all]"
NODES_USAGE = "usage: %cluster_nodes [--interval S]"
DUMP_USAGE = "usage: %cluster_dump DIR [--timeout S]"
DIAGNOSE_USAGE = "usage: %cluster_diagnose [--min-wait S] [--timeout S] [--native]"
NOT_CONNECTED = "not connected — run %cluster_connect"
INTERRUPTED = "query interrupted; the connection is still usable"


class QueryProgress:
    """``on_progress`` for a query: after one second, ranks answered / targeted as an
    ipywidgets bar in a notebook or a text line in a terminal; removed by ``done()``.
    Runs on the cell's thread (the client delivers progress to the thread that waits)."""

    def __init__(self, in_notebook: bool, after: float = 1.0) -> None:
        self.in_notebook, self.after = in_notebook, after
        self.t0 = time.monotonic()
        self.bar: Any = None
        self.handle: Any = None
        self.text_shown = False
        self.events = 0

    def __call__(self, body: dict) -> None:
        self.events += 1
        if time.monotonic() - self.t0 < self.after:
            return
        answered, targeted = int(body.get("answered") or 0), int(body.get("targeted") or 0)
        label = f"{answered}/{targeted} ranks"
        if self.in_notebook:
            if self.bar is None:
                import ipywidgets as widgets
                from IPython.display import display

                self.bar = widgets.IntProgress(value=answered, min=0, max=max(targeted, 1), description=label,
                                               style={"description_width": "initial"})
                self.handle = display(self.bar, display_id=True)
            else:
                self.bar.max = max(targeted, 1)
                self.bar.value = answered
                self.bar.description = label
        else:
            sys.stderr.write(f"\r{label} answered…")
            sys.stderr.flush()
            self.text_shown = True

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()
            if self.handle is not None:
                self.handle.update({"text/plain": ""}, raw=True)
            self.bar = None
        if self.text_shown:
            sys.stderr.write("\r" + " " * 40 + "\r")
            sys.stderr.flush()
            self.text_shown = False


@magics_class
class ClusterMagics(Magics):
    """The cluster magics of one IPython shell."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.settings = ClusterSQL(parent=shell)
        self.client: kernel_probe.Client | None = None
        self.target: str | None = None  # what views connect to (the same job as self.client)
        self._token: str | None = None
        self.views: dict[str, Any] = {}  # cell id (or "") -> that cell's live NodesView

    # ------------------------------------------------------------------ connection
    def _in_notebook(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None

    def _describe(self, client: kernel_probe.Client) -> str:
        info = client.info_ or {}
        text = f"run {client.run_id} · world size {info.get('world_size', '?')}"
        try:
            members = client.nodes_raw(self.settings.connect_timeout)["members"]
        except kernel_probe.ProbeError:
            return text + f" · {client.endpoint}"
        states: dict[str, int] = {}
        for m in members:
            states[m["state"]] = states.get(m["state"], 0) + 1
        counts = ", ".join(f"{n} {s}" for s, n in sorted(states.items(), key=lambda kv: kv[0] != "alive"))
        return f"{text} · {counts or '0 alive'} · {client.endpoint}"

    def _set_client(self, client: kernel_probe.Client, target: str | None, token: str | None) -> None:
        if self.client is not None and self.client is not client:
            self.client.close()
        self.client, self.target, self._token = client, target, token

    def _drop_client(self) -> None:
        if self.client is not None:
            self.client.close()
        self.client = None

    def connected(self) -> kernel_probe.Client:
        """This shell's client; connects to the newest job on this machine when none was chosen."""
        if self.client is not None:
            return self.client
        job = kernel_probe.job_registry().newest()
        if job is None:
            raise ClusterError(f"{NOT_CONNECTED} (no running job found on this machine)")
        try:
            client = kernel_probe.connect(job.target, timeout=self.settings.connect_timeout)
        except kernel_probe.ProbeError as exc:
            raise ClusterError(f"{NOT_CONNECTED} (the newest job here did not answer: {exc})") from None
        except KeyboardInterrupt:
            raise ClusterError("interrupted while connecting") from None
        self._set_client(client, job.target, None)
        print(f"connected to the newest job on this machine: {self._describe(client)}")
        return client

    def _failed(self, exc: kernel_probe.ProbeError) -> ClusterError:
        if isinstance(exc, kernel_probe.JobEndedError):
            self._drop_client()  # the next magic connects to whatever job runs then
            return ClusterError(f"job ended: {exc}")
        return ClusterError(str(exc))

    @line_magic
    def cluster_connect(self, line: str) -> None:
        """%cluster_connect [TARGET] [--token-env VAR] [--timeout S]

        Connect this notebook to a job: TARGET is tcp://host:port, a connection file,
        store://host:port[/run_id], dump://DIR (an ended job's dumps), or nothing for the
        newest job on this machine. A token
        comes from PROBING_AUTH_TOKEN, the variable named by --token-env, or a hidden
        prompt; it is never typed into a cell."""
        cmd = parse_options(line, {"--token-env", "--timeout"}, CONNECT_USAGE, max_positional=1)
        timeout = seconds_option(cmd, "--timeout", self.settings.connect_timeout)
        var = cmd.options.get("--token-env")
        try:
            token = kernel_probe.find_token(token_env=var)
        except ValueError as exc:
            raise UsageError(f"--token-env {var}: {exc}") from None
        target = cmd.positional[0] if cmd.positional else None
        if target is None:
            job = kernel_probe.job_registry().newest()
            if job is None:
                raise ClusterError("no running job found on this machine: start one with PROBING=1, "
                                   "or pass its address (tcp://host:port or store://host:port/run_id)")
            target = job.target
        try:
            try:
                client = kernel_probe.connect(target, token=token, timeout=timeout)
            except kernel_probe.AuthError:
                token = self._ask_token(target, token)
                if token is None:
                    raise
                client = kernel_probe.connect(target, token=token, timeout=timeout)
        except kernel_probe.ProbeError as exc:
            raise ClusterError(str(exc)) from None
        except KeyboardInterrupt:
            raise ClusterError("interrupted while connecting") from None
        self._set_client(client, target, token)
        line = f"connected: {self._describe(client)}"
        store = (client.info_ or {}).get("store") or getattr(client, "store", "")
        if store and not str(target or "").startswith("store://"):
            line += f" · from another host: %cluster_connect {store}"
        print(line)

    def _ask_token(self, target: str, tried: str | None) -> str | None:
        """A hidden prompt, only when nobody gave a token and someone can answer it."""
        if kernel_probe.find_token(tried) is not None:
            return None  # a token was given: it is wrong, and asking again would not help
        if not self._in_notebook() and not sys.stdin.isatty():
            return None
        try:
            return getpass.getpass(f"token for {target}: ") or None
        except (StdinNotImplementedError, EOFError, OSError):
            return None

    # ------------------------------------------------------------------ SQL
    @no_var_expand  # $name is a query parameter here, never text pasted in by IPython
    @line_cell_magic
    def cluster_sql(self, line: str, cell: str | None = None) -> Any:
        """%%cluster_sql [--timeout S] [--ranks SPEC] [--strict] [--per-rank] [--local] [--explain] [--profile]
        [-o NAME] [NAME <<]

        Run one SELECT over every rank of the job (the cell), or  x = %cluster_sql SELECT ...
        Returns a pandas DataFrame with every row; shows at most ClusterSQL.display_limit
        rows and who answered. $name binds the Python variable `name` as a query parameter.
        --profile also prints where the time went, hop by hop."""
        cmd = parse_sql_command(line, cell)
        params = cmd.params(self.shell.user_ns)
        result = self._query(cmd.sql, timeout=cmd.timeout or self.settings.timeout,
                             strict=self.settings.strict if cmd.strict is None else cmd.strict,
                             per_rank=cmd.per_rank, ranks=cmd.ranks, params=params, local=cmd.local,
                             explain=cmd.explain, profile=cmd.profile)
        if result is None:
            return None
        if cmd.explain:
            return ExplainText(result.explain, result.footer())
        if cmd.profile:
            print(result.profile())
        frame = ClusterFrame.wrap(result.df, result.footer(), self.settings.display_limit)
        if cmd.out:
            self.shell.user_ns[cmd.out] = frame
        return frame

    def _query(self, sql: str, **options: Any) -> kernel_probe.QueryResult | None:
        """One query on this shell's client with a progress bar after a second; None when
        the user interrupted it (one line printed, the connection still usable)."""
        client = self.connected()
        progress = QueryProgress(self._in_notebook())
        try:
            return client.query(sql, on_progress=progress, **options)
        except KeyboardInterrupt:
            print(INTERRUPTED)
            return None
        except kernel_probe.ProbeError as exc:
            raise self._failed(exc) from None
        finally:
            progress.done()

    # ------------------------------------------------------------------ stacks
    @line_magic
    def cluster_stacks(self, line: str) -> StacksView | None:
        """%cluster_stacks [--ranks SPEC] [--timeout S] [--native] [--all]

        Where every rank's main thread is right now; identical stacks grouped, innermost frame first.
        Past 5 groups: the largest and the odd ones out, the rest counted in one line (``--all``: every group).
        ``--native``: C/C++ frames too (a gloo/NCCL wait, a C extension), taken by py-spy on each
        rank; a rank where it cannot be taken says why in one line."""
        cmd = parse_options(line, {"--ranks", "--timeout"}, STACKS_USAGE, flags=frozenset({"--native", "--all"}))
        ranks = ranks_option(cmd)
        timeout = seconds_option(cmd, "--timeout", self.settings.timeout)
        native = "--native" in cmd.options
        result = self._query(stacks_sql(), timeout=timeout, ranks=ranks, native=native)
        if result is None:
            return None
        notes: list[str] = []
        if native:
            why = self._query(NATIVE_NOTES_SQL, timeout=timeout, ranks=ranks)
            notes = [] if why is None else native_notes(why.table.to_pylist())
        return StacksView(group_stacks(result.table.to_pylist()), result.footer(),
                          bool(result.coverage.get("partial")), notes=notes, all="--all" in cmd.options)

    # ------------------------------------------------------------------ the verdict
    @line_magic
    def cluster_diagnose(self, line: str) -> Any:
        """%cluster_diagnose [--min-wait S] [--timeout S] [--native]

        Why the job is stuck: one sentence, then the findings (dead and stalled ranks, a
        collective some ranks never entered, a mismatched collective, where the odd ranks
        are). ``.findings`` of the answer is a DataFrame. ``--native``: every rank's C/C++ stack
        too (py-spy), so a rank stuck in C, and what the others wait in, are named."""
        from kernel_probe.frontend import MIN_WAIT_SEC

        from .verdict_view import VerdictView

        cmd = parse_options(line, {"--min-wait", "--timeout"}, DIAGNOSE_USAGE, flags=frozenset({"--native"}))
        timeout = seconds_option(cmd, "--timeout", self.settings.timeout)
        min_wait = seconds_option(cmd, "--min-wait", MIN_WAIT_SEC, zero=True)  # 0: any pending collective counts
        client = self.connected()
        try:
            return VerdictView(client.diagnose(timeout=timeout, min_wait=min_wait, native="--native" in cmd.options))
        except KeyboardInterrupt:
            print(INTERRUPTED)
            return None
        except kernel_probe.ProbeError as exc:
            raise self._failed(exc) from None

    # ------------------------------------------------------------------ profile
    @line_magic
    def cluster_profile(self, line: str) -> None:
        """%cluster_profile [--ranks SPEC] [--steps N] [--out FILE] [--timeout S] [-o NAME]

        torch.profiler on the chosen ranks (default: all) from their next step end for N steps
        (default 2); prints the slowest rank's top ops next to the median rank's; --out writes
        one Chrome/Perfetto trace of every profiled rank; -o NAME keeps the ProfileResult
        (its .ops: every rank's profile_ops rows). Interrupt to cancel the capture."""
        from kernel_probe.frontend import format_profile

        cmd = parse_profile_command(line)
        client = self.connected()
        progress = QueryProgress(self._in_notebook())
        try:
            result = client.profile(ranks=cmd.ranks, steps=cmd.steps, out=cmd.out, timeout=cmd.timeout or 120.0,
                                    on_progress=lambda p: progress({"answered": p["finished"], "targeted": p["ranks"]}))
        except KeyboardInterrupt:
            print("profile interrupted and cancelled; the connection is still usable")
            return None
        except kernel_probe.ProbeError as exc:
            raise self._failed(exc) from None
        finally:
            progress.done()
        if cmd.name:
            self.shell.user_ns[cmd.name] = result
        print(format_profile(result))
        return None

    # ------------------------------------------------------------------ live view
    @line_magic
    def cluster_nodes(self, line: str) -> None:
        """%cluster_nodes [--interval S]

        A live table of the job's ranks, refreshed in the background (the cell returns at once)."""
        from IPython.display import display

        from .widget import NodesView

        cmd = parse_options(line, {"--interval"}, NODES_USAGE)
        interval = seconds_option(cmd, "--interval", self.settings.widget_interval)
        client = self.connected()  # the same job as the cells (auto-connects like every magic)
        if self._show_dumped_nodes(client):
            return None
        key = self._cell_id()  # "" where the frontend sends no cell id: a new view then replaces the last one
        previous = self.views.pop(key, None)
        if previous is not None:  # the same cell run again: its old view stops
            previous.close()
        view = NodesView(self.target, self._token, interval=interval, timeout=self.settings.connect_timeout)
        self.views[key] = view
        view.start(first_wait=min(2.0, self.settings.connect_timeout))
        display(view)
        return None

    def _show_dumped_nodes(self, client: Any) -> bool:
        """An ended job (its dumps): its membership as last seen, once (nothing to refresh)."""
        seen = client.seen_at
        if seen is None:  # a running job: its membership is as of now
            return False
        from datetime import datetime, timezone

        from IPython.display import display

        when = datetime.fromtimestamp(seen, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        print(f"the job has ended: its ranks as last seen ({when}) · {client.endpoint}")
        display(client.nodes())
        return True

    # ------------------------------------------------------------------ dumps
    @line_magic
    def cluster_dump(self, line: str) -> None:
        """%cluster_dump DIR [--timeout S]

        Write the job's dumps under DIR, the files its ranks write when they die (Parquet, one
        directory per rank); read them back with %cluster_connect dump://DIR."""
        from pathlib import Path

        from kernel_probe.frontend import snapshot

        cmd = parse_options(line, {"--timeout"}, DUMP_USAGE, max_positional=1)
        if not cmd.positional:
            raise UsageError(DUMP_USAGE)
        timeout = seconds_option(cmd, "--timeout", self.settings.timeout)
        client = self.connected()
        try:
            run_dir, ranks, failed = snapshot(client, Path(cmd.positional[0]).expanduser(), timeout=timeout)
        except kernel_probe.ProbeError as exc:
            raise self._failed(exc) from None
        print(f"wrote the dumps of {len(ranks)} of {client.info_.get('world_size')} ranks to {run_dir} "
              f"· read them with %cluster_connect dump://{run_dir}")
        for line in reason_lines(failed, prefix="  no dump: "):
            print(line)

    def _cell_id(self) -> str:
        kernel = getattr(self.shell, "kernel", None)
        try:
            parent = kernel.get_parent() if kernel is not None else {}
            return str((parent.get("metadata") or {}).get("cellId") or "")
        except Exception:
            return ""

    def close(self) -> None:
        for view in self.views.values():
            view.close()
        self.views.clear()
        self._drop_client()


_MAGIC_NAMES = {"line": ["cluster_connect", "cluster_sql", "cluster_stacks", "cluster_nodes", "cluster_dump",
                         "cluster_diagnose", "cluster_profile"],
                "cell": ["cluster_sql"]}


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext probing_magics``: register the magics and the ClusterSQL settings. Connects nothing."""
    if getattr(ipython, "_probing_magics", None) is not None:
        return
    magics = ClusterMagics(ipython)
    ipython.register_magics(magics)
    ipython.configurables.append(magics.settings)
    ipython._probing_magics = magics


def unload_ipython_extension(ipython: Any) -> None:
    magics = getattr(ipython, "_probing_magics", None)
    if magics is None:
        return
    magics.close()
    if magics.settings in ipython.configurables:
        ipython.configurables.remove(magics.settings)
    for kind, names in _MAGIC_NAMES.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
    ipython.magics_manager.registry.pop(type(magics).__name__, None)
    ipython._probing_magics = None
