"""Per-step phases (issue: find the straggler that DDP hides): the clock's arithmetic with a
fake clock, then real torch hooks in this process (DDP of world size 1 with a user's own
comm hook), installed and removed without a trace."""

from __future__ import annotations

import time

import pytest

from kernel_probe.progress import CPU_EVERY_SEC, StepClock


def test_phases_of_a_step_from_its_hook_times():
    t = [10.0]
    clock = StepClock(clock=lambda: t[0], wall=lambda: 1000.0 + t[0])

    def at(x, fn, *a):
        t[0] = x
        fn(*a)

    at(10.00, clock.on_step_pre)
    at(10.01, clock.on_step)  # step 1 ends at 10.01
    at(10.11, clock.on_forward_start)  # 100 ms of data wait
    at(10.14, clock.on_forward_end)  # 30 ms forward
    at(10.15, clock.on_backward_start)
    at(10.17, clock.on_grad_ready)
    at(10.19, clock.on_grad_ready)  # compute done: 40 ms of backward
    at(10.24, clock.on_backward_end)  # 50 ms blocked on the all-reduce
    at(10.25, clock.on_step_pre)
    at(10.27, clock.on_step)  # 20 ms of optimizer
    step, start, duration, data, fwd, bwd, wait, opt = clock.snapshot()[-1][:8]
    assert step == 2 and start == pytest.approx(1010.01) and duration == pytest.approx(260.0)
    assert (data, fwd, bwd, wait, opt) == tuple(pytest.approx(v) for v in (100.0, 30.0, 40.0, 50.0, 20.0))
    assert clock.compute_ms == pytest.approx(70.0) and clock.comm_wait_ms == pytest.approx(50.0)


def test_what_is_not_seen_stays_null_and_micro_batches_add_up():
    t = [0.0]
    clock = StepClock(clock=lambda: t[0])
    clock.on_step()
    t[0] = 1.0
    clock.on_backward_start()  # no DDP: a backward without gradient hooks
    t[0] = 1.5
    clock.on_backward_end()
    t[0] = 2.0
    clock.on_step()
    data, fwd, bwd, wait, opt = clock.snapshot()[-1][3:8]
    assert (data, fwd, wait, opt) == (None, None, None, None) and bwd == pytest.approx(500.0)
    assert clock.compute_ms is None and clock.comm_wait_ms is None
    for i in range(3):  # gradient accumulation: three forwards and backwards in one step
        t[0] = 3.0 + i
        clock.on_forward_start()
        t[0] += 0.1
        clock.on_forward_end()
        clock.on_backward_start()
        t[0] += 0.2
        clock.on_grad_ready()
        t[0] += 0.05
        clock.on_backward_end()
    clock.on_step()
    data, fwd, bwd, wait, opt = clock.snapshot()[-1][3:8]
    assert fwd == pytest.approx(300.0) and bwd == pytest.approx(600.0) and wait == pytest.approx(150.0)
    assert data == pytest.approx(1000.0)  # from the last step's end (2.0) to the first forward (3.0)


def test_cpu_time_on_every_long_step_and_on_one_short_step_per_period():
    """The thread's CPU clock is a system call: short steps read it only about once per
    CPU_EVERY_SEC, as a pair of consecutive step ends (an exact figure, never an average)."""
    t = [0.0]
    clock = StepClock(clock=lambda: t[0])
    for _ in range(4):  # long steps: each has its own
        t[0] += CPU_EVERY_SEC * 1.5
        clock.on_step()
    short = CPU_EVERY_SEC * 0.3
    for _ in range(12):
        t[0] += short
        clock.on_step()
    cpu = [r[8] for r in clock.snapshot()]
    assert cpu[0] is None and all(v is not None and v >= 0 for v in cpu[1:4])
    # after the last long step's read: the fourth short step ends past the period and opens a
    # pair, the next closes it with that one step's CPU time; again one period later
    measured = [i for i, v in enumerate(cpu[4:], 5) if v is not None]
    assert measured == [9, 14], cpu


def test_step_start_follows_the_wall_clock_from_the_next_sample():
    """A step end reads one clock; its epoch start comes from an offset the probe thread's
    sample refreshes, so a wall clock set forward shows from the next sample on."""
    t, wall = [10.0], [1000.0]
    clock = StepClock(clock=lambda: t[0], wall=lambda: wall[0] + t[0])
    clock.on_step()
    t[0] = 10.5
    clock.on_step()
    assert clock.snapshot()[-1][1] == pytest.approx(1010.0)
    wall[0] = 2000.0
    try:
        clock.install_torch_hooks()  # the probe thread's sample
    finally:
        clock.remove_hooks()
    t[0] = 11.0
    clock.on_step()
    assert clock.snapshot()[-1][1] == pytest.approx(2010.5)


