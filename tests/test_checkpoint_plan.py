"""The planner (mini_dist/checkpoint_plan.py), without files or ranks: a global tensor saved as one grid of
boxes and wanted as another (cut along any dims, some boxes empty) is filled bit for bit from exactly the
saved boxes each wanted box overlaps; what the saved boxes cannot fill is refused, naming it; a save plan
whose boxes leave a tensor, miss an element or hold one twice is refused. Reading files, crc32 and ranks:
tests/test_checkpoint.py.
"""
import itertools
import re
from math import prod

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import checkpoint_plan_exercise as judge
from checkpoint_plan_exercise import MISTAKES  # noqa: F401  (the exercise's, declared beside its judge)
from checkpoint_plan_exercise import at, manifest_of
from harness import device
from mini_dist import checkpoint_plan  # looked up at call time: an exercise swaps in a learner's module
from mini_dist.checkpoint_plan import Sharded
from mini_dist.manifest import overlap


def cuts(n: int, parts: int) -> list:
    """[lo, hi) of each of `parts` parts of range(n), as rank r of K holds rows (some empty when parts > n)."""
    return [(n * r // parts, n * (r + 1) // parts) for r in range(parts)]


def grid(shape: tuple, parts: tuple) -> list:
    """Boxes (offsets, lengths) cutting `shape` into parts[d] along each dim d, every combination once."""
    per_dim = [cuts(n, k) for n, k in zip(shape, parts)]
    return [(tuple(lo for lo, _ in box), tuple(hi - lo for lo, hi in box)) for box in itertools.product(*per_dim)]


shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def parts_for(shape):
    return st.tuples(*[st.integers(1, 4) for _ in shape])


@pytest.mark.single_process
@given(n=st.integers(0, 40), world=st.integers(1, 9))
def test_even_parts_cover_every_row_once_in_rank_order_and_differ_by_one_row_at_most(n, world):
    parts = [checkpoint_plan.even_part(n, rank, world) for rank in range(world)]
    assert parts[0][0] == 0 and parts[-1][1] == n, parts
    assert all(left[1] == right[0] for left, right in zip(parts, parts[1:])), parts
    sizes = [hi - lo for lo, hi in parts]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, parts


# ----- the learner's exercise (./run.sh check checkpoint_plan): the overlap read (tests/checkpoint_plan_exercise.py)

@pytest.mark.exercise(judges=("plan",))
@pytest.mark.single_process
@given(data=st.data(), shape=shapes, dtype=st.sampled_from([torch.float64, torch.int64, torch.bfloat16]))
def test_every_wanted_box_is_filled_bit_for_bit_from_exactly_the_saved_boxes_it_overlaps(data, shape, dtype):
    """plan: each wanted box, its reads copied into place, holds the tensor's elements bit for bit, read from
    exactly the saved boxes it shares an element with, each once

    A tensor saved as one grid of boxes, wanted as another (cut along any dims, some boxes empty); each read is
    copied as checkpoint.load copies it: destination.copy_(saved box's data[index])."""
    g = torch.Generator().manual_seed(len(shape))
    whole = torch.randn(shape, generator=g, dtype=torch.float64).to(device(), dtype)
    saved = grid(shape, data.draw(parts_for(shape), label="saved parts per dim"))
    manifest = manifest_of(whole, saved)
    for offsets, lengths in grid(shape, data.draw(parts_for(shape), label="wanted parts per dim")):
        box = torch.zeros(lengths, dtype=dtype, device=device())
        reads, said = judge.filled(manifest, offsets, box)
        assert said is None, said
        where = f"the box at {list(offsets)} of {list(lengths)} of a {list(shape)} tensor saved as {saved}"
        read = sorted(tuple(piece["offsets"]) for piece, _, _ in reads)
        overlapping = sorted(tuple(p["offsets"]) for p in manifest["pieces"]
                             if overlap(offsets, lengths, p["offsets"], p["lengths"]))
        assert read == overlapping, (f"{where} reads the saved boxes at {read}, not those it shares an element "
                                     f"with, each once: {overlapping}\n{judge.plan_mistake() or judge.CONTRACT}")
        want = whole[at(offsets, lengths)]
        if not torch.equal(box, want):
            first = tuple((box != want).nonzero()[0].tolist())
            element = [o + a for o, a in zip(offsets, first)]
            assert False, (f"{where}, its reads copied into place: element {element} is {box[first].item()}, "
                           f"the tensor's is {want[first].item()}\n{judge.plan_mistake() or judge.CONTRACT}")


@pytest.mark.exercise(judges=("plan",))
@pytest.mark.single_process
@given(data=st.data(), shape=shapes)
def test_a_box_the_saved_boxes_do_not_hold_is_refused_naming_it(data, shape):
    """plan: a wanted box the saved boxes do not hold all of is refused, ValueError '... the box at [offsets] of
    [lengths] is not all in the checkpoint'"""
    whole = torch.arange(prod(shape), dtype=torch.float32, device=device()).view(shape)
    saved = [box for box in grid(shape, data.draw(parts_for(shape))) if prod(box[1]) > 0]
    lost = data.draw(st.sampled_from(saved), label="the saved box lost")
    manifest = manifest_of(whole, [box for box in saved if box != lost])
    offsets, lengths = lost
    want = {"w": Sharded(shape, whole.dtype, ((offsets, torch.zeros(lengths, device=device())),))}
    words = f"the box at {list(offsets)} of {list(lengths)} is not all in the checkpoint"
    where = f"a {list(shape)} tensor saved as {saved} but for the box at {list(offsets)} of {list(lengths)}"
    try:
        reads = checkpoint_plan.plan(manifest, want)
    except ValueError as e:
        assert words in str(e), f"{where}, wanted: plan raised ValueError: {e}; the contract's words: '{words}'"
        return
    except NotImplementedError:
        raise  # a blank: its own words are the contract
    except Exception as e:
        assert False, f"{where}, wanted: plan raised {type(e).__name__}: {e}, not ValueError '{words}'"
    assert False, (f"{where}, wanted: plan returned {len(reads)} reads, not ValueError '{words}'"
                   f"\n{judge.plan_mistake() or judge.CONTRACT}")


@pytest.mark.single_process
def test_a_tensor_or_value_the_checkpoint_does_not_hold_as_wanted_is_refused():
    manifest = manifest_of(torch.arange(12.0, device=device()).view(3, 4), grid((3, 4), (3, 1)))
    wants = {"the checkpoint holds no such tensor": {"v": torch.zeros(2, device=device())},
             "the checkpoint holds [[3, 4], 'float32'], this rank wants [3, 4] float64":
                 {"w": torch.zeros(3, 4, dtype=torch.float64, device=device())},
             "the checkpoint holds [[3, 4], 'float32'], this rank wants [4, 4]":
                 {"w": torch.zeros(4, 4, device=device())},
             "the checkpoint has no value 'epoch'": {"epoch": None}}
    for words, want in wants.items():
        with pytest.raises(ValueError, match=re.escape(words)):
            checkpoint_plan.plan(manifest, want)


@pytest.mark.single_process
@given(data=st.data(), shape=shapes)
def test_a_save_plan_with_a_box_moved_by_one_along_any_dim_is_refused(data, shape):
    boxes = [box for box in grid(shape, data.draw(parts_for(shape))) if prod(box[1]) > 0]
    tensors = {"w": [list(shape), "float32"]}
    pieces = [{"name": "w", "offsets": list(o), "lengths": list(n)} for o, n in boxes]
    checkpoint_plan.check_tiling(tensors, pieces)  # the grid itself tiles the tensor
    moved = data.draw(st.integers(0, len(pieces) - 1), label="the box moved")
    dim = data.draw(st.integers(0, len(shape) - 1), label="along dim")
    step = data.draw(st.sampled_from([-1, 1]), label="by")
    offsets = list(pieces[moved]["offsets"])
    offsets[dim] += step
    lengths = pieces[moved]["lengths"]
    box = torch.zeros(lengths, device=device())
    value = Sharded(shape, torch.float32, ())
    if not all(0 <= o and o + n <= s for o, n, s in zip(offsets, lengths, shape)):
        with pytest.raises(ValueError, match="is not inside its"):
            checkpoint_plan.check_box("w", value, tuple(offsets), box)
        return
    checkpoint_plan.check_box("w", value, tuple(offsets), box)  # inside the tensor: the tiling must refuse it
    pieces[moved] = {**pieces[moved], "offsets": offsets}
    with pytest.raises(ValueError, match="each element must be saved by one rank"):
        checkpoint_plan.check_tiling(tensors, pieces)
