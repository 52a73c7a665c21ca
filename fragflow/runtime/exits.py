"""How a worker process ended, told to the user: the user's code raising in it (its traceback), the
program's own exit, a death by signal, and why a dead process is or is not started again."""

from __future__ import annotations

import signal


class WorkerFailed(Exception):
    """A worker process raised: names the process and fragment, carries the user's traceback.
    ``who`` names the process as the placement uses it (see ``Driver._process_name``)."""

    def __init__(self, role: str, index: int, fragment: str | None, tb: str, who: str | None = None) -> None:
        who = who or (f"actor {index}" if role == "actor" else role)
        where = f" in fragment '{fragment}'" if fragment else ""
        super().__init__(f"{who} failed{where}:\n{tb.rstrip()}")
        self.role, self.index, self.fragment, self.tb, self.who = role, index, fragment, tb, who


class ProgramExit(Exception):
    """The program's own ``SystemExit`` or ``KeyboardInterrupt``, raised in a worker: the run stops
    and the driver raises it, as the program raises it where the loop runs in one process."""

    def __init__(self, cause: BaseException, role: str = "actor") -> None:
        super().__init__(repr(cause))
        self.cause, self.role = cause, role


SHM_FULL = ("most likely shared memory (/dev/shm) ran out; give it more room (Docker: docker run "
            "--shm-size=..., its default is 64m) or make the channels smaller (num_envs, num_steps, max_lag)")


def ended(code: int) -> str:
    """How a process with exit code ``code`` ended (-N: killed by signal N)."""
    if code >= 0:
        return f"exited with code {code}"
    if -code == signal.SIGBUS:
        return f"was killed by signal {-code} (SIGBUS: {SHM_FULL})"
    return f"was killed by signal {-code}"


def not_restarted(role: str, code: int, restartable: str | None, restarts: int, max_restarts: int) -> str | None:
    """Why a process of ``role`` that ended with exit code ``code`` without a word is not started again
    (None: it is); ``restartable`` is the placement's reason its actors cannot be (None: they can),
    ``restarts`` how many times this one was already."""
    if role != "actor":
        return "only actors are restarted"
    if code == -signal.SIGBUS:   # (/dev/shm ran out: a new process would die the same way)
        return "a process killed by SIGBUS would most likely be killed again"
    if restartable is not None:
        return restartable
    if restarts < max_restarts:
        return None
    return ("--max-restarts is 0" if max_restarts == 0 else
            f"it was restarted {max_restarts} times already (--max-restarts {max_restarts})")
