"""Checkpoints: what a run saves to continue later, and how it is read back.

A checkpoint is a directory ``OUT/checkpoints/<updates>/`` written atomically (a temporary
directory, then a rename; the last ``keep`` are kept):

- ``manifest.json``: format version, the algorithm, its args and policy, the counters (env steps,
  updates, parameter version, episodes and the recent returns), where the loop stands (which
  top-level loop, how many trips), the structure of every saved part and each part file's CRC-32
  (``checksums``: a damaged file is refused at resume, not loaded);
- one ``<part>.safetensors`` per part: ``states`` (every versioned state, its modules' and
  optimizers' ``state_dict`` included), ``loop<k>`` (loop replica ``k``: its numbers and strings,
  ``ff.random`` keys, random generators, the global torch/numpy/python random states, and every
  local object with ``state_dict``/``load_state_dict``, such as a replay buffer or observation
  statistics), and a service group's own objects.

Reading uses safetensors and JSON only: loading never runs code from a checkpoint. Arrays of the
loop that are not keys (observations) are not saved: environments are reset on resume, and the
loop rebuilds them from its first lines (a rollout under way is kept by its ``ff.RolloutBuffer``'s
own ``state_dict``).

What a process saves (its loop's locals, random states, versioned states) and how a resumed one
loads it is :mod:`fragflow.runtime.snapshot`; how values become JSON and arrays,
:mod:`fragflow.runtime.encoding`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fragflow.errors import ConfigError
from fragflow.runtime.encoding import Mismatch, Unsupported, decode, encode
from fragflow.runtime.savedargs import args_from
from fragflow.runtime.snapshot import CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "args_from", "Every", "Mismatch", "RunCheckpoints", "Unsupported", "decode", "encode"]

FORMAT = 1
MANIFEST = "manifest.json"
MANIFEST_CRC = "manifest_crc32"   # (the manifest's own checksum, in it: none in one written before it)
KEEP = 3


# -- when -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Every:
    """``--checkpoint-every``: N updates, or a duration (``90s``, ``5m``, ``1h``)."""

    updates: int | None = None
    seconds: float | None = None

    @staticmethod
    def parse(text: str) -> Every:
        m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*(s|m|h|)\s*", str(text))
        if m is None:
            raise ConfigError(f"--checkpoint-every {text!r} is neither a number of updates nor a duration",
                              fix="give a number of updates (100) or a duration (90s, 5m, 1h)")
        if float(m.group(1)) <= 0:   # (it said "neither a number of updates nor a duration" of 0)
            raise ConfigError(f"--checkpoint-every {text!r}: the interval between checkpoints is "
                              f"{'a duration' if m.group(2) else 'a number of updates'} above zero",
                              fix="give 1 or more updates (100) or a duration above zero (90s, 5m, 1h)")
        n, unit = m.group(1), m.group(2)
        if not unit:
            if "." in n:
                raise ConfigError(f"--checkpoint-every {text!r}: a number of updates is a whole number",
                                  fix="give a whole number of updates, or add a unit (s, m, h)")
            return Every(updates=int(n))
        return Every(seconds=float(n) * {"s": 1, "m": 60, "h": 3600}[unit])

    def __str__(self) -> str:
        return f"{self.updates} updates" if self.updates is not None else f"{self.seconds:g} s"


class Schedule:
    def __init__(self, every: Every, updates: int = 0) -> None:
        self.every = every
        self.last_updates = updates
        self.last_time = time.monotonic()
        self._asked: int | None = None

    def due(self, updates: int) -> bool:
        if self.every.updates is not None:
            return updates - self.last_updates >= self.every.updates
        return self.every.seconds is not None and time.monotonic() - self.last_time >= self.every.seconds

    def asked(self, updates: int | None) -> None:
        """A checkpoint was asked for, on schedule, at ``updates``. Across processes it is the cut at the
        loops' next trip, an update or two later: the next one is due N updates after this ask, not
        after that cut, so that they are N apart (they were N+1 under pipelined)."""
        self._asked = updates

    def written(self, updates: int) -> None:
        self.last_updates = updates if self._asked is None else self._asked
        self._asked = None
        self.last_time = time.monotonic()


# -- writing and reading directories -----------------------------------------------------------------
def write(root: Path, name: str, manifest: dict[str, Any], parts: dict[str, tuple[Any, dict[str, np.ndarray]]],
          keep: int = KEEP) -> Path:
    """Write a checkpoint directory ``root/name`` atomically and keep the newest ``keep``."""
    tmp = stage(root, name)
    try:
        metas = {part: save_part(tmp, part, meta, arrays) for part, (meta, arrays) in parts.items()}
        return finish(root, tmp, name, manifest, metas, keep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def stage(root: Path, name: str, tmp: Path | None = None) -> Path:
    """A fresh temporary directory for checkpoint ``name`` (or ``tmp``), which parts are written into."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = tmp or root / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def save_part(tmp: Path, part: str, meta: Any, arrays: dict[str, np.ndarray]) -> Any:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp / f"{part}.safetensors"))
    return meta


