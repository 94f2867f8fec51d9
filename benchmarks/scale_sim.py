"""A bounded tree at 1k / 4k / 16k ranks, in the in-process simulator (the real rank cores,
wire codec and SQL; nodes of 8 ranks, one host per node).

For each size: the time and bytes to converge; how long until the root shows every rank's
parent and level; the steady-state bytes per rank per minute (over whole report periods);
federated queries (a count, a group-by, a top-k) with their simulated p50/p99 over a
modelled link, and the CPU per query of the root, of a broker of brokers and of a node
broker (this machine's thread CPU time, measured around each virtual rank's work: all of it,
and the query's own, without the membership work that runs meanwhile), measured twice: as it
runs (a garbage collection that strikes inside a rank's work left out, reported apart) and with
no garbage collection at all (a collection walks every virtual rank's objects in the
simulator's one heap and leaves the next rank's work cold in the caches: the simulator's cost,
which grows with the job, where a probe collects its own heap), beside each one's children and
the function calls its query work made per query, counted (what does not grow with the job
beyond its children, where the CPU time of one process holding every rank can); the root's CPU
for a query pruned to one node by its host tag; a broker
of brokers killed, and a broker deeper in the tree killed (how long until its children
report elsewhere, to whom: their grandparent or the root, how many children the root had
meanwhile, who else was ever dead); a rack (another broker of brokers' subtree) cut off
and healed.

The link: every message takes ``--latency`` one way and each rank's interface sends and
receives at ``--bandwidth`` bytes/s, one message at a time each way; a SQL task takes the
CPU time it really took here (``sql_latency="measured"``); the cores' own handling is
counted as CPU, not as simulated time.

    .venv/bin/python benchmarks/scale_sim.py [--sizes 1024 4096 16384] [--fanout 48] [--queries 6]
        [--only-queries | --only-failures]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from kernel_probe.config import Settings  # noqa: E402
from kernel_probe.placement import subtree, tree_depth, tree_parent  # noqa: E402
from kernel_probe.rank_lists import wire_ranks  # noqa: E402
from kernel_probe.testing.sim import Simulation  # noqa: E402

PER_NODE = 8
ROWS = 16
QUERIES = ("SELECT count(*) AS n FROM t",
           "SELECT g, count(*) AS n, max(x) AS m FROM t GROUP BY g",
           "SELECT x, _rank FROM t ORDER BY x DESC LIMIT 10")
PRUNED = "SELECT g, count(*) AS n FROM t WHERE _host = 'host7' GROUP BY g"  # one node's ranks, by a tag
# what a query wakes a rank for (its SQL tasks run inside): the rest is the membership's
# (reports, acks, pushes, its timers and samples), which a slower query only overlaps more of
QUERY_WORK = ("query", "subquery", "subresult", "SqlTaskDone", "warm")


def _tables(rank: int) -> dict:
    return {"t": pa.table({"x": pa.array([rank * ROWS + i for i in range(ROWS)], pa.int64()),
                           "g": pa.array([f"g{(rank + i) % 8}" for i in range(ROWS)], pa.string())})}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _heads(nodes: int, fanout: int) -> list[int]:
    """The nodes whose brokers report to the root (the heads of its runs)."""
    return [n for n in range(1, nodes) if tree_parent(n, nodes, fanout) is None]


def _say(text: str) -> None:
    print(text, flush=True)


def _deepest_head(nodes: int, fanout: int, within: range) -> int:
    """The node in ``within`` deepest in the tree below a broker of brokers (depth >= 2), with
    the most brokers below it: its children's grandparent is not the root."""
    deep = [n for n in within if tree_depth(n, nodes, fanout) >= 2] or list(within)
    return max(deep, key=lambda n: (sum(tree_parent(m, nodes, fanout) == n for m in subtree(n, nodes, fanout)),
                                    tree_depth(n, nodes, fanout)))


