"""``kernel-probe``: the command line.

    kernel-probe list [--prune]              jobs (their roots) on this machine
    kernel-probe -t TARGET nodes [--watch S] [--all]   the membership table (again every S s, following
                                             relaunches); past 64 ranks one row per state (--all: per rank)
    kernel-probe -t TARGET info              the answering probe's identity
    kernel-probe -t TARGET query "SQL" [--local] [--per-rank] [--strict] [--ranks 0-3] [--format csv]
    kernel-probe -t TARGET stacks [--ranks 3] [--native] [--all]   main-thread stacks, grouped (C/C++
                                             frames too); past 5 groups the largest and the odd ones (--all: every one)
    kernel-probe -t dump://DIR query|nodes|stacks|info   the same over an ended job's dumps
    kernel-probe -t TARGET dump DIR          a live job's dumps, as its ranks write them when they die
    kernel-probe -t TARGET diagnose [--json] why the job is stuck, or slow: one sentence, then the findings
                                             (exit 0: nothing found, 1: findings, 2: no answer)
    kernel-probe -t TARGET profile [--ranks 0-3] [--steps N] [--out FILE]   torch.profiler on chosen ranks
    kernel-probe -t TARGET profile --cancel                                 cancel the capture running in the job
    kernel-probe -t TARGET mcp [--config]    an MCP server over stdio for an agent (--config: a client's JSON)
    kernel-probe -t TARGET playbook [NAME]   run a playbook's steps ("why is it stuck", ...); no NAME: list them

Errors are one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .rank_lists import RankRanges, by_text, groups_text, rank_ranges, ranks_label
from .summaries import NODES_ROWS, aligned, state_rows

SUSPECTS_SHOWN = 5  # stall suspects printed under the table; the others counted


def _seconds(text: str, zero: bool = False) -> float:
    """An option's seconds (``--timeout``, ``--min-wait``): what the client takes, else argparse's error."""
    from .client.errors import BadArgument
    from .client.results import positive_number

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    try:
        return positive_number("the value", value, zero=zero)
    except BadArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds_or_zero(text: str) -> float:
    return _seconds(text, zero=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernel-probe", description="Ask a running distributed PyTorch job.")
    p.add_argument("-t", "--target", default=None,
                   help="tcp://host:port, a connection file, store://host:port[/run_id], "
                        "dump://DIR (an ended job's dumps) (default: the newest job on this machine)")
    p.add_argument("--token", default=None, help="the job's PROBING_AUTH_TOKEN (default: from the environment)")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="seconds to wait for an answer (default 5; 10 for queries)")
    p.add_argument("--version", action="version", version=f"kernel-probe {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="probes (job roots) on this machine")
    ls.add_argument("--prune", action="store_true", help="remove the connection files of jobs that are gone")
    nodes = sub.add_parser("nodes", help=f"the job's membership: one row per rank (past {NODES_ROWS} ranks, "
                                         "one row per state)")
    nodes.add_argument("--departures", action="store_true", help="also list ranks that died or left")
    nodes.add_argument("--all", action="store_true", dest="all_rows",
                       help=f"one row per rank even past {NODES_ROWS} ranks (default there: one row per state)")
    nodes.add_argument("--watch", type=_seconds, default=None, metavar="SECONDS",
                       help="print the table again every SECONDS; follows the job across relaunches")
    sub.add_parser("info", help="the answering probe's identity")
    q = sub.add_parser("query", help="run one read-only SELECT over the job's tables")
    q.add_argument("sql")
    q.add_argument("--local", action="store_true", help="ask only the probe at TARGET (its own tables)")
    q.add_argument("--per-rank", action="store_true", help="run the statement as-is on every rank, concatenated")
    q.add_argument("--strict", action="store_true", help="fail instead of returning a partial answer")
    q.add_argument("--ranks", default=None, help="only these ranks, e.g. 0-3,8")
    q.add_argument("--explain", action="store_true", help="show the plan instead of running it")
    q.add_argument("--format", choices=("table", "csv", "json"), default="table")
    q.add_argument("--profile", action="store_true", help="also show where the time went, hop by hop")
    q.add_argument("--native", action="store_true",
                   help="`stacks` with native (C/C++) frames too, taken by py-spy on each rank")
    q.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS, help="query deadline in seconds (default 10)")
    st = sub.add_parser("stacks", help="main-thread Python stacks of every rank, grouped")
    st.add_argument("--all-threads", action="store_true", help="every thread, not only the main one")
    st.add_argument("--all", action="store_true",
                    help="every group of identical stacks (default: past 5, the largest and the odd ones out, "
                         "the rest counted)")
    st.add_argument("--ranks", default=None, help="only these ranks, e.g. 3 or 0-3,8 (py-spy runs on these alone)")
    st.add_argument("--native", action="store_true",
                    help="native (C/C++) frames too (a gloo/NCCL wait, a C extension), taken by py-spy")
    st.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS, help="query deadline in seconds (default 10)")
    dump = sub.add_parser("dump", help="write a live job's dumps under DIR (read them with -t dump://DIR)")
    dump.add_argument("dir")
    dump.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS, help="deadline of each query (default 10)")
    dg = sub.add_parser("diagnose", help="why the job is stuck: dead or stalled ranks, who never entered a "
                                         "collective, mismatched collectives, and where the odd ranks are; "
                                         "else why it is slow: the straggler, its cause, since when",
                        epilog="exit status: 0 when no hang, failure, straggler or slowdown is found, 1 when the verdict has "
                               "findings, 2 when the job could not be asked (or the arguments are wrong)")
    dg.add_argument("--json", action="store_true", help="the verdict as JSON (summary, findings, checked, coverage)")
    dg.add_argument("--min-wait", type=_seconds_or_zero, default=None, metavar="SECONDS",
                    help="how long a collective must be pending before a rank missing from it counts (default 5)")
    dg.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS, help="query deadline in seconds (default 10)")
    dg.add_argument("--native", action="store_true",
                    help="read every rank's native (C/C++) stack too, with py-spy: a rank stuck in C, and what "
                         "the waiting ranks wait in, are then named (a few seconds more)")
    _add_profile_parser(sub)
    mc = sub.add_parser("mcp", help="serve an MCP server over stdio for TARGET (for an agent: Claude, an IDE)")
    mc.add_argument("--config", action="store_true", help="print the JSON to paste into an MCP client, and exit")
    mc.add_argument("--token-env", default=None, metavar="VAR",
                    help="with --config: the variable the client passes the job's token in")
    pb = sub.add_parser("playbook", help="run a playbook's steps against TARGET and print each answer")
    pb.add_argument("name", nargs="?", default=None, help="the playbook (none: list them)")
    pb.add_argument("--job", default=None, help="the job's id, where TARGET serves several")
    pb.add_argument("--with-profile", action="store_true", help="also run profile steps (they take a while)")
    return p


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def cmd_list(args: argparse.Namespace) -> int:
    from .client.alive import root_alive
    from .config import load_settings
    from .shell import connfile

    directory = load_settings().runtime_dir
    infos = connfile.list_files(directory)
    if args.prune:
        removed = connfile.prune(directory)
        for path in removed:
            print(f"removed {path}")
        infos = [i for i in infos if i.path not in removed]
    if not infos:
        print(f"no probes on this machine (connection files in {directory})")
        return 0
    rows = [("RUN ID", "ENDPOINT", "WORLD", "PID", "HOST", "STARTED", "STATUS", "STORE (for -t on another host)")]
    for info in infos:
        status = "running" if root_alive(info) else "gone"
        rows.append((info.run_id, info.endpoint, str(info.world_size), str(info.pid), info.host,
                     _when(info.started), status, info.store or "-"))
    print("\n".join(aligned(rows)))
    return 0


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def format_nodes(raw: dict, info: dict, departures: bool = False, now: float | None = None,
                 all_rows: bool = False) -> str:
    """The membership as a plain-text table (the CLI and the demo print this): one row per rank,
    or, past ``NODES_ROWS`` members (unless ``all_rows``), one row per state, so that 16,384
    ranks read as a few lines with the odd ones apart."""
    from .membership.view import membership_view

    view = membership_view(raw["members"], time.time() if now is None else now, raw["departures"])
    grouped = len(view.members) > NODES_ROWS and not all_rows
    if grouped:
        rows = state_rows(view.members)
    else:
        rows = [("RANK", "NODE", "LOCAL", "HOST", "PID", "TIER", "LEVEL", "PARENT", "ROLE", "STATE", "SEEN", "STEP",
                 "STEP MS", "COMPUTE MS", "WAIT MS")]
        for m in view.members:
            state = m["state"] + (f" {m['state_for']}" if m["state_for"] else "") + \
                (f" ({m['reason']})" if m.get("reason") else "")
            step_ms = _ms(m.get("step_time_ms")) + (" slow" if m["slow"] else "")
            rows.append((str(m["rank"]), str(m["node"]), str(m["local_rank"]), m["host"], str(m["pid"]), m["tier"],
                         _or_dash(m.get("level")), _or_dash(m.get("parent")), m["role"] or "-", state,
                         f"{m['age']} ago", _or_dash(m.get("step")), step_ms, _ms(m.get("compute_ms")),
                         _ms(m.get("comm_wait_ms"))))
    summary = ", ".join(f"{n} {s}" for s, n in sorted(view.counts.items()))
    lines = [f"run {info.get('run_id')} · world size {info.get('world_size')} · {summary or 'no members'}"
             + (" · one row per state (--all: one per rank)" if grouped else "")]
    lines += aligned(rows)
    lines += [f"  {s.text}" for s in view.suspects[:SUSPECTS_SHOWN]]
    if len(view.suspects) > SUSPECTS_SHOWN:
        rest = [r for s in view.suspects[SUSPECTS_SHOWN:] for r in s.ranks]
        lines.append(f"  and {len(view.suspects) - SUSPECTS_SHOWN} more suspect places: {ranks_label(rest)}")
    if departures and raw["departures"]:
        lines.append("departures:")
        lines += [f"  {line}" for line in _departure_lines(raw["departures"])]
    return "\n".join(lines)


def _departure_lines(departed) -> list[str]:
    """Departures grouped by why they left: one line for 512 ranks that exited together."""
    groups = by_text((int(d["rank"]), str(d.get("why") or "left")) for d in departed)
    when = {int(d["rank"]): d.get("when") for d in departed}
    out = []
    for ranks, why in groups:
        if len(ranks) == 1:
            d = next(d for d in departed if int(d["rank"]) == ranks[0])
            out.append(f"rank {d['rank']} (pid {d['pid']} on {d['host']}) {d['why']} at {_when(d['when'])}")
            continue
        times = sorted(t for r in ranks if isinstance(t := when.get(r), (int, float)))
        at = "" if not times else f" at {_when(times[0])}" + (f" to {_when(times[-1])}" if times[-1] != times[0] else "")
        out.append(f"{ranks_label(ranks)} {why}{at}")
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def cmd_nodes(args: argparse.Namespace) -> int:
    import kernel_probe

    with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args), warm=False) as client:
        if args.watch is None:
            raw = client.nodes_raw(_connect_timeout(args))
            # an ended job's dumps: ages as of its last view, not now
            print(format_nodes(raw, client.info_, departures=args.departures, now=client.seen_at,
                               all_rows=args.all_rows))
            return 0
        return _watch_nodes(client, args)


def _watch_nodes(client, args: argparse.Namespace) -> int:
    """Print the table every ``--watch`` seconds; say once that the job ended, and once that
    it restarted when the client follows it to a new launch (Ctrl-C stops)."""
    from .client import ConnectError, JobEndedError
    from .client.lifecycle import Ended, JobLifecycle, Seen

    life = JobLifecycle(time.monotonic, launch=client.launch)
    while True:
        try:
            raw = client.nodes_raw(_connect_timeout(args))
        except JobEndedError as exc:
            change = life.observe(Ended(str(exc)))
            if change.notice:
                print(f"{change.notice} (Ctrl-C to stop)", flush=True)
        except ConnectError as exc:
            print(f"kernel-probe: {exc}", file=sys.stderr, flush=True)
        else:
            followed = 0
            while client.take_notice() is not None:
                followed += 1
            change = life.observe(Seen(client.launch, followed))
            if change.notice:
                print(change.notice, flush=True)
            print(f"--- {datetime.now().strftime('%H:%M:%S')}", flush=True)
            print(format_nodes(raw, client.info_, departures=args.departures, all_rows=args.all_rows), flush=True)
        time.sleep(max(0.1, args.watch))


def cmd_info(args: argparse.Namespace) -> int:
    import kernel_probe

    with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args), warm=False) as client:
        for line in info_lines(client.info_):
            print(line)
        if client.store and not client.info_.get("store"):  # a root that does not say it itself
            print(f"store: {client.store}")
    return 0


INFO_ITEMS = 3  # the items of a list `info` shows; the others are counted


def info_lines(info: dict) -> list[str]:
    """``info``'s items, one line each: a list of ranks as spans ('ranks 0-16383 (16384)'), a
    longer list as its first items and a count, so a dump of 16,384 ranks reads in a few lines."""
    out = []
    for key, value in info.items():
        if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            value = ranks_label(value)
        elif isinstance(value, list) and len(value) > INFO_ITEMS:
            value = "; ".join(map(str, value[:INFO_ITEMS])) + f"; and {len(value) - INFO_ITEMS} more"
        out.append(f"{key}: {value}")
    return out


def parse_ranks(spec: str | None) -> RankRanges | None:
    """'0-3,8' as ranges; the client expands them once checked against the job's size."""
    try:
        return rank_ranges(spec)
    except ValueError as exc:
        raise SystemExit(f"kernel-probe: {exc}") from None


