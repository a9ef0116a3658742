"""A checkpoint's manifest, and the loader's rule for it: trust no field until it is checked.

mini_dist/checkpoint.py writes each rank's boxes as raw bytes to rank_0000r.bin and, last, manifest.json:
which bytes of which file hold which box of which tensor. A checkpoint travels (downloaded, copied between
machines, edited by hand), and a loader that believes its manifest opens whatever file it names and
allocates whatever it asks for: "../../x", "/dev/zero", nbytes = 10^13, offsets that are a string, a literal
nested 10^5 deep. Worse, a raw error on one rank leaves the others waiting in the next collective. So
read_manifest() checks every field before anything is read or allocated, and refuses in one line that names
the field and the checkpoint (a CheckpointError, which checkpoint.load raises on every rank):

    version   VERSION: a later format is refused, never misread
    files     {name: size}: a plain name in the directory (no separator, no "..", no link leading out), a
              regular file
    tensors   {name: [shape, dtype]}: non-negative ints, a dtype of DTYPES
    pieces    [{name, file, offsets, lengths, start, nbytes, crc32}]: the box inside its tensor, nbytes =
              elements x itemsize, [start, start + nbytes) inside its file's real size (os.stat) and no
              other piece's bytes, each tensor's boxes holding each element once
    objects   {name: Python literal}: at most MAX_LITERAL characters, MAX_DEPTH deep, parsed to "values"

What a load allocates is then bounded by the bytes really on disk: each element of a tensor is in one box,
each box in its own bytes of a real file.

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

MANIFEST, VERSION = "manifest.json", 1
MAX_MANIFEST, MAX_LITERAL, MAX_DEPTH = 64 << 20, 1 << 20, 32  # bytes, characters, brackets and signs
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
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
    """(elements held, whether two boxes share one) of boxes (offsets, lengths). A sweep along dim 0:
    a box is compared only with the boxes whose rows it reaches, not with every other."""
    held, twice, boxes = sum(prod(n) for _, n in boxes), False, sorted(boxes, key=lambda b: b[0][:1])
    for i, (o, n) in enumerate(boxes):
        for p, m in boxes[i + 1:]:
            if o and p[0] >= o[0] + n[0]:
                break
            twice = twice or prod(n) > 0 and prod(m) > 0 and overlap(o, n, p, m) is not None
    return held, twice


def literal_text(name: str, value) -> str:
    """repr(value), if ast.literal_eval gives value back: data, never code (pickle would run code on load)."""
    try:
        if ast.literal_eval(text := repr(value)) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    raise ValueError(f"{name!r} is neither a tensor nor a Python literal: {text[:80]}")


def literal_value(text):
    """ast.literal_eval of untrusted text, once its length and depth are known to be small: the parser
    recurses (a MemoryError at 10^5 signs, a SyntaxError at 200 brackets), so it only sees bounded text."""
    if not isinstance(text, str) or len(text) > MAX_LITERAL:
        raise ValueError(f"is not a text of at most {MAX_LITERAL:,} characters")
    depth = signs = deepest = 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            depth += (token.string in ("(", "[", "{")) - (token.string in (")", "]", "}"))
            signs = signs + 1 if token.string in ("+", "-", "~") else 0
            deepest = max(deepest, depth + signs)
            if deepest > MAX_DEPTH:
                raise ValueError(f"is nested deeper than {MAX_DEPTH}")
        return ast.literal_eval(text)
    except (SyntaxError, TypeError, MemoryError, RecursionError, tokenize.TokenError) as e:
        raise ValueError(f"is not a Python literal: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__}")


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def ints(value, count: int) -> bool:
    return isinstance(value, list) and len(value) == count and all(type(x) is int and x >= 0 for x in value)


def real_sizes(path: str, files) -> dict:
    """{file: its size on disk} of each file the manifest names: plain names, regular files, in `path`."""
    home, sizes = os.path.realpath(path), {}
    for name, size in files.items():
        plain = 0 < len(name) <= 255 and name not in (".", "..") and not set(name) & {"/", "\\", "\0"}
        where = os.path.join(path, name) if plain else ""
        if not plain or os.path.dirname(os.path.realpath(where)) != home:
            raise ValueError(f"files: {short(name)} is not a plain file name inside the checkpoint")
        try:
            status = os.stat(where)
        except OSError as e:
            raise ValueError(f"files: {name} cannot be opened: {e.strerror}") from None
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"files: {name} is not a regular file")
        sizes[name] = status.st_size
    return sizes


def check(manifest, path: str) -> dict:
    """`manifest` with every field checked against the files of checkpoint `path` (ValueError otherwise)
    and its literals parsed into manifest["values"]."""
    if not isinstance(manifest, dict):
        raise ValueError(f"the manifest is {short(manifest)}, not a JSON object")
    if manifest.get("version") != VERSION:
        raise ValueError(f"version is {short(manifest.get('version'))}: this mini_dist reads version {VERSION}")
    kinds = {"files": dict, "tensors": dict, "objects": dict, "pieces": list}
    if set(manifest) != KEYS or not all(isinstance(manifest[k], kind) for k, kind in kinds.items()):
        raise ValueError(f"the fields are {short(sorted(manifest))}, not {sorted(KEYS)} of their types")
    if type(manifest["world_size"]) is not int or manifest["world_size"] != len(manifest["files"]):
        raise ValueError(f"world_size {short(manifest['world_size'])} is not the number of files, one per rank")
    sizes, tensors = real_sizes(path, manifest["files"]), manifest["tensors"]
    for name, saved in tensors.items():
        if not (isinstance(saved, list) and len(saved) == 2 and isinstance(saved[0], list)
                and ints(saved[0], len(saved[0])) and len(saved[0]) <= 64 and saved[1] in DTYPES):
            raise ValueError(f"tensors[{short(name)}]: {short(saved)} is not [shape, one of {sorted(DTYPES)}]")
    boxes, extents = {name: [] for name in tensors}, []
    for i, p in enumerate(manifest["pieces"]):
        if not isinstance(p, dict) or set(p) != PIECE or p["name"] not in tensors or p["file"] not in sizes:
            raise ValueError(f"pieces[{i}] is not {sorted(PIECE)} of a saved tensor and file: {short(p)}")
        (shape, dtype), what = tensors[p["name"]], f"pieces[{i}] of tensor {p['name']!r} in {p['file']}"
        if not ints(p["offsets"], len(shape)) or not ints(p["lengths"], len(shape)) or any(
                o + n > s for o, n, s in zip(p["offsets"], p["lengths"], shape)):
            raise ValueError(f"{what}: offsets {short(p['offsets'])} lengths {short(p['lengths'])} are not a box "
                             f"inside its {shape}")
        if type(p["nbytes"]) is not int or p["nbytes"] != prod(p["lengths"]) * DTYPES[dtype].itemsize:
            raise ValueError(f"{what}: nbytes {short(p['nbytes'])} is not its elements x {dtype}'s size")
        if type(p["start"]) is not int or p["start"] < 0 or type(p["crc32"]) is not int or p["crc32"] >> 32:
            raise ValueError(f"{what}: start {short(p['start'])} and crc32 {short(p['crc32'])} are not unsigned ints")
        if p["start"] + p["nbytes"] > sizes[p["file"]]:
            raise ValueError(f"{what}: bytes [{p['start']}, {p['start'] + p['nbytes']}) end past the end of the "
                             f"file ({sizes[p['file']]} B, {manifest['files'][p['file']]} when saved): the file is "
                             f"truncated")
        boxes[p["name"]].append((p["offsets"], p["lengths"]))
        extents.append((p["file"], p["start"], p["start"] + p["nbytes"], i))
    for name, size in sizes.items():  # after the pieces, which name the tensor a truncation cut
        if manifest["files"][name] != size or type(manifest["files"][name]) is not int:
            raise ValueError(f"files: {name} is {size} B on disk, {short(manifest['files'][name])} when saved")
    extents.sort()
    for (file, _, end, i), (other, start, _, j) in zip(extents, extents[1:]):
        if file == other and start < end:
            raise ValueError(f"pieces[{i}] and pieces[{j}] share bytes of {file}")
    for name, (shape, _) in tensors.items():
        held, twice = tiling(boxes[name])
        if held != prod(shape) or twice:
            raise ValueError(f"pieces of tensor {short(name)} hold {held} elements of its {prod(shape)}"
                             f"{', some twice' if twice else ''}")
    values = {}
    for name, text in manifest["objects"].items():
        try:
            values[name] = literal_value(text)
        except ValueError as e:
            raise ValueError(f"objects[{short(name)}] {e}") from None
    return {**manifest, "values": values}


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`, every field checked; a one-line CheckpointError otherwise."""
    file = os.path.join(path, MANIFEST)
    try:
        if not os.path.exists(file):
            raise ValueError(f"has no {MANIFEST}: not a complete checkpoint (its save never finished); load an "
                             f"earlier one")
        real_sizes(path, {MANIFEST: os.path.getsize(file)})  # a regular file in `path`: not a fifo, not /dev/zero
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

