"""Which kernel a fragment's float32 ``Linear`` layers run on, on the CPU.

torch computes ``nn.Linear`` (``torch.nn.functional.linear``) with MKL's ``sgemm``, which takes its
AVX2 code on AMD processors even where they have AVX-512; oneDNN's inner product, which torch ships
too, takes their AVX-512 kernels. On this project's AMD EPYC machine a 256x256 layer on a batch of
256, forward and backward, took 1.05 ms through MKL and 0.54 ms through oneDNN; SAC's update (its
networks are 256-256 MLPs on batches of 256) 8.4-9.5 ms and 6.2-6.5 ms. Inside fragments (the
functions decorated with ``ff.fragment``, wherever they run: eagerly, while tracing, in a worker of
any policy), a float32 ``Linear`` on the CPU whose product is big enough to gain (at least
``onednn.MIN_MACS`` multiply-adds, batch x in x out: below it the call's own cost is more than the
gain) and whose sums are short enough that oneDNN's bits do not depend on its thread count (rows, in
and out features at most ``onednn.REDUCE_MAX``) goes through oneDNN, forward and backward;
everything else goes through torch as before: code outside fragments, other dtypes and devices,
tensor subclasses, and whatever runs with oneDNN turned off (``torch.backends.mkldnn``) or under
autocast, ``torch.func`` transforms, forward-mode AD, torch function or dispatch modes,
``torch.compile`` or ``torch.jit`` tracing. The result is the same function summed in another
order: equal up to float rounding, and the same in every run and every process on a machine
whatever its thread count, eagerly and under every policy (they all run a fragment's ``Linear``
through the same kernel), so a seed gives one result wherever a policy promises one.

``FRAGFLOW_LINEAR`` chooses: ``auto`` (the default) takes oneDNN on an AMD processor with AVX-512
(where MKL leaves it out) and torch's own elsewhere; ``onednn`` takes it wherever torch has it;
``torch`` leaves ``torch.nn.functional.linear`` alone. A run checks the setting before it starts.
This module imports torch only once the program has: a program without torch pays nothing. A
process chooses at its first fragment call after torch is imported (a fragment that imports torch
itself takes the chosen kernel from its next call on); threads a fragment starts itself run outside
fragments (torch's own kernel).
"""

from __future__ import annotations

import os
import sys
import threading

SETTINGS = ("auto", "onednn", "torch")


class _Depth(threading.local):
    n = 0


depth = _Depth()   # fragments running on this thread (a fragment may call another)
_settled = [False]   # this process has chosen (once torch is imported)


def setting() -> str:
    """``FRAGFLOW_LINEAR``: ``auto`` (the default), ``onednn`` or ``torch``; a run checks it before it
    starts (``onednn`` too, where this torch has no oneDNN inner product)."""
    raw = os.environ.get("FRAGFLOW_LINEAR", "").strip()
    value = raw.lower() or "auto"
    from fragflow.errors import ConfigError

    if value not in SETTINGS:
        raise ConfigError(f"FRAGFLOW_LINEAR={raw!r} is not one of {', '.join(SETTINGS)}",
                          fix="unset it (fragments' float32 Linear layers on an AMD CPU with AVX-512 go through "
                              "oneDNN), or set FRAGFLOW_LINEAR=torch (torch's own kernel everywhere) or onednn")
    if value == "onednn" and "torch" in sys.modules:   # (a program without torch has no Linear: nothing to check)
        from fragflow.runtime import onednn

        if onednn.inner_product() is None:
            import torch

            raise ConfigError(f"FRAGFLOW_LINEAR=onednn, but this torch ({torch.__version__}) has no oneDNN inner "
                              "product (torch.ops.mkldnn._linear_pointwise)",
                              fix="unset FRAGFLOW_LINEAR, or use a torch built with oneDNN (the x86 and aarch64 Linux wheels are)")
    return value


def chosen() -> str:
    """The kernel fragments' float32 ``Linear`` layers take in this process: ``onednn`` or ``torch``."""
    value = setting()
    if value == "torch":
        return "torch"
    from fragflow.runtime import onednn

    if onednn.inner_product() is None or not (value == "onednn" or onednn.amd_avx512()):
        return "torch"
    return "onednn"


def settle() -> None:
    """This process takes the chosen kernel, once torch is imported; a setting a run would refuse
    leaves torch's own (an eager call runs as torch does), as does any failure to install it."""
    if "torch" not in sys.modules:
        return
    _settled[0] = True
    try:
        if chosen() == "onednn":
            from fragflow.runtime import onednn

            onednn.install()
    except Exception:
        return


def reset() -> None:
    """The process chooses again at its next fragment (after ``FRAGFLOW_LINEAR`` changed)."""
    _settled[0] = False
    if "fragflow.runtime.onednn" in sys.modules:
        sys.modules["fragflow.runtime.onednn"].uninstall()


class _InFragment:
    """``with in_fragment:`` around a fragment's function: its ``Linear`` layers take the chosen kernel."""

    __slots__ = ()

    def __enter__(self) -> None:
        if not _settled[0]:
            settle()
        depth.n += 1

    def __exit__(self, *exc: object) -> None:
        depth.n -= 1
        if not _settled[0]:   # (a fragment that imported torch itself: its next call takes the chosen kernel)
            settle()


in_fragment = _InFragment()
