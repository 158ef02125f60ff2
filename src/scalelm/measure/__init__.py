"""What a training and the machine measure besides the loss, in one room: the interface the trainer calls
(instruments.py), a device's synchronised clock and memory peak (device.py), the communication profile (comm.py), the
device's peak and MFU (peak.py), the GPUs' energy (energy.py), the hosts' CPU load (hostload.py), the per-node
utilisation sampler (sampler.py, its own program) with its starter (monitor.py), and the machine's baseline
(baseline/, its own program: what the devices and the network deliver). The pipeline's stage timeline stays with
the schedule it times (scalelm.parallel.pipeline); the report (scalelm.report) reads what these leave in the run
directory."""
