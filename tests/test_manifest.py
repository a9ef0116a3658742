"""The loader trusts nothing in a manifest (mini_dist/manifest.py): a manifest edited field by field, raw
garbage, an empty file, a directory, a link leading out, a missing file: each is refused with one line that
names the field and the checkpoint, before anything is read or allocated, and the state asked for is left
as it was. Whatever part of the state the load asks for: all of it, or the part one rank of a reshard reads
(its rows, a flat range, a tensor-parallel slice, at a world size of 1-5, of some of the values). A box
moved by one row is refused even by a rank whose rows it does not hold, and each check of the manifest has
an edit that it alone refuses (test_each_check_refuses_the_edit_only_it_catches_naming_the_field).

The memory bound: while the loader runs, the process's address space is capped (RLIMIT_AS) at its size plus
MEMORY_SLACK. A loader that believed nbytes = 10^13, or a shape of 10^12 elements, would ask for more and
fail with a MemoryError or RuntimeError, which fails the property; without the cap Linux would overcommit a
10 GB torch.empty, the read would come up short, and the loader would look as if it had refused cleanly.
Most properties run in this process, on a checkpoint saved by a world of one (a gloo group of one rank over
a HashStore); two examples run on two ranks and check that every rank refuses.
"""
import json
import os
import resource
import shutil
import tempfile
from contextlib import contextmanager
from math import prod

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import device, run
from mini_dist import checkpoint, manifest
from mini_dist.checkpoint_plan import Sharded
from mini_dist.manifest import CheckpointError
from test_checkpoint import cut

MEMORY_SLACK = 512 << 20
JUNK = [-1, -(2 ** 40), 10 ** 13, 2 ** 64, 1.5, None, True, "", "../x", "/etc/passwd", "0; 0", "x" * 300,
        [], [[]], {}, [-1, -1], ["0"], {"a": 1}, "[" * 100_000, "(" * 40 + ")" * 40, "__import__('os')"]
TENSORS = {"w": torch.arange(12.0).view(4, 3),  # cpu: this process's group is gloo
           "v": torch.arange(12, dtype=torch.float64).view(3, 4) / 8,  # cpu: as w
           "step": torch.tensor(7),  # cpu: as w
           "ids": torch.arange(5, dtype=torch.int32)}  # cpu: as w
RUN = {"epoch": 3, "losses": [0.5, 0.25]}
NAMES = ("w", "v", "step", "ids", "run")
WHOLE = ("whole", 0, 1, NAMES)
ROWS_2_3 = ("rows", 1, 2, ("w",))  # rank 1 of a reshard to 2 ranks: rows 2-3 of w, read from pieces[1] alone
# what a refusal's message starts with after "refused: ": the field it names
FIELDS = ("the manifest is", "version", "the fields are", "world_size", "files", "tensors[", "pieces", "objects[",
          checkpoint.MANIFEST)


@contextmanager
def memory_bounded(slack: int = MEMORY_SLACK):
    """The address space capped at what the process maps now plus `slack`, for the duration."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + slack, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved by a world of one rank in this process (pieces[0-6], in one file):

        pieces[0, 1]     w [4, 3] fp32 in rows 0 and 1-3: the tensor whose rows a box one row off swaps
        pieces[2, 3, 4]  v [3, 4] fp64 in the column slices of tensor parallelism at T = 3: 1, 1, 2 columns
        pieces[5, 6]     step, a scalar; ids, a vector of int32; and the literal run

    The group stays for the module's loads, then goes."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    path = str(tmp_path_factory.mktemp("manifest") / "step_1")
    w = TENSORS["w"]
    v = TENSORS["v"]
    checkpoint.save({"w": Sharded((4, 3), w.dtype, (((0, 0), w[:1]), ((1, 0), w[1:]))),
                     "v": Sharded((3, 4), v.dtype, tuple(((0, a), v[:, a:b]) for a, b in ((0, 1), (1, 2), (2, 4)))),
                     "step": TENSORS["step"], "ids": TENSORS["ids"], "run": RUN}, path)
    yield path
    dist.destroy_process_group()


def wanted(part=WHOLE) -> dict:
    """Zeros shaped as the part of the saved state that one rank asks for: (layout, rank, world, names),
    the layout one of test_checkpoint's cuts (whole, rows, flat, cols)."""
    layout, rank, world, names = part
    state = {n: cut(torch.zeros_like(TENSORS[n]), layout, rank, world) for n in names if n in TENSORS}
    if "run" in names:
        state["run"] = None
    return state


