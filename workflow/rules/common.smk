# Configuration: apply or drop the local overlay, validate, resolve the experiment matrix (fails before any job).
import yaml
from snakemake.utils import validate

from scalelm.errors import ScaleLMError
from scalelm.experiments import apply_local_overlay, load_matrix


def load_site(config):
    """Site settings (account, partition, GPUs, network, modules): profiles/slurm/site.yaml on a cluster."""
    path = config.get("site")
    if not path:
        return {}
    with open(path) as handle:
        return yaml.safe_load(handle) or {}


config = apply_local_overlay(config)
validate(config, "../schemas/config.schema.yaml")
SITE = load_site(config)
RESULTS = config["results"]
try:
    MATRIX = {(e.name, str(e.seed)): e for e in load_matrix(config, RESULTS)}
except ScaleLMError as err:
    raise WorkflowError(f"invalid config: {err}")


wildcard_constraints:
    experiment="[A-Za-z0-9_-]+",
    seed="[0-9]+",


def experiment(wildcards):
    return MATRIX[(wildcards.experiment, wildcards.seed)]


def run_dir(wildcards):
    return f"{RESULTS}/runs/{wildcards.experiment}/seed{wildcards.seed}"
