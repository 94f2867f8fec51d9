"""A stuck job's rows at any size, as its ranks' tables hold them: every rank of group 0 in
collective #42 (an all_reduce) but the odd ones, which never entered it and stand in their own
Python frame; ranks that died answer nothing. The verdict tests feed these rows to the pure
analysis at 16,384 ranks, and the simulator serves them as each virtual rank's tables."""

from __future__ import annotations

from typing import Iterable, Mapping

T0 = 1_800_000_000.0
SEQ = 42
C10D = ("all_reduce", "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", 2800)
TRAIN = ("train_step", "/job/train.py", 60)
FETCH = (("recv", "/usr/lib/python3.12/socket.py", 10), ("fetch_next_batch", "/job/train.py", 42),
         ("main", "/job/train.py", 80))


def group_row(world: int, behind: bool, enqueued_at: int = SEQ) -> dict:
    return {"group_id": 0, "group_name": "0", "group_desc": "default_pg", "ranks": members_text(world),
            "backend": "gloo", "last_enqueued": enqueued_at - 1 if behind else enqueued_at, "last_started": -1,
            "last_completed": enqueued_at - 1}


_MEMBERS: dict[int, str] = {}


def members_text(world: int) -> str:
    """The group's ranks as the flight recorder's reader writes them (one string, shared)."""
    if world not in _MEMBERS:
        _MEMBERS[world] = "[" + ", ".join(map(str, range(world))) + "]"
    return _MEMBERS[world]


def entry_row(seq: int, ts: float, op: str = "all_reduce", sizes: str = "[[1000]]") -> dict:
    return {"ts": ts, "op": op, "source": "flight_recorder", "group_id": 0, "group_name": "0",
            "group_desc": "default_pg", "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "is_p2p": False,
            "state": "scheduled", "input_sizes": sizes, "input_dtypes": '["Float"]'}


def stack_rows(frames: Iterable[tuple[str, str, int]]) -> list[dict]:
    """Main-thread rows, innermost first."""
    return [{"thread_id": 1, "thread_name": "MainThread", "is_main": True, "depth": d, "frame_type": "python",
             "function": f, "file": p, "line": line} for d, (f, p, line) in enumerate(frames)]


def rank_tables(rank: int, world: int, odd: Iterable[int], now: float = T0, waited: float = 41.0,
                calls: Mapping[int, str] | None = None) -> dict[str, list[dict]]:
    """One rank's ``process_groups``, ``collectives`` and ``stacks`` rows: in collective #42 for
    ``waited`` seconds, or (an ``odd`` rank) never entered it, in ``fetch_next_batch``.
    ``calls``: ranks that entered #42 with another op than all_reduce."""
    behind = rank in set(odd)
    entries = [entry_row(SEQ - 1, now - waited - 30)]
    if not behind:
        entries.append(entry_row(SEQ, now - waited, op=(calls or {}).get(rank, "all_reduce")))
    return {"process_groups": [group_row(world, behind)], "collectives": entries,
            "stacks": stack_rows(FETCH if behind else (C10D, TRAIN))}


def job_rows(world: int, odd: Iterable[int], dead: Iterable[int] = (), **kw) -> dict[str, list[dict]]:
    """Every answering rank's rows, tagged with ``_rank``, as a federated query returns them
    (a dead rank answers nothing)."""
    odd, gone = set(odd), set(dead)
    out: dict[str, list[dict]] = {"process_groups": [], "collectives": [], "stacks": []}
    for rank in range(world):
        if rank in gone:
            continue
        for name, rows in rank_tables(rank, world, odd, **kw).items():
            out[name] += [{**row, "_rank": rank} for row in rows]
    return out


def members(world: int, dead: Mapping[int, str] = {}, per_node: int = 8, now: float = T0) -> list[dict]:
    """The ``nodes`` members: alive, or dead with their reason."""
    return [{"rank": r, "node": r // per_node, "local_rank": r % per_node, "host": f"h{r // per_node}",
             "pid": 10000 + r, "tier": "leaf", "role": "", "state": "dead" if r in dead else "alive",
             "reason": dead.get(r, ""), "since": now - 30 if r in dead else now - 600, "last_seen": now - 1,
             "step": 100, "step_time_ms": 100.0} for r in range(world)]


# --- a real job's dumps, scaled up ---------------------------------------------------------------------

DUMP_QUERIES = {"reasons": "SELECT * FROM reason", "steps": "SELECT _rank, max(step) AS step FROM metrics "
                "WHERE step IS NOT NULL GROUP BY _rank", "groups": "SELECT * FROM process_groups",
                "entries": "SELECT * FROM collectives WHERE source = 'flight_recorder'",
                "stacks": "SELECT * FROM stacks WHERE is_main"}


def scaled_dumps(client, world: int, stand_in) -> dict:
    """The answers ``diagnose`` reads from a real job's dumps (``client``: a ``dump://`` client), as
    a job of ``world`` ranks whose rank ``r`` left the dump of the real rank ``stand_in(r)``:
    its rows, tagged ``r``, a group listing every real rank listing every rank, and its last
    membership record. ``client.diagnose.analyse`` takes the result. As diagnose asks, each
    group's ranks come once (``members``), not on every rank's row of ``groups``: 16,384 copies
    of a 90 KB list were 1.5 GB of Arrow and most of the test's CPU."""
    import pyarrow as pa

    from kernel_probe.client.results import QueryResult

    real: dict[str, dict[int, list[dict]]] = {}
    for name, sql in DUMP_QUERIES.items():
        for row in client.query(sql).table.to_pylist():
            real.setdefault(name, {}).setdefault(row["_rank"], []).append(row)
    raw = client.nodes_raw()
    members = {m["rank"]: m for m in raw["members"]}
    every, ours = members_text(world), None
    answers: dict = {"nodes": {"members": [], "departures": []}}
    scaled: dict[str, list[dict]] = {name: [] for name in DUMP_QUERIES}
    listed: dict[tuple, str] = {}  # (group_id, group_name) -> its ranks, as MEMBERS_SQL gives them
    for rank in range(world):
        was = stand_in(rank)
        for name, by_rank in real.items():
            for row in by_rank.get(was, ()):
                row = {**row, "_rank": rank}
                if name == "groups":
                    ranks = row.pop("ranks", None)
                    if ranks:
                        ours = ours or ranks
                        listed.setdefault((row["group_id"], row["group_name"]), every if ranks == ours else ranks)
                scaled[name].append(row)
        if was in members:
            answers["nodes"]["members"].append({**members[was], "rank": rank, "node": rank // 8,
                                                "local_rank": rank % 8})
    scaled["members"] = [{"group_id": gid, "group_name": name, "members": ranks}
                         for (gid, name), ranks in listed.items()]
    for name, rows in scaled.items():
        table = pa.Table.from_pylist(rows) if rows else None
        answers[name] = QueryResult(table, {"targeted": list(range(world)), "answered": list(range(world)),
                                            "failed": {}, "partial": False})
    return answers
