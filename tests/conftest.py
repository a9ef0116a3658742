"""pytest setup: hypothesis profiles sized for a 2-core machine, and the rank pools closed at the end."""
import os

import pytest
from hypothesis import HealthCheck, settings

import harness

# Examples run in live rank pools: cheap, but not the 200 ms hypothesis expects of pure functions.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=10, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# ./run.sh check: one failure, the first; derandomized, so a check gives the same verdict every time it grades
# the same code (and every classic mistake of the banks is caught on the same draws a learner's check makes)
settings.register_profile("exercise", max_examples=10, deadline=None, report_multiple_bugs=False, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# A test that sets its own max_examples (a costly property, sized for the ci profile's 25) keeps that count
# under ci; the other profiles scale it by the same factor they scale the default by, so `thorough` draws
# 8x more examples of every property, not only of the cheap ones.
SCALE = settings.default.max_examples / 25


def scale_own_settings(items, scale: float) -> None:
    """Multiply each test's own max_examples by scale. A parametrized test's items share one function:
    it is scaled once, not once per item (else 5 parameters would draw scale**5 times its examples)."""
    scaled = set()
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None and own.max_examples != settings.default.max_examples and id(test) not in scaled:
            scaled.add(id(test))
            test._hypothesis_internal_use_settings = settings(own, max_examples=max(1, round(own.max_examples * scale)))


def pytest_collection_modifyitems(config, items):
    if SCALE != 1:
        scale_own_settings(items, SCALE)
    if not config.getoption("markexpr"):  # slow checks run only when asked for: ./run.sh test -m slow (CI does)
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_configure(config):
    config.addinivalue_line("markers", "single_process: a property that starts no ranks (harness.run refuses it), "
                                       "cheap enough for CI to run it under the thorough profile too")
    config.addinivalue_line("markers", "slow: a check that starts a pytest or torchrun of its own; kept out of the "
                                       "default run, run by CI with -m slow")
    config.addinivalue_line("markers", "exercise: a property that grades a learner's exercise (./run.sh check MODULE "
                                       "runs these against the learner's copy of the module)")
    # torch's own imports (torch.distributed.pipelining, fsdp) call torch.jit.script, deprecated since 2.9;
    # that warning is about torch, not about mini_dist, and would bury the summary under 60 repeats
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script` is deprecated:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.interface` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def _single_process(request):
    """A test marked single_process that calls harness.run fails: the mark cannot claim what is not so."""
    harness.SINGLE_PROCESS = request.node.get_closest_marker("single_process") is not None
    yield
    harness.SINGLE_PROCESS = False


def pytest_sessionfinish(session, exitstatus):
    harness.close_all()
