"""A query pruned to one rank goes from the client to that rank directly, on a real 2x2
job of plain ranks (gloo, the demo's tiny model stepping; each rank registers a seeded pandas
`frame`): the same rows and the same coverage as through the tree, the direct path taken
(the client's counts and the coverage say so), a rank the client cannot reach or that knows
another membership answered through the tree, and a wrong key refused as before. One job
for all of it; the tests only read it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import kernel_probe
from kernel_probe.client import AuthError, Client
from kernel_probe.client.aio import connect_async
from kernel_probe.client.targets import Target
from kernel_probe.frontend import stacks_sql
from kernel_probe.wire import derive_key

from .conftest import wait_for

pytestmark = pytest.mark.cluster
FRAMES = str(Path(__file__).parent / "workers" / "frames_ddp_worker.py")
ROWS = 2000
ONE_RANK = "SELECT * FROM frame WHERE _rank = 3 AND value > 0.5 ORDER BY id LIMIT 500"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The job, once every rank's `frame` answers; a client of its root."""
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    j = LocalJob([FRAMES, "--rows", str(ROWS), "--step-sleep", "0.05"], nodes=2, ranks_per_node=2, mode="plain",
                 env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "OMP_NUM_THREADS": "1"},
                 workdir=tmp_path_factory.mktemp("job")).start()
    try:
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")
        wait_for(lambda: root.query("SELECT count(*) AS n FROM frame", timeout=5).df["n"][0] == 4 * ROWS, 90,
                 interval=0.3, what="every rank's frame")
        yield root
        root.close()
    finally:
        j.close()
        mp.undo()


def _tree(root: Client, sql: str, **kw):
    root.routing.enabled = False
    try:
        return root.query(sql, **kw)
    finally:
        root.routing.enabled = True


def _same_coverage(direct: dict, tree: dict) -> None:
    for key in ("targeted", "answered", "pruned", "failed", "partial", "plan"):
        assert direct[key] == tree[key], key


def test_one_ranks_rows_come_from_it_directly_as_through_the_tree(job):
    root = job
    tree = _tree(root, ONE_RANK)
    before = root.routing.counts["direct"]
    direct = wait_for(lambda: (r := root.query(ONE_RANK)).coverage.get("direct") == 3 and r, 30, interval=0.2,
                      what="a direct answer")  # the membership settles after the job starts
    assert root.routing.counts["direct"] > before and "direct" not in tree.coverage
    assert direct.df.equals(tree.df) and len(direct.df) == 500 and set(direct.df["_rank"]) == {3}
    _same_coverage(direct.coverage, tree.coverage)
    assert direct.coverage["pruned"] == [0, 1, 2] and "3 pruned" in direct.footer()
    assert direct.footer().split(" · ")[0] == tree.footer().split(" · ")[0] == "1/1 ranks"
    assert not direct.coverage["profile"]["hops"]  # one round trip: no hop below the rank asked
    # its scan was the answer: no finish ran at the rank; the root finishes what the tree brings
    assert direct.coverage["profile"]["finish_ms"] is None and tree.coverage["profile"]["finish_ms"] is not None
    assert direct.table.equals(tree.table, check_metadata=True)

    # one rank's stacks (ranks=[3]), and an aggregate, the same way
    stacks = root.query(stacks_sql(), ranks=[3])
    assert stacks.coverage.get("direct") == 3 and set(stacks.df["_rank"]) == {3} and len(stacks.df) > 0
    agg = "SELECT kind, count(*) AS n, avg(value) AS a FROM frame WHERE _node = 1 AND _local_rank = 1 " \
          "GROUP BY kind ORDER BY kind"
    got, want = root.query(agg), _tree(root, agg)
    assert got.coverage.get("direct") == 3 and got.df.equals(want.df)
    _same_coverage(got.coverage, want.coverage)


def _footer(result) -> list[str]:
    """A result's footer less its time: what answered, the plan, what was pruned or failed."""
    parts = result.footer().split(" · ")
    return parts[:1] + parts[2:]


