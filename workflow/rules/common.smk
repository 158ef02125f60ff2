# Configuration: apply or drop the local overlay, validate, resolve the experiment matrix (fails before any job).
import shlex

import yaml
from snakemake.utils import validate

from scalelm.container import check_image, find_runtime
from scalelm.errors import ScaleLMError
from scalelm.experiments import apply_local_overlay, load_matrix
from scalelm.scheduler import check_node_counts


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


def stop_signal_flags():
    """USR1 to every process of a training job's steps some minutes before its time limit: the training
    checkpoints and exits 75, and Snakemake resubmits the job (retries), which resumes.
    """
    ahead, runtime = (
        config["resources"].get(k) for k in ("stop_signal_s", "runtime_min")
    )
    ahead = 300 if ahead is None else ahead
    if ahead >= runtime * 60:
        raise WorkflowError(
            f"invalid config: resources.stop_signal_s ({ahead} s) must be less than resources.runtime_min "
            f"({runtime} min = {runtime * 60} s), or the stop signal would come at the job's start; "
            "lower stop_signal_s (0 sends none) or raise runtime_min"
        )
    return [f"--signal=USR1@{ahead}"] if ahead else []


def slurm_extra(stop_signal=False):
    """Further sbatch flags: the site's reservation; for training, the stop signal."""
    flags = [f"--reservation={SITE['reservation']}"] if SITE.get("reservation") else []
    if stop_signal:
        flags += stop_signal_flags()
    return shlex.join(flags)


RESULTS = config["results"]
try:
    MATRIX = {(e.name, str(e.seed)): e for e in load_matrix(config, RESULTS)}
    # on the login node, before any job is submitted
    if config.get("site") and workflow.is_main_process:
        check_node_counts(
            {e.name: e.nodes for e in MATRIX.values()}, SITE.get("partition")
        )
except ScaleLMError as err:
    raise WorkflowError(f"invalid config: {err}")


wildcard_constraints:
    experiment="[A-Za-z0-9_-]+",
    seed="[0-9]+",


def experiment(wildcards):
    return MATRIX[(wildcards.experiment, wildcards.seed)]


def run_dir(wildcards):
    return f"{RESULTS}/runs/{wildcards.experiment}/seed{wildcards.seed}"


def image_file():
    """The .sif every job runs in: built here, pulled here (a URI), or given (a path); None without a container."""
    mode, image = config["container"]["mode"], config["container"].get("image")
    if mode == "none":
        return None
    if not image:
        raise WorkflowError(
            f"container.mode is {mode}: set container.image (a .sif path or an oras:// URI)"
        )
    if mode == "image" and "://" in image:
        return f"{RESULTS}/image/scalelm.sif"  # rule pull_image fetches it on the login node
    if mode == "image":
        check_image(image)
    return image


try:
    IMAGE = image_file()
    RUNTIME = find_runtime() if IMAGE else None
except ScaleLMError as err:
    raise WorkflowError(f"invalid config: {err}")


def image_input(wildcards):
    return [IMAGE] if IMAGE else []


def container_binds():
    return [os.path.abspath(p) for p in (config["data"]["prepared_dir"], RESULTS)]


def in_container():
    """Prefix that runs a single-process command inside the image (empty without a container)."""
    if not IMAGE:
        return ""
    binds = [arg for b in container_binds() for arg in ("--bind", b)]
    return shlex.join([RUNTIME, "exec", "--cleanenv", *binds, IMAGE]) + " "


def container_args():
    """Launcher options that run each torchrun inside the image."""
    if not IMAGE:
        return []
    binds = [arg for b in container_binds() for arg in ("--bind", b)]
    gpu = ["--gpu"] if SITE.get("gpus_per_node") else []
    return ["--container", IMAGE, "--container-runtime", RUNTIME, *gpu, *binds]


def prefetch_args():
    source = config["data"]["source"]
    if "files" in source:
        files = ",".join(f"{split}={path}" for split, path in source["files"].items())
        return shlex.join(["--files", files, "--format", source.get("format", "text")])
    return shlex.join(["--dataset", source["dataset"], "--name", source["name"]])


def launch_args(wildcards):
    e = experiment(wildcards)
    args = ["--nodes", e.nodes, "--procs-per-node", e.procs_per_node, *container_args()]
    if SITE.get("host_suffix"):
        args += ["--host-suffix", SITE["host_suffix"]]
    if SITE.get("port_range"):
        args += ["--port-range", *SITE["port_range"]]
    return shlex.join(str(a) for a in args)


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
        parts.append(shlex.join(["module", "load", *SITE["modules"]]))
    if SITE.get("network_interface"):
        nic = SITE["network_interface"]
        parts.append(
            f"export NCCL_SOCKET_IFNAME={shlex.quote(nic)} GLOO_SOCKET_IFNAME={shlex.quote(nic)}"
        )
    return "".join(f"{p} && " for p in parts)
