"""Executing a plan piece by piece: ``piece`` (what moves), ``core`` (the read -> make -> write stages) and
``routes/`` (how pieces are made on the CPU or one GPU). Sinks (``sinks/``) feed it and receive what it makes."""
