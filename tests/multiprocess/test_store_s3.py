"""CheckpointStore behaviour on ``s3://``: the shared contract (:mod:`tests.store_contract`)
against a real S3-compatible server (moto, a subprocess on 127.0.0.1, once per session)."""

from __future__ import annotations

import pytest
import torch

from elastic_kit.store import CheckpointStore
from tests.s3_server import s3_bucket, s3_server  # noqa: F401  (session fixtures)
from tests.store_contract import StoreContract


@pytest.mark.s3
class TestS3(StoreContract):
    @pytest.fixture
    def target(self, s3_bucket):  # noqa: F811
        url, opts = s3_bucket
        return f"{url}/run", opts


@pytest.mark.s3
def test_an_empty_path_component_after_the_bucket_is_refused_naming_the_url(
        s3_bucket):  # noqa: F811
    # s3fs lists "b//run" as "b/run" but writes the keys "/run/...": such a store
    # saved without error, never found its checkpoints again, and took the steps of
    # the store at "b/run" for its own leftovers (and deleted them)
    url, opts = s3_bucket
    first = CheckpointStore(f"{url}/run", storage_options=opts)
    first.save({"w": torch.ones(2)}, step=5)
    first.close()
    for bad in (f"{url}//run", f"{url}/run//sub"):
        with pytest.raises(ValueError, match=r"empty path component.*expected the path "
                                             r"without it \('[^']*/run(/sub)?'\)"):
            CheckpointStore(bad, storage_options=opts)
    loaded = CheckpointStore(f"{url}/run", storage_options=opts).load()
    assert loaded is not None and loaded.step == 5
