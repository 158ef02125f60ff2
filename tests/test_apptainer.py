"""The image: built by the workflow from containers/scalelm.def on a real Apptainer (.ci/apptainer/), tested,
and used by the training jobs of the tiny matrix. Runs as root; under CI it must run."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from scalelm.files import sha256
from system import require_root, run_script
from test_workflow import WORKFLOW_PARTS, edit_yaml, snakemake

pytestmark = pytest.mark.apptainer
# the wrapper (.ci/apptainer/wrapper.sh) shows /var/tmp to the runtime at the same path
BASE_IMAGE = Path("/var/tmp/scalelm/test-base.sif")


# in the image: one process and DDP on two; the other layouts run the same code (tests/test_workflow.py)
OTHER_EXPERIMENTS = (
    "ddp_multinode",
    "ddp_spawn",
    "ddp_lightning",
    "fsdp",
    "hsdp",
    "tp",
    "fsdp_tp",
    "pp",
    "pp_gpipe",
    "3d",
    "cp",
    "cp_long",
    "moe",
    "moe_ep",
)


def script(name: str, *args: str, timeout: int = 900):
    return run_script("apptainer", name, *args, timeout=timeout)


@pytest.fixture(scope="module")
def base_image():
    """A real Apptainer and a local base image (Python 3.11 + the local torch CPU wheel); the runtime's wrappers
    are removed afterwards (the rootfs and caches stay in /var/cache/scalelm for the next run)."""
    require_root("apptainer")
    script("setup.sh")
    try:
        BASE_IMAGE.parent.mkdir(parents=True, exist_ok=True)
        script("make-base-image.sh", str(BASE_IMAGE))
        yield BASE_IMAGE
    finally:
        script("teardown.sh")


@pytest.fixture
def project(tmp_path, base_image) -> Path:
    for part in (*WORKFLOW_PARTS, "containers", "src", "requirements", "pyproject.toml", "README.md"):
        source = REPO / part
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / part)

    def in_image(config):
        local = config["local"]
        local["container"] = {
            "mode": "build",
            "definition": "containers/scalelm.def",
            "base_image": str(base_image),
            "image": "results/local/image/scalelm.sif",
            # zstd: same size as the default gzip, several times faster to build on 2 cores
            "build_options": ["--mksquashfs-args", "-comp zstd -Xcompression-level 3"],
        }
        local["training"]["train"].update(max_steps=6, log_every=2, eval_every=3)
        local["training"]["checkpoint"]["every"] = 3
        for name in OTHER_EXPERIMENTS:
            config["local"]["experiments"].pop(name, None)

    edit_yaml(tmp_path / "config/local.yaml", in_image)
    edit_yaml(tmp_path / "config/config.yaml", lambda c: [c["experiments"].pop(n) for n in OTHER_EXPERIMENTS])
    return tmp_path


def test_workflow_builds_the_image_and_trains_inside_it(project, monkeypatch):
    monkeypatch.setenv("APPTAINER_TMPDIR", "/dev/shm")  # builds are disk-bound otherwise
    result = snakemake(project, timeout=1500)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    image = project / "results/local/image/scalelm.sif"
    assert image.is_file()

    tested = subprocess.run(["apptainer", "test", str(image)], capture_output=True, text=True, timeout=300)
    assert tested.returncode == 0 and "selftest passed" in tested.stdout, tested.stdout + tested.stderr
    labels = json.loads(
        subprocess.run(
            ["apptainer", "inspect", "--json", "--labels", str(image)], capture_output=True, text=True
        ).stdout
    )["data"]["attributes"]["labels"]
    assert labels["org.scalelm.version"] == "0.1.0" and labels["org.scalelm.base-image"].startswith("localimage:")
    assert labels["org.scalelm.base-digest"] == "sha256:" + sha256(BASE_IMAGE)  # the base, pinned by its checksum
    # finding 9: NCCL needs libibverbs and a provider (mlx5) to use InfiniBand; the base image has neither
    libraries = subprocess.run(
        ["apptainer", "exec", str(image), "ldconfig", "-p"], capture_output=True, text=True
    ).stdout
    assert "libibverbs.so.1 " in libraries and "libmlx5.so.1 " in libraries and "librdmacm.so.1 " in libraries
    assert labels["org.scalelm.infiniband"] == "libibverbs" and labels["org.scalelm.architecture"] == platform.machine()

    for name, world in (("single_gpu", 1), ("ddp", 2)):
        record = json.loads((project / f"results/local/runs/{name}/seed1/run.json").read_text())
        container = record["container"]
        assert container, f"{name} did not run inside the image"
        assert container["labels"]["org.scalelm.version"] == labels["org.scalelm.version"]
        # every dependency but the base image's torch at the lock's version and hash
        lock = record["versions"]["lock"]
        assert lock["file"] == "/opt/scalelm/requirements/image.txt" and lock["differs"] == {}, lock
        assert lock["sha256"] == sha256(REPO / "requirements/image.txt")
        assert record["world_size"] == world
        assert (project / f"results/local/runs/{name}/seed1/test.json").is_file()
    summary = (project / "results/local/summary.md").read_text()
    assert "single_gpu" in summary and "ddp" in summary


def test_unreachable_base_image_is_a_clear_error(project):
    edit_yaml(
        project / "config/local.yaml",
        lambda c: c["local"]["container"].update(base_image="docker://registry.invalid/none:1"),
    )
    result = snakemake(project, "build_image", timeout=600)
    assert result.returncode != 0
    log = (project / "results/local/logs/build_image.log").read_text()
    assert "failed" in log and "build on a machine that can and copy the .sif" in log
    assert not (project / "results/local/image/scalelm.sif").exists()


def test_the_launcher_refuses_an_image_built_for_another_architecture(base_image, tmp_path):
    """Finding 21: an image for another architecture (a real SIF header, written by the runtime's own `sif` tool)
    is refused before any torchrun starts, naming both architectures; the base image (this node's) passes."""
    from scalelm.launch.container import image_architecture

    other = ("amd64", "2") if platform.machine() == "aarch64" else ("arm64", "4")
    image, partition = tmp_path / f"{other[0]}.sif", tmp_path / "partition"
    partition.write_bytes(bytes(4096))
    subprocess.run(["apptainer", "sif", "new", str(image)], check=True, capture_output=True)
    subprocess.run(
        [
            "apptainer",
            "sif",
            "add",
            "--datatype",
            "4",
            "--partfs",
            "1",
            "--parttype",
            "2",
            "--partarch",
            other[1],
            str(image),
            str(partition),
        ],
        check=True,
        capture_output=True,
    )
    result = subprocess.run(
        [sys.executable, "-m", "scalelm.launch", "--container", str(image), "--", "--config", "unused.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "torchrun" not in result.stdout, result.stdout + result.stderr
    assert f"built for {other[0]} but this node" in result.stderr and platform.machine() in result.stderr, result.stderr
    assert "docs/gpu.md" in result.stderr
    assert (
        image_architecture("apptainer", str(base_image)) == {"x86_64": "amd64", "aarch64": "arm64"}[platform.machine()]
    )


def aarch64_program(exit_code: int) -> bytes:
    """A static aarch64 Linux program that exits with `exit_code`: an ELF header, one loadable segment and three
    instructions (mov x0, #code; mov x8, #93 (exit); svc #0), so that emulation is proven without an arm64 download."""
    import struct

    base, code_at = 0x400000, 64 + 56
    code = struct.pack("<3I", 0xD2800000 | exit_code << 5, 0xD2800000 | 93 << 5 | 8, 0xD4000001)
    size = code_at + len(code)
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header += struct.pack("<HHIQQQIHHHHHH", 2, 0xB7, 1, base + code_at, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    segment = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)
    return header + segment + code


def test_arm64_emulation_is_turned_on_proven_and_left_as_found(base_image, tmp_path):
    """Issue 55, the steps of the arm64 build this tier can afford (the whole build: bench/arm64_image.sh): the
    base-image script refuses arm64 where no emulation runs it, naming the command that turns it on; that command
    (Debian's qemu-user-static in binfmt_misc) makes a real aarch64 program run, and `off` leaves the host as it
    found it; the project's image for arm64 is refused on an amd64 base by name; the script's downloads for arm64
    (torch and its wheels for aarch64, cached); a cached arm64 base image's SIF header."""
    from scalelm.launch.container import ContainerError, build, image_architecture

    env = {**os.environ, "SCALELM_BINFMT_DIR": str(tmp_path)}  # no handler there: no emulation
    refused = subprocess.run(
        ["bash", str(REPO / ".ci/apptainer/make-base-image.sh"), "--arch", "arm64", str(tmp_path / "b.sif")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert refused.returncode != 0 and not (tmp_path / "b.sif").exists()
    assert "cannot run arm64 binaries: run .ci/apptainer/emulation.sh on arm64 first" in refused.stderr

    binfmt = Path("/proc/sys/fs/binfmt_misc")
    before = (binfmt.is_mount(), sorted(p.name for p in binfmt.iterdir()) if binfmt.is_mount() else [])
    program = tmp_path / "exit42"
    program.write_bytes(aarch64_program(42))
    program.chmod(0o755)
    try:
        on = script("emulation.sh", "on", "arm64", timeout=600)
        assert subprocess.run([str(program)]).returncode == 42  # an aarch64 program, run by QEMU
        assert "qemu-aarch64" in on.stderr or before[1].count("qemu-aarch64")  # it says what it registers
    finally:
        script("emulation.sh", "off", "arm64")
    assert (binfmt.is_mount(), sorted(p.name for p in binfmt.iterdir()) if binfmt.is_mount() else []) == before

    with pytest.raises(ContainerError, match=f"base image {base_image} is built for amd64, not arm64: .*--arch arm64"):
        build(REPO / "containers/scalelm.def", tmp_path / "arm64.sif", str(base_image), False, arch="arm64")

    # the downloads, which need no emulation: torch's aarch64 CPU build and its wheels for aarch64, judged by
    # aarch64's markers (x86_64's would add GBs of CUDA wheels)
    fetched = subprocess.run(
        ["bash", str(REPO / ".ci/apptainer/make-base-image.sh"), "--arch", "arm64", "--download-only"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert fetched.returncode == 0 and "downloaded for arm64: torch-2.10.0-cp311-cp311-" in fetched.stderr, (
        fetched.stderr
    )
    cache = Path(os.environ.get("SCALELM_CACHE_DIR", "/var/cache/scalelm"))
    assert list((cache / "wheels-arm64").glob("torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl"))
    wheels = [p.name for p in (cache / "wheelhouse-arm64").glob("*.whl")]
    assert any(w.startswith("numpy-") and "aarch64" in w for w in wheels), wheels
    assert not [w for w in wheels if w.startswith(("nvidia", "triton", "cuda")) or "x86_64" in w], wheels
    for image in (cache / "base-images").glob("base-arm64-*.sif"):  # a proof's base image (bench/arm64_image.sh)
        assert image_architecture("apptainer", str(image)) == "arm64", image
