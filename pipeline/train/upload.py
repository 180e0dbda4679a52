"""Checkpoint uploads that survive an object store refusing or dropping writes for a while.

Ray Train uploads a reported checkpoint with one `pyarrow.fs.copy_files` (whose S3 client
retries a failed request 3 times within a second or so) and registers it only once the upload has
returned; an error fails the worker. Here the whole folder is copied again with exponential
backoff (1 s, 2 s, ... at most 30 s apart) until `checkpoint.upload_retry_s` has passed, and
after each copy the sizes in the store are compared with the local files. So an outage delays the
upload (the loop goes on if the upload is asynchronous) and says so in the log; the checkpoint is
registered only complete, and a folder an outage leaves half-written is never registered (Ray
Train takes a checkpoint from what this function returns, and a later copy overwrites the
folder). Past the retry time the worker fails and Ray Train restarts from the previous checkpoint.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

FIRST_WAIT_S, MAX_WAIT_S = 1.0, 30.0


class CheckpointUploadError(OSError):
    """The object store took no complete copy of a checkpoint within the retry time."""


def with_retries(copy: Callable[[], None], what: str, retry_s: float, *, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> int:
    """Call `copy()` until it returns without an `OSError`, waiting 1, 2, 4, ... (at most 30) s in
    between, for at most `retry_s` seconds; the number of attempts. The last error is raised as
    `CheckpointUploadError` once the next wait would pass `retry_s`."""
    start, wait, attempt = clock(), FIRST_WAIT_S, 1
    while True:
        try:
            copy()
        except OSError as e:
            elapsed = clock() - start
            if elapsed + wait > retry_s:
                raise CheckpointUploadError(
                    f"{what}: the object store took no complete copy in {attempt} attempt(s) over {elapsed:.0f} s "
                    f"(checkpoint.upload_retry_s={retry_s:g}); last error: {e}") from e
            log.warning("checkpoint upload: %s failed (attempt %d: %s); retrying in %.0f s (for up to "
                        "checkpoint.upload_retry_s=%g s); the checkpoint is registered only once complete",
                        what, attempt, str(e).splitlines()[0][:200], wait, retry_s)
            sleep(wait)
            wait, attempt = min(wait * 2, MAX_WAIT_S), attempt + 1
            continue
        if attempt > 1:
            log.warning("checkpoint upload: %s complete after %d attempts (%.0f s)", what, attempt, clock() - start)
        return attempt


def copy_verified(local_dir: str, fs: Any, dest: str) -> None:
    """Copy the local folder to `dest` on the pyarrow file system `fs`, then check that every file
    is there with its size (an `OSError` otherwise)."""
    import pyarrow.fs as pafs

    files = {p.relative_to(local_dir).as_posix(): p.stat().st_size for p in Path(local_dir).rglob("*") if p.is_file()}
    fs.create_dir(dest)
    pafs.copy_files(local_dir, dest, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    infos = fs.get_file_info([f"{dest}/{rel}" for rel in files])
    wrong = [rel for (rel, size), info in zip(files.items(), infos)
             if info.type != pafs.FileType.File or info.size != size]
    if wrong:
        raise OSError(f"incomplete copy in {dest}: {', '.join(wrong)} missing or of the wrong size")


def ray_upload_fn(retry_s: float) -> Callable[[Any, str], Any]:
    """A `checkpoint_upload_fn` for `ray.train.report`: the checkpoint copied to where Ray Train
    would put it (`<run folder>/<dir_name>` on its storage file system), with retries."""

    def upload(checkpoint: Any, dir_name: str) -> Any:
        import ray.train

        storage = ray.train.get_context().get_storage()
        fs, dest = storage.storage_filesystem, f"{storage.experiment_fs_path}/{dir_name}"
        with checkpoint.as_directory() as local:
            with_retries(lambda: copy_verified(local, fs, dest), f"{dir_name} to {dest}", retry_s)
        return ray.train.Checkpoint(filesystem=fs, path=dest)

    return upload