def write_example(path: str) -> None:
    """A checkpoint by hand, as checkpoint.save writes one at K = 1: a 2x3 fp32 tensor and a literal."""
    raw = torch.arange(6, dtype=torch.float32).numpy().tobytes()  # cpu: bytes for a file
    Path(path, "rank_00000.bin").write_bytes(raw)
    Path(path, MANIFEST).write_text(json.dumps({
        "version": VERSION, "world_size": 1, "tensors": {"w": [[2, 3], "float32"]}, "objects": {"step": "7"},
        "files": {"rank_00000.bin": len(raw)}, "pieces": [{"name": "w", "file": "rank_00000.bin", "offsets": [0, 0],
                                                           "lengths": [2, 3], "start": 0, "nbytes": len(raw),
                                                           "crc32": zlib.crc32(raw)}]}))


def edits(nbytes: int, nested: int) -> dict:
    """What the issue measured, each a raw error, an allocation or an outside read before the checks."""
    return {"a file outside": ("pieces", "file", "../../etc/passwd"), "nbytes negative": ("pieces", "nbytes", -24),
            f"nbytes {nbytes:.0e}": ("pieces", "nbytes", nbytes), "offsets a string": ("pieces", "offsets", "0, 0"),
            f"a literal nested {nested:.0e} deep": ("objects", "step", "[" * nested + "]" * nested),
            "an unknown dtype": ("tensors", "w", [[2, 3], "float128"]), "version 2": (None, "version", 2)}


