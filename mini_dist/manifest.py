"""A checkpoint's manifest, and the loader's rule for it: trust no field until it is checked.

mini_dist/checkpoint.py writes each rank's boxes as raw bytes to rank_0000r.bin and, last, manifest.json:
which bytes of which file hold which box of which tensor. A checkpoint travels (downloaded, copied, edited
by hand), and a loader that believes its manifest opens whatever file it names and allocates whatever it
asks for: "../../x", "/dev/zero", nbytes = 10^13, a literal nested 10^5 deep. Quieter and worse, a box one
row off: a rank that loads part of a tensor, as a reshard to another world size does, copies the rows the
box claims and gets its neighbour's, with no error. So read_manifest() checks every field, and every piece
of every tensor, before anything is read or allocated, whatever part the load then reads. It refuses in one
line naming the field and the checkpoint, a CheckpointError that checkpoint.load raises on every rank (a
raw error on one rank would leave the others waiting in their next collective):

    version   VERSION: a later format is refused, never misread
    files     {name: size}: plain names (no separator, no "..", no link leading out), regular files of that size
    tensors   {name: [shape, dtype]}: non-negative ints, a dtype of DTYPES
    pieces    [{name, file, offsets, lengths, start, nbytes, crc32}]: a box inside its tensor, nbytes =
              elements x itemsize, [start, start + nbytes) inside its file's real size (os.stat) and no
              other piece's bytes; each tensor's boxes tile it, each element in exactly one box
    objects   {name: Python literal}: at most MAX_LITERAL characters, MAX_DEPTH deep, parsed to "values"

A load then allocates at most the bytes on disk, and reads of a tensor exactly the part it asks for.

    torchrun --standalone --nproc_per_node=1 mini_dist/manifest.py
"""
import ast
import io
import json
import os
import stat
import sys
import tempfile
import tokenize
import zlib
from math import prod
from pathlib import Path

import torch

if not __package__:  # run as `torchrun mini_dist/manifest.py`: Python put mini_dist/ on the path, not the repo
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mini_dist.kit import launch

MANIFEST = "manifest.json"
VERSION = 1
MAX_MANIFEST = 64 << 20  # bytes
MAX_LITERAL = 1 << 20  # characters
MAX_DEPTH = 32  # brackets and unary signs: the depth ast.literal_eval recurses to
DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16", "complex128",
                                                  "complex64", "int64", "int32", "int16", "int8", "uint8", "bool")}
