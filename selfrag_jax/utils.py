"""Small shared utilities: atomic outputs and progress reporting.

Every output of the project (checkpoints, indexes, prediction files) is written under a
temporary name and renamed into place, so an interrupted run never leaves a half-written
result that a later run could mistake for a finished one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import secrets
import sys
from pathlib import Path
from typing import Iterator

def _unique_sibling(target: Path, make) -> Path:
    """`make(path)` on a fresh hidden sibling name of `target`; returns the path. Created with
    os.mkdir / os.open's default modes, so a finished output gets the umask's permissions
    (tempfile's 0600 / 0700 kept results private to their writer on shared file systems)."""
    while True:
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            make(tmp)
            return tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `out_dir` in one rename."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(out, os.mkdir)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FileExistsError(f"{out}: already exists")
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(trash)
        tmp.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(out)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", **kwargs):
    """Open a temporary sibling file; it replaces `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(path, lambda p: os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)))
    try:
        with open(tmp, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def progress(iterable=None, total=None, desc: str = "", unit: str = "it", disable: bool | None = None, **kwargs):
    """A tqdm bar (rate and ETA) on terminals; periodic plain lines when output is a file."""
    from tqdm.auto import tqdm

    if disable is None:
        disable = bool(os.environ.get("SELFRAG_NO_PROGRESS"))
    mininterval = 0.5 if sys.stderr.isatty() else 10.0
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=disable, mininterval=mininterval,
                dynamic_ncols=True, **kwargs)


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed), imported on first
    use so that `import selfrag_jax` stays light."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