def test_the_connection_to_a_rank_is_opened_once_and_kept_for_the_next_queries(job):
    client = kernel_probe.connect(timeout=5)
    try:
        wait_for(lambda: client.query(ONE_RANK).coverage.get("direct") == 3, 30, interval=0.2, what="a direct answer")
        assert client.routing.counts["connections"] == 1
        direct = client.routing.counts["direct"]
        for _ in range(5):  # another query, another rank's pruned query: the same connection, no greeting
            assert client.query(ONE_RANK).coverage.get("direct") == 3
        assert client.query("SELECT count(*) AS n FROM frame", ranks=[3]).coverage.get("direct") == 3
        assert client.routing.counts["connections"] == 1 and client.routing.counts["direct"] == direct + 6
    finally:
        client.close()


def test_the_asyncio_client_asks_one_rank_directly_too(job):
    async def ask():
        client = await connect_async(timeout=5)
        try:
            first = await client.query(ONE_RANK)  # the rank is greeted (warmed) meanwhile: the tree answers
            for _ in range(50):
                result = await client.query(ONE_RANK)
                if result.coverage.get("direct") == 3:
                    break
                await asyncio.sleep(0.2)
            return first, result, dict(client.routing.counts)
        finally:
            client.close()

    first, result, counts = asyncio.run(ask())
    assert "direct" not in first.coverage and first.df.equals(result.df)
    assert result.coverage.get("direct") == 3 and counts.get("direct") == 1 and counts.get("connections") == 1
    assert result.df.equals(_tree(job, ONE_RANK).df)


def _book(root: Client, **change) -> dict:
    nodes = root.nodes_raw()
    return {"epoch": change.pop("epoch", nodes["epoch"]),
            "members": [dict(m, **change) if m["rank"] == 3 else m for m in nodes["members"]]}


def test_a_rank_the_client_cannot_reach_is_asked_through_the_tree(job):
    from tests.support.harness import free_port

    client = kernel_probe.connect(timeout=5)
    try:
        want = _tree(client, ONE_RANK)
        client.routing.learn(_book(client, endpoint=f"tcp://127.0.0.1:{free_port()}"), 0.0)  # nobody listens there
        got = client.query(ONE_RANK)
        assert "direct" not in got.coverage and got.df.equals(want.df)
        assert client.routing.counts["fallback"] == 1 and client.routing.counts["direct"] == 0
        _same_coverage(got.coverage, want.coverage)
        assert _footer(got) == _footer(want) == ["1/1 ranks", "top-k", "3 pruned"]
        # the membership is read again, and the rank's real endpoint answers directly, the same way
        again = wait_for(lambda: (r := client.query(ONE_RANK)).coverage.get("direct") == 3 and r, 10,
                         interval=0.3, what="a direct answer once the membership was read again")
        assert again.df.equals(want.df) and _footer(again) == _footer(want)
    finally:
        client.close()


def test_a_rank_at_another_membership_sends_the_client_to_the_tree(job):
    client = kernel_probe.connect(timeout=5)
    try:
        want = _tree(client, ONE_RANK).df
        wait_for(lambda: client.query(ONE_RANK).coverage.get("direct") == 3, 10, interval=0.2, what="a direct answer")
        client.routing.learn(_book(client, epoch=10**6), 0.0)  # as if the membership had moved on since
        got = client.query(ONE_RANK)
        assert "direct" not in got.coverage and got.df.equals(want)
        assert client.routing.counts["fallback"] == 1 and client.routing.stale
    finally:
        client.close()


def test_a_wrong_key_is_refused_with_the_same_clear_error(job):
    root = job
    with pytest.raises(AuthError) as handshake:
        kernel_probe.connect(timeout=5, token="not-the-token")
    assert "refused our credentials" in str(handshake.value)

    wrong = derive_key("not-the-token", root.run_id)
    errors = []
    for sql in ("SELECT count(*) AS n FROM frame", ONE_RANK, ONE_RANK):
        client = Client.from_target(Target(root.endpoint, wrong, run_id=root.run_id))
        if len(errors) == 2:  # it knows the ranks' endpoints: it greets rank 3 (refused there), then asks the root
            client.routing.learn(root.nodes_raw(), 0.0)
        try:
            with pytest.raises(AuthError) as refused:
                client.query(sql, timeout=5)
            errors.append(str(refused.value))
        finally:
            client.close()
    assert errors[0] == errors[1] == errors[2] and "refused our credentials" in errors[0]