def _connect_timeout(args: argparse.Namespace) -> float:
    return min(args.timeout, 10.0) if args.timeout else 5.0


def _query_timeout(args: argparse.Namespace) -> float:
    return args.timeout or 10.0  # the default query deadline


def cmd_query(args: argparse.Namespace) -> int:
    import kernel_probe

    with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args), warm=False) as client:
        result = client.query(args.sql, timeout=_query_timeout(args), strict=args.strict, per_rank=args.per_rank,
                              ranks=parse_ranks(args.ranks), local=args.local, explain=args.explain,
                              native=args.native, profile=args.profile)
        notes = _native_notes(client, args) if args.native and not args.explain else []
    if args.explain:
        print(result.explain)
        return 0
    df = result.df
    if args.format in ("csv", "json"):
        _write_rows(result.table, list(df.columns), args.format)
    else:
        import pandas as pd

        with pd.option_context("display.max_rows", 200, "display.max_columns", 50, "display.width", 200):
            print(df.to_string(index=False) if len(df) else "(no rows)")
    side = sys.stderr if args.format != "table" else sys.stdout
    for line in notes:  # why a rank's `stacks` has no native frames
        print(line, file=side)
    print(result.footer(), file=side)
    if args.profile:
        print(result.profile(), file=side)
    return 0


