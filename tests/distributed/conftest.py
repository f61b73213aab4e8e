import pytest

from helpers.worlds import close_worlds


@pytest.fixture(scope="package", autouse=True)
def shared_worlds():
    """The ranks this tier's tests share live until its last test, not into the tiers after it."""
    yield
    close_worlds()
