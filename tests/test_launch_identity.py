"""Who a process is once init_process_group made it a rank (mp.spawn, mpirun, srun, static
scripts): pure rules over an environment and the process group's facts."""

from __future__ import annotations

import pytest

from kernel_probe.config import (
    GroupFacts,
    identity_from_group,
    load_settings,
    needs_hosts,
    nodes_by_host,
    waits_for_process_group,
)

SETTINGS = load_settings({})
STORE = dict(store_host="127.0.0.1", store_port=29500)


def ident(env: dict, rank: int, world: int, hosts: dict | None = None, host: str = "h0", **facts):
    return identity_from_group(env, GroupFacts(rank=rank, world_size=world, **{**STORE, **facts}), SETTINGS,
                               hosts, host=host)


def shape(i) -> tuple:
    return (i.rank, i.world_size, i.local_rank, i.local_world_size, i.node, i.node_count)


def test_mp_spawn_on_one_host_is_one_node_and_its_store_names_the_run():
    hosts = {r: "h0" for r in range(4)}
    i = ident({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, 2, 4, hosts)
    assert shape(i) == (2, 4, 2, 4, 0, 1)
    assert i.run_id == "127.0.0.1:29500/r0" and (i.master_addr, i.master_port) == ("127.0.0.1", 29500)
    assert i.in_job and i.has_store and i.single_host and i.host == "h0"


def test_ranks_grouped_by_host_number_nodes_by_their_lowest_rank():
    # mpirun --map-by node: ranks alternate between hosts
    hosts = {0: "b", 1: "a", 2: "b", 3: "a"}
    assert nodes_by_host(hosts, 0) == (0, 2, 0, 2)
    assert nodes_by_host(hosts, 1) == (0, 2, 1, 2)
    assert nodes_by_host(hosts, 2) == (1, 2, 0, 2)
    assert nodes_by_host(hosts, 3) == (1, 2, 1, 2)
    # every rank computes the same numbering from the same hosts
    assert {nodes_by_host(hosts, r)[2] for r in (0, 2)} == {0}


def test_open_mpi_local_rank_is_taken_and_the_node_comes_from_hosts():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "3405643777"}
    assert needs_hosts(env)
    i = ident(env, 3, 4, {0: "a", 1: "a", 2: "b", 3: "b"}, host="b")
    assert shape(i) == (3, 4, 1, 2, 1, 2) and i.run_id == "mpi-3405643777/r0"
    # Open MPI 5 names its job by the PMIx namespace
    assert ident({"PMIX_NAMESPACE": "prterun-vm-77@1"}, 0, 2, {0: "a", 1: "a"}).run_id == "mpi-prterun-vm-77@1/r0"


def test_slurm_numbers_nodes_itself_and_names_the_job_and_step():
    env = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
           "SLURM_NODEID": "2", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "6", "SLURM_RESTART_COUNT": "1"}
    assert not needs_hosts(env)
    i = ident(env, 5, 6)
    assert shape(i) == (5, 6, 1, 2, 2, 3) and i.run_id == "slurm-812.0/r1"


def test_torchrun_style_variables_set_by_the_script_win_over_hosts():
    # a notebook launcher or a static script sets LOCAL_RANK / LOCAL_WORLD_SIZE itself
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    assert not needs_hosts(env)
    i = ident(env, 3, 4, store_host="10.0.0.1", store_port=1234)
    assert shape(i) == (3, 4, 1, 2, 1, 2)
    assert i.run_id == "10.0.0.1:1234/r0" and not i.single_host
    # torchrun's own run id, when the process has it, names the run
    i = ident({**env, "TORCHELASTIC_RUN_ID": "exp", "TORCHELASTIC_RESTART_COUNT": "2", "GROUP_RANK": "1"}, 3, 4)
    assert i.run_id == "exp/r2" and i.node == 1


