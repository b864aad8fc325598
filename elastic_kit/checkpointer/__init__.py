"""When to save in a training loop: :class:`Checkpointer`.

A script that keeps its own loop calls ``restore()``, ``step(n)``, ``end_epoch()`` and
``close()``; :class:`~elastic_kit.ElasticLoop` is built on the same object. The
storage it saves into is :mod:`elastic_kit.store`; the in-memory tier is
:mod:`elastic_kit.snapshot`.
"""

from __future__ import annotations

from elastic_kit.checkpointer._checkpointer import Checkpointer
from elastic_kit.checkpointer._config import AUDIT_MODES, DEFAULT_KEEP_LAST, CheckpointerConfig
from elastic_kit.checkpointer._lifecycle import FinishedEarly
from elastic_kit.checkpointer._store_like import StoreLike

__all__ = ["Checkpointer", "CheckpointerConfig", "FinishedEarly", "StoreLike", "AUDIT_MODES",
           "DEFAULT_KEEP_LAST"]
