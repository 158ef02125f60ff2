""".ci/apptainer/ at the level of their logic (issue 66): with stand-ins for the downloads, and QEMU's emulation
in a private binfmt_misc, so that they need no network, no Apptainer and change nothing on this machine. The real
runtime, downloads and emulation are the apptainer tier's (tests/test_apptainer.py)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

SCRIPTS = REPO / ".ci" / "apptainer"


def stand_in(directory: Path, name: str, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text("#!/bin/bash\n" + text)
    (directory / name).chmod(0o755)


def other_architectures() -> list[tuple[str, str]]:
    """Two architectures (Debian's and QEMU's names) that are not this machine's, so that emulation means something."""
    machine = platform.machine()
    return [(a, q) for a, q in (("arm64", "aarch64"), ("s390x", "s390x"), ("ppc64le", "ppc64le")) if q != machine][:2]


# ---- make-base-image.sh --download-only ----


def torch_wheel(directory: Path, qemu: str) -> Path:
    """A stand-in torch wheel: only its METADATA, whose requirements the script downloads for the image's machine."""
    wheel = directory / f"torch-2.10.0-cp311-cp311-manylinux_2_28_{qemu}.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "torch-2.10.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: torch\nVersion: 2.10.0\nRequires-Dist: filelock\n"
            'Requires-Dist: nvidia-cublas; platform_machine == "x86_64" and sys_platform == "linux"\n',
        )
    return wheel


def download_only(tmp_path: Path, pip: str, **env: str) -> subprocess.CompletedProcess:
    """make-base-image.sh --arch ARCH --download-only with `python3 -m pip download` standing in: `fail` (what pip
    says without PyPI), `empty` (exits 0, writes nothing) or `ok` (writes one wheel per requirement)."""
    arch, qemu = other_architectures()[0]
    bin_dir = tmp_path / "bin"
    stand_in(
        bin_dir,
        "python3",
        f"""if [[ "$1 $2 $3" != "-m pip download" ]]; then exec {sys.executable} "$@"; fi
shift 3
dest="" reqs=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dest) dest=$2; shift ;; --platform|--python-version|--implementation|--abi|--find-links) shift ;;
        -*) ;; *) reqs+=("$1") ;;
    esac
    shift
done
case {pip} in
    fail) for r in "${{reqs[@]}}"; do
              echo "ERROR: Could not find a version that satisfies the requirement $r (from versions: none)" >&2
              echo "ERROR: No matching distribution found for $r" >&2; exit 1
          done ;;
    ok) for r in "${{reqs[@]}}"; do
            r=${{r%%==*}}; [[ $r == torch ]] && v=2.10.0 || v=1.0
            : > "$dest/$r-$v-cp311-cp311-manylinux_2_28_{qemu}.whl"
        done ;;
esac
""",
    )
    stand_in(bin_dir, "id", "echo 0\n")  # the script asks for root; with these caches nothing here needs it
    return subprocess.run(
        ["bash", str(SCRIPTS / "make-base-image.sh"), "--arch", arch, "--download-only"],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "SCALELM_CACHE_DIR": str(tmp_path / "cache"),
            "SCALELM_BASE_PIP_EXTRA": "numpy",
            **env,
        },
        timeout=120,
    )


def test_download_only_fails_by_name_when_a_download_fails_and_says_what_it_fetched_when_not(tmp_path):
    """Issue 66, finding 6: a failed download is no success ("0 wheels", exit 0), nor a warning about a chroot this
    mode has not: it names what is missing and what to do."""
    arch, qemu = other_architectures()[0]
    wheel = torch_wheel(tmp_path, qemu)
    wheelhouse = tmp_path / "cache" / f"wheelhouse-{arch}"

    failed = download_only(tmp_path, "fail", SCALELM_TORCH_WHEEL=str(wheel))
    assert failed.returncode != 0, failed.stderr
    assert f"error: pip could not download filelock for {arch} into {wheelhouse}" in failed.stderr, failed.stderr
    assert "where PyPI (or the host's pip index) is reachable" in failed.stderr, failed.stderr
    assert "chroot" not in failed.stderr and "downloaded for" not in failed.stderr, failed.stderr
    assert not list(wheelhouse.glob("*.whl"))

    # torch itself: a download that brings no wheel of the name asked for is no success either
    empty = download_only(tmp_path, "empty")
    torch_dir = tmp_path / "cache" / f"wheels-{arch}"
    assert empty.returncode != 0, empty.stderr
    assert f"pip downloaded no torch-2.10.0-cp311-cp311-*_{qemu}.whl into {torch_dir}" in empty.stderr, empty.stderr

    # a download that works: as before, each wheel named, and no warning
    fetched = download_only(tmp_path, "ok", SCALELM_TORCH_WHEEL=str(wheel))
    assert fetched.returncode == 0, fetched.stderr
    assert f"downloaded for {arch}: {wheel.name} in {tmp_path}, 2 wheels in {wheelhouse}" in fetched.stderr
    assert "warning" not in fetched.stderr and "error" not in fetched.stderr, fetched.stderr
    assert sorted(p.name.split("-")[0] for p in wheelhouse.glob("*.whl")) == ["filelock", "numpy"]