def boxes_of(state: dict) -> list:
    """(name, offsets, data) of every box in a state; a plain tensor is one box at 0."""
    return [(n, o, d) for n, v in state.items() if isinstance(v, Sharded) for o, d in v.boxes] + [
        (n, (0,) * v.dim(), v) for n, v in state.items() if isinstance(v, torch.Tensor)]


def refused_cleanly(path: str, part=WHOLE) -> str:
    """Load `part` of `path` under the memory cap; the one-line CheckpointError it raises, which names the
    checkpoint and a field, the state left as it was (zeros, the literal None)."""
    state = wanted(part)
    with memory_bounded(), pytest.raises(CheckpointError) as refusal:
        checkpoint.load(state, path)
    message = str(refusal.value)
    assert "\n" not in message and path in message, message
    named = message.split(" refused: ", 1)[-1]
    assert named.startswith(FIELDS) or f"has no {checkpoint.MANIFEST}" in message, f"names no field: {message}"
    assert not any(d.any() for _, _, d in boxes_of(state)), f"the state changed before the refusal: {message}"
    assert state.get("run") is None, message
    return message


def leaves(tree, at=()):
    """Every place in a JSON tree: (path of keys, the value there), containers included."""
    yield at, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield from leaves(value, (*at, key))


@st.composite
def edits(draw, original: dict):
    """A manifest with one field replaced by junk, deleted, or renamed (a dict key); or with one offset or
    length of a piece moved by 1 or 2: off by one, partly out of its tensor, over a neighbour, leaving a gap.
    A moved length takes nbytes with it or not, so that the checks of the box itself are reached too."""
    edited = json.loads(json.dumps(original))
    places = [at for at, _ in leaves(original) if at]
    if draw(st.booleans()):
        at = draw(st.sampled_from([at for at in places if len(at) == 4 and at[2] in ("offsets", "lengths")]))
        piece = edited["pieces"][at[1]]
        piece[at[2]][at[3]] = max(0, piece[at[2]][at[3]] + draw(st.sampled_from([-2, -1, 1, 2])))
        if at[2] == "lengths" and draw(st.booleans()):
            piece["nbytes"] = prod(piece["lengths"]) * manifest.DTYPES[original["tensors"][piece["name"]][1]].itemsize
        assume(edited != original)  # a 0 moved down stays 0
        return at, "move", edited
    at = draw(st.sampled_from(places))
    parent = edited
    for key in at[:-1]:
        parent = parent[key]
    how = draw(st.sampled_from(["replace", "delete", "rename"] if isinstance(parent, dict) else ["replace", "delete"]))
    if how == "replace":
        parent[at[-1]] = draw(st.sampled_from(JUNK))
    elif how == "delete":
        del parent[at[-1]]
    else:
        parent[draw(st.sampled_from(["../x", "/etc/passwd", "", "rank_00009.bin", "other", "w "]))] = parent.pop(at[-1])
    assume(edited != original)  # junk that happens to equal the field it replaces
    assume(not still_a_checkpoint(original, edited))
    return at, how, edited


def still_a_checkpoint(original: dict, edited: dict) -> bool:
    """Whether the edit only dropped or renamed literals: a valid checkpoint without them, which a load that
    asks for one refuses in its planner (test_checkpoint), and a load that does not ask reads."""
    if not isinstance(edited.get("objects"), dict):
        return False
    others = {k: v for k, v in edited.items() if k != "objects"}
    return others == {k: v for k, v in original.items() if k != "objects"} and all(
        text in original["objects"].values() for text in edited["objects"].values())


@st.composite
def parts(draw):
    """What one rank asks of the checkpoint: some of the saved values, each whole or the part a rank of a
    reshard to 1-5 ranks reads (its rows, a flat range as ZeRO and FSDP hold, a tensor-parallel slice)."""
    world = draw(st.integers(1, 5))
    layout = draw(st.sampled_from(["whole", "rows", "flat", "cols"]))
    rank = draw(st.integers(0, world - 1))
    return layout, rank, world, tuple(sorted(draw(st.sets(st.sampled_from(NAMES), min_size=1))))


def copy_of(path: str) -> str:
    where = os.path.join(tempfile.mkdtemp(prefix="test_manifest_"), "step_1")
    shutil.copytree(path, where)
    return where


