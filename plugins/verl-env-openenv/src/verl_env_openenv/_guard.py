"""Run a server command and take its whole process group down when the process that launched it dies.

``python -m verl_env_openenv._guard PARENT_PID -- COMMAND...``: started by
:mod:`verl_env_openenv.server` as the leader of a new process group, it runs COMMAND in that group and
watches PARENT_PID. A run that ends normally stops the group itself (``close``/``atexit``); this guard
covers the rest (a run killed with SIGKILL, a crash past atexit), so a launched server never outlives
its run. SIGTERM to the guard is passed on to the group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

#: How often the guard looks at its parent (seconds).
POLL_S = 0.5
#: How long the group gets between SIGTERM and SIGKILL (seconds).
GRACE_S = 5.0


def _stop_group(child: subprocess.Popen) -> None:
    """SIGTERM to the guard's group (the server and whatever it started), then SIGKILL to what is left
    after :data:`GRACE_S` (the guard goes with it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard is in the group: let it finish the job
    os.killpg(0, signal.SIGTERM)
    try:
        child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    os.killpg(0, signal.SIGKILL)  # grandchildren that ignored SIGTERM, or outlived the server


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m verl_env_openenv._guard PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent = int(argv[0])
    child = subprocess.Popen(argv[2:])
    signal.signal(signal.SIGTERM, lambda *_: _stop_group(child))
    while True:
        code = child.poll()
        if code is not None:
            return code
        if os.getppid() != parent:  # the run is gone (re-parented to init or a subreaper)
            _stop_group(child)
            return 0
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
