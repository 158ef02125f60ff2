"""After the runs: the report. Summary tables per run and per experiment (aggregate.py, with each experiment's seeds
as one: repeats.py), steady-state speed (timing.py), scaling against the baseline (scaling.py), utilisation
(utilisation.py), pipeline bubbles (bubble.py), the figures (plots.py) and the `expect:` checks (expectations.py)."""