def _write_rows(table: Any, names: list[str], fmt: str) -> None:
    """The answer's rows on stdout as CSV (a header, then a line a row) or JSON lines, every
    SQL type as such a reader takes it (``payloads.json_safe``; in CSV a list or a struct is
    its JSON text, a NULL an empty cell); ``names`` as the DataFrame shows them (a name given
    twice made unique)."""
    import csv
    import json

    from .client.payloads import table_rows

    _, rows, _ = table_rows(table, table.num_rows) if table is not None else ([], [], False)
    if fmt == "json":
        for row in rows:
            sys.stdout.write(json.dumps(dict(zip(names, row)), ensure_ascii=False, allow_nan=False) + "\n")
        return
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(names)
    for row in rows:
        out.writerow(["" if c is None else json.dumps(c, ensure_ascii=False) if isinstance(c, (list, dict))
                      else str(c).lower() if isinstance(c, bool) else c for c in row])


def _native_notes(client, args: argparse.Namespace) -> list[str]:
    """After a query with native frames: why a rank has none, one line per reason."""
    from .summaries import NATIVE_NOTES_SQL, native_notes

    ranks = parse_ranks(getattr(args, "ranks", None))
    found = client.query(NATIVE_NOTES_SQL, timeout=_query_timeout(args), ranks=ranks, local=getattr(args, "local", False))
    return native_notes(found.table.to_pylist())


