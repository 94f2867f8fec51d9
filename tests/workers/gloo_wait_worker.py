"""Rank 1 blocks in gloo waiting for rank 0, which never comes (it waits in Python).

Rank 1's main thread waits in ``recv`` from rank 0: gloo waits on that very thread
(``gloo::transport::tcp::UnboundBuffer::waitRecv``). Its thread ``reducer`` waits in an
``all_reduce`` rank 0 never enters: gloo runs a collective on its own C++ threads, which
py-spy does not see, so that thread's native frames end in c10d's ``Work::wait``.
Either way the Python stack ends at the call; only the native frames say where it waits.
"""

import datetime
import threading
import time

import torch
import torch.distributed as dist


def never_enters() -> None:
    time.sleep(3600)  # rank 0: busy elsewhere, its peer waits for it


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if dist.get_rank() == 1:
        threading.Thread(target=lambda: dist.all_reduce(torch.ones(4)), name="reducer", daemon=True).start()
        dist.recv(torch.ones(4), src=0)
    else:
        never_enters()


if __name__ == "__main__":
    main()