def edit(path: str, where, key, value) -> None:
    manifest = json.loads(Path(path, MANIFEST).read_text())
    target = manifest if where is None else manifest[where][0] if where == "pieces" else manifest[where]
    if where == "pieces" and key == "file":
        manifest["files"] = {value: 24}
    target[key] = value
    Path(path, MANIFEST).write_text(json.dumps(manifest))


def parser():
    p = launch.demo_parser(__doc__)
    p.add_argument("--nbytes", type=int, default=10 ** 13, help="the bytes an edited piece asks for")
    p.add_argument("--nested", type=int, default=100_000, help="how deep an edited literal nests")
    return p


def demo(args) -> int:
    launch.require(args.nested >= 1, "--nested must be at least 1")
    launch.setup()
    refused, EDITS = 0, edits(args.nbytes, args.nested)
    with tempfile.TemporaryDirectory(prefix="mini_dist_manifest_") as path:
        write_example(path)
        ok = read_manifest(path)["values"] == {"step": 7}
        launch.print0(f"a hand-written checkpoint (2x3 fp32, step = 7) reads back: {ok}; each edit is refused:")
        for what, change in EDITS.items():
            write_example(path)
            edit(path, *change)
            try:
                read_manifest(path)
                launch.print0(f"  {what:<27} ACCEPTED")
            except CheckpointError as e:
                refused += 1
                launch.print0(f"  {what:<27} {str(e).split(' refused: ', 1)[-1][:90]}")
    return launch.conclude("manifest", ok and refused == len(EDITS), "every field checked before a byte is read",
                           refused == len(EDITS), f"{refused}/{len(EDITS)} edited manifests refused in one line")


if __name__ == "__main__":
    raise SystemExit(launch.main(parser(), demo))
