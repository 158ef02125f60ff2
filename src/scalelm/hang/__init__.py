"""The hang autopsy, one room below the training loop: a watchdog thread per rank that names the ranks a stalled job
waits for and ends it (watchdog.py), with PyTorch's Flight Recorder's last operations of each rank (flight_recorder.py).
"""
