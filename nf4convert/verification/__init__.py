"""Verify: a converted checkpoint or GGUF checked against its source with the reference libraries, bit for bit
(``verify.py`` is the front door; ``report.py`` what it found)."""