def checksum(file: Path) -> str:
    """A file's CRC-32, as 8 hex digits (what detects a flipped byte in a part written earlier)."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def finish(root: Path, tmp: Path, name: str, manifest: dict[str, Any], parts: dict[str, Any], keep: int = KEEP) -> Path:
    """Write the manifest into ``tmp`` and rename it to ``root/name`` (replacing one of that name)."""
    sums = {f.name: checksum(f) for f in sorted(tmp.glob("*.safetensors"))}
    manifest = dict(manifest, format=FORMAT, parts=parts, checksums=sums)
    manifest[MANIFEST_CRC] = _manifest_crc(json.loads(json.dumps(manifest, default=_json_default)))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True, default=_json_default) + "\n")
    final = root / name
    if final.exists():
        old = root / f".old-{name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    for old_dir in listing(root)[:-keep] if keep > 0 else []:
        remove(old_dir)
    return final


def _manifest_crc(manifest: dict[str, Any]) -> str:
    """The CRC-32 of a manifest as read back (its own checksum left out): a changed byte in it (a
    counter, a checksum of a part, a saved local) is refused at resume as a damaged part is."""
    text = json.dumps({k: v for k, v in manifest.items() if k != MANIFEST_CRC}, sort_keys=True)
    return f"{zlib.crc32(text.encode()):08x}"


def remove(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of the listing first (one atomic step), so that a
    process killed while it deletes leaves no half-deleted checkpoint among the complete ones, only
    a ``.old-`` directory that the next run checkpointing there removes."""
    gone = path.with_name(f".old-{path.name}-{os.getpid()}")
    try:
        path.rename(gone)
    except OSError:
        return
    shutil.rmtree(gone, ignore_errors=True)


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def listing(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, oldest written first (a run resumed from an older
    checkpoint writes lower numbers after higher ones: the newest is the last written)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: (_written_ns(p), int(p.name)))


def _written_ns(path: Path) -> int:
    """When a checkpoint was written: its manifest says (a copy made with ``cp -r`` keeps that, not
    the files' times), else its manifest file's time."""
    try:
        written = json.loads((path / MANIFEST).read_text()).get("written_ns")
    except (OSError, ValueError):
        written = None
    return int(written) if isinstance(written, int) else (path / MANIFEST).stat().st_mtime_ns


