"""rl_megatron.checkpoint.atomic: a folder is written into `<target>.incomplete` and renamed to `target` at the end,
a file replaced through a temporary file, so that readers see all or nothing."""
import os

import pytest

from rl_megatron.checkpoint.atomic import finish_partial, partial_path, replace_file, start_partial


def test_partial_path_ignores_a_trailing_slash(tmp_path):
    assert partial_path(f"{tmp_path}/ckpt/") == partial_path(f"{tmp_path}/ckpt") == f"{tmp_path}/ckpt.incomplete"


def test_a_folder_appears_whole_under_its_name_only_when_finished(tmp_path):
    target = str(tmp_path / "ckpt")
    partial = start_partial(target)
    os.makedirs(os.path.join(partial, "shards"))
    (tmp_path / "ckpt.incomplete" / "shards" / "0.bin").write_bytes(b"\x01\x02")
    assert not os.path.exists(target)
    assert finish_partial(target) == target
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert (tmp_path / "ckpt" / "shards" / "0.bin").read_bytes() == b"\x01\x02"


def test_a_leftover_of_an_interrupted_write_is_removed(tmp_path):
    target = str(tmp_path / "out")
    os.makedirs(partial_path(target))
    (tmp_path / "out.incomplete" / "stale.json").write_text("{}")
    assert os.listdir(start_partial(target)) == []
    start_partial(target, create=False)
    assert not os.path.exists(partial_path(target))


def test_replace_decides_what_happens_to_an_existing_target(tmp_path):
    target = str(tmp_path / "step")
    os.makedirs(target)
    (tmp_path / "step" / "old.txt").write_text("old")
    start_partial(target)
    (tmp_path / "step.incomplete" / "new.txt").write_text("new")
    with pytest.raises(OSError):  # a finished folder is never silently overwritten...
        finish_partial(target)
    finish_partial(target, replace=True)  # ...unless asked: the new one wins
    assert os.listdir(target) == ["new.txt"] and not os.path.exists(partial_path(target))


def test_replace_file_leaves_the_new_text_and_no_temporary(tmp_path):
    path = str(tmp_path / "latest.txt")
    replace_file(path, "4\n")
    replace_file(path, "5\n")
    assert open(path).read() == "5\n" and os.listdir(tmp_path) == ["latest.txt"]
