"""Loading an algorithm: a file path (``algorithms/ppo.py``) or a built-in name (``ppo``).

An algorithm module defines a training function, the one decorated with ``@ff.distribute`` (one
per module: two are refused) or else the one named ``train``, whose first parameter is annotated with a frozen dataclass of
hyper-parameters (conventionally ``Args``). ``total_timesteps``, when the dataclass has it, is
the length shown by the progress display.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import traceback
import typing
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from fragflow.errors import ConfigError, UnknownFileError, did_you_mean
from fragflow.source import SourceLoc, definition_of, display_path


@dataclass(frozen=True)
class Program:
    name: str
    module: ModuleType
    train: Any
    args_cls: type | None

    @property
    def where(self) -> SourceLoc | None:
        return definition_of(self.train)


def builtin_algorithms() -> list[str]:
    algorithms: Any = importlib.import_module("fragflow.algorithms")

    return sorted(m.name for m in pkgutil.iter_modules(algorithms.__path__) if not m.name.startswith("_"))


def load(target: str) -> Program:
    path = Path(target)
    # a folder named like a built-in (a run directory: `--out a2c`) does not hide it
    if path.suffix == ".py" or path.is_file() or (path.exists() and target not in builtin_algorithms()):
        if path.is_dir():   # (it was "no such algorithm file", of a folder that is there)
            inside = sorted(p.name for p in path.glob("*.py"))
            raise UnknownFileError(f"{target} is a directory, not an algorithm file",
                                   fix=f"give the path of one of its .py files ({', '.join(inside[:6])}"
                                       f"{', ...' if len(inside) > 6 else ''})" if inside else
                                   f"give the path of a .py file, or a built-in algorithm: {', '.join(builtin_algorithms())}")
        if not path.is_file():
            raise UnknownFileError(f"no such algorithm file: {target}",
                                   fix=f"give the path of a .py file, or a built-in algorithm: {', '.join(builtin_algorithms())}")
        module = _import_file(path)
    else:
        names = builtin_algorithms()
        if target not in names:
            raise UnknownFileError(f"no algorithm file or built-in algorithm named {target!r}",
                                   fix=did_you_mean(target, names))
        module = importlib.import_module(f"fragflow.algorithms.{target}")
    return from_module(module, path.stem)


# the folders of the algorithm files imported here: their sibling modules import in every worker
# (local workers start with this process's path; Ray workers are given them, see backends.ray)
USER_FOLDERS: list[str] = []


def _import_file(path: Path) -> ModuleType:
    name = f"fragflow_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    if spec is None or spec.loader is None:
        raise UnknownFileError(f"cannot import {path}", fix="give the path of a Python source file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:   # as `python FILE`: modules beside the file import (and so do the workers)
        sys.path.insert(0, folder)
    if folder not in USER_FOLDERS:
        USER_FOLDERS.append(folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:   # (the file, or a module beside it that it imports)
        where = SourceLoc.of(exc.filename, exc.lineno) if exc.filename and exc.lineno else None
        text = (exc.text or "").strip()
        raise UnknownFileError(f"{display_path(exc.filename) if exc.filename else path} is not valid Python: {exc.msg}" + (f": `{text}`" if text else ""),
                               where=where, fix="correct that line (`python FILE` reports the same)") from None
    except ModuleNotFoundError as exc:   # (a module it imports, not installed here)
        lines = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        where = SourceLoc.of(lines[-1].filename, lines[-1].lineno) if lines and lines[-1].lineno else None
        raise UnknownFileError(f"{path} imports {exc.name!r}, which this Python cannot find"
                               + (f" ({exc})" if exc.name is None else ""), where=where,
                               fix=f"install it where fragflow runs (pip install ..., in {sys.prefix}), or correct the "
                                   "module's name; a module beside the file imports as it does with `python FILE`") from None
    return module


def from_module(module: ModuleType, name: str) -> Program:
    functions = [f for f in vars(module).values() if inspect.isfunction(f) and f.__module__ == module.__name__]
    marked = list({id(f): f for f in functions if hasattr(f, "__fragflow_policy__")}.values())
    if len(marked) > 1:   # (the first was taken, the others' decorators silently ignored)
        where = [definition_of(f) for f in marked]
        raise ConfigError(
            f"{getattr(module, '__file__', name)} marks {len(marked)} training functions with @ff.distribute: "
            + ", ".join(f"'{f.__name__}' (at {at})" for f, at in zip(marked, where))
            + "; fragflow runs one", where=where[1],
            fix="keep @ff.distribute on the training function fragflow should run (the others may stay, "
                "undecorated, or move to a file of their own)")
    train = marked[0] if marked else vars(module).get("train")
    if train is None or not callable(train):
        raise UnknownFileError(f"{getattr(module, '__file__', name)} defines no training loop",
                               fix="define `def train(args: Args)` or mark the loop with @ff.distribute(...)")
    return Program(name, module, train, args_class(train, module))


def args_class(train: Any, module: ModuleType) -> type | None:
    params = list(inspect.signature(train).parameters.values())
    if not params:   # train() makes its own settings: an Args class beside it is not given to it
        return None
    try:
        hints = typing.get_type_hints(train)
    except Exception:  # noqa: BLE001 - an annotation of a name imported only for type checkers
        hints = {}
        raw = getattr(train, "__annotations__", {}).get(params[0].name)
        if isinstance(raw, str):   # (postponed: the parameter's own annotation, if it resolves)
            hints[params[0].name] = getattr(module, raw, None)
        elif raw is not None:
            hints[params[0].name] = raw
    cls = hints.get(params[0].name)
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return cls
    named = cls if isinstance(cls, type) and cls.__module__ == module.__name__ else getattr(module, "Args", None)
    if isinstance(named, type) and dataclasses.is_dataclass(named):
        return named
    if isinstance(named, type) and params[0].default is inspect.Parameter.empty and \
            params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        # a settings class without @dataclass: train(args) would be called with nothing
        try:
            where: SourceLoc | None = SourceLoc.of(inspect.getsourcefile(named) or "", inspect.getsourcelines(named)[1])
        except (OSError, TypeError):
            where = definition_of(train)
        raise ConfigError(f"{named.__name__}, the settings of '{getattr(train, '__name__', 'train')}({params[0].name})', is not a "
                          "dataclass: fragflow makes the args from its fields (and --set changes them)",
                          where=where, fix=f"decorate it: @dataclass(frozen=True) above class {named.__name__} "
                                           "(from dataclasses import dataclass)")
    return None
