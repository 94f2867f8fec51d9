"""Issue 10, part 1: three hosts. Three network namespaces on one bridge, one torchrun
agent per namespace (2 ranks each), probes advertising their namespace's address.
Clients run inside the namespaces (the test process itself is on none of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.support.harness import LocalJob
from tests.support import REPO
from tests.support.netns import Hosts, NetnsError

from .conftest import wait_for
from tests.support import IDLE_WORKER

pytestmark = pytest.mark.cluster
HOSTS, PER_HOST = 3, 2
STALE, BASE = 3.0, 0.5
# "one interval": the report interval after backoff, capped at STALE - STALE//4 - 1 (README);
# a leaf behind a silent broker gets that long again to reach the root itself (registry)
INTERVAL = STALE - STALE // 4 - 1
FAST = {"PROBING_CLUSTER_STALE_SEC": str(STALE), "PROBING_CLUSTER_REPORT_INTERVAL_SEC": str(BASE),
        "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.0", "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}
SLACK = 0.75  # the watcher's poll period, the root's timer and two cores shared by 6 ranks and 3 agents
QUERY_TIMEOUT = 2.0
RDZV_PORT = 29511
RUN_ID = "three-hosts"


class Watcher:
    """``tests.support.netns watch`` on one host: JSON lines collected on a thread."""

    def __init__(self, net: Hosts, host: int, target: str | None, *args: str, runtime=None) -> None:
        argv = [sys.executable, "-m", "tests.support.netns", "watch", target or "", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}  # finds tests.support
        if runtime is not None:
            env["PROBING_RUNTIME_DIR"] = str(runtime)
        self.proc = net.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env=env)
        self.events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass

    def of(self, kind: str, since: float = 0.0) -> list[dict]:
        return [e for e in list(self.events) if e["kind"] == kind and e["t"] >= since]

    def connected(self, timeout: float = 30) -> dict:
        def done():
            ev = [e for e in self.events if e["kind"] in ("connected", "error")]
            return ev[0] if ev else None
        event = wait_for(done, timeout, what="the watcher's connect")
        assert event["kind"] == "connected", event
        return event

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)


def states(event: dict) -> dict[int, str]:
    return {m["rank"]: m["state"] for m in event["members"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    runtime = tmp_path_factory.mktemp("runtime")
    net = Hosts(HOSTS)
    try:
        net.start()
    except NetnsError as exc:
        pytest.fail(f"cannot create network namespaces: {exc}", pytrace=False)
    job = None
    try:
        job = LocalJob([IDLE_WORKER], nodes=HOSTS, ranks_per_node=PER_HOST,
                       mode="torchrun", run_id=RUN_ID, rdzv_port=RDZV_PORT, rdzv_host=net.addr(0),
                       env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), **FAST},
                       workdir=tmp_path_factory.mktemp("job"), grace=5,
                       node_prefix=net.prefix, node_addr=net.addr,
                       node_env=lambda i: {"PROBING_NODE_HOST": f"h{i}"},
                       # host 0's agent serves the c10d rendezvous store (hostnames match across namespaces)
                       node_args=lambda i: [f"--rdzv-conf=is_host={1 if i == 0 else 0}"]).start()
        job.wait_ready(90)
        yield net, job, runtime
    finally:
        if job is not None:
            job.close()
        net.close()
        assert net.exists() == [], "namespaces left behind"


def converged(net: Hosts, runtime) -> tuple[Watcher, dict]:
    """A watcher on the root's host (its connection file), once all 6 ranks are alive and queryable."""
    watcher = Watcher(net, 0, None, "--poll", "0.1", "--query-every", "0.5", "--wait", "60",
                      "--query-timeout", str(QUERY_TIMEOUT), runtime=runtime)
    watcher.connected(70)

    def whole():
        qs = watcher.of("query")
        ns = watcher.of("nodes")
        return (ns and len(ns[-1]["members"]) == HOSTS * PER_HOST
                and set(states(ns[-1]).values()) == {"alive"}
                and qs and not qs[-1]["partial"] and len(qs[-1]["answered"]) == HOSTS * PER_HOST)
    wait_for(whole, 90, interval=0.2, what="6 alive ranks answering queries")
    return watcher, watcher.of("nodes")[-1]


