"""How scalelm.launch turns an experiment's geometry into torchrun command lines; the `scalelm` command."""

import contextlib
import importlib
import socket
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO
from scalelm.cli import COMMANDS
from scalelm.errors import ConfigError
from scalelm.launch import launcher as launch
from scalelm.launch import slurm
from scalelm.launch.container import PASSED_PREFIXES


def commands(monkeypatch, argv, env=None, hosts=("c01", "c02"), cpus_per_node=8):
    unset = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "GLIBC_TUNABLES")
    passed_by_prefix = [name for name in launch.os.environ if name.startswith(PASSED_PREFIXES)]
    for name in (*unset, *launch.THREAD_VARIABLES, *passed_by_prefix):
        monkeypatch.setenv(name, "")  # recorded, so that what the launcher sets is undone after the test too
        monkeypatch.delenv(name)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    allocation = slurm.Allocation(list(hosts), cpus_per_node, restarts=0)
    monkeypatch.setattr(slurm, "allocation", lambda job_id: allocation)
    args, train = launch.parse_args([*argv, "--", "--config", "t.yaml"])
    return launch.build_commands(args, train)


def test_single_node_is_one_standalone_torchrun(monkeypatch):
    [command] = commands(monkeypatch, ["--nodes", "1", "--procs-per-node", "4"])
    assert command[:4] == ["torchrun", "--nnodes=1", "--nproc-per-node=4", "--standalone"]
    assert command[-4:] == ["-m", "scalelm.train", "--config", "t.yaml"]
    # the machine's baseline on the same geometry; no other program (a module name is no place for a user's code)
    first, second = commands(monkeypatch, ["--program", "baseline", "--nodes", "2"])
    assert first == second and first[-4:] == ["-m", "scalelm.measure.baseline", "--config", "t.yaml"]
    with pytest.raises(SystemExit):
        launch.parse_args(["--program", "os", "--", "x"])


def test_the_spawn_launcher_replaces_torchrun_on_one_node_here_and_in_slurm_and_refuses_several(monkeypatch):
    """The lecture's torch.multiprocessing.spawn (`launcher: spawn`); its run is tested against torchrun's, bitwise,
    through a stop and a resume, in tests/test_training.py."""
    spawn = ["-m", "scalelm.launch.spawn", "--nprocs=2", "--", "-m", "scalelm.train", "--config", "t.yaml"]
    [command] = commands(monkeypatch, ["--launcher", "spawn", "--procs-per-node", "2"])
    assert command == [launch.sys.executable, *spawn]
    [command] = commands(monkeypatch, ["--launcher", "spawn", "--procs-per-node", "2"], {"SLURM_JOB_ID": "9"})
    assert command[command.index("scalelm.launch.supervise") + 2 :] == [launch.sys.executable, *spawn]
    with pytest.raises(ConfigError, match="--launcher spawn starts one node's processes, but --nodes is 2"):
        commands(monkeypatch, ["--launcher", "spawn", "--nodes", "2"])


