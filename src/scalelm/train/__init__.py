"""Training: the process's entry point (run.py, `python -m scalelm.train`), the engines' shared base (engine.py), the
two loops (trainer.py, scalelm's; lightning_engine.py, Lightning's) and what they rely on: checkpoints, optimizer,
metrics, evaluation, the run directory, provenance and the stop signal."""