def cmd_stacks(args: argparse.Namespace) -> int:
    import kernel_probe
    from .summaries import format_stacks, group_stacks, stacks_sql

    with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args), warm=False) as client:
        result = client.query(stacks_sql(args.all_threads), timeout=_query_timeout(args), native=args.native,
                              ranks=parse_ranks(args.ranks))
        notes = _native_notes(client, args) if args.native else []
    print(format_stacks(group_stacks(result.table.to_pylist()), notes, all=args.all))
    print(result.footer())
    return 0


def cmd_dump(args: argparse.Namespace) -> int:
    import kernel_probe
    from .frontend import snapshot

    with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args), warm=False) as client:
        run_dir, ranks, failed = snapshot(client, Path(args.dir), timeout=_query_timeout(args))
    print(f"wrote the dumps of {len(ranks)} of {client.info_.get('world_size')} ranks to {run_dir} "
          f"(read them with: kernel-probe -t dump://{run_dir} query ...)")
    for line in no_dump_lines(failed):
        print(line, file=sys.stderr)
    return 0


def no_dump_lines(failed: dict) -> list[str]:
    """The ranks a snapshot got no dump from, one line per reason (addresses and numbers aside)."""
    from .summaries import reason_lines

    return reason_lines(failed, prefix="  no dump: ")


