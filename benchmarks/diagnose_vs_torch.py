"""Why is it stuck: our verdict beside torch's own tools, on the same hung jobs.

A real torchrun job (2 nodes x 2 ranks, gloo, DDP: tests/workers/ddp_hang_worker.py) hangs
on purpose, once per scenario:

- ``late``: rank 3 is late in Python (``fetch_next_batch``) while ranks 0-2 wait in DDP's
  gradient all-reduce;
- ``mismatch``: rank 3 calls broadcast where ranks 0-2 call all_reduce.

Every rank also runs torch's debug server and can write torch's flight-recorder dump on
request (the worker's HANG_WORKER_DEBUG_PORT and HANG_WORKER_FR_DUMP_DIR). Once the job
hangs, each tool is asked, ``--reps`` times, tools in a rotating order:

- ours: ``kernel_probe.connect()`` then ``Client.diagnose()``; ``kernel-probe diagnose --json``
  (a new process: its wall time); the ``stacks`` table with native frames (``native=True``);
- torch's debug server (rank 0 serves it): its flight-recorder page ``/fr_trace``, ``/stacks``,
  ``/pyspy_dump`` and ``/pyspy_dump?native=1``; and the page's own analysis (its handler's
  ``_build_db``) on its ``/fr_trace_json`` with the groups' key repaired;
- torchfrtrace: each rank writes its ``_dump_fr_trace()`` pickle, then ``python -m
  torch.distributed.flight_recorder.fr_trace`` runs on them as they are, and on copies whose
  ``pg_config`` is keyed by the groups' names with their ranks (torch 2.13's gloo recorder
  keys it '' with no ranks, while entries name their group '0'). Its seconds include the
  dumps' writing.

Each answer is judged against what the worker did: does it name the culprit rank, the
collective's op, the culprit's place (late: ``fetch_next_batch``; mismatch: the line of its
``broadcast`` call)? "unmarked" means the place is on the page among every rank's stacks,
with nothing saying which rank is the odd one. One table: scenario, tool, the three
answers, seconds (first ask, and the median of the others), a note (status, error).

    .venv/bin/python benchmarks/diagnose_vs_torch.py [--reps 2] [--scenarios late mismatch] [--json OUT]

The debug server needs the ``tabulate`` package (in the bench and test extras).
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_probe  # noqa: E402
from kernel_probe.diagnosis.verdict import MIN_WAIT_SEC  # noqa: E402
from tests.support import wait_for  # noqa: E402
from tests.support.harness import LocalJob, free_port  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "ddp_hang_worker.py"
NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
HANG_SEC = 240  # the late rank's delay and the group's timeout: longer than any run of the tools
SETTLE_SEC = MIN_WAIT_SEC + 1.0  # our verdict calls a rank missing once the others waited MIN_WAIT_SEC
FR_TRACE = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]


@dataclass(frozen=True)
class Expected:
    """What the worker did: the culprit rank, the op to name, the culprit's place (a function,
    or a line of the worker)."""

    rank: int
    op: str
    function: str | None = None
    line: int | None = None

    def placed(self, text: str) -> bool:
        """Does ``text`` name the place, as any of the tools writes one?"""
        if self.function is not None:
            return self.function in text
        return any(form in text for form in (f"{WORKER.name}:{self.line}",  # py-spy, torchfrtrace, ours
                                             f'{WORKER.name}", line {self.line} '))  # faulthandler


def expected(scenario: str) -> Expected:
    culprit = WORLD - 1
    if scenario == "late":
        return Expected(culprit, "all_reduce", function="fetch_next_batch")
    lines = WORKER.read_text().splitlines()
    return Expected(culprit, "broadcast", line=next(i for i, text in enumerate(lines, 1) if "dist.broadcast(" in text))


@dataclass
class Row:
    scenario: str
    tool: str
    rank: str  # the rank it names as the culprit, "no", or "no (...)"
    op: str  # "yes" / "no"
    place: str  # "yes" / "unmarked" / "no"
    seconds: list[float] = field(default_factory=list)
    note: str = ""

    def key(self) -> tuple[str, str]:
        return self.scenario, self.tool


# ---------------------------------------------------------------- judging (no I/O)
def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def judge_verdict(answer: dict[str, Any], want: Expected) -> tuple[str, str, str, str]:
    """Our verdict as JSON (``DiagnoseResult.to_dict()``): its first finding is its answer."""
    findings = answer.get("findings") or []
    if not findings:
        return "no", "no", "no", answer.get("summary", "")[:80]
    first = findings[0]
    ranks = list(first.get("ranks") or [])
    detail = str(first.get("detail", ""))
    named = ",".join(str(r) for r in ranks) if ranks else "no"
    where = detail.rsplit(" — ", 1)[-1] if " — " in detail else detail
    return named, yes(want.op in detail), yes(want.placed(detail)), f"{first.get('kind')}: …{where[-70:]}"


def judge_fr_trace(text: str, want: Expected) -> tuple[str, str, str]:
    """torchfrtrace's report: "missing ranks: {3}" under "collective: gloo:all_reduce", or
    "Culprit rank 3; ... 'all_reduce' does not match found collective type: 'broadcast'"."""
    missing = re.search(r"collective: \w+:(\w+)\nmissing ranks: \{([\d, ]+)\}", text)
    if missing:
        ranks = sorted(int(r) for r in missing.group(2).split(","))
        return ",".join(map(str, ranks)), yes(missing.group(1) == want.op), yes(want.placed(text))
    culprit = re.search(r"Culprit rank (\d+); Error type: \w+, Expected collective type: '(\w+)' does not match "
                        r"found collective type: '(\w+)'", text)
    if culprit:
        return culprit.group(1), yes(culprit.group(3) == want.op), yes(want.placed(text))
    return "no", "no", "no"


def judge_fr_db(db: Any, want: Expected) -> tuple[str, str, str]:
    """The debug server's flight-recorder tables (torch's ``Database``): the first collective
    with missing ranks (it still passes its check) or with ranks whose call did not match."""
    for c in db.collectives:
        if c.missing_ranks:
            ranks = sorted(c.missing_ranks)
            op = c.collective_name.split(":")[-1]
        elif c.mismatch_collectives:
            ranks = sorted(c.mismatch_collectives)
            op = c.mismatch_collectives[ranks[0]].collective_name.split(":")[-1]
        else:
            continue
        frames = json.dumps(c.collective_frames, default=str)
        return ",".join(map(str, ranks)), yes(op == want.op), yes(want.placed(frames))
    return "no", "no", "no"


def rank_sections(page: str) -> dict[int, str]:
    """The debug server's per-rank sections ("Rank N: http://..."), as text."""
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    parts = re.split(r"^\s*Rank (\d+): \S+\s*$", text, flags=re.MULTILINE)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def judge_stacks_page(page: str, want: Expected) -> tuple[str, str, str, str]:
    """Every rank's stacks, one section each: the place is there or not; no rank is singled out."""
    sections = rank_sections(page)
    failed = {r: s for r, s in sections.items() if "Failed to fetch" in s}
    if failed:
        why = " ".join(next(iter(failed.values())).split("Failed to fetch:", 1)[1].split())
        return "no", "no", "no", f"{len(failed)}/{len(sections)} ranks failed: {why[:80]}"
    shown = want.placed(sections.get(want.rank, ""))
    return "no", "no", "unmarked" if shown else "no", f"{len(sections)} ranks' stacks"