def test_multi_node_in_slurm_is_one_supervised_torchrun_per_node_with_a_job_derived_port(monkeypatch):
    env = {"SLURM_JOB_ID": "123457"}
    [command] = commands(monkeypatch, ["--nodes", "2", "--procs-per-node", "4", "--host-suffix", "i"], env)
    srun = ["srun", "--jobid=123457", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=8"]
    assert command[:8] == [*srun, "--kill-on-bad-exit=1", launch.sys.executable]
    assert command[8:12] == ["-m", "scalelm.launch.supervise", "--", "torchrun"]
    assert "--rdzv-endpoint=c01i:29957" in command  # 29500 + 123457 mod 500
    assert "--rdzv-id=123457" in command and "--nnodes=2" in command


def test_one_node_in_slurm_is_a_supervised_torchrun_in_an_srun_step_that_the_stop_signal_reaches(monkeypatch):
    [command] = commands(monkeypatch, ["--nodes", "1", "--procs-per-node", "4"], {"SLURM_JOB_ID": "9"}, hosts=["c07"])
    assert command[:6] == ["srun", "--jobid=9", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--cpus-per-task=8"]
    supervised = command[command.index("scalelm.launch.supervise") + 2 :]
    assert supervised[:4] == ["torchrun", "--nnodes=1", "--nproc-per-node=4", "--standalone"]
    assert not any(arg.startswith(("--gres", "--gpu-bind")) for arg in command)
    # on a site with GPUs the step asks for the node's (a step gets none it did not ask for) and binds none to the
    # one task: its torchrun's processes see every GPU and each takes its LOCAL_RANK's
    [command] = commands(
        monkeypatch, ["--nodes", "1", "--procs-per-node", "4", "--gpu"], {"SLURM_JOB_ID": "9"}, hosts=["c07"]
    )
    assert command[6:9] == ["--gres=gpu:4", "--gpu-bind=none", "--kill-on-bad-exit=1"]


def test_two_jobs_sharing_a_node_get_different_ports():
    ports = {slurm.job_port(str(job), (29500, 29999)) for job in range(1000, 1500)}
    assert len(ports) == 500
    with pytest.raises(ConfigError, match="port range 80-90"):
        slurm.job_port("1", (80, 90))


def test_a_port_in_use_on_the_rendezvous_host_is_skipped_and_an_exhausted_range_is_a_clear_error():
    low = next(p for p in range(40000, 48000, 11) if all(slurm.port_is_free(p + i) for i in range(4)))
    with contextlib.ExitStack() as held:
        for port in (low, low + 1, low + 2):  # held listening, like other jobs' rendezvous servers
            sock = held.enter_context(socket.socket())
            sock.bind(("", port))
            sock.listen()
        job = "3000"  # 0 mod 3 and 0 mod 4: the range's first port
        assert slurm.job_port(job, (low, low + 2)) == low  # without probing: the port derived from the job id
        assert slurm.job_port(job, (low, low + 3), probe=True) == low + 3  # the first free one after it
        with pytest.raises(ConfigError, match=rf"port range {low}-{low + 2} is exhausted: all 3 ports are in use"):
            slurm.job_port(job, (low, low + 2), probe=True)


def test_multi_node_without_slurm_runs_local_torchruns_meeting_on_one_port(monkeypatch):
    first, second = commands(monkeypatch, ["--nodes", "2", "--procs-per-node", "1"])
    assert first == second and "--nnodes=2" in first
    assert any(a.startswith("--rdzv-endpoint=127.0.0.1:") for a in first)


def test_each_process_gets_its_share_of_the_cpus(monkeypatch):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(8)))
    snakemake = {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4"}  # the rule's threads
    commands(monkeypatch, ["--nodes", "1", "--procs-per-node", "4"], snakemake)
    assert [launch.os.environ[name] for name in snakemake] == ["2", "2", "2"]  # MKL's too: torch's matmuls use it
    assert "NUMEXPR_NUM_THREADS" not in launch.os.environ  # not set before: left unset
    commands(monkeypatch, ["--nodes", "2", "--procs-per-node", "4"])  # two local "nodes" share this machine
    assert launch.os.environ["OMP_NUM_THREADS"] == "1"
    commands(monkeypatch, ["--nodes", "2", "--procs-per-node", "2"], {"SLURM_JOB_ID": "7"})  # the job's CPUs per node
    assert launch.os.environ["OMP_NUM_THREADS"] == "4"
    # malloc maps large buffers with huge pages (scalelm.parallel.hostmemory); a site's own tunables stay
    assert launch.os.environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    commands(monkeypatch, [], {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert launch.os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    commands(monkeypatch, [], {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert launch.os.environ["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_container_wraps_each_torchrun(monkeypatch):
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1})
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    [command] = commands(monkeypatch, ["--container", "img.sif", "--bind", "/data", "--gpu"], env)
    prefix = ["apptainer", "exec", "--cleanenv", "--nv", "--bind", "/data"]
    prefix += ["--env", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1", "--env", "NCCL_SOCKET_IFNAME=ib0"]
    prefix += ["--env", "OMP_NUM_THREADS=2", "img.sif"]  # --cleanenv drops them
    assert command[: len(prefix)] == prefix and command[len(prefix)] == "torchrun"
    [command] = commands(monkeypatch, ["--container", "img.sif"], {"SLURM_JOB_ID": "3"}, cpus_per_node=6)
    inside = command[command.index("img.sif") + 1 :]  # the image's Python supervises the image's torchrun
    assert inside[:5] == ["python", "-m", "scalelm.launch.supervise", "--", "torchrun"]
    assert "OMP_NUM_THREADS=6" in command


def test_bad_geometry_is_refused(monkeypatch):
    with pytest.raises(ConfigError, match="--nodes must be positive, got 0"):
        commands(monkeypatch, ["--nodes", "0"])
    with pytest.raises(ConfigError, match="allocation has 2 node"):
        commands(monkeypatch, ["--nodes", "3"], {"SLURM_JOB_ID": "5"})


def test_launch_without_the_programs_arguments_is_one_usage_error(capsys):
    """Issue 49: without arguments the launcher started torchrun on the default settings, which failed there with
    torchrun's traceback."""
    for argv in ([], ["--nodes", "1"], ["--program", "baseline", "--"]):
        with pytest.raises(SystemExit) as stop:
            launch.main(argv)
        err = capsys.readouterr().err
        program = "baseline" if "baseline" in argv else "train"
        assert stop.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: nothing to run: give the {program} program's arguments after `--`, e.g."), err


def test_site_settings_are_typed_and_produce_the_jobs_sbatch_options_prelude_and_launch_flags(tmp_path):
    from scalelm.site import load_site

    path = tmp_path / "site.yaml"
    path.write_text(
        "account: proj1\npartition: dc-gpu\nreservation: course\ngpus_per_node: 4\nhost_suffix: i\n"
        "network_interface: ib0\nport_range: [30000, 30099]\nmodules: [Stages/2025, CUDA]\n"
    )
    site = load_site(path)
    assert site.sbatch_resources() == {"slurm_account": "proj1", "slurm_partition": "dc-gpu"}
    assert site.slurm_extra() == "--reservation=course"
    assert site.slurm_extra(stop_signal_s=300) == "--reservation=course --signal=USR1@300"
    assert site.slurm_extra(300, training=True) == "--reservation=course --exclusive --signal=USR1@300"
    path.write_text(path.read_text() + "exclusive: false\npeak_tflops: 400\n")
    assert load_site(path).slurm_extra(300, training=True) == "--reservation=course --signal=USR1@300"
    assert load_site(path).peak_tflops == 400.0
    path.write_text(path.read_text().replace("peak_tflops: 400", "peak_tflops: 0"))
    with pytest.raises(
        ConfigError, match="site file .*: peak_tflops must be one GPU's positive dense TFLOP/s or null, got 0"
    ):
        load_site(path)
    assert site.prelude() == (
        "module load Stages/2025 CUDA && export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 && "
    )
    assert site.launch_flags() == ["--host-suffix", "i", "--port-range", "30000", "30099"]
    assert site.gres(2) == "gpu:2" and load_site(None).gres(2) == ""  # no site file: CPU nodes, Slurm's defaults
    with pytest.raises(ConfigError, match="experiment big runs 8 processes per node but the site's nodes have 4 GPUs"):
        site.check_fits("big", 8)


@pytest.mark.parametrize(
    "text, message",
    [
        ("acount: proj1\n", r"site file .*site.yaml: unknown setting 'acount'; did you mean 'account'\?"),
        ("gpus_per_node: four\n", r"gpus_per_node: expected an integer, got 'four'"),
        ("modules: CUDA\n", r"modules: expected a list, got 'CUDA'"),
        ("port_range: [80, 90]\n", r"port_range \[80, 90\] must be two ports within 1024-65535"),
        ("- account\n", r"must hold a mapping of settings"),
    ],
)
def test_a_bad_site_file_is_a_clear_error_naming_the_key(tmp_path, text, message):
    from scalelm.site import load_site

    path = tmp_path / "site.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_site(path)


def test_the_shipped_site_file_loads():
    from conftest import REPO
    from scalelm.site import load_site

    site = load_site(REPO / "profiles/slurm/site.yaml")
    assert site.gpus_per_node == 4 and site.port_range == (29500, 29999)


def test_a_stop_goes_to_the_training_processes_not_to_torchrun_which_would_kill_them_after_30_s(tmp_path):
    """The supervisor passes a stop signal to the workers under torchrun (SIGUSR1: checkpoint, exit 75) and leaves
    torchrun alone; torchrun ends because they did. Stand-ins: a "torchrun" that notes any SIGTERM and waits for its
    worker, a worker (`scalelm.train` in its command line) that notes the SIGUSR1 and exits 75."""
    import signal
    import subprocess
    import sys
    import time

    from scalelm.launch import supervise

    worker = (
        "import pathlib, signal, sys, time\n"
        "def stop(*_):\n"
        f"    pathlib.Path({str(tmp_path / 'worker')!r}).write_text('SIGUSR1'); sys.exit(75)\n"
        "signal.signal(signal.SIGUSR1, stop)\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()\n"
        "time.sleep(60)\n"
    )
    torchrun = (
        "import pathlib, signal, subprocess, sys\n"
        f"signal.signal(signal.SIGTERM, lambda *_: pathlib.Path({str(tmp_path / 'torchrun')!r}).write_text('SIGTERM'))\n"
        f"sys.exit(1 if subprocess.call([sys.executable, '-c', {worker!r}, 'scalelm.train']) else 0)\n"
    )
    supervisor = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from scalelm.launch.supervise import supervise; sys.exit(supervise([sys.argv[1:]]))",
            sys.executable,
            "-c",
            torchrun,
        ],
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and supervisor.poll() is None
        time.sleep(0.05)
    supervisor.send_signal(signal.SIGUSR1)
    assert supervisor.wait(timeout=60) == supervise.EXIT_PREEMPTED
    assert (tmp_path / "worker").read_text() == "SIGUSR1" and not (tmp_path / "torchrun").exists()


def test_one_scalelm_command_runs_every_step():
    """`scalelm COMMAND ARGS` (pyproject's console script, or `python -m scalelm`) is `python -m MODULE ARGS`."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"scalelm": "scalelm.cli:main"}
    assert all(callable(importlib.import_module(module).main) for module, _ in COMMANDS.values())
    scalelm = [sys.executable, "-m", "scalelm"]
    machine = ["--vocab-size", "33278", "--nodes", "2", "--gpus-per-node", "4", "--gpu-memory-gb", "80"]
    planned = subprocess.run([*scalelm, "plan", *machine], capture_output=True, text=True, timeout=120)
    direct = subprocess.run(
        [sys.executable, "-m", "scalelm.plan", *machine], capture_output=True, text=True, timeout=120
    )
    assert planned.returncode == 0 and "recommended:" in planned.stdout and planned.stdout == direct.stdout
    unknown = subprocess.run([*scalelm, "trian"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode != 0 and "unknown command 'trian'; did you mean 'train'?" in unknown.stderr
    listed = subprocess.run(scalelm, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 2 and all(f"  {name} " in listed.stdout for name in COMMANDS)


def test_the_image_labels_record_the_base_images_digest(tmp_path, capsys):
    """A rebuild gets the same base only where it is pinned: the digest of a pinned reference, the checksum of a
    local image, and an unpinned tag said aloud (the default config pins its base)."""
    from scalelm.files import sha256
    from scalelm.launch.container import base_digest, split_base

    pinned = "docker://pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime@sha256:" + "ab" * 32
    assert base_digest(*split_base(pinned)) == "sha256:" + "ab" * 32
    (tmp_path / "base.sif").write_bytes(b"an image")
    assert base_digest(*split_base(str(tmp_path / "base.sif"))) == "sha256:" + sha256(tmp_path / "base.sif")
    assert base_digest(*split_base("docker://pytorch/pytorch:latest")) == "unpinned"
    assert "docker://pytorch/pytorch:latest is not pinned by digest (@sha256:...)" in capsys.readouterr().err
    default = (REPO / "config/config.yaml").read_text()
    assert "base_image: docker://pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime@sha256:" in default


def test_another_architectures_image_runs_only_where_emulation_is_allowed_and_present(monkeypatch, tmp_path, capsys):
    """Issue 55: an arm64 (GH200) image on an amd64 node is refused by name, unless emulation is allowed and this
    machine has it (an enabled QEMU handler with the F flag, which a container can use)."""
    from scalelm.launch import container

    monkeypatch.setattr(container, "image_architecture", lambda runtime, image: "arm64")
    binfmt = tmp_path / "binfmt_misc"
    binfmt.mkdir()
    refused = (
        r"built for arm64 but this node \(.*\) is x86_64: build the image for amd64 .*--arch amd64.*--allow-emulation"
    )
    with pytest.raises(container.ContainerError, match=refused):
        container.check_architecture("apptainer", "img.sif", "x86_64", binfmt=binfmt)
    missing = r"cannot run the arm64 image img.sif .*\(no enabled QEMU handler .*qemu-aarch64 with the F flag\)\. As root: `.ci/apptainer/emulation.sh on arm64`"
    with pytest.raises(container.ContainerError, match=missing):
        container.check_architecture("apptainer", "img.sif", "x86_64", allow_emulation=True, binfmt=binfmt)
    handler, usable = (
        binfmt / "qemu-aarch64",
        "enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: POCF\n",
    )
    for text, runs in ((usable, True), (usable.replace("enabled", "disabled"), False), (usable[:-2] + "\n", False)):
        handler.write_text(text)
        assert container.emulates("arm64", binfmt) is runs, text
    handler.write_text(usable)
    emulated = container.check_architecture("apptainer", "img.sif", "x86_64", allow_emulation=True, binfmt=binfmt)
    assert "under QEMU emulation (--allow-emulation): the results hold, its timings do not" in capsys.readouterr().err
    # what the launcher then sets goes into the image, and so into run.json (the report flags the run's timings)
    assert emulated == "arm64 on x86_64"
    assert container.passed_environment({container.EMULATED_ENV: emulated, "HOME": "/root"}) == {
        "SCALELM_EMULATED": "arm64 on x86_64"
    }
    for image_arch in ("amd64", None):  # this node's, or no SIF header to read: nothing to refuse, nothing said
        monkeypatch.setattr(container, "image_architecture", lambda runtime, image, arch=image_arch: arch)
        assert container.check_architecture("apptainer", "img.sif", "x86_64", binfmt=tmp_path) is None
    assert capsys.readouterr().err == ""


def test_an_image_build_for_an_unknown_architecture_is_a_usage_error(capsys):
    from scalelm.launch import container

    with pytest.raises(SystemExit) as stop:
        container.main(
            ["build", "--definition", "d.def", "--out", "x.sif", "--base-image", "docker://a:b", "--arch", "x86"]
        )
    assert stop.value.code == 2 and "--arch: invalid choice: 'x86' (choose from" in capsys.readouterr().err


def test_allow_emulation_without_an_image_is_refused_by_name():
    """Issue 66: --allow-emulation without --container changed nothing (the run is on this machine's own Python) and
    was accepted in silence; like container.allow_emulation without a container mode, it is refused by name."""
    with pytest.raises(ConfigError) as refused:
        launch.parse_args(["--allow-emulation", "--", "--config", "t.yaml"])
    assert str(refused.value).startswith("--allow-emulation applies only with --container IMAGE"), refused.value
    assert "give --container, or drop --allow-emulation" in str(refused.value)
    args, _ = launch.parse_args(["--container", "img.sif", "--allow-emulation", "--", "--config", "t.yaml"])
    assert args.allow_emulation and args.container == "img.sif"