def refusal_of(saved: str, text: bytes, part=WHOLE) -> str:
    """refused_cleanly on a copy of the checkpoint `saved` whose manifest is `text`."""
    path = copy_of(saved)
    try:
        with open(os.path.join(path, checkpoint.MANIFEST), "wb") as f:
            f.write(text)
        return refused_cleanly(path, part)
    finally:
        shutil.rmtree(os.path.dirname(path))


@pytest.mark.single_process
@pytest.mark.parametrize("layout", ["whole", "rows", "flat", "cols"])
def test_the_saved_checkpoint_loads_in_every_part_a_reshard_reads_and_its_manifest_has_a_version(saved, layout):
    for world in (1, 2, 3, 5):
        for rank in range(world):
            state = wanted((layout, rank, world, NAMES))
            checkpoint.load(state, saved)
            for name, offsets, data in boxes_of(state):
                assert torch.equal(data, TENSORS[name][tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))])
            assert state["run"] == RUN
    assert json.load(open(os.path.join(saved, checkpoint.MANIFEST)))["version"] == manifest.VERSION


@pytest.mark.single_process
@settings(max_examples=120)
@given(data=st.data())
def test_a_manifest_edited_in_any_one_field_is_refused_in_one_line_whatever_part_a_rank_loads(saved, data):
    original = json.load(open(os.path.join(saved, checkpoint.MANIFEST)))
    at, how, edited = data.draw(edits(original))
    message = refusal_of(saved, json.dumps(edited).encode(), data.draw(parts()))
    if how == "move":  # the moved piece is named, or its tensor, whose boxes no longer tile it
        name = original["pieces"][at[1]]["name"]
        assert f"pieces[{at[1]}]" in message or f"tensor {name!r}" in message, message


@pytest.mark.single_process
@settings(max_examples=40)
@given(text=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.recursive(st.none() | st.integers() | st.text(max_size=5),
                                   lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                       max_size=3)
                                   ).map(lambda v: json.dumps(v).encode())))
def test_a_manifest_of_raw_garbage_is_refused_in_one_line(saved, text):
    refusal_of(saved, text)


def rename_file(path: str, name: str) -> None:
    """Rank 0's data file renamed to `name`, on disk and everywhere in the manifest."""
    m = json.load(open(os.path.join(path, checkpoint.MANIFEST)))
    os.rename(os.path.join(path, "rank_00000.bin"), os.path.join(path, name))
    m["files"] = {name: m["files"]["rank_00000.bin"]}
    m["pieces"] = [{**p, "file": name} for p in m["pieces"]]
    json.dump(m, open(os.path.join(path, checkpoint.MANIFEST), "w"))


def break_it(path: str, how: str) -> None:
    file = os.path.join(path, checkpoint.MANIFEST)
    data = os.path.join(path, "rank_00000.bin")
    if how == "empty manifest":
        open(file, "w").close()
    elif how == "manifest is a directory":
        os.remove(file)
        os.mkdir(file)
    elif how == "no manifest":
        os.remove(file)
    elif how == "data file missing":
        os.remove(data)
    elif how == "data file is a directory":
        os.remove(data)
        os.mkdir(data)
    elif how in ("data file links out", "manifest links out"):
        target = file if how == "manifest links out" else data
        outside = os.path.join(os.path.dirname(path), "outside")
        shutil.move(target, outside)
        os.symlink(outside, target)
    elif how == "data file is /dev/zero":
        os.remove(data)
        os.symlink("/dev/zero", data)
    elif how == "data file named with a backslash":  # a separator where the checkpoint may be read next
        rename_file(path, "rank\\00000.bin")
    elif how == "deep JSON":
        open(file, "w").write("[" * 200_000 + "]" * 200_000)
    elif how == "nbytes 10^10":  # the allocation the cap exists for: a loader that believed it would ask 10 GB
        m = json.load(open(file))
        m["pieces"][0]["nbytes"] = 10 ** 10
        json.dump(m, open(file, "w"))


