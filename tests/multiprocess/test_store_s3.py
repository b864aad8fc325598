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


@pytest.mark.s3
def test_a_killed_writers_unfinished_multipart_upload_is_aborted_once_stale(
        s3_bucket):  # noqa: F811
    """A writer killed during a multipart upload (a payload over s3fs's block size)
    leaves the upload and its parts: no listing shows them, and S3 keeps (and bills)
    them until aborted. The stale cleanup aborts those under the store's steps that
    did not change for ``stale_after_s``, and only those."""
    import fsspec

    url, opts = s3_bucket
    fs = fsspec.filesystem("s3", **opts)
    bucket = url[len("s3://"):]

    def start_upload(key: str) -> None:
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                   Body=b"x" * 1024)

    def unfinished() -> list[str]:
        return sorted(u["Key"] for u in fs.call_s3("list_multipart_uploads",
                                                   Bucket=bucket).get("Uploads") or [])

    store = CheckpointStore(f"{url}/run", storage_options=opts)
    store.save({"w": torch.ones(2)}, step=1)
    store.wait()
    killed = "run/step-000000000002/state.0123456789ab.pt"
    others = ["run2/step-000000000002/state.0123456789ab.pt",  # another store's
              "run/notes/big.bin"]                                 # not a step's
    for key in [killed, *others]:
        start_upload(key)
    assert unfinished() == sorted([killed, *others])
    # younger than stale_after_s: a live writer's, kept
    store.save({"w": torch.ones(2)}, step=3)
    store.wait()
    assert unfinished() == sorted([killed, *others])
    told: list[str] = []
    stale = CheckpointStore(f"{url}/run", storage_options=opts, stale_after_s=0)
    stale.prune(1, dry_run=True, on_delete=lambda path, step, leftover: told.append(path))
    assert f"{bucket}/{killed}" in told and unfinished() == sorted([killed, *others])
    stale.prune(1)
    assert unfinished() == sorted(others)
    assert stale.latest_step() == 3
