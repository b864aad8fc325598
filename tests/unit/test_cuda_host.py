"""Registering host memory with CUDA: a refusal is returned with its description and
leaves no last error on the thread (the runtime's cudaGetLastError clears it). The
CUDA runtime is stood in for by a recording stub on this CPU machine; the library
that clears the error is the real one torch loaded, where it loaded one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_kit.snapshot import _cuda_host


class _Runtime:
    """torch.cuda.cudart() as the registration calls it: each call's error code comes
    from ``codes`` (0: success)."""

    def __init__(self, *codes: int) -> None:
        self.codes = list(codes)
        self.calls: list[tuple[Any, ...]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, nbytes, flags))
        return self.codes.pop(0)

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return self.codes.pop(0)

    def cudaGetErrorString(self, err: int) -> str:
        return f"error {err}"


@pytest.fixture
def cleared(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    seen: list[bool] = []
    monkeypatch.setattr(_cuda_host, "clear_last_error", lambda: seen.append(True) or True)
    return seen


def test_a_refused_registration_is_described_and_its_error_cleared(
        monkeypatch: pytest.MonkeyPatch, cleared: list[bool]) -> None:
    runtime = _Runtime(0, 712, 0, 1)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    assert _cuda_host.register(4096, 8192) == (0, "")
    assert cleared == []
    assert _cuda_host.register(4096, 8192) == (712, "error 712")
    assert cleared == [True]
    assert _cuda_host.unregister(4096) == 0 and cleared == [True]
    assert _cuda_host.unregister(4096) == 1 and cleared == [True, True]
    assert runtime.calls == [("register", 4096, 8192, 0)] * 2 + [("unregister", 4096)] * 2


def test_the_runtime_library_is_found_in_the_memory_map(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f20-7f30 r--p 00000000 00:00 0 \n"
        "7f40-7f50 r-xp 00000000 08:01 2 /opt/site-packages/nvidia/cu13/lib/libcudart.so.13\n")
    assert _cuda_host.runtime_library(str(maps)) == (
        "/opt/site-packages/nvidia/cu13/lib/libcudart.so.13")
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert _cuda_host.runtime_library(str(maps)) is None
    assert _cuda_host.runtime_library(str(tmp_path / "missing")) is None


def test_the_last_error_is_cleared_through_the_runtime_torch_loaded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the real library where torch loaded one (a CUDA build without a GPU here): its
    # cudaGetLastError is callable without a device
    monkeypatch.setattr(_cuda_host, "_looked", False)
    monkeypatch.setattr(_cuda_host, "_get_last_error", None)
    assert _cuda_host.clear_last_error() == (_cuda_host.runtime_library() is not None)