@pytest.mark.single_process
@pytest.mark.parametrize("how, words", [
    ("empty manifest", "manifest.json is not JSON"),
    ("manifest is a directory", "files: manifest.json is not a regular file"),
    ("no manifest", "has no manifest.json: not a complete checkpoint"),
    ("data file missing", "files: rank_00000.bin cannot be opened: No such file"),
    ("data file is a directory", "files: rank_00000.bin is not a regular file"),
    ("data file links out", "files: 'rank_00000.bin' is not a plain file name inside the checkpoint"),
    ("manifest links out", "files: 'manifest.json' is not a plain file name inside the checkpoint"),
    ("data file is /dev/zero", "files: 'rank_00000.bin' is not a plain file name inside the checkpoint"),
    ("data file named with a backslash", "files: 'rank\\\\00000.bin' is not a plain file name inside the checkpoint"),
    ("deep JSON", "manifest.json is not JSON"),
    ("nbytes 10^10", "pieces[0] of tensor 'w' in rank_00000.bin: nbytes 10000000000 is not its elements"),
])
def test_a_broken_checkpoint_directory_is_refused_in_one_line_naming_what_is_wrong(saved, how, words):
    path = copy_of(saved)
    try:
        break_it(path, how)
        message = refused_cleanly(path, ROWS_2_3)
        assert words in message, message
    finally:
        shutil.rmtree(os.path.dirname(path))


@pytest.mark.single_process
def test_a_manifest_longer_than_its_bound_is_refused_before_it_is_parsed(saved, monkeypatch):
    """Valid JSON padded with spaces past the bound (lowered here: 64 MiB of padding would cost the suite
    time): the loader stops reading at the bound and refuses, where a loader without it would parse it."""
    monkeypatch.setattr(manifest, "MAX_MANIFEST", 4096)
    text = open(os.path.join(saved, checkpoint.MANIFEST), "rb").read()
    assert "manifest.json is longer than 4,096 B" in refusal_of(saved, text + b" " * 4096, ROWS_2_3)


def changed(original: dict, changes: list):
    """A copy of the manifest with `changes` made: (place, value) pairs, the value a function of the value
    there or the value itself; the place () replaces the whole manifest."""
    edited = json.loads(json.dumps(original))
    for at, value in changes:
        if not at:
            return value
        parent = edited
        for key in at[:-1]:
            parent = parent[key]
        parent[at[-1]] = value(parent[at[-1]]) if callable(value) else value
    return edited


