"""Training: the loop (trainer.py) and what it relies on: checkpoints, optimizer, metrics, evaluation, the run
directory, provenance and the stop signal. `python -m scalelm.train` runs it (see trainer.py)."""
