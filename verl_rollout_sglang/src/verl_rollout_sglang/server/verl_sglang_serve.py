"""Run ``sglang.launch_server`` under a watchdog that ends it when the trainer dies.

Started by the engine as ``SERVER_PYTHON verl_sglang_serve.py TRAINER_PID [sglang args...]`` in a
process group of its own (the engine starts it with a new session). It runs under SGLang's
interpreter, which has no verl installed, so it uses the standard library only.

SGLang's scheduler and detokenizer processes are children of this one and share its process
group. A daemon thread polls the trainer: once it is gone (killed with -9, say, so nothing in it
could clean up), the thread kills the whole group, so that no server process outlives the run.
"""

import os
import runpy
import signal
import sys
import threading
import time


def _trainer_alive(pid: int) -> bool:
    if os.getppid() != pid:  # re-parented: the process that started us has exited
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(pid: int) -> None:
    while _trainer_alive(pid):
        time.sleep(0.5)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main() -> None:
    trainer = int(sys.argv[1])
    threading.Thread(target=_watch, args=(trainer,), name="verl-trainer-watchdog", daemon=True).start()
    sys.argv = ["sglang.launch_server", *sys.argv[2:]]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