DIAGNOSE_HEALTHY, DIAGNOSE_FINDINGS, DIAGNOSE_ERROR = 0, 1, 2  # `diagnose`'s exit status (as diff's)


def cmd_diagnose(args: argparse.Namespace) -> int:
    import json

    import kernel_probe
    from .diagnosis.verdict import MIN_WAIT_SEC

    from .client import ProbeError

    min_wait = MIN_WAIT_SEC if args.min_wait is None else args.min_wait
    try:
        with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args),
                                  warm=False) as client:
            result = client.diagnose(timeout=_query_timeout(args), min_wait=min_wait, native=args.native)
    except ProbeError as exc:  # 2, as argparse's errors: 1 means the verdict found something
        print(f"kernel-probe: {exc}", file=sys.stderr)
        return DIAGNOSE_ERROR
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print(result.text())
    return DIAGNOSE_HEALTHY if result.healthy else DIAGNOSE_FINDINGS


def _add_profile_parser(sub) -> None:
    pr = sub.add_parser("profile", help="torch.profiler on chosen ranks for N steps: top ops, one merged trace")
    pr.add_argument("--ranks", default=None, help="only these ranks, e.g. 0-3,8 (default: every rank)")
    pr.add_argument("--steps", type=int, default=2, help="steps to profile, from each rank's next step end")
    pr.add_argument("--out", default=None, metavar="FILE", help="write one Chrome/Perfetto trace of every rank here")
    pr.add_argument("--max-trace-mb", type=float, default=None, help="cap of the trace file (default 100)")
    pr.add_argument("--top", type=int, default=10, help="ops shown for the slowest and the median rank")
    pr.add_argument("--timeout", type=_seconds, default=argparse.SUPPRESS,
                    help="seconds the ranks have to finish their steps (default 120)")
    pr.add_argument("--cancel", action="store_true",
                    help="cancel the capture running in the job (whoever started it), then exit")


