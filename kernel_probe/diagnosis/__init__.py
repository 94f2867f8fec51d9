"""Why a job is stuck, slow or dead: readers of what torch and the process already know.

``flight_recorder``: torch's record of the collectives each process group enqueued, as
rows of the ``collectives`` and ``process_groups`` tables.

``verdict``: why a job is stuck, from membership, those rows and the main threads' stacks.
``profile``: a torch.profiler capture on demand, started and stopped at step boundaries,
as rows of ``profile_ops``, ``profile_status`` and ``profile_trace``.
"""
