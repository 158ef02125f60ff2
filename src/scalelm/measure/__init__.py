"""What a training measures besides its loss, in one room: the interface the trainer calls (instruments.py), the
communication profile (comm.py), the device's peak and MFU (peak.py), the hosts' CPU load (hostload.py), and the
per-node utilisation sampler (sampler.py, its own program) with its starter (monitor.py). The pipeline's stage
timeline stays with the schedule it times (scalelm.parallel.pipeline); the report (scalelm.report) reads what these
leave in the run directory."""
