"""Cluster launch: torchrun command lines (launcher.py), their supervision (supervise.py), Slurm (slurm.py) and the
Apptainer image (container.py). `python -m scalelm.launch` starts a training."""
