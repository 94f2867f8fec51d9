"""Why a job is stuck, slow or dead: readers of what torch and the process already know.

``flight_recorder``: torch's record of the collectives each process group enqueued, as
rows of the ``collectives`` and ``process_groups`` tables.
"""