# Each check of mini_dist/manifest.py, with an edit that it alone refuses: without the check, the load of
# the part asked for (rows 2-3 of w unless said: it reads pieces[1] alone) goes through, reads the wrong
# elements, or fails with a raw error or a message that names no field. The words are the check's own.
CHECKS = [
    ("not an object", [((), [])], "the manifest is [], not a JSON object"),
    ("version 2", [(("version",), 2)], "version is 2: this mini_dist reads version 1"),
    ("a field too many", [(("extra",), 1)], "the fields are ['extra', 'files', 'objects', 'pieces', 'tenso"),
    ("a field of another type", [(("objects",), [])], "the fields are ['files', 'objects', 'pieces', 'tensors', '"),
    ("world_size a bool", [(("world_size",), True)], "world_size True is not the number of files"),
    ("world_size not the number of files", [(("world_size",), 2)], "world_size 2 is not the number of files"),
    ("a file name with a separator", [(("files",), lambda f: {"./rank_00000.bin": f["rank_00000.bin"]}),
                                      (("pieces",), lambda ps: [{**p, "file": "./rank_00000.bin"} for p in ps])],
     "files: './rank_00000.bin' is not a plain file name inside the checkpoint"),
    ("a file name with a NUL", [(("files",), lambda f: {"rank\0.bin": f["rank_00000.bin"]}),
                                (("pieces",), lambda ps: [{**p, "file": "rank\0.bin"} for p in ps])],
     "files: 'rank\\x00.bin' is not a plain file name inside the checkpoint"),
    ("a file's size off by one", [(("files", "rank_00000.bin"), lambda size: size - 1)],
     "files: rank_00000.bin is 172 B on disk, 171 when saved"),
    ("a file's size a float", [(("files", "rank_00000.bin"), float)],
     "files: rank_00000.bin is 172 B on disk, 172.0 when saved"),
    ("a tensor not a list", [(("tensors", "w"), 5)], "tensors['w']: 5 is not [shape, one of"),
    ("a tensor of three fields", [(("tensors", "ids"), [[5], "int32", 0])], "tensors['ids']: [[5], 'int32', 0] is"),
    ("a shape not a list", [(("tensors", "w", 0), 12)], "tensors['w']: [12, 'float32'] is not [shape"),
    ("a shape negative", [(("tensors", "ids", 0), [-5])], "tensors['ids']: [[-5], 'int32'] is not [shape"),
    ("a shape of 65 dims", [(("tensors", "step", 0), [1] * 65)], "tensors['step']: [[1, 1, 1"),
    ("an unknown dtype", [(("tensors", "w", 1), "float128")], "tensors['w']: [[4, 3], 'float128'] is not [shape"),
    ("a dtype a list", [(("tensors", "w", 1), ["float32"])], "tensors['w']: [[4, 3], ['float32']] is not [shape"),
    ("a piece not an object", [(("pieces", 0), 5)], "pieces[0] is not ['crc32', 'file', 'lengths', 'name', 'nbytes',"),
    ("a piece with a key too many", [(("pieces", 0, "extra"), 1)], "pieces[0] is not ['crc32', 'file', 'lengths'"),
    ("a piece of no tensor", [(("pieces", 0, "name"), "x")], "pieces[0] is not ['crc32', 'file', 'lengths'"),
    ("a piece's name a list", [(("pieces", 0, "name"), ["w"])], "pieces[0] is not ['crc32', 'file', 'lengths'"),
    ("a piece in no file", [(("pieces", 0, "file"), "rank_00009.bin")], "pieces[0] is not ['crc32', 'file'"),
    ("offsets not a list", [(("pieces", 0, "offsets"), 5)],
     "pieces[0] of tensor 'w' in rank_00000.bin: offsets 5 lengths [1, 3] are not a box inside its [4, 3]"),
    ("offsets one too few", [(("pieces", 0, "offsets"), [0])], "offsets [0] lengths [1, 3] are not a box inside"),
    ("an offset negative", [(("pieces", 0, "offsets"), [-1, 0])], "offsets [-1, 0] lengths [1, 3] are not a box"),
    ("an offset a float", [(("pieces", 0, "offsets"), [0, 0.0])], "offsets [0, 0.0] lengths [1, 3] are not a box"),
    ("a length a float", [(("pieces", 0, "lengths"), [1, 3.0])], "offsets [0, 0] lengths [1, 3.0] are not a box"),
    ("a box one row off, partly out of its tensor", [(("pieces", 1, "offsets"), [2, 0])],
     "pieces[1] of tensor 'w' in rank_00000.bin: offsets [2, 0] lengths [3, 3] are not a box inside its [4, 3]"),
    ("nbytes a float", [(("pieces", 0, "nbytes"), 12.0)], "nbytes 12.0 is not its elements x float32's size"),
    ("nbytes too few", [(("pieces", 0, "nbytes"), 8)], "nbytes 8 is not its elements x float32's size"),
    ("start a float", [(("pieces", 0, "start"), 0.0)], "start 0.0 and crc32"),
    ("start negative", [(("pieces", 0, "start"), -1)], "start -1 and crc32"),
    ("crc32 a bool", [(("pieces", 0, "crc32"), True)], "crc32 True are not unsigned ints"),
    ("crc32 of 33 bits", [(("pieces", 0, "crc32"), lambda crc: crc + 2 ** 32)], "are not unsigned ints"),
    ("bytes past the end of the file", [(("pieces", 6, "start"), 160)],
     "pieces[6] of tensor 'ids' in rank_00000.bin: bytes [160, 180) end past the end of the file (172 B)"),
    ("bytes shared", [(("pieces", 0, "start"), 4)], "pieces[0] and pieces[1] share bytes of rank_00000.bin"),
    ("a gap", [(("pieces", 1, "lengths"), [2, 3]), (("pieces", 1, "nbytes"), 24)],
     "pieces of tensor 'w' hold 9 elements of its 12", ("rows", 0, 4, ("w",))),
    ("a box over its neighbour", [(("pieces", 1, "offsets"), [0, 0])],
     "pieces of tensor 'w' hold 12 elements of its 12, some twice", ("rows", 1, 4, ("w",))),
    ("a box over a box two along", [(("pieces", 2, "offsets"), [0, 3])],  # v's column 0 moved onto column 3
     "pieces of tensor 'v' hold 12 elements of its 12, some twice"),
    ("a literal not a text", [(("objects", "run"), 5)], "objects['run'] is not a text of at most 1,048,576 characters"),
    ("a literal too long", [(("objects", "run"), "1" * (manifest.MAX_LITERAL + 1))], "objects['run'] is not a text"),
    ("a literal too deep", [(("objects", "run"), "[" * 40 + "]" * 40)],
     "objects['run'] is not a Python literal: nested deeper than 32"),
    ("a literal that is code", [(("objects", "run"), "__import__('os')")], "objects['run'] is not a Python literal"),
]