# ---- emulation.sh, in a private binfmt_misc ----

# Each step runs in one user and mount namespace of its own (Linux 6.7 gives it its own binfmt_misc instance), and
# prints its output, exit status and the state after it: binfmt_misc mounted or not, and its entries.
STEPS = r"""
B=$1 script=$2; shift 2
E() { bash "$script" "$@"; }
for step in "$@"; do
    echo "== $step"
    eval "$step" 2>&1
    echo "rc: $?"
    if mountpoint -q "$B"; then echo "state: mounted $(ls "$B" | sort | tr '\n' ' ')"; else echo "state: unmounted"; fi
done
"""


@pytest.fixture
def binfmt(tmp_path):
    """A binfmt_misc of our own (Linux 6.7's per user namespace instances): where the kernel has none, a skip."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare (util-linux) here")
    probe = tmp_path / "probe"
    probe.mkdir()
    mounted = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "--", "mount", "-t", "binfmt_misc", "binfmt_misc", probe],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"no binfmt_misc of a user namespace's own here (Linux 6.7 or later): {mounted.stderr.strip()}")
    directory = tmp_path / "binfmt_misc"
    directory.mkdir()
    return directory


def emulation(tmp_path: Path, binfmt: Path, steps: list[str], confs: list[str]) -> list[tuple[str, int, str]]:
    """Run `steps` in one private namespace (E: emulation.sh), with Debian's qemu-user-static standing in: its
    programs and its binfmt.d files for the QEMU names in `confs` (harmless magic, an interpreter that does
    nothing). Returns (output, exit status, state) of each step."""
    bin_dir, conf_dir = tmp_path / "bin", tmp_path / "binfmt.d"
    conf_dir.mkdir(parents=True)
    for _, qemu in other_architectures():
        stand_in(bin_dir, f"qemu-{qemu}-static", "exit 0\n")
    for qemu in confs:
        (conf_dir / f"qemu-{qemu}.conf").write_text(
            f"# stand-in\n:qemu-{qemu}:M::scalelm-test-{qemu}::{bin_dir}/qemu-{qemu}-static:POCF\n"
        )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SCALELM_CACHE_DIR": str(tmp_path / "cache"),
        "SCALELM_BINFMT_DIR": str(binfmt),
        "SCALELM_BINFMT_CONF_DIR": str(conf_dir),
    }
    ran = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "--",
            "bash",
            "-c",
            STEPS,
            "_",
            binfmt,
            SCRIPTS / "emulation.sh",
            *steps,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ran.returncode == 0 and not ran.stderr, ran.stderr
    results = []
    for part in ran.stdout.split("== ")[1:]:
        lines = part.splitlines()
        results.append(("\n".join(lines[1:-2]), int(lines[-2].removeprefix("rc: ")), lines[-1]))
    assert len(results) == len(steps), ran.stdout
    return results


def states(steps: list[tuple[str, int, str]]) -> list[str]:
    return [state.removeprefix("state: ").strip() for _, _, state in steps]


def test_emulation_off_undoes_the_mount_after_several_ons_and_a_failed_on_and_again_changes_nothing(tmp_path, binfmt):
    """Issue 66: binfmt_misc, mounted by the first `on` of any architecture, is unmounted by the `off` that removes
    the last handler, whichever architecture's it is (`on A`, `on B`, `off A`, `off B` left it mounted); a failed
    `on` is undone by `off` too (it was not); `off` again is a no-op."""
    (a, qa), (b, qb) = other_architectures()
    both, only_b = f"mounted qemu-{qa} qemu-{qb} register status", f"mounted qemu-{qb} register status"

    ons = emulation(
        tmp_path / "1",
        binfmt,
        [f"E on {a}", f"E on {b}", f"E on {a}", f"E off {a}", f"E off {b}", f"E off {b}", f"E off {a}"],
        [qa, qb],
    )
    assert states(ons) == [f"mounted qemu-{qa} register status", both, both, only_b, *["unmounted"] * 3], ons
    assert [rc for _, rc, _ in ons] == [0] * 7, ons
    assert f"mounted binfmt_misc on {binfmt}" in ons[0][0] and f"registered {binfmt}/qemu-{qa}" in ons[0][0]
    assert f"unregistered {binfmt}/qemu-{qa}" in ons[3][0]
    assert f"{binfmt} stays mounted while it holds other handlers: qemu-{qb}" in ons[3][0]
    assert f"unregistered {binfmt}/qemu-{qb}" in ons[4][0] and f"unmounted {binfmt}" in ons[4][0]
    assert all("nothing to undo" in output for output, _, _ in ons[5:]), ons

    failed = emulation(tmp_path / "2", binfmt, [f"E on {b}", f"E off {b}", f"E off {b}"], [qa])
    assert states(failed) == ["mounted register status", "unmounted", "unmounted"], failed
    assert [rc != 0 for _, rc, _ in failed] == [True, False, False], failed
    assert f"error: qemu-user-static has no {tmp_path}/2/binfmt.d/qemu-{qb}.conf: reinstall it" in failed[0][0]
    assert f"`emulation.sh off {b}` undoes what this did" in failed[0][0]
    assert f"unmounted {binfmt}" in failed[1][0] and "nothing to undo" in failed[2][0], failed


def test_emulation_off_leaves_what_was_there_before_and_what_another_registered(tmp_path, binfmt):
    """What `on` found stays after `off` (a mount, a handler); a handler someone else registered on the mount keeps
    it mounted, said by name, until a later `off` finds it gone."""
    (a, qa), (b, qb) = other_architectures()
    conf = tmp_path / "1" / "binfmt.d" / f"qemu-{qa}.conf"
    found = f"mounted qemu-{qa} register status"
    before = emulation(
        tmp_path / "1",
        binfmt,
        [
            "mount -t binfmt_misc binfmt_misc $B",
            f"grep -v '^#' {conf} > $B/register",
            f"E on {a}",
            f"E on {b}",
            f"E off {b}",
            f"E off {a}",
        ],
        [qa, qb],
    )
    assert states(before)[2:] == [found, f"mounted qemu-{qa} qemu-{qb} register status", found, found], before
    assert [rc for _, rc, _ in before] == [0] * 6, before
    assert before[2][0] == "" and f"registered {binfmt}/qemu-{qb}" in before[3][0]
    assert f"unregistered {binfmt}/qemu-{qb}" in before[4][0] and "nothing to undo" in before[5][0], before

    conf = tmp_path / "2" / "binfmt.d" / f"qemu-{qb}.conf"
    other = emulation(
        tmp_path / "2",
        binfmt,
        [f"E on {a}", f"grep -v '^#' {conf} > $B/register", f"E off {a}", f"echo -1 > $B/qemu-{qb}", f"E off {a}"],
        [qa, qb],
    )
    assert states(other)[2:] == [f"mounted qemu-{qb} register status", "mounted register status", "unmounted"]
    assert [rc for _, rc, _ in other] == [0] * 5, other
    assert f"{binfmt} stays mounted while it holds other handlers: qemu-{qb}" in other[2][0]
    assert f"unmounted {binfmt}" in other[4][0], other


def test_the_image_scripts_and_the_package_name_architectures_from_one_list():
    """Issue 69: .ci/apptainer/common.sh reads the package's architectures.tsv, as scalelm.launch.container does: the
    same QEMU name for every architecture (by Debian's name too), this host's architecture the package's name of it,
    and an unknown one refused."""
    from scalelm.launch.container import QEMU_NAMES, node_architecture

    def common(call: str) -> subprocess.CompletedProcess:
        script = f"source {SCRIPTS / 'common.sh'}; {call}"
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True)

    for arch, machine in QEMU_NAMES.items():
        assert common(f"qemu_name {arch}").stdout.strip() == machine
    assert common("qemu_name ppc64el").stdout.strip() == QEMU_NAMES["ppc64le"]  # Debian's name of it
    assert common("host_arch").stdout.strip() == node_architecture()
    assert common("qemu_name vax").returncode != 0
