import pytest
from hosts import hosts  # noqa: F401  (hosts of a multi-host test: tests/hosts.py)
from warm_torchrun import WarmTorchrun


@pytest.fixture(scope="session")
def warm_torchrun(tmp_path_factory):
    """One torchrun launch for the session's multi-rank `hlat` jobs (tests/warm_torchrun.py)."""
    runner = WarmTorchrun(tmp_path_factory.mktemp("torchrun"))
    yield runner
    runner.close()
