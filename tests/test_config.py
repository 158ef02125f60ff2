import pytest

from scalelm.config import Config, load_config, parse_override
from scalelm.errors import ConfigError
from scalelm.parallel.layout import resolve_layout


def test_defaults_mirror_the_course():
    c = Config()
    assert (c.model.d_model, c.model.n_heads, c.model.n_layers, c.model.d_ff) == (128, 4, 2, 2048)
    assert (c.model.dropout, c.data.seq_len, c.optim.lr, c.batch.size, c.train.epochs, c.seed) == (
        0.1,
        32,
        2e-3,
        512,
        10,
        1,
    )
    assert c.batch.mode == "per_device" and c.parallel.strategy is None


def test_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_model: 64\noptim:\n  lr: 1.0e-3\n")
    c = load_config(path, ["model.n_layers=3", "optim.betas=[0.8, 0.9]", "optim.grad_clip=1", "run_dir=x"])
    assert c.model.d_model == 64 and c.model.n_layers == 3
    assert c.optim.betas == (0.8, 0.9) and c.optim.grad_clip == 1.0 and c.run_dir == "x"


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown setting 'model.d_modle'; did you mean 'model.d_model'"):
        load_config(None, ["model.d_modle=3"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_model=abc", r"model.d_model: expected an integer, got 'abc'"),
        ("model.dropout=true", r"model.dropout: expected a number"),
        ("batch.mode=both", r"batch.mode: 'both' is not one of 'per_device', 'global'"),
        ("parallel.strategy=dddp", r"unknown strategy 'dddp'; did you mean 'ddp'"),
        ("data.seq_len=2048", r"data.seq_len \(2048\) exceeds model.max_seq_len \(1024\)"),
        ("batch.size=0", r"batch.size must be positive, got 0"),
        ("train.peak_tflops=-5", r"train.peak_tflops must be positive or null, got -5"),
        (
            "train.monitor_interval_s=-1",
            r"train.monitor_interval_s must be 0 \(no monitor\) or a number of seconds, got -1",
        ),
        ("train.hang_factor=1.5", r"train.hang_factor must be 0 \(no watchdog\) or at least 2 .*, got 1.5"),
        ("train.hang_floor_s=0", r"train.hang_floor_s must be a positive number of seconds, got 0"),
        ("model.n_heads=3", r"model.d_model \(128\) must be divisible by model.n_heads \(3\)"),
        (
            "train.comm_profile_steps=-1",
            r"train.comm_profile_steps must be 0 \(no profile\) or a number of steps, got -1",
        ),
        ("parallel.host_reuse_below_mb=0", r"parallel.host_reuse_below_mb must be positive or null, got 0"),
        # what would only fail inside training (after the run directory was touched), or train silently wrong
        ("optim.weight_decay=-1", r"optim.weight_decay must be 0 or positive, got -1"),
        ("optim.betas=[2, 3]", r"optim.betas\[0\] must be in \[0, 1\), got 2"),
        ("optim.betas=[0.9, 1]", r"optim.betas\[1\] must be in \[0, 1\), got 1"),
        ("optim.lr=.nan", r"optim.lr: expected a finite number, got nan"),
        ("optim.lr=.inf", r"optim.lr: expected a finite number, got inf"),
        ("optim.lr=nan", r"optim.lr: expected a finite number, got nan"),  # YAML's string, read as a float
        ("optim.grad_clip=-1", r"optim.grad_clip must be a positive gradient norm, or null for no clipping, got -1"),
        ("optim.grad_clip=0", r"optim.grad_clip must be a positive gradient norm"),
        ("optim.min_lr_ratio=-3", r"optim.min_lr_ratio must be in \[0, 1\] .*, got -3"),
        ("optim.warmup_steps=-5", r"optim.warmup_steps must be 0 \(no warm-up\) or a number of steps, got -5"),
        ("train.peak_tflops=.nan", r"train.peak_tflops: expected a finite number, got nan"),
        ("model.dropout=.nan", r"model.dropout: expected a finite number, got nan"),
        ("seed=-1", r"seed must be an integer from 0 to 4294967295, got -1"),
        ("seed=18446744073709551616", r"seed must be an integer from 0 to 4294967295, got 18446744073709551616"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.pp_schedule=zb"], r"parallel.pp_schedule: 'zb' is not one of 'gpipe', '1f1b', 'interleaved_1f1b'"),
        (["parallel.pp_microbatches=0"], r"parallel.pp_microbatches must be positive or null, got 0"),
        (["parallel.pp_virtual_stages=0"], r"parallel.pp_virtual_stages must be positive, got 0"),
    ],
)
def test_pipeline_settings_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.pp=4"],
            r"model.n_layers=2 blocks cannot fill 4 pipeline stages \(parallel.pp=4 x pp_virtual_stages=1\)",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
            r"interleaved_1f1b runs several stages per rank, but parallel.pp_virtual_stages=1",
        ),
        (
            ["parallel.pp=2", "parallel.pp_virtual_stages=2"],
            r"parallel.pp_virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b",
        ),
        (
            ["parallel.pp=2", "model.tie_weights=true"],
            r"model.tie_weights shares the embedding of the first pipeline stage",
        ),
        (
            ["parallel.pp=2", "parallel.pp_microbatches=3"],
            r"parallel.pp_microbatches=3 does not divide the batch of \d+ sequences",
        ),
    ],
)
def test_a_pipeline_that_cannot_be_built_is_refused_where_its_layout_is_resolved(overrides, message):
    """The trainer (Parallel.start), the workflow (each experiment) and the planner all call resolve_layout."""
    config = load_config(None, overrides)
    world = config.parallel.pp
    with pytest.raises(ConfigError, match=message):
        resolve_layout(config, world, world)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.cp=2", "data.seq_len=18"], 2,
         r"^data.seq_len=18 is not divisible by 2 x parallel.cp = 4 \(context parallelism with load balancing cuts "
         r"each sequence into 2 x cp chunks\); choose a sequence length that is a multiple of 4$"),
        (["parallel.cp=4", "parallel.cp_load_balance=false", "data.seq_len=18"], 4,
         r"data.seq_len=18 is not divisible by parallel.cp = 4 .*multiple of 4$"),
        (["parallel.cp=2", "parallel.cp_load_balance=false", "parallel.tp=2", "parallel.sequence_parallel=true",
          "data.seq_len=18"], 4,
         r"parallel.sequence_parallel splits each context-parallel rank's 9 tokens .* across parallel.tp=2 ranks"),
        (["parallel.cp=0"], 1, r"parallel.cp must be a positive integer or -1 \(the rest of the world\), got 0"),
    ],
)  # fmt: skip
def test_a_sequence_that_context_parallelism_cannot_split_is_refused_where_its_layout_is_resolved(
    overrides, world, message
):
    with pytest.raises(ConfigError, match=message):
        resolve_layout(load_config(None, overrides), world, world)


def test_invalid_yaml_and_bad_override(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="not of the form key=value"):
        parse_override("model.d_model")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_weights_and_biases_without_its_package_is_a_clear_error(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(
        ConfigError, match=r"train.wandb=true .* needs the wandb package: pip install 'scalelm\[wandb\]'"
    ):
        load_config(None, ["train.wandb=true"])