@pytest.mark.single_process
@pytest.mark.parametrize("case", CHECKS, ids=[case[0] for case in CHECKS])
def test_each_check_refuses_the_edit_only_it_catches_naming_the_field(saved, case):
    changes, words = case[1], case[2]
    part = case[3] if len(case) > 3 else ROWS_2_3
    original = json.load(open(os.path.join(saved, checkpoint.MANIFEST)))
    message = refusal_of(saved, json.dumps(changed(original, changes)).encode(), part)
    assert words in message, message


@pytest.mark.single_process
def test_the_pieces_of_the_checks_are_where_the_table_says(saved):
    """CHECKS counts on this layout of the saved checkpoint (piece numbers, bytes, file size)."""
    m = json.load(open(os.path.join(saved, checkpoint.MANIFEST)))
    assert [(p["name"], p["offsets"], p["lengths"], p["start"]) for p in m["pieces"]] == [
        ("w", [0, 0], [1, 3], 0), ("w", [1, 0], [3, 3], 12), ("v", [0, 0], [3, 1], 48), ("v", [0, 1], [3, 1], 72),
        ("v", [0, 2], [3, 2], 96), ("step", [], [], 144), ("ids", [0], [5], 152)]
    assert m["files"] == {"rank_00000.bin": 172}


@pytest.mark.single_process
@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "-" * 100_000 + "1", "(" * 300 + ")" * 300,
                                  "9" * 10_000, "x" * (manifest.MAX_LITERAL + 1), "__import__('os').system('x')"])
def test_a_literal_too_deep_too_long_or_not_data_is_refused_without_a_raw_error(text):
    with pytest.raises(ValueError, match=r"^objects\['x'\] is not a "):
        manifest.literal_value("x", text)


class Looks:
    """An object whose repr reads as a literal that is not it."""

    def __repr__(self):
        return "1"


@pytest.mark.single_process
@pytest.mark.parametrize("value", [Looks(), float("nan"), torch.nn.Identity(), {1: Looks()}])
def test_a_value_is_saved_as_a_literal_only_if_the_literal_reads_back_as_it(value):
    with pytest.raises(ValueError, match="is neither a tensor nor a Python literal"):
        manifest.literal_text("x", value)


def save_then_edit(path, change, value):
    """Two ranks save w [4, 3] by rows (rank r rows 2r, 2r + 1); rank 0 edits the piece in rank 1's file;
    each rank then loads only its own rows, which rank 0 can read without touching the edited piece."""
    rank = dist.get_rank()
    state = {"w": Sharded((4, 3), torch.float32, (((2 * rank, 0), torch.ones(2, 3, device=device())),)), "run": 1}
    checkpoint.save(state, path)
    if rank == 0:
        m = json.load(open(os.path.join(path, checkpoint.MANIFEST)))
        next(p for p in m["pieces"] if p["file"] == "rank_00001.bin")[change] = value
        json.dump(m, open(os.path.join(path, checkpoint.MANIFEST), "w"))
    dist.barrier()
    mine = Sharded((4, 3), torch.float32, (((2 * rank, 0), torch.zeros(2, 3, device=device())),))
    try:
        checkpoint.load({"w": mine, "run": None}, path)
    except CheckpointError as e:
        return str(e), torch.count_nonzero(mine.boxes[0][1]).item()
    return "loaded", None


@pytest.mark.parametrize("change, value, words", [
    ("nbytes", -1, "nbytes -1"),
    ("offsets", [3, 0], "offsets [3, 0] lengths [2, 3] are not a box inside its [4, 3]")])
def test_every_rank_refuses_a_manifest_that_one_rank_alone_would_trip_on(change, value, words):
    path = tempfile.mkdtemp(prefix="test_manifest_")
    try:
        replies = run(2, save_then_edit, path, change, value)
        assert len({m for m, _ in replies}) == 1 and words in replies[0][0], replies
        assert all(changed == 0 for _, changed in replies)
    finally:
        shutil.rmtree(path)
