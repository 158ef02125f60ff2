"""Every training setting acts in every engine that accepts it, or is refused by name where layouts are checked,
before the run directory is touched (issue 41); both engines run on one base (scalelm.train.engine)."""

import copy
import dataclasses

import pytest
import torch

from conftest import run_dir_of, train_here
from scalelm.config import TrainConfig, load_config, refusals
from scalelm.errors import ConfigError
from scalelm.parallel.layout import resolve_layout
from scalelm.train.record import read_metrics

ENGINES = ("scalelm", "lightning")

# Every train.* setting at a value other than its default that a CPU can run (compile and the compiled optimizer are
# recorded where they are applied, not compiled: CPU compiles take minutes); one run per engine with all of them.
CHANGED = {
    "epochs": 2,
    "max_steps": 4,
    "log_every": 2,
    "eval_every": 3,
    "eval_batch_size": 8,
    "eval_batch_tokens": 64,
    "precision": "fp32",
    "peak_tflops": 0.5,
    "monitor_interval_s": 0.25,
    "comm_profile_steps": 1,
    "wandb": True,
    "deterministic": True,
    "activation_checkpointing": "full",
    "compile": True,
    "compile_mode": "max-autotune-no-cudagraphs",
    "compile_optimizer": True,
    "fused_loss": "plain",
    "attention_kernels": "auto",
    "hang_factor": 3.0,
    "hang_floor_s": 30.0,
}


def steps_without_max(run) -> int:
    from scalelm.train.engine import total_steps

    config = copy.deepcopy(run.engine.config)
    config.train.max_steps = None
    return total_steps(config, run.engine.batches)


def evals(run) -> list[tuple[str, int]]:
    return [(r["split"], r["step"]) for r in read_metrics(run.dir) if r["kind"] == "eval"]


# How each setting shows that it acted, read off the finished run: `run.engine` the engine object, `run.record` its
# run.json, `run.applied` what reached the functions that apply a setting. A setting missing here fails the test.
PROBES = {
    # train.max_steps (4) binds in the run: the epochs' steps are the run's without it
    "epochs": lambda run: steps_without_max(run) == 2 * run.engine.batches.steps_per_epoch,
    "max_steps": lambda run: run.record.results.steps == 4,
    "log_every": lambda run: [r["step"] for r in read_metrics(run.dir) if r["kind"] == "train"] == [2, 4],
    "eval_every": lambda run: evals(run) == [("validation", 3), ("validation", 4), ("test", 4)],
    "eval_batch_size": lambda run: {a["batch_size"] for a in run.applied["evaluate"]} == {8},
    "eval_batch_tokens": lambda run: {a["max_tokens"] for a in run.applied["evaluate"]} == {64},
    "precision": lambda run: run.engine.parallel.precision == "fp32",
    "peak_tflops": lambda run: run.record.results.peak_flops_per_device == pytest.approx(0.5e12),
    "monitor_interval_s": lambda run: run.applied["monitor"] == [0.25],
    # the window of steps profiled (one process has no collectives to profile: the window is all it shows)
    "comm_profile_steps": lambda run: (run.engine.instruments.comm.first, run.engine.instruments.comm.last) == (4, 4),
    "wandb": lambda run: (run.dir / "wandb").is_dir() and any((run.dir / "wandb").iterdir()),
    "deterministic": lambda run: run.applied["deterministic"],
    "activation_checkpointing": lambda run: all(
        getattr(b, "activation_checkpointing", None) == "full" for b in run.engine.model.blocks.values()
    ),
    "compile": lambda run: len(run.applied["compile"]) == 1,
    "compile_mode": lambda run: run.applied["compile"] == ["max-autotune-no-cudagraphs"],
    "compile_optimizer": lambda run: run.applied["optimizer_step"] == [True],
    # the head's loss on the logits, not fused with the projection as a CPU's in fp32 is by default
    "fused_loss": lambda run: run.engine.model.head.fused_loss == "plain",
    "attention_kernels": lambda run: run.applied["attention_kernels"] == ["auto"],
    "hang_factor": lambda run: run.engine.watchdog.factor == 3.0,
    "hang_floor_s": lambda run: run.engine.watchdog.floor_s == 30.0,
}


@dataclasses.dataclass
class Run:
    engine: object
    record: object
    dir: object
    applied: dict


