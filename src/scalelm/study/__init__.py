"""Before the queue: the experiment matrix resolved and checked (experiments.py), what every rule needs
(workflow.py: `Study`, which Snakemake's parse builds), each experiment's memory against the site's GPUs (plan_check.py)
and the optional wiring check of every layout against one process (preflight.py)."""