def _kill_broker(sim: Simulation, node: int, nodes: int, fanout: int) -> dict:
    """Kill ``node``'s broker; wait until every child of it reports elsewhere and it is dead at
    the root. Where its children went, how fast, the root's children meanwhile, who else died."""
    mid = node * PER_NODE
    up = tree_parent(node, nodes, fanout)
    grandparent = 0 if up is None else up * PER_NODE
    children = [n * PER_NODE for n in subtree(node, nodes, fanout) if tree_parent(n, nodes, fanout) == node] + \
        list(range(mid + 1, mid + PER_NODE))
    killed_at = sim.now
    # a child on another host finds its parent gone when its next report goes unanswered (one
    # on the broker's host sees its pid go): where the kill falls in their report period counts
    host = sim.core(mid).identity.host
    due = [sim.core(r).report_due - killed_at for r in children
           if sim.core(r).identity.host != host and sim.core(r).report_due is not None]
    root_children = [len(sim.core(0).children)]
    sim.kill(mid)
    ever_dead: set[int] = set()

    def look() -> bool:
        ever_dead.update(m.rank for m in sim.root.registry.members() if m.state == "dead")
        root_children.append(len(sim.core(0).children))
        return all(sim.ranks[r].parent not in (None, mid) for r in children)

    moved_s = sim.wait_for(look, 120.0, check_every=0.5)
    went = [sim.ranks[r].parent for r in children]
    sim.wait_for(lambda: look() and sim.state(mid) == "dead", 60.0, check_every=0.5)
    dead_s = sim.now - killed_at
    sim.run_for(30.0, lambda: look() and False, check_every=0.5)
    return {"rank": mid, "level": tree_depth(node, nodes, fanout), "children": len(children),
            "grandparent": grandparent, "moved_s": moved_s, "dead_s": dead_s,
            "next_reports_s": (min(due), max(due)) if due else None,
            "to_grandparent": sum(p == grandparent for p in went), "to_root": sum(p == 0 for p in went),
            "root_children": (root_children[0], max(root_children)), "others_dead": sorted(ever_dead - {mid}),
            "alive_after": sim.root.registry.counts()["alive"]}


def _say_kill(what: str, k: dict) -> None:
    grandparent = "the root" if k["grandparent"] == 0 else f"rank {k['grandparent']}"
    due = k["next_reports_s"]
    due = f" (the next reports of those on other hosts were due in {due[0]:.1f}-{due[1]:.1f} s)" if due else ""
    _say(f"  {what} (rank {k['rank']}, level {k['level']}) killed: its {k['children']} children moved in "
         f"{k['moved_s']} s{due}, {k['to_grandparent']} to their grandparent ({grandparent}), {k['to_root']} to the root; "
         f"dead at the root after {k['dead_s']:.1f} s; the root's children {k['root_children'][0]} before, at most "
         f"{k['root_children'][1]} during; others ever dead {k['others_dead']}, alive after {k['alive_after']}")


