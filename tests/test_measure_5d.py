"""A 5D run measured (mini_dist/measure_5d.py): measuring changes nothing (the measured run's losses are the plain
train_5d run's, bit for bit), each rank's bytes per axis and memory by category are its ledger's
(mini_dist/rank_ledger.py), and the demo refuses a configuration it cannot run in one line. The same comparison
on every factorisation of 1, 2 and 4 ranks, every ZeRO stage and schedule, is tests/test_train_5d.py's."""
import pytest

from harness import refusal, run
from mini_dist import measure_5d, train_5d
from mini_dist.mesh import Mesh, RankGrid
from mini_dist.tiny_gpt import Config, padded_vocab

_meshes = {}


def both_ways(grid, cfg, M, schedule, zero):
    """On every rank: the plain run's losses, then the measured run's, its last step's bytes and memory beside
    its ledger."""
    if grid not in _meshes:
        _meshes[grid] = Mesh(grid.dp, grid.pp, grid.cp, grid.tp, grid.ep)
    mesh = _meshes[grid]
    plain = train_5d.train_5d(cfg, mesh, 2, M, schedule, zero)
    measured = measure_5d.measured_run(cfg, mesh, 2, M, schedule, zero)
    traffic, memory = measure_5d.predictions(measured, cfg, mesh, M, schedule, zero)
    return plain, measured.losses, measured.bytes[-1], traffic, measured.memory, memory


@pytest.mark.parametrize("grid, experts, schedule, zero", [
    (RankGrid(dp=2, ep=2), 4, "1f1b", 1), (RankGrid(pp=2), 0, "gpipe", 2), (RankGrid(tp=2), 2, "1f1b", 3),
    (RankGrid(cp=2), 0, "1f1b", 1)], ids=["dp2-ep2-moe", "pp2", "tp2-fsdp", "cp2"])
def test_measuring_changes_nothing_and_every_rank_measures_its_ledger(grid, experts, schedule, zero):
    cfg = Config(vocab=padded_vocab(grid.tp), layers=2, batch=4 * grid.dp, experts=experts)
    for rank, (plain, losses, sent, traffic, held, planned) in enumerate(run(grid.size, both_ways, grid, cfg, 2,
                                                                             schedule, zero)):
        assert losses == plain, rank
        assert sent == traffic, rank
        assert held == planned, rank


@pytest.mark.parametrize("world, argv, says", [
    (4, ["--dp", "2", "--pp", "2", "--tp", "1", "--zero", "3", "--moe", "4", "--ep", "2"], "--zero 3 (FSDP)"),
    (4, ["--dp", "3", "--tp", "2"], "--dp 3 x --tp 2 = 6 does not divide the world of 4 ranks"),
    (2, ["--pp", "2", "--tp", "1", "--microbatches", "0"], "--microbatches and --chunks must be >= 1")])
def test_a_configuration_that_cannot_run_is_one_line_before_any_process_group(world, argv, says, monkeypatch, capsys):
    err = refusal(measure_5d, world, argv, monkeypatch, capsys)
    assert len(err) == 1 and says in err[0], err
