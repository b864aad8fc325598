"""Registering host memory with CUDA as pinned, without leaving an error behind.

Why. A snapshot file's mapping is registered (``cudaHostRegister``) so copies to and
from the device run at the bus's speed; Linux refuses for a shared mapping of a file
on a disk's file system, and the tier then copies through pageable memory. But the
CUDA runtime also keeps a refused call's error as the calling thread's "last error",
and torch's binding does not clear it: the next kernel launch on that thread, whose
check reads the last error, would raise the registration's error from an unrelated
operation (on the writer thread: the copy of a non-contiguous tensor, which switches
snapshots off). :func:`register` and :func:`unregister` clear it where they fail,
with ``cudaGetLastError`` of the CUDA runtime library torch loaded.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any, Callable

import torch

__all__ = ["clear_last_error", "register", "runtime_library", "unregister"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_get_last_error: Callable[[], int] | None = None
_looked = False


def runtime_library(maps: str = "/proc/self/maps") -> str | None:
    """The path of the CUDA runtime library (``libcudart.so*``) this process has
    loaded, from its memory map; None where none is (a static runtime, no CUDA)."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and "/libcudart.so" in fields[5]:
                    return fields[5].strip()
    except OSError:
        pass
    return None


def clear_last_error() -> bool:
    """Reset the calling thread's last CUDA error (``cudaGetLastError``); whether the
    runtime's function could be found."""
    global _get_last_error, _looked
    with _lock:
        if not _looked:
            _looked = True
            path = runtime_library()
            try:
                fn: Any = ctypes.CDLL(path).cudaGetLastError if path else None
            except (OSError, AttributeError) as e:
                log.debug("no cudaGetLastError in %s: %r", path, e)
                fn = None
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = []
            _get_last_error = fn
    if _get_last_error is None:
        return False
    _get_last_error()
    return True


def register(ptr: int, nbytes: int) -> tuple[int, str]:
    """``cudaHostRegister`` of ``nbytes`` at ``ptr`` (default flags): the error code
    (0 on success) and its description; a refusal leaves no last error behind."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
    if err == 0:
        return 0, ""
    message = str(cudart.cudaGetErrorString(err))
    clear_last_error()
    return err, message


def unregister(ptr: int) -> int:
    """``cudaHostUnregister`` of memory :func:`register` registered: the error code (0
    on success); a refusal leaves no last error behind."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        clear_last_error()
    return err
