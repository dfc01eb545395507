import importlib.util
import os

import torch

# The kernel runs in Triton's interpreter where there is no GPU; triton.jit reads this at import. Without Triton
# (tests/test_without_triton.py runs the API's tests so) the interpreter's tests skip.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA (bitsandbytes' CUDA kernels, our Triton kernel on a GPU): skipped without it."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same torch and random state: draws without an explicit generator repeat too."""
    import random

    random.seed(20261123)
    torch.manual_seed(20261123)
