"""Tests marked ``cuda`` need a CUDA GPU: without one they are skipped, with the reason."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU here (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Every trace the tests make is type-checked after every pass (core/typecheck.py); set
# here so that the rank pools' processes inherit it.
os.environ.setdefault("DTCOMPILE_VERIFY_TYPES", "1")
