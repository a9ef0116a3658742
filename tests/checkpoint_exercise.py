"""The atomic write's judge (checkpoint.write_atomically): the file system watched while the learner's code runs,
and what a crash at any moment could leave behind.

The crash model is POSIX's: the bytes written to a file reach the disk when that file is fsync'd (os.fsync, or
os.fdatasync), not before; a rename onto `path` (os.replace, os.rename) swaps the name atomically, but may reach
the disk before bytes that were never synced; a write into `path` itself is seen half done. So whatever the code
(a Python file or a raw descriptor, any temporary name), the contract holds when the file renamed onto `path` was
synced with all its bytes before the rename, and nothing removed or wrote `path` on the way.
"""
import os

from grading import mistake
from mini_dist import checkpoint  # looked up at call time: in a check, the learner's copy

# each is made by a wrong solution of tests/bank_checkpoint.py (tests/test_exercise.py holds that)
MISTAKES = {
    "written in place": ("write_atomically", "a write into path itself is seen half done, by a reader or after a "
                         "crash: write the new bytes under another name in path's directory, then rename that "
                         "file onto path (os.replace)"),
    "renamed without fsync": ("write_atomically", "the rename can reach the disk before the bytes do: after a crash "
                              "path names an empty or partial file; os.fsync the new file before renaming it"),
    "fsync before flush": ("write_atomically", "os.fsync syncs what the kernel holds; a Python file keeps small "
                           "writes in its own buffer until f.flush() (or close): flush, then fsync"),
    "fsync after the rename": ("write_atomically", "once renamed, the new name may reach the disk before the bytes "
                               "it names: sync the file first, rename it after"),
    "old file removed first": ("write_atomically", "between the removal and the rename there is no file at path; "
                               "os.replace puts the new file in the old one's place in one step"),
}

CONTRACT = ("when write_atomically returns, path holds the chunks one after another; at every moment, and after a "
            "crash at any moment, whoever opens path finds the old file whole or the new one whole; a chunk that "
            "raises leaves the old file and the error goes on to the caller")
OLD = b"the old file"


def failing_chunks():
    """Chunks that fail half way, as a disk that fills up: the first one given, then an OSError."""
    yield b"the new"
    raise OSError("no space left on device")


def after_a_failure(folder: str) -> str | None:
    """What a writer that fails half way leaves at path, in words, or None when it is the old file and the error
    went on to the caller."""
    path = os.path.join(folder, "rank_00000.bin")
    with open(path, "wb") as f:
        f.write(OLD)
    try:
        checkpoint.write_atomically(path, failing_chunks())
        raised = None
    except OSError as e:
        raised = e
    left = open(path, "rb").read() if os.path.exists(path) else None
    if left != OLD:
        said = f"{left!r}" if left is not None else "no file at all"
        return mistake(MISTAKES, "written in place", f"a chunk raised half way: path then held {said}, not the old "
                       f"file {OLD!r}")
    if raised is None:
        return f"a chunk raised OSError half way, and write_atomically returned as if it had written: {CONTRACT}"
    return None


class Watch:
    """os.fsync, os.fdatasync, os.replace, os.rename, os.remove and os.unlink as the learner's code calls them:
    each sync with the inode and size of the file synced, each rename with its source's, in order."""

    def __init__(self, monkeypatch):
        self.events = []
        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, self.synced(getattr(os, name)))
        for name in ("replace", "rename"):
            monkeypatch.setattr(os, name, self.renamed(getattr(os, name)))
        for name in ("remove", "unlink"):
            monkeypatch.setattr(os, name, self.removed(getattr(os, name)))

    def synced(self, real):
        def sync(fd):
            st = os.fstat(fd)
            self.events.append(("sync", st.st_ino, st.st_size))
            return real(fd)
        return sync

    def renamed(self, real):
        def rename(src, dst, **kwargs):
            st = os.stat(src)
            self.events.append(("rename", st.st_ino, st.st_size, os.path.abspath(dst)))
            return real(src, dst, **kwargs)
        return rename

    def removed(self, real):
        def remove(path, **kwargs):
            self.events.append(("remove", os.path.abspath(path)))
            return real(path, **kwargs)
        return remove


def after_a_write(folder: str, monkeypatch) -> str | None:
    """What the learner's write could leave at path after a crash, judged from the calls it made, or None."""
    path = os.path.abspath(os.path.join(folder, "rank_00000.bin"))
    with open(path, "wb") as f:
        f.write(OLD)
    chunks = [b"the new ", bytearray(b"file, "), memoryview(b"whole")]
    new = b"the new file, whole"
    watch = Watch(monkeypatch)
    checkpoint.write_atomically(path, chunks)
    monkeypatch.undo()
    events = watch.events
    left = open(path, "rb").read()
    if left != new:
        return f"path holds {left!r} once write_atomically returned, not the chunks one after another {new!r}"
    renames = [k for k, e in enumerate(events) if e[0] == "rename" and e[3] == path]
    removed = [k for k, e in enumerate(events) if e[0] == "remove" and e[1] == path]
    if not renames:
        return mistake(MISTAKES, "written in place", "no file was renamed onto path (os.replace): its bytes were "
                       "written into it, where a crash leaves them half done")
    last = renames[-1]
    if removed and removed[0] < last:
        return mistake(MISTAKES, "old file removed first", "path was removed, then the new file renamed onto it: "
                       "a crash in between leaves no checkpoint file at all")
    ino = events[last][1]
    size = events[last][2]
    syncs = [(k, e[2]) for k, e in enumerate(events) if e[0] == "sync" and e[1] == ino]
    before = [s for k, s in syncs if k < last]
    if before and max(before) < size:
        return mistake(MISTAKES, "fsync before flush", f"the new file was synced holding {max(before)} of its {size} "
                       f"bytes: the rest sat in the Python file's buffer, and a crash after the rename can leave "
                       f"path with {max(before)} bytes")
    if not before and syncs:
        return mistake(MISTAKES, "fsync after the rename", "the new file was synced only after it was renamed onto "
                       "path: a crash in between can leave path naming an empty file")
    if not before:
        return mistake(MISTAKES, "renamed without fsync", "the new file was renamed onto path, never synced")
    return None
