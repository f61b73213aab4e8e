"""Folders and files that appear whole or not at all: a folder is written into `<target>.incomplete`, every file
and folder in it fsynced, then renamed to `target` (and the rename made durable); a file is written beside its
target, fsynced and renamed over it. A crash at any point leaves `target` as it was, plus at most a `.incomplete`
folder that the next write to the same target removes."""
from __future__ import annotations

import os
import shutil

PARTIAL_SUFFIX = ".incomplete"


def partial_path(target: str) -> str:
    """The folder `target` is written into before it is renamed: `<target>.incomplete`."""
    return target.rstrip("/") + PARTIAL_SUFFIX


def start_partial(target: str, create: bool = True) -> str:
    """`partial_path(target)`, emptied of what an interrupted write left there and, with `create`, made anew.
    Returns it."""
    partial = partial_path(target)
    shutil.rmtree(partial, ignore_errors=True)
    if create:
        os.makedirs(partial)
    return partial


def finish_partial(target: str, replace: bool = False) -> str:
    """Make everything written into `partial_path(target)` durable, rename it to `target` and make the rename
    durable. With `replace` an existing `target` is deleted first (otherwise the rename fails on a folder that is
    not empty). Returns `target`."""
    partial = partial_path(target)
    fsync_tree(partial)
    if replace and os.path.exists(target):
        shutil.rmtree(target)
    os.rename(partial, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
    return target


def replace_file(path: str, text: str) -> None:
    """Replace `path` with `text` so that a reader sees either the old or the new content, never a part."""
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_tree(folder: str) -> None:
    """fsync every file and folder under `folder` (itself included)."""
    for parent, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(parent)


def fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
