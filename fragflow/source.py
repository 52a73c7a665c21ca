"""Source locations in the user's code, and the stack walking that finds them."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from dataclasses import dataclass
from types import FrameType, TracebackType

_CORE_DIR = os.path.dirname(os.path.abspath(__file__))
# Algorithms are user code even when they are installed inside the fragflow package.
_USER_SUBDIRS = (os.path.join(_CORE_DIR, "algorithms") + os.sep,)


@dataclass(frozen=True, slots=True)
class SourceLoc:
    """A ``file:line`` in the user's program; ``file`` is relative to the working directory when it can be."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    @staticmethod
    def of(filename: str, line: int) -> SourceLoc:
        return SourceLoc(display_path(filename), line)


def display_path(filename: str) -> str:
    """Relative to the working directory when below it, else as given."""
    return _display(filename, os.getcwd())


@functools.lru_cache(maxsize=4096)
def _display(filename: str, cwd: str) -> str:
    try:
        rel = os.path.relpath(filename, cwd)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def user_frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    """A traceback's frames of the user's code: fragflow's own, the import machinery's and those of
    installed libraries and Python's standard library left out (an error raised inside torch's
    ``Linear`` shows the user's line that called it, and is placed there); all but fragflow's where
    no frame is the user's."""
    frames = [f for f in traceback.extract_tb(tb) if not is_internal(f.filename)]
    return [f for f in frames if not is_library(f.filename)] or frames


def _library_roots() -> tuple[str, ...]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    try:
        roots.update(site.getsitepackages())
    except AttributeError:   # (an interpreter whose site module has none)
        pass
    return tuple(sorted(os.path.abspath(r) + os.sep for r in roots))


@functools.lru_cache(maxsize=4096)
def is_library(filename: str) -> bool:
    """True for a file of an installed package (site-packages) or of Python's standard library; the
    algorithms shipped inside fragflow are the user's."""
    path = os.path.abspath(filename)
    return not path.startswith(_USER_SUBDIRS) and path.startswith(_LIBRARY_ROOTS)


@functools.lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """True for frames inside fragflow's compiler and runtime (not algorithms, not user code), and
    Python's own import machinery (``<frozen importlib._bootstrap>``, importing the user's file)."""
    if filename.startswith("<frozen "):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_USER_SUBDIRS):
        return False
    return path.startswith(_CORE_DIR + os.sep) or "/typer/" in path or "/click/" in path


_LIBRARIES = ("numpy", "torch")
_library_cache: tuple[str, ...] = ()


def _library_dirs() -> tuple[str, ...]:
    global _library_cache
    if len(_library_cache) == len(_LIBRARIES):   # both imported: their directories stay where they are
        return _library_cache
    dirs = []
    for name in _LIBRARIES:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None) if mod is not None else None
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    _library_cache = tuple(dirs)
    return _library_cache


@functools.lru_cache(maxsize=4096)
def _skipped(filename: str, libs: tuple[str, ...]) -> bool:
    return is_internal(filename) or os.path.abspath(filename).startswith(libs) or is_library(filename)


def user_frame(skip: int = 1) -> FrameType | None:
    """The innermost stack frame that belongs to the user's code (fragflow's frames and those of
    the libraries a user's value passed through, e.g. ``np.asarray`` or gymnasium's vector env, are
    skipped)."""
    frame: FrameType | None = sys._getframe(skip)
    libs = _library_dirs()
    while frame is not None and _skipped(frame.f_code.co_filename, libs):
        frame = frame.f_back
    return frame


def user_callsite(skip: int = 1) -> SourceLoc | None:
    """``file:line`` of the innermost user frame on the stack."""
    frame = user_frame(skip + 1)
    if frame is None:
        return None
    return SourceLoc.of(frame.f_code.co_filename, frame.f_lineno)


def definition_of(fn: object) -> SourceLoc | None:
    """``file:line`` where a user function was defined; None for fragflow's built-ins."""
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    if code is None or is_internal(code.co_filename):
        return None
    return SourceLoc.of(code.co_filename, code.co_firstlineno)


_LIBRARY_ROOTS = _library_roots()
