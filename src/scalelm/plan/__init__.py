"""Planning a layout before the queue: per-GPU memory (memory.py) and per-step communication (comm.py) of every
layout a machine can hold, and the choice among them (layouts.py); `python -m scalelm.plan` prints it."""
