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
# sbatch options of every job, from the site file (the plugin reads these resource names)
SITE_RESOURCES = {
    name: SITE[key]
    for key, name in (
        ("account", "slurm_account"),
        ("partition", "slurm_partition"),
        ("qos", "qos"),
        ("constraint", "constraint"),
    )
    if SITE.get(key)
}
if SITE.get("reservation"):
    SITE_RESOURCES["slurm_extra"] = f"--reservation={SITE['reservation']}"
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


def image_input(wildcards):
    return (
        [config["container"]["image"]] if config["container"]["mode"] == "build" else []
    )


def container_args():
    """Launcher options that run each torchrun inside the image."""
    if config["container"]["mode"] == "none":
        return ""
    binds = [config["data"]["prepared_dir"], RESULTS]
    gpu = "--gpu " if SITE.get("gpus_per_node") else ""
    return f"--container {config['container']['image']} {gpu}" + " ".join(
        f"--bind {b}" for b in binds
    )


def prefetch_args():
    source = config["data"]["source"]
    if "files" in source:
        files = ",".join(f"{split}={path}" for split, path in source["files"].items())
        return f"--files {files} --format {source.get('format', 'text')}"
    return f"--dataset {source['dataset']} --name {source['name']}"


def launch_args(wildcards):
    e = experiment(wildcards)
    args = f"--nodes {e.nodes} --procs-per-node {e.procs_per_node} {container_args()}"
    if SITE.get("host_suffix"):
        args += f" --host-suffix {SITE['host_suffix']}"
    if SITE.get("port_range"):
        args += " --port-range {} {}".format(*SITE["port_range"])
    return args


def per_proc(key):
    return (
        lambda wildcards: config["resources"][key]
        * experiment(wildcards).procs_per_node
    )


RUN_DIRS = [f"{RESULTS}/runs/{e.name}/seed{e.seed}" for e in MATRIX.values()]


def site_prelude():
    """Shell run before a training job: the site's modules and the network interface for NCCL and gloo."""
    parts = []
    if SITE.get("modules"):
        parts.append("module load " + " ".join(SITE["modules"]))
    if SITE.get("network_interface"):
        nic = SITE["network_interface"]
        parts.append(f"export NCCL_SOCKET_IFNAME={nic} GLOO_SOCKET_IFNAME={nic}")
    return "".join(f"{p} && " for p in parts)
