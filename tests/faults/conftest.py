import os

import pytest


def pytest_collection_modifyitems(config, items):
    # Long variants run on request only (CI keeps the short ones):
    #   CUBEGATE_SLOW=1 pytest tests/faults     or     pytest -m slow tests/faults
    run_slow = os.environ.get("CUBEGATE_SLOW") == "1" or "slow" in (config.getoption("-m") or "")
    skip = pytest.mark.skip(reason="long variant: set CUBEGATE_SLOW=1 or -m slow")
    for item in items:
        if "tests/faults/" not in str(item.fspath).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.netns)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip)