@dataclass
class Checkpoint:
    path: Path
    manifest: dict[str, Any]
    loaded: dict[str, tuple[Any, dict[str, np.ndarray]]] | None = None   # parts read already (sent to workers)

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    def part(self, name: str) -> tuple[Any, dict[str, np.ndarray]]:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        if self.loaded is not None and name in self.loaded:
            return self.loaded[name]
        meta = self.manifest["parts"].get(name)
        if meta is None:
            raise CheckpointError(f"checkpoint {self.path} has no part {name!r}",
                                  fix="resume with the policy that wrote it (see its manifest.json)")
        file = self.path / f"{name}.safetensors"
        want = self.manifest.get("checksums", {}).get(file.name)   # (none in a checkpoint written before them)
        try:
            if want is not None and checksum(file) != want:
                raise CheckpointError(
                    f"checkpoint file {file} is damaged: its CRC-32 is not the one its manifest recorded when it "
                    "was written", fix="resume from another checkpoint of the run (an older one in the same folder)")
            arrays = load_file(str(file))
        except (OSError, SafetensorError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {file} cannot be read: {exc}",
                                  fix="resume from another checkpoint of the run (an older one in the same folder)") from None
        return meta, arrays

    @property
    def counters(self) -> dict[str, Any]:
        return dict(self.manifest.get("counters", {}))

    def with_parts(self) -> Checkpoint:
        """This checkpoint with every part read: what the driver sends its workers, which may run on
        machines that do not see its files."""
        return Checkpoint(self.path, self.manifest, {name: self.part(name) for name in self.manifest["parts"]})


