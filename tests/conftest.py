import pytest

from hosts import hosts  # noqa: F401  (hosts of a multi-host test: tests/hosts.py)
from warm_torchrun import WarmTorchrun


@pytest.fixture(scope="session")
def warm_torchrun(tmp_path_factory):
    """One torchrun launch for the session's multi-rank `hlat` jobs (tests/warm_torchrun.py)."""
    runner = WarmTorchrun(tmp_path_factory.mktemp("torchrun"))
    yield runner
    runner.close()


def pytest_collection_modifyitems(items):
    """The files that hold long (`slow`) tests first: `make test`'s workers take a file at a time in this order, so
    the short files fill the end of the run instead of one long file running there alone. The sort is stable:
    each file's tests keep their order."""
    long_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in long_files)
