"""The references verify recomputes each tensor kind with, one module per kind under the same name as in ``kinds/``:
the reference libraries (bitsandbytes, peft, transformers' integrations) and torch only, never nf4convert's kernels or
converter code. ``base.py`` says what each module answers and finds a kind's; ``cuda_arithmetic.py`` is bitsandbytes'
CUDA arithmetic on a CPU, from bitsandbytes' own parts.
"""
