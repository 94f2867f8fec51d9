"""Readers that ask torch or an outside tool for a table's rows, in the rank, when a query asks.

``flight_recorder``: torch's record of the collectives each process group enqueued, as rows
of ``collectives`` and ``process_groups``. ``native_stacks``: py-spy's dump of this process,
merged into ``stacks``. ``profile``: a torch.profiler capture on demand, started and stopped
at step boundaries, as rows of ``profile_ops``, ``profile_status`` and ``profile_trace``.

The flight recorder and py-spy are read on a SQL worker (never the probe thread, never a
training thread); a capture is started and stopped by the optimizer hooks. None loads torch
before the application did, and ``tables.catalog`` imports them lazily, so a probe nobody
asks never loads them. What the rows mean is analysed
client-side, in ``diagnosis``.
"""