KEYS = {"version", "world_size", "tensors", "objects", "files", "pieces"}
PIECE = {"name", "file", "offsets", "lengths", "start", "nbytes", "crc32"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; raised on every rank, naming ranks and files."""


def overlap(offsets, lengths, other_offsets, other_lengths):
    """The box two boxes share, (offsets, lengths), or None."""
    lo = [max(a, b) for a, b in zip(offsets, other_offsets)]
    hi = [min(a + m, b + n) for a, m, b, n in zip(offsets, lengths, other_offsets, other_lengths)]
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, [h - l for l, h in zip(lo, hi)])


def tiling(boxes) -> tuple:
    """(elements held, whether two boxes share one) of boxes (offsets, lengths), in one sweep along dim 0."""
    held = sum(prod(lengths) for _, lengths in boxes)
    boxes = sorted(boxes, key=lambda box: box[0][:1])
    for i, (o, n) in enumerate(boxes):
        for p, m in boxes[i + 1:]:
            if o and p[0] >= o[0] + n[0]:
                break  # sorted by first row: this box reaches no later one, so not every pair is compared
            if prod(n) > 0 and prod(m) > 0 and overlap(o, n, p, m) is not None:
                return held, True
    return held, False


def literal_text(name: str, value) -> str:
    """repr(value), if ast.literal_eval gives value back: data, never code (pickle would run code on load)."""
    try:
        if ast.literal_eval(text := repr(value)) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    raise ValueError(f"{name!r} is neither a tensor nor a Python literal: {text[:80]}")


def literal_value(name: str, text):
    """ast.literal_eval of the untrusted text of objects[name], once its length and depth are known to be
    small: the parser recurses (a MemoryError at 10^5 signs, a SyntaxError at 200 brackets)."""
    what = f"objects[{name!r:.60}]"
    if not isinstance(text, str) or len(text) > MAX_LITERAL:
        raise ValueError(f"{what} is not a text of at most {MAX_LITERAL:,} characters")
    depth = 0
    signs = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            depth += (token.string in ("(", "[", "{")) - (token.string in (")", "]", "}"))
            signs = signs + 1 if token.string in ("+", "-", "~") else 0
            if depth + signs > MAX_DEPTH:
                raise ValueError(f"nested deeper than {MAX_DEPTH}")
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, tokenize.TokenError) as e:
        reason = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
        raise ValueError(f"{what} is not a Python literal: {reason}") from None


def ints(value, count: int) -> bool:
    """Whether value is a list of `count` non-negative ints (JSON's true is not one)."""
    return isinstance(value, list) and len(value) == count and all(type(x) is int and x >= 0 for x in value)


def real_size(path: str, name: str) -> int:
    """The size on disk of file `name` of checkpoint `path`: a plain name that resolves into `path`, a regular file."""
    where = os.path.join(path, name)
    if set(name) & {"/", "\\", "\0"} or os.path.dirname(os.path.realpath(where)) != os.path.realpath(path):
        raise ValueError(f"files: {name!r:.60} is not a plain file name inside the checkpoint")
    try:
        status = os.stat(where)
    except OSError as e:
        raise ValueError(f"files: {name:.60} cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"files: {name} is not a regular file")
    return status.st_size


def check_piece(i: int, p, tensors: dict, sizes: dict) -> None:
    """Piece i against its tensor and its file: a box inside the tensor, its bytes inside the file."""
    known = isinstance(p, dict) and set(p) == PIECE and all(isinstance(p[k], str) for k in ("name", "file"))
    if not known or p["name"] not in tensors or p["file"] not in sizes:
        raise ValueError(f"pieces[{i}] is not {sorted(PIECE)} of a saved tensor and file: {p!r:.60}")
    shape, dtype = tensors[p["name"]]
    what = f"pieces[{i}] of tensor {p['name']!r} in {p['file']}"
    inside = ints(p["offsets"], len(shape)) and ints(p["lengths"], len(shape))
    if not inside or any(o + n > s for o, n, s in zip(p["offsets"], p["lengths"], shape)):
        raise ValueError(f"{what}: offsets {p['offsets']!r:.60} lengths {p['lengths']!r:.60} are not a box "
                         f"inside its {shape}")
    if type(p["nbytes"]) is not int or p["nbytes"] != prod(p["lengths"]) * DTYPES[dtype].itemsize:
        raise ValueError(f"{what}: nbytes {p['nbytes']!r:.60} is not its elements x {dtype}'s size")
    if type(p["start"]) is not int or p["start"] < 0 or type(p["crc32"]) is not int or p["crc32"] >> 32:
        raise ValueError(f"{what}: start {p['start']!r:.60} and crc32 {p['crc32']!r:.60} are not unsigned ints")
    if p["start"] + p["nbytes"] > sizes[p["file"]]:
        raise ValueError(f"{what}: bytes [{p['start']}, {p['start'] + p['nbytes']}) end past the end of the "
                         f"file ({sizes[p['file']]} B): the file is truncated")


def check(manifest, path: str) -> dict:
    """`manifest`, every field checked against checkpoint `path` (else a ValueError), its literals in "values"."""
    if not isinstance(manifest, dict):
        raise ValueError(f"the manifest is {manifest!r:.60}, not a JSON object")
    if manifest.get("version") != VERSION:
        raise ValueError(f"version is {manifest.get('version')!r:.60}: this mini_dist reads version {VERSION}")
    kinds = {"files": dict, "tensors": dict, "objects": dict, "pieces": list}
    if set(manifest) != KEYS or not all(isinstance(manifest[k], kind) for k, kind in kinds.items()):
        raise ValueError(f"the fields are {sorted(manifest)!r:.60}, not {sorted(KEYS)} of their types")
    if type(manifest["world_size"]) is not int or manifest["world_size"] != len(manifest["files"]):
        raise ValueError(f"world_size {manifest['world_size']!r:.60} is not the number of files, one per rank")
    sizes = {name: real_size(path, name) for name in manifest["files"]}
    for name, saved in manifest["tensors"].items():
        if not (isinstance(saved, list) and len(saved) == 2 and isinstance(saved[0], list)
                and ints(saved[0], len(saved[0])) and len(saved[0]) <= 64
                and isinstance(saved[1], str) and saved[1] in DTYPES):
            raise ValueError(f"tensors[{name!r:.60}]: {saved!r:.60} is not [shape, one of {sorted(DTYPES)}]")
    for i, piece in enumerate(manifest["pieces"]):
        check_piece(i, piece, manifest["tensors"], sizes)
    for name, size in sizes.items():  # after the pieces, which name the tensor a truncation cut
        if type(manifest["files"][name]) is not int or manifest["files"][name] != size:
            raise ValueError(f"files: {name} is {size} B on disk, {manifest['files'][name]!r:.60} when saved")
    extents = sorted((p["file"], p["start"], p["start"] + p["nbytes"], i) for i, p in enumerate(manifest["pieces"]))
    for (file, _, end, i), (other, start, _, j) in zip(extents, extents[1:]):
        if file == other and start < end:
            raise ValueError(f"pieces[{i}] and pieces[{j}] share bytes of {file}")
    for name, (shape, _) in manifest["tensors"].items():
        held, twice = tiling([(p["offsets"], p["lengths"]) for p in manifest["pieces"] if p["name"] == name])
        if held != prod(shape) or twice:
            raise ValueError(f"pieces of tensor {name!r:.60} hold {held} elements of its {prod(shape)}"
                             f"{', some twice' if twice else ''}")
    return {**manifest, "values": {name: literal_value(name, text) for name, text in manifest["objects"].items()}}


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, every field checked; a one-line CheckpointError otherwise."""
    file = os.path.join(path, MANIFEST)
    try:
        if not os.path.exists(file):
            raise ValueError(f"has no {MANIFEST}: not a complete checkpoint (an unfinished save); load an earlier one")
        real_size(path, MANIFEST)  # a regular file in `path`: not a fifo, not /dev/zero
        with open(file, "rb") as f:
            text = f.read(MAX_MANIFEST + 1)
        if len(text) > MAX_MANIFEST:
            raise ValueError(f"{MANIFEST} is longer than {MAX_MANIFEST:,} B")
        try:
            manifest = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{MANIFEST} is not JSON: {str(e).splitlines()[0][:80]}") from None
        return check(manifest, path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} {'' if 'has no' in str(e) else 'refused: '}{e}") from None


# ----------------------------------------------------------------------------- demo

def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--nbytes", type=int, default=10 ** 13, help="the bytes an edited piece asks for")
    p.add_argument("--nested", type=int, default=100_000, help="how deep an edited literal nests")
    return p


def write_example(path: str) -> None:
    """A checkpoint by hand, as checkpoint.save writes one at K = 1: a 2x3 fp32 tensor and a literal."""
    raw = torch.arange(6, dtype=torch.float32).numpy().tobytes()  # cpu: bytes for a file
    piece = {"name": "w", "file": "rank_00000.bin", "offsets": [0, 0], "lengths": [2, 3], "start": 0,
             "nbytes": len(raw), "crc32": zlib.crc32(raw)}
    Path(path, "rank_00000.bin").write_bytes(raw)
    Path(path, MANIFEST).write_text(json.dumps({
        "version": VERSION, "world_size": 1, "tensors": {"w": [[2, 3], "float32"]}, "objects": {"step": "7"},
        "files": {"rank_00000.bin": len(raw)}, "pieces": [piece]}))


def edits(nbytes: int, nested: int) -> dict:
    """Edits a manifest from elsewhere may carry: believed, each is a raw error, an allocation, a read
    outside the checkpoint or, for the box one row off, the wrong rows loaded without a word."""
    return {"a file outside": ("pieces", "file", "../../etc/passwd"),
            "nbytes negative": ("pieces", "nbytes", -24),
            f"nbytes {nbytes:.0e}": ("pieces", "nbytes", nbytes),
            "offsets a string": ("pieces", "offsets", "0, 0"),
            "a box one row off": ("pieces", "offsets", [1, 0]),
            f"a literal nested {nested:.0e} deep": ("objects", "step", "[" * nested + "]" * nested),
            "an unknown dtype": ("tensors", "w", [[2, 3], "float128"]),
            "version 2": (None, "version", 2)}


def edit(path: str, where, key, value) -> None:
    """Set one field of the example's manifest: a top-level one (where None), its piece's, or its tensor's."""
    manifest = json.loads(Path(path, MANIFEST).read_text())
    if where is None:
        target = manifest
    elif where == "pieces":
        target = manifest["pieces"][0]
    else:
        target = manifest[where]
    if where == "pieces" and key == "file":
        manifest["files"] = {value: 24}
    target[key] = value
    Path(path, MANIFEST).write_text(json.dumps(manifest))


def demo(args) -> int:
    launch.require(args.nested >= 1, "--nested must be at least 1")
    launch.setup()
    refused = 0
    changes = edits(args.nbytes, args.nested)
    with tempfile.TemporaryDirectory(prefix="mini_dist_manifest_") as path:
        write_example(path)
        ok = read_manifest(path)["values"] == {"step": 7}
        launch.print0(f"a hand-written checkpoint (2x3 fp32, step = 7) reads back: {ok}; each edit is refused:")
        for what, change in changes.items():
            write_example(path)
            edit(path, *change)
            try:
                read_manifest(path)
                launch.print0(f"  {what:<27} ACCEPTED")
            except CheckpointError as e:
                refused += 1
                launch.print0(f"  {what:<27} {str(e).split(' refused: ', 1)[-1][:90]}")
    return launch.conclude("manifest", ok and refused == len(changes), "every field checked before a byte is read",
                           refused == len(changes), f"{refused}/{len(changes)} edited manifests refused in one line")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
