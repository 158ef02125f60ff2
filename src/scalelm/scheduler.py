"""What the Slurm cluster can give, asked on the login node before any job is submitted.

Slurm accepts a job that asks for more nodes than its partition has (unless the site sets EnforcePartLimits) and
leaves it pending for ever (reason PartitionNodeLimit): the workflow would wait with it. So the workflow asks
`sinfo` first and refuses such an experiment by name.
"""

from __future__ import annotations

import shutil
import subprocess

from scalelm.errors import ConfigError


def partition_nodes(partition: str | None) -> tuple[str, int] | None:
    """(name, number of nodes) of `partition`, or of the cluster's default partition; None where sinfo is missing
    or does not answer (no cluster here: the scheduler will judge)."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        return None
    nodes: dict[str, set[str]] = {}
    default = None
    for line in out.stdout.splitlines():
        node, name = line.split()
        if name.endswith("*"):
            name = default = name[:-1]
        nodes.setdefault(name, set()).add(node)
    name = partition or default
    if name is None:
        return None
    if name not in nodes:
        raise ConfigError(
            f"partition {name!r} does not exist on this cluster (sinfo lists {', '.join(sorted(nodes))}); "
            "fix partition in the site file (profiles/slurm/site.yaml)"
        )
    return name, len(nodes[name])


def check_node_counts(nodes_by_experiment: dict[str, int], partition: str | None) -> None:
    """Refuse an experiment that asks for more nodes than the partition has."""
    found = partition_nodes(partition)
    if found is None:
        return
    name, available = found
    for experiment, nodes in sorted(nodes_by_experiment.items()):
        if nodes > available:
            raise ConfigError(
                f"experiment {experiment} asks for {nodes} nodes but partition {name} has {available} (sinfo); "
                "lower its nodes in the config, or choose a larger partition in profiles/slurm/site.yaml"
            )
