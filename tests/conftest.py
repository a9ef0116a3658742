"""pytest setup: hypothesis profiles sized for a 2-core machine, and the rank pools closed at the end."""
import os

from hypothesis import HealthCheck, settings

import harness

# Examples run in live rank pools: cheap, but not the 200 ms hypothesis expects of pure functions.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=10, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_sessionfinish(session, exitstatus):
    harness.close_all()