def _profile_progress(started: float, out=None) -> tuple[Callable[[dict], None], Callable[[], None]]:
    """A capture's progress on stderr once it takes more than a second: one line rewritten on a
    terminal; plain lines in a pipe (each change, and at least every 10 s while nothing changes),
    saying what it waits for when no step comes. Returns (on_progress, end of the line)."""
    out = out or sys.stderr
    tty = out.isatty()
    state = {"shown": False, "last": "", "at": 0.0}

    def on_progress(p: dict) -> None:
        now = time.monotonic()
        if now - started < 1.0:
            return
        text = f"profiling: {p['finished']}/{p['ranks']} ranks finished, {p['running']} running"
        if p.get("armed"):
            text += (f"; waiting for {p['armed']} rank(s) to end a step (armed {p.get('waited', 0):.0f} s ago: "
                     "is the job stepping?)")
        if tty:
            state["shown"] = True
            print(f"\r{text}\033[K", end="", file=out, flush=True)
            return
        what = text.split(" (armed")[0]  # the seconds alone changing is not news
        if what != state["last"] or now - state["at"] >= 10.0:
            print(text, file=out, flush=True)
            state["last"], state["at"] = what, now

    def end_line() -> None:
        if state["shown"]:
            state["shown"] = False
            print(file=out)

    return on_progress, end_line


def _cancel_profiles(client: Any) -> int:
    from .client.profiles import cancel_captures

    cancelled = cancel_captures(client)
    if not cancelled:
        print("no capture is running in this job")
        return 0
    for capture_id, ranks in cancelled.items():
        print(f"cancelled capture {capture_id} on ranks {ranks}")
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM during a capture: handled as an interrupt, so the run cancels its capture."""


def cmd_profile(args: argparse.Namespace) -> int:
    import signal

    import kernel_probe
    from .client.profiles import DEFAULT_TRACE_MAX_MB, format_profile

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    ranks = parse_ranks(args.ranks)
    progress, end_line = _profile_progress(time.monotonic())
    previous = signal.signal(signal.SIGTERM, terminated)  # the CLI is the main thread: SIGINT is KeyboardInterrupt
    try:
        with kernel_probe.connect(args.target, token=args.token, timeout=_connect_timeout(args),
                                  warm=False) as client:
            if args.cancel:
                return _cancel_profiles(client)
            try:
                result = client.profile(ranks=ranks, steps=args.steps, out=args.out, timeout=args.timeout or 120.0,
                                        max_trace_mb=args.max_trace_mb or DEFAULT_TRACE_MAX_MB, on_progress=progress)
            except KeyboardInterrupt as exc:  # the run sent the ranks a cancel before this
                end_line()
                how = "terminated" if isinstance(exc, _Terminated) else "interrupted"
                print(f"kernel-probe: profile {how} and cancelled on its ranks", file=sys.stderr)
                return 143 if isinstance(exc, _Terminated) else 130
            finally:
                end_line()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_profile(result, top=args.top))
    return 0 if len(result.failed) < len(result.ranks) else 1


def cmd_mcp(args: argparse.Namespace) -> int:
    from .mcp import format_config, serve_stdio

    if args.config:
        print(format_config(args.target, args.token_env))
        return 0
    serve_stdio(args.target, args.token)
    return 0


def cmd_playbook(args: argparse.Namespace) -> int:
    from .mcp import run_playbook
    from .mcp.playbooks import PlaybookError, playbooks

    try:
        if args.name is None:
            for name, book in playbooks().items():
                print(f"{name:16} {book.title} — {book.description}")
            return 0
        return run_playbook(args.name, args.target, args.token, job=args.job, with_profile=args.with_profile)
    except PlaybookError as exc:
        print(f"kernel-probe: {exc}", file=sys.stderr)
        return 2


COMMANDS = {"list": cmd_list, "nodes": cmd_nodes, "info": cmd_info, "query": cmd_query, "stacks": cmd_stacks,
            "diagnose": cmd_diagnose, "dump": cmd_dump, "profile": cmd_profile,
            "mcp": cmd_mcp, "playbook": cmd_playbook}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .client import ProbeError

    try:
        return COMMANDS[args.command](args)
    except ProbeError as exc:
        print(f"kernel-probe: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kernel-probe nodes | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush would raise again)
        return 141  # as a shell reports a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