def run(world: int, fanout: int, queries: int, latency: float, bandwidth: float, only_queries: bool = False,
        only_failures: bool = False) -> dict:
    nodes = world // PER_NODE
    settings = dataclasses.replace(Settings(), fanout=fanout)
    t_build = time.process_time()
    sim = Simulation(nodes, PER_NODE, settings=settings, record=False, tables=_tables, sql_latency="measured",
                     latency=latency, bandwidth=bandwidth)
    sim.start_all()
    gc.collect()
    gc.freeze()  # the cores and their registries live all run: a collection that scans them is the simulator's
    # cost, not a rank's (unfrozen, one lands inside some SQL task's measured time and on the critical path)
    took = sim.wait_for(sim.converged, 120.0, check_every=0.05)
    out: dict = {"world": world, "nodes": nodes, "levels": 1 + max(tree_depth(n, nodes, fanout) for n in range(nodes)),
                 "root_children": len(sim.core(0).children), "converge_s": took,
                 "converge_bytes": sum(sim.bytes_sent.values())}
    placed = sim.wait_for(sim.placed_at_root, 60.0, check_every=0.05)  # nodes' parent and level, every rank
    out["placed_s"] = None if placed is None else took + placed
    if not only_queries:
        sim.run_for(60.0)  # reports back off to the cap
    out["steady_B_rank_min"] = 0.0 if only_queries else sim.steady_bytes_per_minute() / world
    out["root_children"] = len(sim.core(0).children)
    out["membership_cpu_s"] = time.process_time() - t_build
    _say(f"{world:6d} ranks ({nodes} nodes, {out['levels']} levels of brokers, root children {out['root_children']}):"
         f"\n  converge {took:.2f} s, {out['converge_bytes'] / 1e6:.1f} MB ({out['converge_bytes'] / world:.0f} B/rank);"
         f" every rank's parent and level at the root after "
         f"{'more than 60' if out['placed_s'] is None else format(out['placed_s'], '.2f')} s;"
         f" steady {out['steady_B_rank_min']:.0f} B/rank/min ({out['membership_cpu_s']:.0f} s CPU so far)")

    heads = _heads(nodes, fanout)
    if only_failures:
        return _failures(sim, out, heads, nodes, fanout, world, t_build)
    mid = heads[0] * PER_NODE  # a broker of brokers
    below = [n for n in subtree(heads[0], nodes, fanout) if tree_parent(n, nodes, fanout) == heads[0]]
    node_broker = below[0] * PER_NODE if below else mid
    for sql in QUERIES:  # the first query loads the engines; each is planned once (sqlglot) before it is timed
        sim.query(sql, timeout=60.0)
    watched = (("root", 0), ("broker of brokers", mid), ("node broker", node_broker))
    lat: list[float] = []
    plan_ms, finish_ms, mid_merge_ms = [], [], []

    def timed(gc_on: bool) -> tuple[dict, dict]:
        """The queries, each rank's CPU per query around them: all of it and the query's own.
        ``gc_on`` False: no garbage collection at all meanwhile (a collection walks every virtual
        rank's objects in the simulator's one heap, then leaves the next rank's work cold in the
        caches: the simulator's cost, which grows with the job; a probe collects its own heap)."""
        gc.collect()
        gc.freeze()
        if not gc_on:
            gc.disable()
        cpu0 = {r: (sim.ranks[r].cpu, _query_cpu(sim, r)) for _, r in watched}
        try:
            for i in range(queries):
                sql = QUERIES[i % len(QUERIES)]
                t0 = sim.now
                # every hop's part of the profile asked: the merges' times below come from it, and the
                # figures stay those of the worst case (as before queries could leave it out)
                env = sim.query(sql, timeout=60.0, profile=True)
                cov = env.msg.body.get("coverage") or {}
                answered = cov.get("answered", "")
                answered = wire_ranks(answered).count if isinstance(answered, str) else len(answered)
                assert env.msg.body.get("status") == "ok" and answered == world, (sql, cov.get("failed"))
                lat.append(sim.now - t0)
                prof = cov.get("profile") or {}
                plan_ms.append(prof.get("plan_ms") or 0.0)
                finish_ms.append(prof.get("finish_ms") or 0.0)
                mid_merge_ms.extend(m["ms"] for m in prof.get("merges", ()) if m["rank"] == mid)
        finally:
            gc.enable()
        return ({name: (sim.ranks[r].cpu - cpu0[r][0]) / queries * 1e3 for name, r in watched},
                {name: (_query_cpu(sim, r) - cpu0[r][1]) / queries * 1e3 for name, r in watched})

    gc0 = sim.gc_cpu
    out["cpu_ms_per_query"], out["query_cpu_ms_per_query"] = timed(gc_on=True)
    out["gc_ms_per_query"] = (sim.gc_cpu - gc0) / queries * 1e3  # the simulator's heap, every rank's objects
    out["cpu_ms_per_query_gc_off"], out["query_cpu_ms_per_query_gc_off"] = timed(gc_on=False)
    # counted, not timed: the function calls each one's query work made (a profile hook, so apart)
    counted = {name: sim.count_calls(r) for name, r in watched}
    calls0 = {name: sum(c[k] for k in QUERY_WORK) for name, c in counted.items()}
    for i in range(queries):
        sim.query(QUERIES[i % len(QUERIES)], timeout=60.0, profile=True)
    out["calls_per_query"] = {name: (sum(c[k] for k in QUERY_WORK) - calls0[name]) / queries
                              for name, c in counted.items()}
    for _, r in watched:
        sim.ranks[r].calls_by = None
    out["query_p50_ms"], out["query_p99_ms"] = _pct(lat, 0.5) * 1e3, _pct(lat, 0.99) * 1e3
    sim.query(PRUNED, timeout=60.0)  # planned once (and the root's tag index made)
    before = (sim.ranks[0].cpu, _query_cpu(sim, 0))
    for _ in range(queries):
        env = sim.query(PRUNED, timeout=60.0)
        assert env.msg.body.get("status") == "ok" and wire_ranks(env.msg.body["coverage"]["answered"]).count == PER_NODE
    out["pruned_root_cpu_ms"] = ((sim.ranks[0].cpu - before[0]) / queries * 1e3,
                                 (_query_cpu(sim, 0) - before[1]) / queries * 1e3)
    out["mid_children"] = len(sim.core(mid).children)
    out["root_plan_ms"], out["root_finish_ms"] = statistics.median(plan_ms), statistics.median(finish_ms)
    out["mid_merge_ms"] = statistics.median(mid_merge_ms) if mid_merge_ms else None
    cpu, own = out["cpu_ms_per_query"], out["query_cpu_ms_per_query"]
    own_off, calls = out["query_cpu_ms_per_query_gc_off"], out["calls_per_query"]
    children = {"root": out["root_children"], "broker of brokers": out["mid_children"],
                "node broker": len(sim.core(node_broker).children)}
    out["children"] = children
    _say(f"  query p50 {out['query_p50_ms']:.0f} ms p99 {out['query_p99_ms']:.0f} ms; CPU per query, all of it "
         f"(the query's own) [the query's own with no garbage collection at all] and the function calls of its "
         f"query work, counted:")
    for name, _ in watched:
        _say(f"    {name:18s} {cpu[name]:5.1f} ({own[name]:5.1f}) [{own_off[name]:5.1f}] ms, {calls[name]:8.0f} calls "
             f"({children[name]} children: {calls[name] / max(1, children[name]):6.0f} per child)")
    _say(f"  the root's plan {out['root_plan_ms']:.1f} ms and finish {out['root_finish_ms']:.1f} ms (merges its "
         f"children's partials); a broker of brokers' merge {out['mid_merge_ms']} ms (medians); a query pruned to one "
         f"node by its host: the root's CPU {out['pruned_root_cpu_ms'][0]:.1f} ({out['pruned_root_cpu_ms'][1]:.1f}) ms; "
         f"garbage collections of the simulator's one heap {out['gc_ms_per_query']:.1f} ms per query (no rank's)")
    if only_queries:
        return out

    return _failures(sim, out, heads, nodes, fanout, world, t_build)