def test_without_a_tcp_store_or_hosts_a_rank_still_has_its_rank():
    i = identity_from_group({}, GroupFacts(rank=1, world_size=2), SETTINGS, None, host="h")
    assert shape(i) == (1, 2, 1, 2, 0, 1) and not i.has_store


def test_role_and_host_from_settings():
    s = load_settings({"PROBING_ROLE": "eval", "PROBING_NODE_HOST": "n7"})
    i = identity_from_group({}, GroupFacts(rank=0, world_size=2, **STORE), s, {0: "n7", 1: "n7"})
    assert (i.role, i.host) == ("eval", "n7")


@pytest.mark.parametrize("env, waits", [
    ({}, False),  # a plain script: a job of one until it becomes a rank or launches ranks
    ({"RANK": "1", "WORLD_SIZE": "2"}, False),  # torchrun: a rank from the start
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}, True),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, False),  # mpirun -np 1: a job of one
    ({"PMI_SIZE": "2"}, True),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2"}, True),
    ({"SLURM_STEP_NUM_TASKS": "4", "RANK": "2", "WORLD_SIZE": "4"}, False),  # torchrun inside srun
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4"}, False),  # the batch script itself is no task of a step
])
def test_which_processes_wait_to_become_ranks(env, waits):
    assert waits_for_process_group(env) is waits


# --- a process that is not a rank yet: a job of one only after its imports -----------------------

def test_a_job_of_one_is_due_once_the_main_thread_stopped_importing_for_the_delay():
    from kernel_probe._activate.solo import SoloDelay

    d = SoloDelay(now=0.0, delay=2.0)
    assert not d.due(1.0, importing=False)
    assert not d.due(1.9, importing=True)  # `import torch` for seconds: the clock starts again after it
    assert not d.due(3.8, importing=False) and d.due(3.9, importing=False)
    forever = SoloDelay(now=0.0, delay=2.0, max_wait=30.0)  # a program that runs inside an import
    assert not any(forever.due(t, importing=True) for t in range(30)) and forever.due(30.0, importing=True)


def test_the_main_threads_import_is_seen_from_another_thread(tmp_path, monkeypatch):
    import sys
    import threading
    import time

    from kernel_probe._activate.solo import main_thread_importing

    (tmp_path / "slow_module_for_solo.py").write_text("import time\ntime.sleep(1.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=lambda: __import__("slow_module_for_solo"))
    importer.start()
    time.sleep(0.3)
    assert main_thread_importing(importer.ident)
    importer.join()
    idle = threading.Thread(target=time.sleep, args=(1.0,))
    idle.start()
    time.sleep(0.1)
    assert not main_thread_importing(idle.ident)
    idle.join()
    sys.modules.pop("slow_module_for_solo", None)


def test_a_pending_job_of_one_never_starts_once_cancelled(monkeypatch):
    import threading

    from kernel_probe._activate import solo

    monkeypatch.setattr(solo, "POLL_SEC", 0.001)
    monkeypatch.setattr(solo, "_state", None)
    started: list[str] = []
    t = [0.0]

    def clock():
        t[0] += 0.5
        return t[0]

    solo._state = solo.PENDING
    solo._wait_then_start(solo.SoloDelay(clock(), 2.0), clock, lambda: False, lambda: started.append("probe"))
    assert started == ["probe"] and solo.state() == solo.STARTED and not solo.cancel()

    started.clear()
    solo._state = solo.PENDING
    asked = threading.Event()

    def still_importing() -> bool:  # the main thread stays in its imports until the launcher cancels
        asked.set()
        return True

    waiter = threading.Thread(target=solo._wait_then_start,
                              args=(solo.SoloDelay(clock(), 2.0), clock, still_importing,
                                    lambda: started.append("probe")))
    waiter.start()
    asked.wait(5)
    assert solo.cancel() and solo.state() == solo.CANCELLED  # mp.spawn called: it was pending
    waiter.join(5)
    assert not waiter.is_alive() and started == []
