import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# BAGUA_TEST_MAX_WORLD=N leaves out the cases parametrized with a world_size
# above N. The PyTorch 2 lane of scripts/test.sh sets it: there the question
# is whether the API and the loops work on torch 2, which worlds up to 3
# answer (odd and even); the main lane runs every world size.
MAX_WORLD = int(os.environ.get("BAGUA_TEST_MAX_WORLD", "0"))
# BAGUA_TEST_LEFT_TO_TORCH2="N SELECTORS..." (the main lane of scripts/test.sh
# sets it to the PyTorch 2 lane's world bound and test list): the cases that
# lane runs (world at most N, or not parametrized by world) are left out here,
# so no case runs twice; the main lane keeps their larger worlds.
_LEFT = os.environ.get("BAGUA_TEST_LEFT_TO_TORCH2", "").split()
LEFT_WORLD, LEFT_SELECTORS = (int(_LEFT[0]), _LEFT[1:]) if _LEFT else (0, [])


def _world(item):
    return getattr(getattr(item, "callspec", None), "params", {}).get("world_size")


def _left_to_torch2(item) -> bool:
    path = Path(str(item.fspath)).name
    node = path + "::" + item.name.split("[")[0]
    if not any(node == s or path == s for s in LEFT_SELECTORS):
        return False
    world = _world(item)
    return not isinstance(world, int) or world <= LEFT_WORLD


def pytest_collection_modifyitems(config, items):
    too_large = pytest.mark.skip(reason=f"world_size above BAGUA_TEST_MAX_WORLD={MAX_WORLD} (run in the main lane)")
    left = pytest.mark.skip(reason="run on PyTorch 2 in its lane of scripts/test.sh (BAGUA_TEST_LEFT_TO_TORCH2)")
    for item in items:
        world = _world(item)
        if MAX_WORLD > 0 and isinstance(world, int) and world > MAX_WORLD:
            item.add_marker(too_large)
        elif LEFT_SELECTORS and _left_to_torch2(item):
            item.add_marker(left)