def host_ranks(last: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for m in last["members"]:
        out.setdefault(m["host"], []).append(m["rank"])
    return out


@pytest.mark.serial  # a latency bound
def test_clients_in_two_namespaces_and_store_target_as_typed(cluster):
    net, job, runtime = cluster
    # the root's namespace: the CLI finds the job by its connection file and shows the store:// to copy
    watcher, last = converged(net, runtime)
    try:
        root = next(m for m in last["members"] if m["rank"] == 0)
        root_host = int(root["host"][1:])
        assert root["endpoint"].startswith(f"tcp://{net.addr(root_host)}:")
        for m in last["members"]:  # every probe advertises its own namespace's address
            assert m["endpoint"].startswith(f"tcp://{net.addr(int(m['host'][1:]))}:"), m
        typed = f"store://{net.addr(0)}:{RDZV_PORT}/{RUN_ID}"  # --rdzv-endpoint / --rdzv-id as typed
        listing = net.run(root_host, [sys.executable, "-m", "kernel_probe.cli", "list"], capture_output=True,
                          text=True, env={**os.environ, "PROBING_RUNTIME_DIR": str(runtime)})
        assert typed in listing.stdout, listing.stdout + listing.stderr
        from kernel_probe.jobs import JobRegistry  # what the server and the magics show

        assert [j.to_dict()["store"] for j in JobRegistry(runtime).jobs()] == [typed]
        info = net.run(root_host, [sys.executable, "-m", "kernel_probe.cli", "info"], capture_output=True,
                       text=True, env={**os.environ, "PROBING_RUNTIME_DIR": str(runtime)})
        assert info.stdout.count(f"store: {typed}\n") == 1, info.stdout  # the root's own info answer says it

        other = (root_host + 1) % HOSTS
        remote = Watcher(net, other, typed, "--poll", "0.2", "--seconds", "3")
        try:
            event = remote.connected()
            assert event["seconds"] < 1.0, event
            assert event["run_id"] == f"{RUN_ID}/r0" and event["endpoint"] == root["endpoint"]
            wait_for(lambda: remote.of("nodes"), 10, what="the remote client's membership")
            seen = remote.of("nodes")[0]
            near = min(watcher.of("nodes"), key=lambda e: abs(e["t"] - seen["t"]))
            key = lambda e: sorted((m["rank"], m["state"], m["incarnation"], m["host"], m["endpoint"], m["tier"])  # noqa: E731
                                   for m in e["members"])
            assert key(seen) == key(near)
        finally:
            remote.stop()
        # the whole command a user on another host types, end to end (interpreter start included)
        t0 = time.monotonic()
        info = net.run(other, [sys.executable, "-m", "kernel_probe.cli", "-t", typed, "info"], capture_output=True,
                       text=True)
        print(f"kernel-probe -t {typed} info from host {other}: {time.monotonic() - t0:.2f} s")
        assert info.returncode == 0 and f"run_id: {RUN_ID}/r0" in info.stdout, info.stdout + info.stderr
        assert f"store: {typed}" in info.stdout
    finally:
        watcher.stop()


def check_cut(watcher: Watcher, cut_at: float, healed_at: float, cut: list[int], others: list[int]) -> dict:
    """The guarantees of one cut; returns what was measured."""
    polls = watcher.of("nodes", since=cut_at - 1.0)
    dead_at = {r: min((e["t"] for e in polls if states(e).get(r) == "dead"), default=None) for r in cut}
    gone_at = {r: min((e["t"] for e in polls if e["t"] > cut_at and r not in states(e)), default=None) for r in cut}
    timeline = [(round(e["t"] - cut_at, 2), {r: states(e).get(r, "-") for r in cut}) for e in polls]
    changes = [x for i, x in enumerate(timeline) if i == 0 or x[1] != timeline[i - 1][1]]
    print("timeline of the cut ranks (seconds after the cut):", changes)
    for r in cut:
        assert dead_at[r] is not None, f"rank {r} never reported dead"
        assert dead_at[r] - cut_at <= STALE + INTERVAL + SLACK, (r, dead_at[r] - cut_at)
        assert gone_at[r] is not None, f"rank {r} never removed"
        assert gone_at[r] - cut_at <= 2 * STALE + INTERVAL + SLACK, (r, gone_at[r] - cut_at)
    for e in polls:  # the other ranks never flap, before, during and after the cut
        assert all(states(e).get(r) == "alive" for r in others), e
    removed = min(gone_at.values())
    during = [q for q in watcher.of("query", since=cut_at + 0.05) if q["t"] < removed - QUERY_TIMEOUT]
    assert during, "no query ran while the cut ranks were members"
    for q in during:
        assert q["partial"] and sorted(int(r) for r in q["failed"]) == sorted(cut), q
        assert sorted(q["answered"]) == sorted(others), q
        assert q["elapsed"] <= QUERY_TIMEOUT + SLACK, q
    errors = watcher.of("query_error", since=cut_at - 1.0) + watcher.of("nodes_error", since=cut_at - 1.0)
    assert not errors, errors
    # after the removal the cut ranks are no longer members: queries target the others only
    after = [q for q in watcher.of("query", since=removed + 0.2) if q["t"] + q["elapsed"] < healed_at]
    print("queries after the removal, before the restore:",
          [(q["partial"], q["targeted"], sorted(q["failed"])) for q in after])
    return {"dead_after": max(dead_at[r] - cut_at for r in cut), "removed_after": max(gone_at[r] - cut_at for r in cut),
            "queries_during": len(during), "max_query_s": max(q["elapsed"] for q in during)}


def back_after_restore(watcher: Watcher, healed_at: float, cut: list[int], incarnations: dict[int, str]) -> float:
    """After the link is back the cut ranks are members again, alive, same processes (incarnations)."""
    def back():
        e = watcher.of("nodes", since=healed_at)
        if not e:
            return None
        last = {m["rank"]: m for m in e[-1]["members"]}
        if all(r in last and last[r]["state"] == "alive" for r in cut):
            return e[-1]
        return None
    event = wait_for(back, 30, interval=0.1, what="the cut ranks back")
    for m in event["members"]:
        assert m["incarnation"] == incarnations[m["rank"]], m
    return event["t"] - healed_at


def test_cut_a_hosts_link(cluster):
    net, job, runtime = cluster
    watcher, last = converged(net, runtime)
    try:
        by_host = host_ranks(last)
        root_host = next(int(m["host"][1:]) for m in last["members"] if m["rank"] == 0)
        victim = (root_host + 1) % HOSTS
        cut = sorted(by_host[f"h{victim}"])
        others = sorted(r for r in states(last) if r not in cut)
        incarnations = {m["rank"]: m["incarnation"] for m in last["members"]}
        cut_at = time.time()
        net.cut(victim)
        wait_for(lambda: all(r not in states(e) for e in watcher.of("nodes")[-1:] for r in cut),
                 2 * STALE + INTERVAL + 5, interval=0.1, what="the cut ranks removed")
        time.sleep(QUERY_TIMEOUT)
        healed_at = time.time()
        net.restore(victim)
        back = back_after_restore(watcher, healed_at, cut, incarnations)
        time.sleep(2.0)  # and they stay: nobody flaps after the restore either
        measured = check_cut(watcher, cut_at, healed_at, cut, others)
        print(f"cut host h{victim} (ranks {cut}): {measured}; back alive {back:.2f} s after the restore")
        assert all(set(states(e).values()) == {"alive"} for e in watcher.of("nodes", since=healed_at + back))
    finally:
        watcher.stop()


def test_cut_only_between_a_broker_host_and_the_root(cluster):
    net, job, runtime = cluster
    watcher, last = converged(net, runtime)
    try:
        by_host = host_ranks(last)
        root_host = next(int(m["host"][1:]) for m in last["members"] if m["rank"] == 0)
        victim = (root_host + 2) % HOSTS
        cut = sorted(by_host[f"h{victim}"])
        assert any(m["tier"] == "broker" for m in last["members"] if m["rank"] in cut)
        others = sorted(r for r in states(last) if r not in cut)
        incarnations = {m["rank"]: m["incarnation"] for m in last["members"]}
        cut_at = time.time()
        net.cut_between(victim, root_host)  # leaves still reach their broker; the broker not the root
        wait_for(lambda: all(r not in states(e) for e in watcher.of("nodes")[-1:] for r in cut),
                 2 * STALE + INTERVAL + 5, interval=0.1, what="the cut ranks removed")
        time.sleep(QUERY_TIMEOUT)
        healed_at = time.time()
        net.heal_between(victim, root_host)
        back = back_after_restore(watcher, healed_at, cut, incarnations)
        time.sleep(2.0)
        measured = check_cut(watcher, cut_at, healed_at, cut, others)
        print(f"cut h{victim} from the root's h{root_host} (ranks {cut}): {measured}; back {back:.2f} s after")
    finally:
        watcher.stop()
