"""The locked environment: uv.lock holds every dependency but torch, its exports in requirements/ are current, the
environment the README's setup command made holds exactly the lock's versions; a run records which it had
(tests/test_workflow.py)."""

from __future__ import annotations

import shutil
import subprocess

from conftest import REPO
from scalelm.version import installed, installed_closure, lock_facts, read_lock

EXPORTS = ("image", "workflow", "dev")


def test_the_lock_is_current_and_its_exports_are_what_the_lock_script_makes(tmp_path):
    for part in (
        "pyproject.toml",
        "README.md",
        "uv.lock",
        "scripts/lock.sh",
        *(f"requirements/{e}.txt" for e in EXPORTS),
    ):
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / part, tmp_path / part)
    # --locked: fails if pyproject.toml asks for what uv.lock does not hold (offline: no resolution, a check)
    made = subprocess.run(
        ["bash", "scripts/lock.sh", "--locked", "--offline"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"UV": shutil.which("uv"), "PATH": "/usr/bin:/bin"},
    )
    assert made.returncode == 0, made.stderr
    for export in EXPORTS:
        assert (tmp_path / f"requirements/{export}.txt").read_text() == (
            REPO / f"requirements/{export}.txt"
        ).read_text()
    image = read_lock(REPO / "requirements/image.txt")
    assert {"numpy", "pyyaml", "psutil", "tensorboard", "nvidia-ml-py", "packaging"} <= set(image)
    assert "torch" not in image and "sympy" not in image  # the site's or the image's, with its own dependencies
    assert "snakemake" not in image and {"snakemake", "scipy"} <= set(read_lock(REPO / "requirements/workflow.txt"))
    assert "--hash=sha256:" in (REPO / "requirements/image.txt").read_text()


def test_the_environment_holds_the_locks_versions(tmp_path, monkeypatch):
    distributions = installed()
    facts = lock_facts(distributions)
    assert facts["file"] == str(REPO / "requirements/dev.txt") and len(facts["sha256"]) == 64
    assert facts["differs"] == {}, f"the environment is not the lock's: rerun scripts/setup.sh ({facts['differs']})"
    closure = installed_closure(distributions=distributions)
    assert {"scalelm", "torch", "numpy", "tensorboard"} <= set(closure) and "pytest" not in closure  # no extras

    # a pin the environment does not hold is named, with both versions; markers of other platforms are left out
    (tmp_path / "lock.txt").write_text(
        "numpy==0.0.1 \\\n    --hash=sha256:00\n    # via scalelm\npyyaml==" + closure["pyyaml"] + "\n"
        "pywin32==306 ; sys_platform == 'win32'\nnot-installed-anywhere==1.0\n"
    )
    assert read_lock(tmp_path / "lock.txt") == {
        "numpy": "0.0.1",
        "pyyaml": closure["pyyaml"],
        "not-installed-anywhere": "1.0",
    }
    monkeypatch.setenv("SCALELM_LOCK", str(tmp_path / "lock.txt"))
    assert lock_facts(distributions)["differs"] == {
        "numpy": ["0.0.1", closure["numpy"]],
        "not-installed-anywhere": ["1.0", None],
    }
