"""Why a job is stuck, slow or dead: pure analysis of rows a query or a dump already holds.

``verdict``: why a running job is stuck, from membership, the collectives' rows and the
main threads' stacks. ``failure``: who failed first and why, from the post-mortem dumps.
``values``: the readers of row values both share.

Nothing here reads torch, runs a process or reads the clock (the time now comes in as an
argument): the rank-side readers that produce these rows live in ``tables.readers``.
"""
