"""CheckpointStore behaviour on ``s3://``: the shared contract (:mod:`tests.store_contract`)
against a real S3-compatible server (moto, a subprocess on 127.0.0.1, once per session)."""

from __future__ import annotations

import pytest

from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (session fixtures)
from tests.store_contract import StoreContract


@pytest.mark.s3
class TestS3(StoreContract):
    @pytest.fixture
    def target(self, s3_bucket):  # noqa: F811
        url, opts = s3_bucket
        return f"{url}/run", opts
