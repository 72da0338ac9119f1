"""Every test here saves and loads in one process without a process group, which DCP warns about each time."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "security" in item.path.parts:
            item.add_marker(pytest.mark.filterwarnings("ignore:torch.distributed is disabled"))
