"""Fixtures for the multi-process tests: Gloo rank pools, started once per pytest worker."""

import pytest
from harness import RankPool


@pytest.fixture(scope="session")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()
