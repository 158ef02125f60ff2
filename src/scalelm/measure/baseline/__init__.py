"""The machine's baseline, its own program (`python -m scalelm.measure.baseline`: __main__.py): what the devices and
the network deliver, measured the way a site's own probes measure them. The job's measurement (job.py) times the
model's matrix products and elementwise bandwidth at its training shapes (shapes.py, rates.py), the model's training
step (model_step.py) and each layout's machinery run in one process (layout_overheads.py), a small collective inside
every rank's step (collective_waits.py) and every collective over message sizes (collectives.py), all with the same
timing (timing.py), while it samples each GPU's health (gpu_health.py) and reads the network NCCL chose
(nccl_network.py). Each module imports torch only where it measures: the workflow reads them without it."""
