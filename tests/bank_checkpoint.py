"""The atomic write: the exercise's bank (kit/exercise.py); MISTAKES: tests/checkpoint_exercise.py."""
from mini_dist.kit import exercise
from mini_dist.kit.exercise import planted

HINTS = {
    "write_atomically": [
        "A reader must never see path half written, so the new bytes cannot go into path while they are being "
        "written. Which operation of the file system changes what a name points to in one step?",
        "Write the chunks to a file of another name in path's directory (a rename is atomic only within one file "
        "system), then os.replace it onto path. A chunk that raises stops you before the rename: path was never "
        "touched.",
        "After a crash the rename may be on disk while the bytes it names are not: before os.replace, f.flush() "
        "(Python's buffer to the kernel) and os.fsync(f.fileno()) (the kernel's to the disk).",
    ],
}

RIGHT = {
    "a Python file beside path, flushed and synced inside its with block, then os.replace": {
        "write_atomically": """
            part = f"{path}.part"
            with open(part, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, path)
        """,
    },
    "a raw descriptor (no Python buffer), every byte written, os.rename, the partial file removed on error": {
        "write_atomically": """
            part = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}")
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    while len(view):
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                os.remove(part)
                raise
            os.close(fd)
            os.rename(part, path)
        """,
    },
    "the chunks joined, written once, closed, then synced through a descriptor of its own (fdatasync)": {
        "write_atomically": """
            tmp = path + ".new"
            data = b"".join(bytes(memoryview(chunk).cast("B")) for chunk in chunks)
            with open(tmp, "wb") as f:
                f.write(data)
            fd = os.open(tmp, os.O_RDONLY)
            os.fdatasync(fd)
            os.close(fd)
            os.replace(tmp, path)
        """,
    },
}

# mini_dist's own atomic write: the wrong solutions below (but the first) plant one mistake each in it
PLAIN = exercise.answers("checkpoint")["write_atomically"]
FLUSHED = "f.flush()"
SYNCED = "os.fsync(f.fileno())"
RENAMED = 'os.replace(path + ".tmp", path)'

WRONG = {
    "the chunks written straight into path, synced": ("written in place", {
        "write_atomically": planted(PLAIN, {'with open(path + ".tmp", "wb") as f:': 'with open(path, "wb") as f:',
                                            RENAMED: ""}),
    }),
    "a temporary file renamed onto path, never synced": ("renamed without fsync", {
        "write_atomically": planted(PLAIN, {FLUSHED: "", SYNCED: ""}),
    }),
    "os.fsync while the bytes still sit in the Python file's buffer": ("fsync before flush", {
        "write_atomically": planted(PLAIN, {FLUSHED: ""}),
    }),
    "renamed first, synced after": ("fsync after the rename", {
        "write_atomically": planted(PLAIN, {
            FLUSHED: "",
            SYNCED: "",
            RENAMED: RENAMED + "\nfd = os.open(path, os.O_RDONLY)\nos.fsync(fd)\nos.close(fd)"}),
    }),
    "the old file removed, then the synced new one renamed into its place": ("old file removed first", {
        "write_atomically": planted(PLAIN, {
            RENAMED: 'if os.path.exists(path):\n    os.remove(path)\nos.rename(path + ".tmp", path)'}),
    }),
}
