"""The object-store backend (``s3://``, ``gs://``, ``memory://``, any other fsspec URL).

An object store has no rename of a directory, but a PUT is atomic per object: the
payload is uploaded into ``step-<n>/`` first and the manifest after it, so a step is
committed exactly when its manifest object exists. A re-save uploads the new payload
under a fresh name and replaces the manifest with one PUT. A failed upload is
discarded, never completed with what it holds.
"""

from __future__ import annotations

import errno
import io
import logging
import posixpath
import re
import time
from typing import IO, Any, TypeVar

import fsspec

from elastic_kit.errors import CheckpointCorruptError, CheckpointError
from elastic_kit.store._backend import Fill, PayloadWrite, Reader, Seal, basename, check_size
from elastic_kit.store._fs import join, raise_named
from elastic_kit.store._manifest import MANIFEST_NAME, Manifest

__all__ = ["ObjectBackend"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _literal(path: str) -> str:
    """``path`` as a pattern that matches only itself: fsspec's ``rm`` expands ``*``,
    ``?`` and ``[`` (a store named ``run[1]`` would remove run ``run1``'s steps, and
    keep its own); each becomes a one-character class."""
    return re.sub(r"([*?[])", r"[\1]", path)


def entry_time(info: dict[str, Any]) -> float | None:
    """Modification time of an fsspec ``info`` entry, in seconds since the epoch."""
    for key in ("mtime", "LastModified", "last_modified", "created", "updated"):
        v = info.get(key)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return None


def discard_upload(f: Any) -> None:
    """Abandon a remote file being written without uploading what it holds."""
    try:
        discard = getattr(f, "discard", None)
        if callable(discard):
            discard()
        f.closed = True  # an fsspec buffered file would upload on close()/__del__
    except Exception:  # pragma: no cover - best effort
        pass


def _completing(f: Any, path: str) -> None:
    """Close ``f``, the upload of ``path``, which completes there (s3fs and gcsfs send
    a small file's only PUT at close); its failure names the file."""
    try:
        f.close()
    except Exception as e:
        raise_named(e, path)


class ObjectBackend:
    """A store on an fsspec filesystem other than the local one.

    Args:
        fs, root: the filesystem and the store's root path in it.
        url: the store's URL, for messages.
        read: runs a read with the store's retry policy.
    """

    #: A step's files are written where they stay (no private directory renamed into
    #: place), so each save names its files afresh: two writers of one step (a stale
    #: process and its successor) never overwrite each other's bytes, and whichever
    #: manifest lands last names its own intact files.
    in_place = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, url: str,
                 read: Reader) -> None:
        # a filesystem whose paths keep their scheme (http's are whole URLs) has its
        # "//" there, not in the path
        scheme, _, path = root.rpartition("://")
        inside = path.strip("/")
        if inside and "" in inside.split("/"):
            # s3fs lists ``b//run`` as ``b/run`` (it strips the key's leading slash)
            # but reads and writes the key ``/run/...``: such a store never found its
            # own checkpoints, and took another store's steps for its leftovers
            collapsed = (f"{scheme}://" if scheme else "") + "/".join(
                part for part in path.split("/") if part)
            raise ValueError(
                f"checkpoint url={url!r} has an empty path component ('//'), which object "
                f"stores list and write under different keys; expected the path without "
                f"it ({collapsed!r})")
        self.fs = fs
        self.root = root
        self.url = url
        self._read = read
        self._root_ok = False  # the root seen to be a directory once

    # ------------------------------------------------------------------ read
    def _bucket_missing(self) -> str | None:
        """The bucket's name when the root lives in a bucket that does not exist."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (
            self.fs.protocol,)
        if not any(p in ("s3", "s3a", "gs", "gcs") for p in protocols):
            return None
        bucket = self.root.split("/", 1)[0]
        exists = self._read(lambda: self.fs.exists(bucket), f"bucket {bucket!r}")
        return None if exists else bucket

    def check_root(self) -> None:
        if self._root_ok:
            return
        try:
            info = self._read(lambda: self.fs.info(self.root), self.url)
        except FileNotFoundError:
            info = None
        if info is not None and info.get("type") == "file":
            raise NotADirectoryError(errno.ENOTDIR, f"checkpoint url={self.url!r} is a file, "
                                     f"expected a directory (or nothing yet)", self.root)
        if info is None:
            bucket = self._bucket_missing()
            if bucket is not None:
                raise FileNotFoundError(errno.ENOENT, f"checkpoint url={self.url!r}: bucket "
                                        f"{bucket!r} does not exist (create it first)",
                                        self.url)
        else:
            self._root_ok = True  # a directory that exists: no request per save after this

    def list_root(self) -> list[tuple[str, bool]]:
        try:
            self.fs.invalidate_cache(self.root)  # another rank or job may have written
        except Exception:  # pragma: no cover - not every filesystem caches
            pass
        try:
            listing = self._read(lambda: self.fs.ls(self.root, detail=True), self.url)
        except FileNotFoundError:
            self.check_root()
            return []
        if len(listing) == 1 and listing[0].get("type") == "file" and \
                listing[0]["name"].rstrip("/") == self.root.rstrip("/"):
            self.check_root()
        own = self.root.rstrip("/")
        names = [self.fs._strip_protocol(i["name"]).rstrip("/") for i in listing]
        foreign = [n for n in names if n != own and not n.startswith(own + "/")]
        if foreign:
            # an entry named after its own path elsewhere: taken by its base name, it
            # would be read, and deleted, as this store's
            raise CheckpointError(
                f"checkpoint url={self.url!r}: listing {self.root!r} returned "
                f"{foreign[0]!r}, outside it (the filesystem normalizes this path to "
                f"another one); nothing was read or deleted")
        return [(basename(i["name"]), i.get("type") == "directory") for i in listing]

    def open_regular(self, path: str, max_bytes: int | None) -> tuple[IO[bytes], int]:
        info = self.fs.info(path)
        if info.get("type") != "file":
            raise CheckpointCorruptError(f"{path} is a {info.get('type')}, expected a "
                                         f"regular file")
        size = int(info.get("size") or 0)
        check_size(path, size, max_bytes)  # before a byte of it is fetched
        return self.fs.open(path, "rb"), size

    def kept_copy(self) -> io.BytesIO | None:
        return io.BytesIO()  # a remote stream does not outlive a concurrent delete

    def is_dir(self, path: str) -> bool:
        try:
            return bool(self._read(lambda: self.fs.isdir(path), path))
        except FileNotFoundError:
            return False

    def read_small(self, path: str, limit: int) -> bytes:
        return bytes(self.fs.cat_file(path))[:limit]

    # ------------------------------------------------------------------ write
    def commit(self, directory: str, name: str, *, replacing: bool, write: PayloadWrite,
               seal: Seal) -> Manifest:
        """The payload PUT, then the manifest PUT (which is also the atomic switch of
        a re-save: ``replacing`` needs nothing else here)."""
        payload = join(directory, name)
        try:
            f = self.fs.open(payload, "wb")
        except FileNotFoundError:  # a filesystem with real directories (wrapped local)
            self.fs.makedirs(directory, exist_ok=True)
            f = self.fs.open(payload, "wb")
        try:
            entry = write(f, payload, False)
            _completing(f, payload)
        except BaseException:
            discard_upload(f)
            try:
                self.fs.rm_file(payload)
            except Exception:
                pass
            raise
        manifest = seal(name, entry)
        self._put_manifest(directory, manifest)
        if replacing:
            self._check_not_deleted(directory, manifest)
        return manifest

    def _put_manifest(self, directory: str, manifest: Manifest) -> None:
        """The manifest PUT; its failure names the manifest's path."""
        path = join(directory, MANIFEST_NAME)
        try:
            self.fs.pipe_file(path, manifest.to_json().encode("utf-8"))
        except Exception as e:
            raise_named(e, path)

    def _check_not_deleted(self, directory: str, manifest: Manifest) -> None:
        """After a re-save's manifest PUT: every file it names is still there.

        A re-save replaces a committed step, which a prune (of this or another
        process) may delete meanwhile: the PUT would then land on its own, a manifest
        naming files that are gone, and the save would report success. Here the
        manifest just put is removed again (when it is still this save's) and the save
        fails, as its rename into the deleted step does on a local disk."""
        try:
            self.fs.invalidate_cache(directory)
        except Exception:  # pragma: no cover - not every filesystem caches
            pass
        gone = [n for n in manifest.files if not self.fs.exists(join(directory, n))]
        if not gone:
            return
        path = join(directory, MANIFEST_NAME)
        mine = manifest.to_json().encode("utf-8")
        try:
            if bytes(self.fs.cat_file(path)) == mine:
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        raise FileNotFoundError(
            errno.ENOENT, f"checkpoint url={self.url!r}: {directory} was deleted while "
            f"this save replaced it (a prune or another process's retention removed the "
            f"step between the upload and the manifest's PUT; {gone[0]} is gone): the "
            f"save did not land", path)

    # ------------------------------------------------------------------ many writers
    def begin_parts(self, directory: str, *, replacing: bool) -> str:
        """The step directory itself: nothing is committed before the manifest PUT."""
        return directory

    def write_part(self, staging: str, name: str, fill: Fill[T], *,
                   size_hint: int | None = None) -> T:
        """One upload; a failed one is discarded, never completed."""
        path = join(staging, name)
        try:
            f = self.fs.open(path, "wb")
        except FileNotFoundError:  # a filesystem with real directories (wrapped local)
            self.fs.makedirs(staging, exist_ok=True)
            f = self.fs.open(path, "wb")
        try:
            try:
                out = fill(f)
            except Exception as e:
                raise_named(e, path)
            _completing(f, path)
        except BaseException:
            discard_upload(f)
            try:
                self.fs.rm_file(path)
            except Exception:
                pass
            raise
        return out

    def finish_parts(self, staging: str, directory: str, manifest: Manifest, *,
                     replacing: bool) -> None:
        """The manifest PUT, after every part's upload completed."""
        self._put_manifest(directory, manifest)
        if replacing:
            self._check_not_deleted(directory, manifest)

    def abort_parts(self, staging: str, names: list[str], *, replacing: bool) -> None:
        for n in names:
            try:
                self.fs.rm_file(join(staging, n))
            except Exception:
                pass

    def create_once(self, path: str, data: bytes) -> None:
        """One PUT with ``If-None-Match: *`` (fsspec's ``mode="create"``); where the
        filesystem knows no create mode, a plain PUT."""
        try:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except FileNotFoundError:  # a filesystem with real directories (wrapped local)
                self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            pass
        except TypeError:  # a filesystem that knows no create mode: a plain PUT
            self.fs.pipe_file(path, data)
        except OSError as e:
            # S3 answers a lost If-None-Match race with 412 Precondition Failed
            if e.errno != errno.EEXIST and "412" not in str(e):
                raise

    # ------------------------------------------------------------------ remove
    def remove_file(self, path: str) -> None:
        self.fs.rm_file(path)

    def remove_step(self, path: str) -> None:
        """The manifest first (the step is uncommitted from then on), then the rest."""
        try:
            self.fs.rm_file(join(path, MANIFEST_NAME))
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(_literal(path), recursive=True)
        except FileNotFoundError:
            pass

    def leftovers(self) -> list[str]:
        return []  # nothing is written under a temporary name

    def age(self, path: str) -> float | None:
        """The newest modification time of any object under ``path`` (None: none known)."""
        times = [entry_time(i) for i in self.fs.find(path, detail=True).values()]
        known = [t for t in times if t is not None]
        return time.time() - max(known) if known else None

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(_literal(path), recursive=True)
        except Exception as e:
            log.debug("could not remove %s: %r", path, e)

    def _s3(self) -> Any:
        """s3fs's call of the S3 API, where the filesystem is s3fs (else None): only S3
        lists the multipart uploads a killed writer left."""
        call = getattr(self.fs, "call_s3", None)
        return call if callable(call) and callable(getattr(self.fs, "split_path", None)) \
            else None

    def unfinished_uploads(self) -> list[tuple[str, str, float]]:
        call = self._s3()
        if call is None:
            return []
        try:
            bucket, key, _ = self.fs.split_path(self.root)
            prefix = f"{key.strip('/')}/" if key.strip("/") else ""
            found = []
            args: dict[str, Any] = {"Bucket": bucket, "Prefix": f"{prefix}step-"}
            while True:
                page = call("list_multipart_uploads", **args)
                for upload in page.get("Uploads") or []:
                    changed = [upload.get("Initiated")]
                    parts: dict[str, Any] = {"Bucket": bucket, "Key": upload["Key"],
                                             "UploadId": upload["UploadId"]}
                    while True:  # a live writer's newest part is recent
                        listed = call("list_parts", **parts)
                        changed += [p.get("LastModified") for p in listed.get("Parts") or []]
                        if not listed.get("IsTruncated"):
                            break
                        parts["PartNumberMarker"] = listed.get("NextPartNumberMarker")
                    times = [t.timestamp() for t in changed if hasattr(t, "timestamp")]
                    if times:
                        found.append((f"{bucket}/{upload['Key']}", upload["UploadId"],
                                      time.time() - max(times)))
                if not page.get("IsTruncated"):
                    return found
                args.update(KeyMarker=page.get("NextKeyMarker"),
                            UploadIdMarker=page.get("NextUploadIdMarker"))
        except Exception as e:  # no permission to list them, say: cleanup is best effort
            log.debug("could not list the unfinished uploads under %s: %r", self.url, e)
            return []

    def abort_upload(self, path: str, upload: str) -> None:
        call = self._s3()
        if call is None:
            return
        bucket, key, _ = self.fs.split_path(path)
        try:
            call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
        except Exception as e:
            log.debug("could not abort the upload %s of %s: %r", upload, path, e)