# ---------------------------------------------------------------- torch's dumps, repaired
def repaired(dump: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """A copy of a gloo flight-recorder dump whose ``pg_config`` is keyed by each group's
    name, with its ranks, as torch's analyzers expect (the entries name their group that way)."""
    config = {g["name"]: {"name": g["name"], "desc": g["desc"] or "", "ranks": json.dumps(g["ranks"])} for g in groups}
    return {**dump, "pg_config": config}


def worker_frame(text: str) -> str:
    """The innermost frame of the worker in the stack torchfrtrace prints with its finding."""
    frame = re.search(r"collective stack trace:.*?^\s*(\w+) at \S*?" + re.escape(WORKER.name) + r":(\d+)", text,
                      flags=re.DOTALL | re.MULTILINE)
    return f"{frame.group(1)} ({WORKER.name}:{frame.group(2)})" if frame else "none"


def error_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:90] if lines else ""


# ---------------------------------------------------------------- asking (I/O)
class Bench:
    """One hung job and the tools asked about it."""

    def __init__(self, scenario: str, workdir: Path) -> None:
        self.scenario = scenario
        self.want = expected(scenario)
        self.runtime = workdir / "runtime"
        self.dumps = workdir / "fr-dumps"
        self.runtime.mkdir(parents=True)
        self.dumps.mkdir()
        self.port = free_port()
        self.asked_dumps = 0
        self.groups: list[dict[str, Any]] | None = None
        self.runtime_before = os.environ.get("PROBING_RUNTIME_DIR")  # put back by close()
        # as an activated venv would have it: torch's /pyspy_dump runs `py-spy` from PATH
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {"PROBING": "1", "PROBING_RUNTIME_DIR": str(self.runtime), "OMP_NUM_THREADS": "1", "PATH": path,
                    "HANG_WORKER_DEBUG_PORT": str(self.port), "HANG_WORKER_FR_DUMP_DIR": str(self.dumps)}
        self.job = LocalJob([str(WORKER), "--scenario", scenario, "--late-sec", str(HANG_SEC),
                             "--timeout-sec", str(HANG_SEC)], nodes=NODES, ranks_per_node=RANKS_PER_NODE,
                            env=self.env, workdir=workdir / "job")

    def start(self) -> float:
        """Start the job; return once it hangs (every rank trained, then SETTLE_SEC)."""
        os.environ["PROBING_RUNTIME_DIR"] = str(self.runtime)  # connect(): the newest job there
        t = time.perf_counter()
        self.job.start()
        self.job.wait_ready(180)
        wait_for(lambda: self.job.output().count("trained") >= WORLD, 180, interval=0.2, what="every rank trained")
        time.sleep(SETTLE_SEC)
        return time.perf_counter() - t

    def close(self) -> None:
        self.job.close()
        if self.runtime_before is None:
            os.environ.pop("PROBING_RUNTIME_DIR", None)
        else:
            os.environ["PROBING_RUNTIME_DIR"] = self.runtime_before

    def tools(self) -> list[Callable[[], list[Row]]]:
        return [self.ours, self.ours_cli, self.ours_native, self.debug_fr_page, self.debug_fr_view_repaired,
                self.debug_stacks, self.debug_pyspy, self.debug_pyspy_native, self.torchfrtrace]

    def row(self, tool: str, judged: tuple[str, ...], seconds: float, note: str = "") -> Row:
        rank, op, place = judged[:3]
        return Row(self.scenario, tool, rank, op, place, [seconds], note if len(judged) < 4 else judged[3])

    # ours
    def ours(self) -> list[Row]:
        t = time.perf_counter()
        with kernel_probe.connect() as client:
            answer = client.diagnose().to_dict()
        seconds = time.perf_counter() - t
        return [self.row("ours: connect() + Client.diagnose()", judge_verdict(answer, self.want), seconds)]

    def ours_cli(self) -> list[Row]:
        t = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "diagnose", "--json"], capture_output=True,
                             text=True, timeout=120, check=False,
                             env={**os.environ, "PROBING_RUNTIME_DIR": str(self.runtime)})
        seconds = time.perf_counter() - t
        if run.returncode not in (0, 1):  # 0: healthy, 1: findings; 2: the job could not be asked
            return [self.row("ours: kernel-probe diagnose", ("no", "no", "no"), seconds, error_line(run.stderr))]
        return [self.row("ours: kernel-probe diagnose", judge_verdict(json.loads(run.stdout), self.want), seconds)]

    def ours_native(self) -> list[Row]:
        t = time.perf_counter()
        with kernel_probe.connect() as client:
            result = client.query("SELECT _rank, frame_type, function, file, line FROM stacks WHERE is_main",
                                  native=True, timeout=30)
        seconds = time.perf_counter() - t
        df = result.df
        mine = df[df["_rank"] == self.want.rank]
        frames = zip(mine["function"], mine["file"], mine["line"])
        where = " ".join(f"{function} {Path(str(file)).name}:{line}" for function, file, line in frames)
        native = int((df["frame_type"] == "native").sum())
        place = "unmarked" if self.want.placed(where) else "no"
        ranks = df["_rank"].nunique()
        return [self.row("ours: stacks, native=True", ("no", "no", place), seconds,
                         f"{ranks} ranks' main stacks, {native} native frames")]

    # torch's debug server
    def get(self, path: str, timeout: float = 120) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as resp:
                return resp.status, resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def debug_fr_page(self) -> list[Row]:
        t = time.perf_counter()
        status, page = self.get("/fr_trace")
        seconds = time.perf_counter() - t
        if status != 200:
            message = re.search(r"Message: (.*?)</p>", page)
            return [self.row("torch debug server: /fr_trace", ("no", "no", "no"), seconds,
                             f"{status} {html.unescape(message.group(1)) if message else ''}")]
        # a torch whose page works shows the tables its FR view (key repaired) below reads
        return [self.row("torch debug server: /fr_trace", ("?", "?", "?"), seconds, f"{status}: tables, not read here")]

    def debug_fr_view_repaired(self) -> list[Row]:
        """The page's own analysis (its handler's ``_build_db``) on the dumps it fetches
        (``/fr_trace_json``), their ``pg_config`` repaired as for torchfrtrace."""
        from torch.distributed.debug._debug_handlers import FlightRecorderHandler
        from torch.distributed.debug._frontend import Response

        groups = self.groups_of_job()
        t = time.perf_counter()
        status, page = self.get("/fr_trace_json")
        sections = rank_sections(page)
        resps = [Response(200, json.dumps(repaired(json.loads(sections[r]), groups))) for r in sorted(sections)]
        log = logging.getLogger("Flight Recorder")  # the server writes its findings there, not on the page
        log.disabled = True
        try:
            db = FlightRecorderHandler._build_db([f"rank{r}" for r in sorted(sections)], resps)
        finally:
            log.disabled = False
        seconds = time.perf_counter() - t
        return [self.row("torch debug server: its FR view, key repaired", judge_fr_db(db, self.want), seconds,
                         f"/fr_trace_json {status} + its _build_db")]

    def debug_stacks(self) -> list[Row]:
        t = time.perf_counter()
        status, page = self.get("/stacks")
        seconds = time.perf_counter() - t
        judged = judge_stacks_page(page, self.want)
        return [self.row("torch debug server: /stacks", judged[:3], seconds, f"{status}, {judged[3]}")]

    def debug_pyspy(self, native: bool = False) -> list[Row]:
        path = "/pyspy_dump?native=1" if native else "/pyspy_dump"
        t = time.perf_counter()
        status, page = self.get(path)
        seconds = time.perf_counter() - t
        judged = judge_stacks_page(page, self.want)
        return [self.row(f"torch debug server: {path}", judged[:3], seconds, f"{status}, {judged[3]}")]

    def debug_pyspy_native(self) -> list[Row]:
        return self.debug_pyspy(native=True)

    # torchfrtrace
    def write_dumps(self) -> Path:
        """Ask every rank for its dump (the worker's dump thread); return the request's folder."""
        asked = self.dumps / str(self.asked_dumps)
        self.asked_dumps += 1
        asked.mkdir()
        (asked / "now").touch()
        wait_for(lambda: len(list((asked / "trace").glob("rank*"))) == WORLD, 60, interval=0.005,
                 what="every rank's flight-recorder dump")
        return asked

    def groups_of_job(self) -> list[dict[str, Any]]:
        """torch.distributed's groups (name, desc, ranks), as rank 0 wrote them beside a dump."""
        if self.groups is None:
            self.groups = json.loads((self.write_dumps() / "groups" / "rank0.json").read_text())
        return self.groups

    def torchfrtrace(self) -> list[Row]:
        t = time.perf_counter()
        asked = self.write_dumps()
        written = time.perf_counter() - t
        t = time.perf_counter()
        as_is = subprocess.run([*FR_TRACE, str(asked / "trace")], capture_output=True, text=True, timeout=120,
                               check=False)
        as_is_sec = written + time.perf_counter() - t
        t = time.perf_counter()
        fixed = asked / "repaired"
        fixed.mkdir()
        for rank in range(WORLD):
            dump = pickle.loads((asked / "trace" / f"rank{rank}").read_bytes())
            groups = json.loads((asked / "groups" / f"rank{rank}.json").read_text())
            (fixed / f"rank{rank}").write_bytes(pickle.dumps(repaired(dump, groups)))
        run = subprocess.run([*FR_TRACE, str(fixed)], capture_output=True, text=True, timeout=120, check=False)
        fixed_sec = written + time.perf_counter() - t
        rows = []
        for tool, done, seconds in (("torchfrtrace", as_is, as_is_sec), ("torchfrtrace, key repaired", run, fixed_sec)):
            said = done.stdout + done.stderr
            note = (f"exit {done.returncode}: {error_line(done.stderr)}" if done.returncode
                    else f"incl. {written:.2f} s of dumps; its stack: {worker_frame(said)}")
            rows.append(self.row(tool, judge_fr_trace(said, self.want), seconds, note))
        return rows


