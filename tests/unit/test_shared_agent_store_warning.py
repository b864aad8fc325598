"""A job whose torchrun agents share their rendezvous store with the workers and may
restart them is told on its first start (rank 0, once) to set
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: without it a restarted gloo group sometimes
fails to form, or hangs, on the dead group's addresses (each a lost restart)."""

from __future__ import annotations

import logging

import pytest

import elastic_kit as ek
from elastic_kit.distributed import _warn_shared_agent_store


@pytest.mark.parametrize("shared, restarts, disabled, warned", [
    ("True", 3, None, True), ("False", 3, "1", False), ("True", 0, None, False),
    (None, 3, None, False),
    # a static rendezvous shares its store whatever the variable says (and
    # python -m elastic_kit.run sets it): the advice is a rendezvous backend
    ("True", 3, "1", True), ("True", 0, "1", False)])
def test_a_shared_agent_store_with_restarts_is_named_once(
        monkeypatch, caplog, shared: str | None, restarts: int, disabled: str | None,
        warned: bool) -> None:
    if disabled is None:
        monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", disabled)
    if shared is None:
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    with caplog.at_level(logging.WARNING, logger="elastic_kit.distributed"):
        _warn_shared_agent_store(ek.DistInfo(max_restarts=restarts))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == int(warned), said
    if warned:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in said[0]
        assert "--max-restarts=3" in said[0]
        if disabled == "1":  # the variable cannot help: the backend can
            assert "static rendezvous" in said[0] and "--rdzv-backend=c10d" in said[0]