def find(target: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint a ``--resume`` argument names: a checkpoint directory, or a run directory
    (its newest checkpoint)."""
    path = Path(target)
    if not path.exists():
        raise CheckpointError(f"--resume {target}: no such directory", fix="give a run directory (--out of the run) or one of its checkpoints")
    if not (path / MANIFEST).is_file():
        found = listing(path / "checkpoints") or listing(path)
        if not found:
            raise CheckpointError(f"--resume {target}: no checkpoint there",
                                  fix="run with --checkpoint-every N to write checkpoints into OUT/checkpoints/")
        path = found[-1]
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt: {MANIFEST} cannot be read ({exc})",
                              fix="resume from another checkpoint of the run") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "parts" not in manifest:
        raise CheckpointError(f"checkpoint {path} is not a fragflow checkpoint of format {FORMAT}",
                              fix="resume from a checkpoint this version of fragflow wrote")
    if MANIFEST_CRC in manifest and manifest[MANIFEST_CRC] != _manifest_crc(manifest):
        raise CheckpointError(f"checkpoint {path} is corrupt: its {MANIFEST} changed since it was written (its CRC-32 "
                              f"is not the {manifest[MANIFEST_CRC]} it records)",
                              fix="resume from another checkpoint of the run")
    counters = manifest.get("counters")
    bad = [k for k in ("env_steps", "updates", "version", "episodes")
           if isinstance(counters, dict) and k in counters and (isinstance(counters[k], bool) or not isinstance(counters[k], int))]
    lacks = [k for k in ("env_steps", "updates") if isinstance(counters, dict) and k not in counters]
    if not isinstance(counters, dict) or bad or lacks:
        what = "has no counters" if not isinstance(counters, dict) else \
            f"counters lack {' and '.join(lacks)}" if lacks else \
            "counts " + ", ".join(f"{k}={counters[k]!r}" for k in bad) + " (whole numbers expected)"
        raise CheckpointError(f"checkpoint {path} is corrupt: its {MANIFEST} {what}",
                              fix="resume from another checkpoint of the run")
    return Checkpoint(path, manifest)


def deliver(results: Any, saving: dict[str, Any], seq: int, driver: int, part: str, meta: Any,
            arrays: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    """A worker's part of checkpoint ``seq``: written into the driver's staging directory when
    they share a filesystem (the local backend), else sent to the driver, which writes it. A
    checkpoint the loops cut on their own schedule (``cut_every``) is staged by its first part."""
    if saving.get("ship"):
        results.put(("ckpt_data", seq, part, meta, arrays, info))
        return
    from safetensors import SafetensorError

    tmp = staging_dir(Path(saving["root"]), seq, driver)
    try:
        if saving.get("cut_every"):   # (cut by the loops on their own: the driver stages it as its first part comes)
            tmp.mkdir(parents=True, exist_ok=True)
        save_part(tmp, part, meta, arrays)
    except (OSError, SafetensorError):   # the driver gave this one up (an actor ended meanwhile)
        return
    results.put(("ckpt", seq, part, meta, info))


def refuse_completed(ckpt: Checkpoint) -> None:
    """A completed run's last checkpoint (its weights) is not one to resume: refused before tracing."""
    if ckpt.manifest.get("complete"):
        raise CheckpointError(f"checkpoint {ckpt.path} is the end of a completed run: there is nothing to resume",
                              fix="start a new run (its weights are in states.safetensors), or resume an earlier checkpoint")


def changed_fields(ckpt: Checkpoint, args: Any) -> dict[str, Any]:
    """The fields a resumed run's args changed from its checkpoint's (a --set given with --resume), with
    their new values as the manifest records args."""
    from fragflow.runtime.summary import args_record

    try:
        now = json.loads(json.dumps(args_record(args), default=str))
    except (TypeError, ValueError):
        return {}
    saved = ckpt.manifest.get("args") or {}
    return {k: v for k, v in now.items() if saved.get(k, v) != v} if isinstance(now, dict) else {}


def args_changed(ckpt: Checkpoint, args: Any) -> list[Any]:
    """The new values of the fields a resumed run's args changed from its checkpoint's, numbers only."""
    return [v for v in changed_fields(ckpt, args).values() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def resumed(saving: dict[str, Any]) -> Checkpoint | None:
    """The checkpoint a worker resumes from: the one the driver read and sent (or its path)."""
    ckpt = saving.get("resume")
    if ckpt is None or isinstance(ckpt, Checkpoint):
        return ckpt
    return find(ckpt)


def _prune_stale(root: Path) -> None:
    """Checkpoints half written by a process that is gone (stopped while it wrote or committed one):
    removed as a run starts checkpointing in the directory."""
    if not root.is_dir():
        return
    for d in root.iterdir():
        m = re.fullmatch(r"\.(?:tmp|old)-.*-(\d+)", d.name)
        if m is None or not d.is_dir() or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)   # (its writer still runs: another run in the same directory)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def staging_dir(root: Path, seq: int, pid: int) -> Path:
    """Where the processes of the run whose driver is ``pid`` write the parts of checkpoint ``seq``."""
    return Path(root) / f".tmp-req{seq}-{pid}"


def merged_states(ckpt: Checkpoint) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Every versioned state a checkpoint holds: its ``states`` part (one process) or the
    ``states.<group>`` parts of the service groups that wrote them."""
    meta: dict[str, Any] = {}
    arrays: dict[str, np.ndarray] = {}
    for part in ckpt.manifest["parts"]:
        if part == "states" or part.startswith("states."):
            m, a = ckpt.part(part)
            meta.update(m)
            arrays.update(a)
    return meta, arrays


# -- one run's checkpoints -------------------------------------------------------------------------------
class RunCheckpoints:
    """The checkpoints of one run: when to write (``every``), what the manifest records, and the
    checkpoint it resumes from (``resume``). Lives in the driver process."""

    def __init__(self, out: Path, every: Every | None, identity: dict[str, Any], resume: Checkpoint | None = None,
                 keep: int = KEEP) -> None:
        self.root = Path(out) / "checkpoints"
        self.every = every
        self.identity = identity                # algorithm, program, args, policy, policy_options
        self.resume = resume
        self.keep = keep
        base = resume.counters.get("updates", 0) if resume is not None else 0
        self.schedule = Schedule(every, base) if every is not None else None
        self.stop_after = False                 # Ctrl-C: write one at the next trip, then stop
        self.written: list[Path] = []
        self.tracker: Any = None               # the loop's trip tracker, in one process
        self.requested = False                 # one was asked for out of schedule (Ctrl-C)
        self.seq = 0
        # begun, neither committed nor given up (several where the next is asked for ahead while the
        # services still save the last): seq -> (staging directory, parts expected, parts in, infos)
        self.staging: dict[int, tuple[Path, set[str], dict[str, Any], dict[str, Any]]] = {}
        self.begun: dict[int, float] = {}      # seq -> when it was staged (its parts are waited for from then)
        self.given_up: set[int] = set()        # their parts, still coming, are dropped
        self.committed = 0                     # the newest committed (an older one's parts are dropped)
        self.warn: Callable[[str], None] | None = None   # the run's warnings (the monitor's)
        # the run's outputs written through before a checkpoint is (a run killed after it keeps every row
        # the checkpoint's resume needs: TensorBoard's events are otherwise held for minutes)
        self.flush: Callable[[], None] | None = None
        self._unsaved_said: set[str] = set()
        if every is not None:
            _prune_stale(self.root)

    @property
    def enabled(self) -> bool:
        return self.every is not None

    def due(self, updates: int) -> bool:
        return self.schedule is not None and self.schedule.due(updates)

    def request(self) -> None:
        """Write one at the loop's next trip, whatever the schedule says."""
        if self.tracker is not None:
            self.tracker.pending = True
        self.requested = True

    def manifest(self, counters: dict[str, Any], loop: dict[str, Any] | None, complete: bool) -> dict[str, Any]:
        return {**self.identity, "counters": counters, "loop": loop, "complete": complete,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "written_ns": time.time_ns(),
                "resumed_from": str(self.resume.path) if self.resume is not None else None}

    def refuse_nothing_run(self, counters: dict[str, Any]) -> None:
        """Refuse a resumed run that ended where its checkpoint is: its budget ends there or before."""
        if self.resume is not None and all(
                int(counters.get(k, 0)) == int(self.resume.counters.get(k, 0)) for k in ("updates", "env_steps")):
            raise CheckpointError(
                f"the run resumed from {self.resume.path} ended where that checkpoint is (update "
                f"{counters.get('updates', 0)}, {counters.get('env_steps', 0)} env steps): the budget of these args "
                "ends there or before, so there is nothing to run (the checkpoint is left as it was)",
                fix="resume with a larger budget (--set the field of your Args that sets its steps or updates, as "
                    "total_timesteps in the algorithms/ programs), or resume an earlier checkpoint")

    def commit(self, counters: dict[str, Any], loop: dict[str, Any] | None,
               parts: dict[str, tuple[Any, dict[str, np.ndarray]]], complete: bool = False) -> Path:
        if complete:
            self.refuse_nothing_run(counters)
        for name, (meta, _) in parts.items():
            self._say_unsaved(name, meta)
        if self.flush is not None:
            self.flush()
        path = write(self.root, str(counters["updates"]), self.manifest(counters, loop, complete), parts, self.keep)
        if self.schedule is not None:
            self.schedule.written(int(counters["updates"]))
        self.written.append(path)
        return path

    # -- across processes (the driver's side) -----------------------------------------------------
    @property
    def staged(self) -> int | None:   # (the newest of them)
        return max(self.staging, default=None)

    def begin(self, expected: set[str]) -> int:
        """Start checkpoint number ``seq``: its parts are written by the processes into ``staging(seq)``."""
        self.seq += 1
        tmp = stage(self.root, "", staging_dir(self.root, self.seq, os.getpid()))
        self.staging[self.seq] = (tmp, set(expected), {}, {})
        self.begun[self.seq] = time.monotonic()
        return self.seq

    def adopt(self, seq: int, expected: set[str]) -> bool:
        """A part of checkpoint ``seq`` came, which the loops cut on their own (a schedule they know,
        see ``worker._loop_saving``): staged from now on, in the directory the processes write its
        parts into; False where it was given up or a newer one committed (its directory removed)."""
        if seq in self.staging:
            return True
        tmp = staging_dir(self.root, seq, os.getpid())
        if seq in self.given_up or seq <= self.committed:
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        self.seq = max(self.seq, seq)
        tmp.mkdir(parents=True, exist_ok=True)
        self.staging[seq] = (tmp, set(expected), {}, {})
        self.begun[seq] = time.monotonic()
        return True

    def sweep(self) -> None:
        """Remove every staging directory of this run (the run has ended and its processes with it:
        parts of checkpoints never committed, written after they were given up)."""
        for tmp in self.root.glob(f".tmp-req*-{os.getpid()}") if self.root.is_dir() else ():
            shutil.rmtree(tmp, ignore_errors=True)

    def directory(self, seq: int) -> Path | None:
        """Where checkpoint ``seq``'s parts are written, while it is staged."""
        return self.staging[seq][0] if seq in self.staging else None

    def arrived(self, seq: int, part: str, meta: Any, info: dict[str, Any]) -> bool:
        """A process wrote its part; True when every expected part is in."""
        entry = self.staging.get(seq)
        if entry is None:
            return False
        _, expected, parts, infos = entry
        self._say_unsaved(part, meta)
        parts[part] = meta
        infos[part] = info
        return expected <= set(parts)

    def _say_unsaved(self, part: str, meta: Any) -> None:
        """Say, once each, what of a loop's locals its checkpoints leave out that the loop keeps
        across trips (a resumed run starts it afresh)."""
        unsaved = [u for u in (meta.get("unsaved", ()) if part.startswith("loop") and isinstance(meta, dict) else ())
                   if u not in self._unsaved_said]
        if not unsaved or self.warn is None:
            return
        self._unsaved_said.update(unsaved)
        self.warn(f"checkpoints leave out the training loop's {', '.join(unsaved)}: a run resumed from them starts "
                  f"{'it' if len(unsaved) == 1 else 'them'} as the program makes {'it' if len(unsaved) == 1 else 'them'}, "
                  "not as saved (a checkpoint keeps the loop's numbers, strings, keys, generators, objects with "
                  "state_dict()/load_state_dict(), and lists, dicts, tuples, deques and objects of your own classes "
                  "holding only numbers, strings, arrays and random generators): give its class state_dict() and "
                  "load_state_dict(), or "
                  "keep what it holds in such values")

    def missing(self, seq: int) -> set[str]:
        entry = self.staging.get(seq)
        return set() if entry is None else entry[1] - set(entry[2])

    def complete(self, seq: int, counters: dict[str, Any], replicas: int, base: tuple[int, int] = (0, 0)) -> Path:
        """Commit staged checkpoint ``seq``: the parts are all written. The run went on while they
        were: the counters are those of the parts (the updates of the saved states, the steps the
        loops had made when they saved theirs), where the parts tell them; ``base``: the steps and
        updates of the run this one resumed. Any older one still staged is given up (committed
        later, it would be the newest)."""
        tmp, _, parts, infos = self.staging[seq]
        positions = {k: infos[k] for k in sorted(infos) if k.startswith("loop")}
        counters = dict(counters)
        versions = {info["version"] for k, info in infos.items() if k.startswith("states.") and "version" in info}
        if len(versions) == 1:
            counters["updates"] = counters["version"] = base[1] + versions.pop()
        if positions and all("steps" in p for p in positions.values()):
            counters["env_steps"] = base[0] + sum(int(p["steps"]) for p in positions.values())
        if self.flush is not None:
            self.flush()
        path = finish(self.root, tmp, str(counters["updates"]), self.manifest(counters, {"replicas": replicas, "positions": positions}, False),
                      parts, self.keep)
        del self.staging[seq]   # (not before: a run stopped while it is committed removes the staged parts)
        self.begun.pop(seq, None)
        self.committed = max(self.committed, seq)
        for older in [s for s in self.staging if s < seq]:
            self.begun.pop(older, None)
            shutil.rmtree(self.staging.pop(older)[0], ignore_errors=True)
        if self.schedule is not None:
            self.schedule.written(int(counters["updates"]))
        self.written.append(path)
        return path

    def abort(self, seq: int | None = None) -> None:
        """Give up staged checkpoint ``seq`` (default: every one)."""
        for s in list(self.staging) if seq is None else [seq]:
            self.given_up.add(s)
            self.begun.pop(s, None)
            entry = self.staging.pop(s, None)
            if entry is not None:
                shutil.rmtree(entry[0], ignore_errors=True)
        if self.schedule is not None:
            self.schedule.asked(None)   # (given up: the next is asked again, when due)

    # -- resuming ------------------------------------------------------------------------------
    def resumed_states(self) -> tuple[Any, dict[str, np.ndarray]] | None:
        return merged_states(self.resume) if self.resume is not None else None

    def check_fits(self, fragments: list[str], replicas: int, loops: list[list[Any]] | None = None) -> None:
        """Refuse a checkpoint another algorithm wrote, or a loop split another way; ``loops``: the
        training function's top-level loops now (``[line, source]`` each, see :func:`loop_headers`)."""
        if self.resume is None:
            return
        m = self.resume.manifest
        if loops is not None and m.get("loops") is not None:
            self._follow_loops(m["loops"], loops)
        refuse_completed(self.resume)
        if m.get("fragments") != fragments:
            raise CheckpointError(f"checkpoint {self.resume.path} was written by another algorithm (fragments "
                                  f"{', '.join(m.get('fragments') or [])}; this one has {', '.join(fragments)})",
                                  fix="resume with the algorithm that wrote it (leave it out: "
                                  "`fragflow run --resume DIR` reads it from the checkpoint)")
        loops = (m.get("loop") or {}).get("replicas")
        if loops is not None and loops != replicas:
            raise CheckpointError(f"checkpoint {self.resume.path} holds {loops} loop replica(s) (policy {m.get('policy')}), "
                                  f"this placement runs {replicas}", fix=f"resume with --policy {m.get('policy_spec') or m.get('policy')}")


    def _follow_loops(self, saved: list[list[Any]], loops: list[list[Any]]) -> None:
        """The saved loop positions name their loop by its line: a program edited above or inside
        the training function (a comment) moved it. The loops are matched in order by their source
        line; the positions are moved to the lines they are on now. Loops added, removed or changed
        since the checkpoint are refused: no saved position would mean the same trip of them."""
        assert self.resume is not None
        path = self.resume.path
        if [s for _, s in saved] != [s for _, s in loops]:
            def show(ls: list[list[Any]]) -> str:
                return "; ".join(f"line {line}: {src}" for line, src in ls) or "none"

            raise CheckpointError(
                f"checkpoint {path} was written when the training function's top-level loops were "
                f"[{show(saved)}]; they are now [{show(loops)}]: its loop position does not fit them",
                fix="resume with the program as it was when the checkpoint was written (only lines moved "
                    "by edits elsewhere are followed), or start a new run")
        moved = {int(a[0]): int(b[0]) for a, b in zip(saved, loops) if a[0] != b[0]}
        if not moved or self.resume.loaded is None:
            return
        for name, (meta, _) in self.resume.loaded.items():
            if name.startswith("loop") and isinstance(meta, dict) and "line" in meta:
                meta["line"] = moved.get(int(meta["line"]), meta["line"])


def loop_headers(fn: Any) -> list[list[Any]]:
    """``[line, source of that line]`` of each top-level loop of a resumable training function."""
    import linecache

    from fragflow.compiler.resumable import loop_lines

    file = getattr(getattr(fn, "__code__", None), "co_filename", "")
    linecache.checkcache(file)
    return [[line, linecache.getline(file, line).strip()] for line in loop_lines(fn)]
