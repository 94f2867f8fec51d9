"""Put first on the PYTHONPATH of every process a ``LocalJob`` starts (tests/support/harness.py).
At exit, once the atexit handlers registered after it have run (handlers run last registered
first, and this one is registered at startup: torch's, the job's), it moves the process's
objects out of the garbage collector's sight.

Why: a process that imported torch spends 0.5 CPU-s (1 with DDP's torch._dynamo) in the
collections of its interpreter's shutdown, walking a heap that the OS frees a moment later
anyway; a ``make test`` ends about 150 such processes. Objects still reachable at exit are
released by reference counting as before; only those in reference cycles are left to the OS."""

import atexit
import gc

atexit.register(gc.freeze)
