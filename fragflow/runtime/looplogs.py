"""What ``ff.log`` does in a loop replica of a run over several processes: the loop's own scalars go to
the driver with the update they follow; outputs of fragments served elsewhere that it logs are asked
of the process that computes them (where the trace saw them logged; others are refused)."""

from __future__ import annotations

from typing import Any

from fragflow.api.versioned import Pending
from fragflow.errors import LearnerOutputOnActingSideError
from fragflow.runtime.scalars import flat_scalars
from fragflow.source import user_callsite


class LoopLogs:
    """The loop interpreter's logging (the attributes below are the interpreter's)."""

    program: Any
    reporter: Any
    index: int
    logs: int
    skip_logs: int
    update: int
    _log_stepped: bool

    def _log(self, tree: Any) -> None:
        n = self.logs
        self.logs += 1
        if self.index != 0 or n < self.skip_logs:
            return None   # (a restarted replica re-running trips its dead process had made: reported then)
        self.reporter.log_seq = n   # (the driver counts the loop's logs it heard: a restart skips those)
        requests: list[tuple[str, int, int, str, str, int]] = []
        self._check_logged(tree, "", requests)
        # after an env step, a row of its own (single_process's row ends at the next step)
        steps, new_row = int(getattr(self.reporter, "total_steps", 0)), self._log_stepped
        if requests:   # logged where they are computed: the driver writes those of the calls the loop logged
            self.reporter.logged(requests, steps, new_row)
        scalars = flat_scalars(_without_pending(tree))
        if scalars:
            self.reporter.log(scalars, self.update, steps, new_row)
        if scalars or requests:
            self._log_stepped = False
        return None


    def _check_logged(self, tree: Any, name: str, requests: list[tuple[str, int, int, str, str, int]]) -> None:
        """Each output of another process's fragment sent to ff.log must be in a part its process
        reports (see lowering's _logged): others would be lost. ``requests`` gets (fragment, its
        call, the part, the output's path in the part, the name it is logged by, the loop's update: the
        row it joins, as under single_process) of each."""
        if isinstance(tree, Pending):
            part = max(((p, keys) for fragment, p, index, keys in self.program.logged
                        if fragment == tree.fragment and index == tree.index and tree.path_keys[:len(keys)] == keys),
                       key=lambda pk: len(pk[1]), default=None)
            if part is not None:
                rest = "/".join(str(k) for k in tree.path_keys[len(part[1]):])
                requests.append((tree.fragment, tree.call, part[0], rest, name, self.update))
            else:
                what = f"{'' if tree.index < 0 else f'[{tree.index}]'}{tree.path}"
                raise LearnerOutputOnActingSideError(
                    f"ff.log got output {what} of fragment '{tree.fragment}' as {name or 'its value'!r}, which "
                    "the trace did not see logged: that fragment runs in another process under this policy and "
                    "logs there the parts of its outputs that ff.log got while tracing, so this value would be lost",
                    where=user_callsite(),
                    fix="log the fragment's outputs as it returns them (ff.log(metrics) or "
                        "ff.log({'name': metrics['key']})) from the first call on; to log an element of an array, "
                        "return it as a metric of its own; or run with --policy single_process")
        elif isinstance(tree, dict):
            whole = _whole_outputs(tree)
            for output in whole:
                self._check_logged(output, name, requests)
            taken = {k for output in whole for k in output.skel}
            for k, v in tree.items():
                if k not in taken:
                    self._check_logged(v, f"{name}/{k}" if name else str(k), requests)
        elif isinstance(tree, (list, tuple)):
            for k, v in zip(tree._fields if hasattr(tree, "_fields") else range(len(tree)), tree):
                self._check_logged(v, f"{name}/{k}" if name else str(k), requests)


def _whole_outputs(tree: dict[Any, Any]) -> list[Pending]:
    """The outputs of which ``tree`` holds every traced key, each under its own key, taken as the
    output was spread or walked whole (``{**metrics, "eps": eps}``): logged as the output whole, they
    log the keys its calls add after the trace too, as ``ff.log(metrics)`` does (the entries alone
    were its traced keys only)."""
    held: dict[int, tuple[Pending, list[Any]]] = {}
    for k, v in tree.items():
        if isinstance(v, Pending) and v.spread is not None and v.path_keys and v.path_keys[-1] == k:
            held.setdefault(id(v.spread), (v.spread, []))[1].append(k)
    return [output for output, keys in held.values()
            if isinstance(output.skel, dict) and len(output.skel) == len(keys) and set(output.skel) == set(keys)]


def _without_pending(tree: Any) -> Any:
    if isinstance(tree, Pending):
        return None
    if isinstance(tree, dict):
        return {k: _without_pending(v) for k, v in tree.items() if not isinstance(v, Pending)}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_without_pending(v) for v in tree)
    return tree
