"""`python -m pdserve.launch PARENT_PID CPUS MODULE [ARGS...]`: how `pdserve cluster` starts each service.

Ties this process to its parent (SIGTERM once PARENT_PID is gone, even killed by SIGKILL), pins it to CPUS
(comma-separated core numbers; "" = not pinned), then execs `python -m MODULE ARGS`, which keeps both settings.
This runs after an exec, in a fresh interpreter, rather than in a Popen `preexec_fn`: see `cluster.spawn_service`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # prctl(2)


def main(argv: list[str]) -> None:
    parent, cpus, module, *args = argv
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        sys.exit(f"pdserve.launch: prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}")
    if os.getppid() != int(parent):  # it died before the prctl: no signal will come
        sys.exit(f"pdserve.launch: parent {parent} is gone")
    if cpus:
        os.sched_setaffinity(0, {int(cpu) for cpu in cpus.split(",")})
    os.execv(sys.executable, [sys.executable, "-m", module, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
