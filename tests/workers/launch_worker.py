"""A training script as users start it with launchers other than torchrun's dynamic
rendezvous: the script finds its rank itself, then calls init_process_group (gloo, env://).

    --launcher spawn|fork   this process is the launcher: torch.multiprocessing.start_processes
                            with that start method, --nprocs ranks on this host, node
                            --node-rank of --nnodes (ranks node_rank * nprocs + i)
    --launcher mpi          one rank of mpirun: OMPI_COMM_WORLD_RANK / _SIZE
    --launcher slurm        one task of srun: SLURM_PROCID / SLURM_NTASKS
    --launcher env          torchrun (static or --standalone): RANK / WORLD_SIZE already set
    --launcher args         started by hand, once per rank: --rank of --world-size

Every rank writes ``rank-<r>`` (its pid) to --control-dir once the group is up, checks the
group with one all_reduce, then logs a metric row a second (``metrics`` for SQL) and
idles without collectives, so killing one rank leaves the others running. The launcher
writes ``launcher`` (its pid). MASTER_ADDR / MASTER_PORT come from --master-addr/--master-port
unless set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _rank_and_world(args: argparse.Namespace) -> tuple[int, int]:
    launcher = args.launcher
    if launcher == "args":
        return args.rank, args.world_size
    if launcher == "mpi":
        return int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    if launcher == "slurm":
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _write(control: str, name: str, text: str) -> None:
    tmp = os.path.join(control, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(control, name))


def rank_main(index: int | None, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", args.master_addr)
    os.environ.setdefault("MASTER_PORT", str(args.master_port))
    if index is not None:  # started by start_processes on node --node-rank of --nnodes
        rank, world = args.node_rank * args.nprocs + index, args.nnodes * args.nprocs
    else:
        rank, world = _rank_and_world(args)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == world
    _write(args.control_dir, f"rank-{rank}", str(os.getpid()))
    import kernel_probe

    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end and not os.path.exists(os.path.join(args.control_dir, "stop")):
        kernel_probe.log(step=step, rank_seen=rank)
        step += 1
        time.sleep(1.0)
    os._exit(0)  # no destroy_process_group: the other ranks may be gone (the test kills one)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--launcher", required=True, choices=["spawn", "fork", "mpi", "slurm", "env", "args"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--nnodes", type=int, default=1, help="spawn/fork: this script runs once per node")
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--control-dir", required=True)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--no-teardown", action="store_true",
                   help="spawn/fork: wait for every rank, never stop the others when one dies (as torch does)")
    args = p.parse_args()
    if args.launcher in ("spawn", "fork"):
        import torch.multiprocessing as mp

        _write(args.control_dir, "launcher", str(os.getpid()))
        context = mp.start_processes(rank_main, args=(args,), nprocs=args.nprocs, start_method=args.launcher,
                                     join=not args.no_teardown)
        for process in context.processes if args.no_teardown else ():
            process.join()
        return
    rank_main(None, args)


if __name__ == "__main__":
    sys.exit(main())