@pytest.fixture
def ddp_world_of_one(monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from tests.support.harness import free_port

    port = free_port()
    # for this test alone: a process a later test starts must not find a store to join
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield torch
    finally:
        dist.destroy_process_group()


def test_real_hooks_time_ddp_compose_with_a_users_comm_hook_and_come_off(ddp_world_of_one):
    torch = ddp_world_of_one
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    original_forward, original_backward = DDP.forward, torch.autograd.backward
    clock = StepClock()
    assert clock.install_torch_hooks()
    assert DDP.forward is not original_forward and torch.autograd.backward is not original_backward

    calls = []

    def users_hook(state, bucket):  # the user's own communication hook, registered as usual
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    model.register_comm_hook(None, users_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for _ in range(4):
        time.sleep(CPU_EVERY_SEC)  # the data loader: steps long enough that each has its cpu_ms
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    rows = clock.snapshot()
    assert len(rows) == 4 and calls  # the user's hook still runs
    for step, _start, _dur, data, fwd, bwd, wait, opt_ms, cpu_ms, _gc in rows[1:]:
        assert all(v is not None and v >= 0 for v in (data, fwd, bwd, wait, opt_ms, cpu_ms)), rows
    assert clock.compute_ms > 0 and clock.comm_wait_ms is not None

    clock.remove_hooks()
    assert DDP.forward is original_forward and torch.autograd.backward is original_backward
    before = len(clock.snapshot())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert len(clock.snapshot()) == before  # nothing of ours runs any more


def test_after_the_first_backward_only_the_last_gradients_stay_hooked(ddp_world_of_one):
    """The per-step cost does not grow with the model: every parameter is hooked for the first
    backward only; then the two whose gradients arrived last (those DDP's last bucket waits
    for) keep their hooks, and each later step's last gradient is still one of them."""
    torch = ddp_world_of_one
    from torch.nn.parallel import DistributedDataParallel as DDP

    layers = [torch.nn.Linear(16, 16) for _ in range(12)]
    model = DDP(torch.nn.Sequential(*layers))
    n_params = len(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    clock = StepClock()
    assert clock.install_torch_hooks()
    try:
        arrivals = []  # our own witness: every gradient's arrival, in order
        witness = [p.register_post_accumulate_grad_hook(lambda p: arrivals.append(p)) for p in model.parameters()]
        model(x).sum()  # a forward hooks every parameter
        assert clock.watched_gradients == n_params == 24
        for step in range(4):
            arrivals.clear()
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            assert clock.watched_gradients == 2
            kept = [p for p in model.parameters()
                    if any(h == clock.on_grad_ready for h in getattr(p, "_post_accumulate_grad_hooks", {}).values())]
            assert len(kept) == 2 and any(arrivals[-1] is p for p in kept)
            assert {id(p) for p in kept} == {id(layers[0].weight), id(layers[0].bias)}  # the first layer: last in backward
        for h in witness:
            h.remove()
        for _step, _start, _dur, data, fwd, bwd, wait, opt_ms, *_cpu_gc in clock.snapshot()[1:]:
            assert all(v is not None and v >= 0 for v in (data, fwd, bwd, wait, opt_ms))

        dynamic = DDP(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)), find_unused_parameters=True)
        dynamic(x).sum().backward()  # a graph that may change: every hook stays
        assert clock.watched_gradients == 2 + 4
    finally:
        clock.remove_hooks()
    assert clock.watched_gradients == 0
    # none of this clock's hooks stay (another test's probe in this process may hook the same DDP class)
    assert not any(h == clock.on_grad_ready for p in model.parameters()
                   for h in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values())


def test_a_module_on_a_gpu_leaves_every_phase_null():
    import torch

    t = [0.0]
    clock = StepClock(clock=lambda: t[0])
    clock._hook_grads(torch.nn.Linear(2, 2, device="meta"))  # not the CPU: kernels run apart from the host
    assert clock.device_side and clock.watched_gradients == 0
    for x, hook in ((0.0, clock.on_step), (1.0, clock.on_forward_start), (1.1, clock.on_forward_end),
                    (1.2, clock.on_backward_start), (1.3, clock.on_grad_ready), (1.5, clock.on_backward_end),
                    (1.6, clock.on_step_pre), (1.7, clock.on_step)):
        t[0] = x
        hook()
    step, _start, duration, *phases = clock.snapshot()[-1]
    assert step == 2 and duration == pytest.approx(1700.0) and phases[:5] == [None] * 5
    assert clock.compute_ms is None and clock.comm_wait_ms is None