def _query_cpu(sim: Simulation, rank: int) -> float:
    """The CPU seconds ``rank`` spent on queries (woken by a query's message or SQL task)."""
    spent = sim.ranks[rank].cpu_by
    return sum(spent[k] for k in QUERY_WORK)


def _failures(sim: Simulation, out: dict, heads: list[int], nodes: int, fanout: int, world: int,
              t_build: float) -> dict:
    # a broker of brokers killed: its children go to their grandparent (the root, for one
    # right below it), nobody else dies
    out["kill"] = _kill_broker(sim, heads[0], nodes, fanout)
    _say_kill("a broker of brokers", out["kill"])
    # a broker deeper down killed (in a third run, away from the rack below): its children's
    # grandparent is a broker of brokers, not the root
    deep = _deepest_head(nodes, fanout, subtree(heads[min(2, len(heads) - 1)], nodes, fanout))
    out["kill_deep"] = _kill_broker(sim, deep, nodes, fanout)
    _say_kill("a broker below a broker of brokers", out["kill_deep"])
    out_dead = {out["kill"]["rank"], out["kill_deep"]["rank"]}

    # a rack cut off: the subtree of another broker of brokers
    rack_head = heads[1] if len(heads) > 1 else heads[0]
    rack = [r for n in subtree(rack_head, nodes, fanout) for r in range(n * PER_NODE, (n + 1) * PER_NODE)]
    cut_at = sim.now
    sim.cut(rack)
    seen_dead: set[int] = set()

    def rack_dead() -> bool:
        dead = {m.rank for m in sim.root.registry.members() if m.state == "dead"} - set(out_dead)
        seen_dead.update(dead)
        return set(rack) <= dead

    out["cut_dead_s"] = sim.wait_for(rack_dead, 120.0, check_every=0.5)
    out["cut_rack_ranks"] = len(rack)
    out["cut_others_dead"] = sorted(seen_dead - set(rack))
    sim.heal()
    out["heal_s"] = sim.wait_for(lambda: sim.root.registry.counts()["alive"] == world - len(out_dead), 120.0,
                                 check_every=0.5)
    out["cut_at"] = cut_at
    out["total_cpu_s"] = time.process_time() - t_build
    out["rejected"] = dict(sim.rejected)
    _say(f"  rack of {out['cut_rack_ranks']} ranks cut off: all dead at the root in {out['cut_dead_s']} s, others "
         f"dead {out['cut_others_dead']}; healed: all back in {out['heal_s']} s\n"
         f"  rejected {out['rejected']}; {out['total_cpu_s']:.0f} s CPU in all")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--fanout", type=int, default=48)
    ap.add_argument("--queries", type=int, default=6)
    ap.add_argument("--latency", type=float, default=100e-6, help="one way, seconds")
    ap.add_argument("--bandwidth", type=float, default=1.25e9, help="bytes/s per interface, each way")
    ap.add_argument("--only-queries", action="store_true", help="converge, then the queries (no steady state, no failures)")
    ap.add_argument("--only-failures", action="store_true", help="converge, the steady state, then the failures (no queries)")
    args = ap.parse_args()
    if args.only_queries and args.only_failures:
        ap.error("--only-queries and --only-failures exclude each other")
    print(f"fan-out {args.fanout}, nodes of {PER_NODE}, link {args.latency * 1e6:.0f} us one way, "
          f"{args.bandwidth * 8 / 1e9:.0f} Gb/s per interface; default membership intervals", flush=True)
    for world in args.sizes:
        run(world, args.fanout, args.queries, args.latency, args.bandwidth, args.only_queries, args.only_failures)
        gc.unfreeze()  # the next size starts with this one's garbage collectable
    return 0


if __name__ == "__main__":
    sys.exit(main())