def run_recorded(monkeypatch, config) -> Run:
    """Train `config` in this process, keeping the engine and what reached the functions that apply settings."""
    from scalelm.parallel import numerics, runtime
    from scalelm.train import evaluation, trainer
    from scalelm.train import run as entry

    applied = {"evaluate": [], "monitor": [], "compile": [], "optimizer_step": [], "attention_kernels": []}
    built = []
    make_engine, evaluate, monitor = entry.engine_for, evaluation.evaluate, entry.Monitor
    attention_backends = numerics.attention_backends

    def engine_for(config):
        class Recorded(make_engine(config)):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                built.append(self)

        return Recorded

    def recorded_evaluate(*args, **kwargs):
        applied["evaluate"].append({"batch_size": args[3], "max_tokens": kwargs["max_tokens"]})
        return evaluate(*args, **kwargs)

    def recorded_monitor(*args, **kwargs):
        applied["monitor"].append(args[2])
        return monitor(*args, **kwargs)

    def recorded_optimizer_step(optimizer, compiled):
        applied["optimizer_step"].append(compiled)
        return optimizer.step

    def recorded_attention_backends(setting, device):
        applied["attention_kernels"].append(setting)
        return attention_backends(setting, device)

    monkeypatch.setattr(entry, "engine_for", engine_for)
    monkeypatch.setattr(evaluation, "evaluate", recorded_evaluate)  # as the Validator calls it
    monkeypatch.setattr(entry, "Monitor", recorded_monitor)
    monkeypatch.setattr(trainer, "optimizer_step", recorded_optimizer_step)
    monkeypatch.setattr(numerics, "attention_backends", recorded_attention_backends)
    monkeypatch.setattr(runtime, "apply_compile", lambda model, device, mode: applied["compile"].append(mode))
    try:
        record = train_here(config)
        applied["deterministic"] = torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    (engine,) = built
    return Run(engine, record, run_dir_of(config), applied)


def test_every_training_setting_acts_in_every_engine_or_is_refused_by_name(tiny_config, monkeypatch):
    """Both engines, one process: each train.* setting either acts (its probe reads the change off the run) or is
    refused by name where layouts are checked; a setting with neither fails, a new one included."""
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name != "engine"}
    assert set(CHANGED) == set(PROBES) == set(fields), "a train.* setting without its changed value and probe"
    assert all(CHANGED[name] != default for name, default in fields.items())
    for engine in ENGINES:
        changed = {f"train.{name}": value for name, value in CHANGED.items()}
        refused = {}
        for key, value in changed.items():
            # alone, but for compile_mode's one condition (train.compile on)
            config = load_config(None, [f"train.engine={engine}", "train.compile=true", f"{key}={str(value).lower()}"])
            if refusals(config, engine):
                with pytest.raises(ConfigError, match=rf"^{key}=.* is scalelm's engine only .* leave {key} at"):
                    resolve_layout(config, 1, 1)
                refused[key] = value
        overrides = {k.replace(".", "__"): v for k, v in changed.items() if k not in refused}
        run = run_recorded(monkeypatch, tiny_config(engine, train__engine=engine, **overrides))
        monkeypatch.undo()
        for key in overrides:
            name = key.split("__")[1]
            assert PROBES[name](run), f"train.{name} set but not acting under train.engine={engine}"
        assert run.record.parallel.get("engine", "scalelm").split()[0] == engine
        expected = {"train.compile_optimizer", "train.attention_kernels"} if engine == "lightning" else set()
        assert set(refused) == expected


@pytest.mark.parametrize(
    "setting, device, message",
    [
        ("parallel.cpu_offload=true", "cpu", r"parallel.cpu_offload .* needs CUDA; .* set parallel.cpu_offload=false"),
        ("train.compile=true", "cuda", r"train.compile on CUDA needs a C compiler"),
        (
            "train.compile_optimizer=true",
            "cuda",
            r"train.compile_optimizer on CUDA needs a C compiler .* or set train.compile_optimizer: false",
        ),
    ],
)
def test_what_only_the_device_decides_is_refused_before_the_run_directory(
    setting, device, message, tiny_config, monkeypatch
):
    """FSDP's CPU offload on a CPU, a compiled CUDA run without a C compiler: refused when the layout meets its
    device (Parallel.start), before the run directory exists (they used to fire inside the model's build)."""
    from scalelm.parallel import compile as compiling
    from scalelm.parallel import runtime

    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    config = load_config(tiny_config("refused"), [setting])
    with pytest.raises(ConfigError, match=message):
        runtime.check_on_device(config, torch.device(device))
    if device == "cpu":  # one process has no FSDP to offload either: the layout's refusal comes first
        with pytest.raises(ConfigError, match=r"parallel.cpu_offload moves FSDP's parameters to host memory, and the"):
            train_here(tiny_config("refused"), setting)
        assert not run_dir_of(tiny_config("refused")).exists()