def run_scenario(scenario: str, reps: int, workdir: Path) -> tuple[list[Row], float]:
    bench = Bench(scenario, workdir / scenario)
    rows: dict[tuple[str, str], Row] = {}
    try:
        started = bench.start()
        tools = bench.tools()
        for rep in range(reps):
            shift = rep % len(tools)  # rotate: no tool is always the first asked
            for tool in tools[shift:] + tools[:shift]:
                for row in tool():
                    kept = rows.setdefault(row.key(), row)
                    if kept is not row:
                        kept.seconds += row.seconds
                        if (kept.rank, kept.op, kept.place) != (row.rank, row.op, row.place):
                            kept.note += f" | rep {rep + 1}: {row.rank}/{row.op}/{row.place}"
    finally:
        bench.close()
    return list(rows.values()), started  # the first round asks in the tools' order


def seconds_text(seconds: list[float]) -> str:
    first = f"{seconds[0]:.2f}"
    return first if len(seconds) == 1 else f"{first} / {statistics.median(seconds[1:]):.2f}"


def disagreements(rows: list[Row]) -> list[str]:
    """Per scenario, each tool whose answer differs from our verdict's, and how."""
    out = []
    for scenario in dict.fromkeys(r.scenario for r in rows):
        here = [r for r in rows if r.scenario == scenario]
        ours = next(r for r in here if r.tool.startswith("ours: connect"))
        for r in here:
            if r.tool.startswith("ours") or (r.rank, r.op, r.place) == (ours.rank, ours.op, ours.place):
                continue
            if r.rank == ours.rank:
                pairs = (("the op", r.op, ours.op), ("the place", r.place, ours.place))
                missed = [what for what, theirs, our in pairs if theirs != our]
                why = f"names rank {r.rank} too, not {' nor '.join(missed)}"
            elif r.place == "unmarked":
                why = "shows every rank's stack (the culprit's place among them), names no culprit"
            elif r.rank.startswith("no"):
                why = f"names no culprit ({r.note})"
            else:
                why = f"names rank {r.rank}, ours rank {ours.rank}"
            out.append(f"{scenario}: {r.tool} {why}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2, help="asks of each tool per scenario (default 2)")
    p.add_argument("--scenarios", nargs="+", choices=("late", "mismatch"), default=["late", "mismatch"])
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    load_before = os.getloadavg()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kp-vs-torch-") as tmp:
        for scenario in args.scenarios:
            got, started = run_scenario(scenario, args.reps, Path(tmp))
            print(f"{scenario}: the job hung {started:.1f} s after its start", flush=True)
            rows += got
    load_after = os.getloadavg()
    print(f"\n{WORLD} ranks ({NODES} nodes x {RANKS_PER_NODE}, torchrun, gloo, DDP); {args.reps} asks per tool; "
          f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print("seconds: the first ask / the median of the others\n")
    head = f"{'scenario':9s} {'tool':46s} {'rank':>5s} {'op':>4s} {'place':>9s} {'seconds':>12s}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.scenario:9s} {r.tool:46s} {r.rank:>5s} {r.op:>4s} {r.place:>9s} {seconds_text(r.seconds):>12s}  "
              f"{r.note}")
    print("\nwhere the tools differ from ours:")
    for line in disagreements(rows):
        print(f"  {line}")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
