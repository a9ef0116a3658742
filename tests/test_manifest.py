"""The loader trusts nothing in a manifest (mini_dist/manifest.py): a manifest edited field by field, raw
garbage, an empty file, a directory, a link leading out, a missing file: each is refused with one line that
names the checkpoint, before anything is read or allocated, and the state asked for is left as it was.

The memory bound: while the loader runs, the process's address space is capped (RLIMIT_AS) at its size plus
MEMORY_SLACK. A loader that believed nbytes = 10^13, or a shape of 10^12 elements, would ask for more and
fail with a MemoryError or RuntimeError, which fails the property; without the cap Linux would overcommit a
10 GB torch.empty, the read would come up short, and the loader would look as if it had refused cleanly.
Most properties run in this process, on a checkpoint saved by a world of one (a gloo group of one rank over
a HashStore); one example runs on two ranks and checks that every rank refuses.
"""
import json
import os
import resource
import shutil
import tempfile
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness import device, run
from mini_dist import checkpoint, manifest
from mini_dist.checkpoint import CheckpointError, Sharded

MEMORY_SLACK = 512 << 20
JUNK = [-1, -(2 ** 40), 10 ** 13, 2 ** 64, 1.5, None, True, "", "../x", "/etc/passwd", "0; 0", "x" * 300,
        [], [[]], {}, [-1, -1], ["0"], {"a": 1}, "[" * 100_000, "(" * 40 + ")" * 40, "__import__('os')"]


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
    """A checkpoint saved by a world of one rank in this process: two tensors (one in two boxes), a scalar,
    a literal. The group stays for the module's loads, then goes."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    path = str(tmp_path_factory.mktemp("manifest") / "step_1")
    checkpoint.save(wanted(False), path)
    yield path
    dist.destroy_process_group()


def wanted(zeros: bool) -> dict:
    """The state saved (zeros=False), or one shaped like it that a load fills (zeros=True)."""
    w = torch.zeros(4, 3) if zeros else torch.arange(12.0).view(4, 3)  # cpu: this process's group is gloo
    return {"w": Sharded((4, 3), w.dtype, (((0, 0), w[:1]), ((1, 0), w[1:]))),
            "step": torch.zeros((), dtype=torch.int64) if zeros else torch.tensor(7),  # cpu: as w
            "ids": torch.zeros(5, dtype=torch.int32) if zeros else torch.arange(5, dtype=torch.int32),  # cpu: as w
            "run": None if zeros else {"epoch": 3, "losses": [0.5, 0.25]}}


def refused_cleanly(path: str) -> str:
    """Load `path` under the memory cap; the one-line CheckpointError it raises, the state untouched."""
    state = wanted(True)
    before = {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in state.items()}
    with memory_bounded(), pytest.raises(CheckpointError) as refusal:
        checkpoint.load(state, path)
    message = str(refusal.value)
    assert "\n" not in message and path in message, message
    assert torch.equal(state["w"].boxes[1][1], torch.zeros(3, 3)) and state["run"] is None  # cpu: as w
    assert all(torch.equal(state[n], before[n]) for n in ("step", "ids")), "the state changed before the refusal"
    return message


def leaves(tree, at=()):
    """Every place in a JSON tree: (path of keys, the value there), containers included."""
    yield at, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        yield from leaves(value, (*at, key))


@st.composite
def edits(draw, original: dict):
    """A manifest with one field replaced by junk, deleted, or renamed (a dict key)."""
    places = [at for at, _ in leaves(original) if at]
    at = draw(st.sampled_from(places))
    edited = json.loads(json.dumps(original))
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
    return at, how, edited


def copy_of(path: str) -> str:
    where = os.path.join(tempfile.mkdtemp(prefix="test_manifest_"), "step_1")
    shutil.copytree(path, where)
    return where


@pytest.mark.single_process
def test_the_saved_checkpoint_loads_and_its_manifest_has_a_version(saved):
    state = wanted(True)
    checkpoint.load(state, saved)
    assert torch.equal(state["w"].boxes[1][1], torch.arange(3.0, 12.0).view(3, 3))  # cpu: as in wanted()
    assert state["run"]["epoch"] == 3
    assert json.load(open(os.path.join(saved, checkpoint.MANIFEST)))["version"] == manifest.VERSION


@pytest.mark.single_process
@settings(max_examples=120)
@given(data=st.data())
def test_a_manifest_edited_in_any_one_field_is_refused_in_one_line_before_anything_is_read(saved, data):
    original = json.load(open(os.path.join(saved, checkpoint.MANIFEST)))
    at, how, edited = data.draw(edits(original))
    path = copy_of(saved)
    try:
        with open(os.path.join(path, checkpoint.MANIFEST), "w") as f:
            json.dump(edited, f)
        refused_cleanly(path)
    finally:
        shutil.rmtree(os.path.dirname(path))


@pytest.mark.single_process
@settings(max_examples=40)
@given(text=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                      st.recursive(st.none() | st.integers() | st.text(max_size=5),
                                   lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                       max_size=3)
                                   ).map(lambda v: json.dumps(v).encode())))
def test_a_manifest_of_raw_garbage_is_refused_in_one_line(saved, text):
    path = copy_of(saved)
    try:
        with open(os.path.join(path, checkpoint.MANIFEST), "wb") as f:
            f.write(text)
        refused_cleanly(path)
    finally:
        shutil.rmtree(os.path.dirname(path))


def break_it(path: str, how: str) -> None:
    file, data = os.path.join(path, checkpoint.MANIFEST), os.path.join(path, "rank_00000.bin")
    if how == "empty manifest":
        open(file, "w").close()
    elif how == "manifest is a directory":
        os.remove(file)
        os.mkdir(file)
    elif how == "no manifest":
        os.remove(file)
    elif how == "data file missing":
        os.remove(data)
    elif how in ("data file links out", "manifest links out"):
        target = file if how == "manifest links out" else data
        outside = os.path.join(os.path.dirname(path), "outside")
        shutil.move(target, outside)
        os.symlink(outside, target)
    elif how == "data file is /dev/zero":
        os.remove(data)
        os.symlink("/dev/zero", data)
    elif how == "deep JSON":
        open(file, "w").write("[" * 200_000 + "]" * 200_000)
    elif how == "nbytes 10^10":  # the allocation the cap exists for: a loader that believed it would ask 10 GB
        m = json.load(open(file))
        m["pieces"][0]["nbytes"] = 10 ** 10
        json.dump(m, open(file, "w"))


@pytest.mark.single_process
@pytest.mark.parametrize("how", ["empty manifest", "manifest is a directory", "no manifest", "data file missing",
                                 "data file links out", "manifest links out", "data file is /dev/zero",
                                 "deep JSON", "nbytes 10^10"])
def test_a_broken_checkpoint_directory_is_refused_in_one_line(saved, how):
    path = copy_of(saved)
    try:
        break_it(path, how)
        message = refused_cleanly(path)
        if how == "no manifest":
            assert "not a complete checkpoint" in message
    finally:
        shutil.rmtree(os.path.dirname(path))


@pytest.mark.single_process
@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "-" * 100_000 + "1", "(" * 300 + ")" * 300,
                                  "9" * 10_000, "x" * (manifest.MAX_LITERAL + 1), "__import__('os').system('x')"])
def test_a_literal_too_deep_too_long_or_not_data_is_refused_without_a_raw_error(text):
    with pytest.raises(ValueError):
        manifest.literal_value(text)


def save_then_edit(path):
    state = {"w": Sharded((4, 3), torch.float32, (((2 * dist.get_rank(), 0), torch.ones(2, 3, device=device())),)),
             "run": 1}
    checkpoint.save(state, path)
    if dist.get_rank() == 0:  # a piece of rank 1's file asks for -1 bytes
        m = json.load(open(os.path.join(path, checkpoint.MANIFEST)))
        next(p for p in m["pieces"] if p["file"] == "rank_00001.bin")["nbytes"] = -1
        json.dump(m, open(os.path.join(path, checkpoint.MANIFEST), "w"))
    dist.barrier()
    mine = Sharded((4, 3), torch.float32, (((0, 0), torch.zeros(4, 3, device=device())),))  # every rank: all of it
    try:
        checkpoint.load({"w": mine, "run": None}, path)
    except CheckpointError as e:
        return str(e), torch.count_nonzero(mine.boxes[0][1]).item()
    return "loaded", None


def test_every_rank_refuses_a_manifest_that_one_rank_alone_would_trip_on():
    path = tempfile.mkdtemp(prefix="test_manifest_")
    try:
        replies = run(2, save_then_edit, path)
        assert len({m for m, _ in replies}) == 1 and "nbytes -1" in replies[0][0], replies
        assert all(changed == 0 for _, changed in replies)
    finally:
        shutil.rmtree(path)
