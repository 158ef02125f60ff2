"""Build or fetch the Apptainer image the jobs run in, and the prefix that runs a command inside it.

    python -m scalelm.launch.container build --definition containers/scalelm.def --out results/image/scalelm.sif \
        --base-image docker://nvcr.io/nvidia/pytorch:25.01-py3
    python -m scalelm.launch.container pull --uri oras://registry/scalelm:0.1 --out results/image/scalelm.sif

Builds go through spython, which calls an executable named `singularity`; on systems that only have `apptainer`
a private `singularity` link to it is put first on PATH for the call.

The prefix (`exec_prefix`) runs with `--cleanenv` and passes in what the training needs from the launcher's
environment (`passed_environment`); in a Slurm step (`step_prefix`), launched from the batch node, what Slurm sets
for each node (its GPUs, its ranks) comes from that node instead, and Triton's and Inductor's caches default to the
node's /tmp.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import scalelm
from scalelm.errors import ScaleLMError, friendly_errors
from scalelm.files import atomic_path, sha256
from scalelm.version import git_commit


class ContainerError(ScaleLMError):
    pass


RUNTIMES = ("apptainer", "singularity")
# set by the launcher for the processes it starts in an image of another architecture under QEMU: run.json records
# it (train.provenance), and the report flags such a run's timings (report.disturbance)
EMULATED_ENV = "SCALELM_EMULATED"
# apptainer --cleanenv drops the host environment; these are what torchrun, NCCL, gloo, CUDA and the compiler
# (Inductor, Triton) need from it: the named variables, and every one with a prefix (NCCL_IB_TIMEOUT, TORCH_NCCL_*,
# CUDA_VISIBLE_DEVICES, UCX_*, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, ...)
PASSED_ENV = (
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "SLURM_JOB_ID",
    "GLIBC_TUNABLES",
    EMULATED_ENV,
)
PASSED_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "CUBLAS_", "PYTORCH_", "UCX_", "TORCHINDUCTOR_", "TRITON_")
# What Slurm sets for each node (or task) of a step: the batch node's values would be wrong on the others, so on
# Slurm each node passes its own into its container (`node_forwarder`) instead of the launcher passing its own
NODE_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "SLURM_STEP_GPUS",
    "SLURM_JOB_GPUS",
    "SLURM_LOCALID",
    "SLURM_PROCID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "SLURM_TOPOLOGY_ADDR",
)


def passed_environment(environ: Mapping[str, str], slurm_step: bool = False) -> dict[str, str]:
    """The variables of `environ` that go into the container (secrets never match: see docs/faults.md). For a
    Slurm step (`slurm_step`, run on every node from the batch node's environment): without NODE_VARIABLES, and
    with node-local compile caches where `environ` names none (`node_local_caches`)."""
    passed = {name: environ[name] for name in environ if name in PASSED_ENV or name.startswith(PASSED_PREFIXES)}
    if slurm_step:
        passed = node_local_caches(environ) | {n: v for n, v in passed.items() if n not in NODE_VARIABLES}
    return dict(sorted(passed.items()))


def node_local_caches(environ: Mapping[str, str]) -> dict[str, str]:
    """Triton's and Inductor's caches under /tmp/$USER: Triton's own default is under $HOME, on a cluster one
    file system for every node (slow to fill, its locks contended), while /tmp is each node's and Apptainer binds
    it into the container by default. Not $TMPDIR: the batch node's may not exist on the other nodes, nor be
    bound into the container."""
    user = environ.get("USER") or f"uid{os.getuid()}"
    return {"TORCHINDUCTOR_CACHE_DIR": f"/tmp/{user}/torchinductor", "TRITON_CACHE_DIR": f"/tmp/{user}/triton"}


def node_forwarder(runtime: str) -> list[str]:
    """`/bin/sh -c SCRIPT NAME` that runs the rest of its command line (the container's) after exporting, for each
    of NODE_VARIABLES this node has, <RUNTIME>ENV_<name>=<value>: what `--cleanenv` lets into the container."""
    into = "SINGULARITYENV_" if Path(runtime).name == "singularity" else "APPTAINERENV_"
    script = (
        f"for name in {' '.join(NODE_VARIABLES)}; do "
        'eval "known=\\${$name+x} value=\\${$name-}"; '
        f'if [ -n "$known" ]; then export "{into}$name=$value"; fi; '
        'done; exec "$@"'
    )
    return ["/bin/sh", "-c", script, "scalelm-node-environment"]


def exec_prefix(
    runtime: str, image: str, binds: Sequence[str] = (), gpu: bool = False, env: Mapping[str, str] | None = None
) -> list[str]:
    """`<runtime> exec --cleanenv [--nv] [--bind B ...] [--env K=V ...] IMAGE`: what runs a command in the image."""
    prefix = [runtime, "exec", "--cleanenv", *(["--nv"] if gpu else [])]
    prefix += [arg for bind in binds for arg in ("--bind", bind)]
    prefix += [arg for name, value in (env or {}).items() for arg in ("--env", f"{name}={value}")]
    return [*prefix, image]


def step_prefix(runtime: str, image: str, binds: Sequence[str], gpu: bool, environ: Mapping[str, str]) -> list[str]:
    """What runs a command in the image on every node of a Slurm step launched from `environ` (the batch node's):
    each node's own NODE_VARIABLES, the rest of `environ` as the launcher passes it (`passed_environment`)."""
    env = passed_environment(environ, slurm_step=True)
    return [*node_forwarder(runtime), *exec_prefix(runtime, image, binds, gpu, env)]


def find_runtime() -> str:
    for name in RUNTIMES:
        if shutil.which(name):
            return name
    raise ContainerError(
        "neither apptainer nor singularity is on PATH: load the site's module (e.g. `module load apptainer`), "
        "build the image on a machine that has it and copy the .sif here (container.mode: image), "
        "or run without a container (container.mode: none)"
    )


@contextmanager
def singularity_on_path():
    """spython runs `singularity`; make that name reach whichever runtime this system has."""
    runtime = find_runtime()
    if runtime == "singularity":
        yield
        return
    with tempfile.TemporaryDirectory() as shim:
        os.symlink(shutil.which(runtime), Path(shim) / "singularity")
        previous = os.environ["PATH"]
        os.environ["PATH"] = f"{shim}{os.pathsep}{previous}"
        try:
            yield
        finally:
            os.environ["PATH"] = previous


def is_uri(image: str) -> bool:
    """docker://, oras://, library://...: an image to fetch, not a file."""
    return "://" in image


def split_base(base_image: str) -> tuple[str, str]:
    """`docker://repo:tag` -> ('docker', 'repo:tag'); a local .sif path -> ('localimage', path)."""
    if is_uri(base_image):
        agent, _, rest = base_image.partition("://")
        return agent, rest
    path = Path(base_image)
    if not path.is_file():
        raise ContainerError(
            f"base image {base_image} is neither a URI (docker://, oras://, library://) nor an existing image file"
        )
    return "localimage", str(path.resolve())


def base_digest(agent: str, base: str) -> str:
    """The base image's digest for the labels: the one a reference pins (`repo:tag@sha256:...`), the checksum of a
    local image file, or "unpinned" (said aloud: a rebuild may get another image under the same tag)."""
    if agent == "localimage":
        return "sha256:" + sha256(base)
    _, at, digest = base.partition("@")
    if at and digest.startswith("sha256:"):
        return digest
    print(
        f"scalelm: the base image {agent}://{base} is not pinned by digest (@sha256:...): a rebuild may get another "
        "image under the same tag. Pin it in container.base_image to rebuild this one",
        file=sys.stderr,
    )
    return "unpinned"


def build(
    definition: Path, out: Path, base_image: str, fakeroot: bool, extra: list[str] = (), arch: str | None = None
) -> Path:
    """Build the image; `arch` (amd64, arm64): the architecture to build for, default this machine's. Another one is
    built under emulation (`check_emulation`): a docker://, oras:// or library:// base is fetched for it, a local
    base image must be one (.ci/apptainer/make-base-image.sh --arch)."""
    from spython.main import Client

    if not definition.is_file():
        raise ContainerError(f"definition file {definition} does not exist")
    agent, base = split_base(base_image)
    runtime = find_runtime()
    node = node_architecture()
    arch = SIF_ARCHITECTURES.get(arch, arch) if arch else node
    if agent == "localimage":
        base_arch = image_architecture(runtime, base)
        if base_arch not in (None, arch):
            raise ContainerError(
                f"base image {base} is built for {base_arch}, not {arch}: give a base image for {arch} "
                f"(.ci/apptainer/make-base-image.sh --arch {arch}, or a multi-architecture docker:// image)"
            )
    if arch != node:  # the definition's %post runs the base image's programs
        check_emulation(arch, f"build an image for {arch} on this {platform.machine()} machine")
    build_args = {
        "bootstrap": agent,
        "base_image": base,
        "project_dir": str(definition.resolve().parent.parent),
        "scalelm_version": scalelm.__version__,
        "git_commit": git_commit() or "unknown",
        "base_digest": base_digest(agent, base),
    }
    options = [arg for key, value in build_args.items() for arg in ("--build-arg", f"{key}={value}")]
    if fakeroot:
        options.append("--fakeroot")
    if agent != "localimage" and arch != node:  # which of a multi-architecture image's variants to fetch
        options += ["--arch", arch]
    options += extra
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as partial, singularity_on_path():
        # the build's own output goes straight to this process's stdout/stderr (the rule's log)
        Client.build(recipe=str(definition), image=str(partial), sudo=False, options=options, force=True)
        if not partial.is_file():
            raise ContainerError(
                f"building {out} from {definition} (base {base_image}) failed; the build output above says why. "
                "If the base image cannot be reached from here, build on a machine that can and copy the .sif "
                "(container.mode: image), or run without a container (container.mode: none)"
            )
        built_for = image_architecture(runtime, str(partial))
        if built_for not in (None, arch):
            raise ContainerError(
                f"building {out} for {arch} made an image for {built_for}: the base image {base_image} "
                f"has no {arch} variant"
            )
    return out


def pull(uri: str, out: Path) -> Path:
    runtime = find_runtime()
    out.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run([runtime, "pull", "--force", str(out), uri], capture_output=True, text=True)
    if result.returncode != 0:
        raise ContainerError(f"`{runtime} pull {uri}` failed: {result.stderr.strip()[-2000:]}")
    return out


def check_image(image: str) -> None:
    if not is_uri(image) and not Path(image).is_file():
        raise ContainerError(
            f"container image {image} does not exist: build it (container.mode: build), copy it from the cluster "
            "where it was built, or run without a container (container.mode: none)"
        )


def architecture_table() -> list[tuple[str, str]]:
    """(architecture, machine) of architectures.tsv, the one list of the names that the test machine's image scripts
    read too: SIF's (Go's) name and `uname -m`'s."""
    text = (Path(__file__).parent / "architectures.tsv").read_text()
    return [tuple(line.split("\t")[:2]) for line in text.splitlines() if line and not line.startswith("#")]


# `uname -m` (and the architecture's own name: macOS says arm64) -> the architecture names SIF headers use
SIF_ARCHITECTURES = {name: arch for arch, machine in architecture_table() for name in (machine, arch)}


def image_architecture(runtime: str, image: str) -> str | None:
    """The SIF's primary architecture (`<runtime> sif header`); None for what has no SIF header (a sandbox
    directory, a URI) or a runtime that cannot read it."""
    if not Path(image).is_file():
        return None
    try:
        header = subprocess.run([runtime, "sif", "header", image], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^Primary Architecture:\s*(\S+)", header, re.MULTILINE)
    return found.group(1) if found else None


def node_architecture(machine: str | None = None) -> str:
    machine = machine or platform.machine()
    return SIF_ARCHITECTURES.get(machine, machine)


# where the kernel finds the interpreter of another architecture's binaries (QEMU user-mode emulation)
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
QEMU_NAMES = dict(architecture_table())


def qemu_handler(arch: str, binfmt: Path = BINFMT_DIR) -> Path:
    """Where Debian's qemu-user-static registers `arch` (.ci/apptainer/emulation.sh)."""
    return binfmt / f"qemu-{QEMU_NAMES.get(arch, arch)}"


def emulates(arch: str, binfmt: Path = BINFMT_DIR) -> bool:
    """Whether this machine runs `arch` binaries through an enabled QEMU handler that a container can use too (the
    F flag: the kernel opened the interpreter when it was registered, so the container need not have it)."""
    try:
        lines = qemu_handler(arch, binfmt).read_text().splitlines()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags:")), "")
    return bool(lines) and lines[0] == "enabled" and "F" in flags


def check_emulation(arch: str, purpose: str, binfmt: Path = BINFMT_DIR) -> None:
    if not emulates(arch, binfmt):
        raise ContainerError(
            f"cannot {purpose}: this machine does not run {arch} binaries (no enabled QEMU handler "
            f"{qemu_handler(arch, binfmt)} with the F flag). As root: "
            f"`.ci/apptainer/emulation.sh on {arch}` (Debian's qemu-user-static, registered in binfmt_misc)"
        )


def check_architecture(
    runtime: str, image: str, machine: str | None = None, allow_emulation: bool = False, binfmt: Path = BINFMT_DIR
) -> str | None:
    """Refuse an image built for another architecture than this node's (an amd64 image on a GH200 node would
    fail in every process with `exec format error`), unless emulation is allowed and this machine has it: then
    say that its timings mean nothing (QEMU runs it tens of times slower) and return what it emulates (e.g.
    "arm64 on x86_64"); None for an image this node runs itself."""
    machine = machine or platform.machine()
    node = node_architecture(machine)
    built_for = image_architecture(runtime, image)
    if built_for is None or built_for == node:
        return None
    if not allow_emulation:
        raise ContainerError(
            f"image {image} is built for {built_for} but this node ({platform.node()}) is {machine}: build the image "
            f"for {node} from a base image published for {node} (`scalelm container build --arch {node}`, "
            'container.architecture; docs/gpu.md, "Images for aarch64") and point container.image at it. To run it here '
            "under emulation anyway (slow: only to prove the image), allow it: the launcher's --allow-emulation "
            "(container.allow_emulation: true)"
        )
    check_emulation(built_for, f"run the {built_for} image {image} on this {machine} node", binfmt)
    print(
        f"scalelm launch: running the {built_for} image {image} on this {machine} node under QEMU emulation "
        "(--allow-emulation): the results hold, its timings do not",
        file=sys.stderr,
        flush=True,
    )
    return f"{built_for} on {machine}"


@friendly_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scalelm.launch.container", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="build the image from the definition file")
    b.add_argument("--definition", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--base-image", required=True, help="docker://..., oras://... or a local .sif")
    b.add_argument("--no-fakeroot", action="store_true", help="build without --fakeroot (e.g. as root)")
    b.add_argument("--build-option", action="append", default=[], help="passed on to `apptainer build` (repeatable)")
    b.add_argument(
        "--arch",
        choices=sorted(set(SIF_ARCHITECTURES) | set(SIF_ARCHITECTURES.values())),
        help="the image's architecture (amd64, arm64); default this machine's",
    )
    p = commands.add_parser("pull", help="fetch a prebuilt image (oras://, library://, docker://)")
    p.add_argument("--uri", required=True)
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "build":
        image = build(args.definition, args.out, args.base_image, not args.no_fakeroot, args.build_option, args.arch)
        print(f"built {image}")
    else:
        print(f"pulled {pull(args.uri, args.out)}")


if __name__ == "__main__":
    main()
