"""Routes: how pieces are made on a device, generic over the tensor kinds (each kind brings its compute). ``base.py``
says what every route answers and picks the route for a device; ``cpu.py`` (with ``workers.py``, its forked worker
processes) and ``cuda.py`` are the two."""
