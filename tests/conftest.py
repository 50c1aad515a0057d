"""Shared fixtures: ``pools(world)`` gives a pool of real gloo ranks (see harness.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Pools


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()
