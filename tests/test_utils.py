"""Atomic outputs: whole or absent, and readable like any other file once finished."""

from __future__ import annotations

import stat

import pytest

from selfrag_jax.utils import atomic_dir, atomic_file


def test_atomic_outputs_get_the_umask_permissions_not_tempfiles(tmp_path):
    with atomic_file(tmp_path / "out.json") as f:
        f.write("{}")
    with atomic_dir(tmp_path / "folder") as d:
        (d / "x").write_text("x")
    plain_file, plain_dir = tmp_path / "plain.json", tmp_path / "plain"
    plain_file.write_text("{}")
    plain_dir.mkdir()
    # what open() and mkdir() give (tempfile alone gives 0600 and 0700)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == stat.S_IMODE(plain_file.stat().st_mode)
    assert stat.S_IMODE((tmp_path / "folder").stat().st_mode) == stat.S_IMODE(plain_dir.stat().st_mode)
    assert (tmp_path / "out.json").read_text() == "{}" and (tmp_path / "folder" / "x").read_text() == "x"


def test_atomic_file_leaves_nothing_when_the_block_fails(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "out.json") as f:
            f.write("half")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
