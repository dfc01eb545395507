import os

import torch

# The kernel runs in Triton's interpreter where there is no GPU; triton.jit reads this at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
