import os
import re

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
    "moe, key, value",
    [
        ("z_loss_coef: 1e30", "z_loss_coef", "1e\\+30"),  # overflowed the gradients at step 1
        ("z_loss_coef: 1e300", "z_loss_coef", "1e\\+300"),  # no float32: a RuntimeError in the backward
        ("aux_loss_coef: 1e300", "aux_loss_coef", "1e\\+300"),
        ("balance: bias, bias_rate: 1e300", "bias_rate", "1e\\+300"),
    ],
)
def test_a_router_coefficient_beyond_float32s_reach_is_refused_by_name_before_the_run(moe, key, value):
    """Issue 66: a router coefficient above ROUTER_COEF_LIMIT is refused at load, naming it and its value, rather
    than failing in the training (blaming optim.lr, or with a traceback); the limit itself is accepted."""
    with pytest.raises(ConfigError, match=rf"^model.moe.{key} must be at most 1000, got {value}: .*; lower it$"):
        load_config(None, [f"model.moe={{experts: 4, {moe}}}"])
    limit = load_config(None, ["model.moe={experts: 4, aux_loss_coef: 1000, z_loss_coef: 1000}"]).model.moe
    assert (limit.aux_loss_coef, limit.z_loss_coef) == (1000, 1000)


def test_a_coefficient_its_balance_does_not_use_is_refused_unless_at_its_default():
    """Issue 66: bias_rate under balance=aux, aux_loss_coef under balance=bias or none would train nothing and still
    tell the run apart (its identity holds them): refused by name with the balance. At their defaults they are
    accepted under every balance, and the identity keeps them as before."""
    from scalelm.config import identity_settings

    for balance, key, value in (
        ("aux", "bias_rate", 0.01),
        ("bias", "aux_loss_coef", 0.3),
        ("none", "aux_loss_coef", 0.0),
    ):
        used = {"bias_rate": "bias", "aux_loss_coef": "aux"}[key]
        refused = rf"model.moe.{key}={value} acts under model.moe.balance={used} only, and the balance is {balance}: "
        with pytest.raises(ConfigError, match=rf"^{refused}remove {key} .*or set model.moe.balance={used}$"):
            load_config(None, [f"model.moe={{experts: 4, balance: {balance}, {key}: {value}}}"])
    for balance in ("aux", "bias", "none"):
        spelt = load_config(
            None, [f"model.moe={{experts: 4, balance: {balance}, aux_loss_coef: 0.01, bias_rate: 0.001}}"]
        )
        moe = identity_settings(spelt.to_dict())["model"]["moe"]
        assert moe["aux_loss_coef"] == 0.01 and "bias_rate" not in moe  # (an added setting, at its default)


def test_a_setting_of_the_other_model_family_is_refused_by_name_and_the_course_blocks_identity_is_unchanged():
    """Issue 70: n_kv_heads and rope_theta are the llama block's, model.norm the course block's (a llama block is
    always pre-norm): each refused by name with the other family unless at its default; grouped-query attention's
    key/value heads divide the query heads, and tensor parallelism divides them. The new settings at their
    defaults leave a run's identity as it was; a llama run's identity names none of the course block's settings."""
    from scalelm.config import identity_settings

    for overrides, message in (
        (["model.n_kv_heads=2"], r"^model.n_kv_heads=2 applies to model.family=llama only, and the family is gpt2: "),
        (["model.rope_theta=500000"], r"^model.rope_theta=500000.0 applies to model.family=llama only"),
        (["model.family=llama", "model.norm=pre"], r"^model.norm=pre applies to model.family=gpt2 only.*pre-norm"),
        (["model.family=llama", "model.n_kv_heads=3"], r"model.n_kv_heads \(3\) must divide model.n_heads \(4\)"),
        (["model.family=llama", "model.n_kv_heads=0"], r"model.n_kv_heads must be a positive integer or null"),
        (["model.family=bert"], r"model.family: 'bert' is not one of 'gpt2', 'llama'"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    llama = load_config(None, ["model.family=llama", "model.n_heads=8", "model.n_kv_heads=2", "parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2 is not divisible by parallel.tp=4: each TP rank"):
        resolve_layout(load_config(None, ["model.family=llama", "model.n_kv_heads=2", "parallel.tp=4"]), 4, 4)
    assert resolve_layout(llama, 2, 2)
    assert identity_settings(Config().to_dict())["model"].keys() == {
        "d_model",
        "n_heads",
        "n_layers",
        "d_ff",
        "dropout",
        "max_seq_len",
        "norm",
        "tie_weights",
    }
    llama_identity = identity_settings(llama.to_dict())["model"]
    assert llama_identity["family"] == "llama" and llama_identity["n_kv_heads"] == 2
    assert "norm" not in llama_identity  # the course block's setting: a llama run's identity does not name it


def test_a_misspelt_strategy_is_refused_where_layouts_are_checked():
    """Strategies and degrees are the layout's (scalelm.parallel.dims): checked with it, by the trainer, the workflow
    and the planner alike, not a second time by the settings' loader."""
    from scalelm.parallel.layout import resolve_layout

    with pytest.raises(ConfigError, match=r"unknown strategy 'dddp'; did you mean 'ddp'"):
        resolve_layout(load_config(None, ["parallel.strategy=dddp"]), 2, 2)


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
        (
            ["parallel.cp=2", "data.seq_len=18"],
            2,
            r"^data.seq_len=18 is not divisible by 2 x parallel.cp = 4 \(context parallelism with load balancing cuts "
            r"each sequence into 2 x cp chunks\); choose a sequence length that is a multiple of 4$",
        ),
        (
            ["parallel.cp=4", "parallel.cp_load_balance=false", "data.seq_len=18"],
            4,
            r"data.seq_len=18 is not divisible by parallel.cp = 4 .*multiple of 4$",
        ),
        (
            [
                "parallel.cp=2",
                "parallel.cp_load_balance=false",
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "data.seq_len=18",
            ],
            4,
            r"parallel.sequence_parallel splits each context-parallel rank's 9 tokens .* across parallel.tp=2 ranks",
        ),
        (["parallel.cp=0"], 1, r"parallel.cp must be a positive integer or -1 \(the rest of the world\), got 0"),
    ],
)
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


def test_weights_and_biases_without_its_package_is_refused_before_the_run_directory(monkeypatch, tiny_config):
    """What is installed is the training's to check (the settings load anywhere, a login node without wandb
    included), before anything is written."""
    import importlib.util

    from conftest import run_dir_of, train_here

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    config = tiny_config("wandb", train__wandb=True)
    assert load_config(config).train.wandb
    with pytest.raises(
        ConfigError, match=r"train.wandb=true .* needs the wandb package: pip install 'scalelm\[wandb\]'"
    ):
        train_here(config)
    assert not run_dir_of(config).exists()


# ------------------------------------------------------------------------------ settings files: hostile YAML
def alias_bomb(depth: int) -> str:
    """Under 500 bytes of YAML whose value, expanded, holds 10^(depth+1) strings (550 MB of repr at depth 6)."""
    value = "&a0 [x, x, x, x, x, x, x, x, x, x]"
    for level in range(1, depth + 1):
        value = f"&a{level} [{value}, {', '.join([f'*a{level - 1}'] * 9)}]"
    return f"train:\n  epochs: {value}\n"


def test_settings_files_refuse_aliases_duplicate_keys_deep_nesting_and_unreadable_files_naming_them(tmp_path):
    from scalelm.config import write_settings
    from scalelm.site import load_site

    cases = {
        "bomb.yaml": (alias_bomb(7), r"bomb.yaml, line 2: YAML anchors and aliases \(&name, \*name\) are not accepted"),
        "twice.yaml": (
            "seed: 1\nmodel:\n  d_ff: 64\n  n_layers: 3\n  d_ff: 32\n",
            r"twice.yaml, line 5: key 'd_ff' appears twice \(first on line 3\); keep one",
        ),
        "deep.yaml": ("seed: " + "[" * 50_000 + "]" * 50_000 + "\n", r"deep.yaml, line 1: nested more than 32 levels"),
        "latin1.yaml": (b"run_dir: r\xe9sultats\n", r"latin1.yaml is not UTF-8 text \(byte 0xe9 at offset 10\); save"),
        "huge_int.yaml": ("seed: " + "1" * 5000 + "\n", r"huge_int.yaml is not valid YAML: a value cannot be read"),
        "huge.yaml": ("seed: 1\n#" + "#" * 2**20, r"huge.yaml is larger than 1 MiB, far beyond any settings"),
    }
    assert len(alias_bomb(7)) < 500
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ConfigError, match=f"^config file {tmp_path}/{message}") as err:
            load_config(path)
        assert len(str(err.value)) < 300
    with pytest.raises(ConfigError, match=f"^config file {tmp_path} is a directory; give the YAML file in it"):
        load_config(tmp_path)
    os.mkfifo(tmp_path / "fifo")  # opening it would wait for a writer; /dev/zero would never end
    for special in (tmp_path / "fifo", "/dev/zero"):
        with pytest.raises(
            ConfigError, match=rf"^config file {special} is not a regular file \(a pipe or a device\?\)"
        ):
            load_config(special)
    with pytest.raises(ConfigError, match=f"^site file {tmp_path}/bomb.yaml, line 2: YAML anchors and aliases"):
        load_site(tmp_path / "bomb.yaml")
    for override, message in [
        ("seed=[&a 1, *a]", "anchors and aliases"),
        ("model={d_ff: 1, d_ff: 2}", "'d_ff' appears twice"),
    ]:
        with pytest.raises(ConfigError, match=f"^override '{re.escape(override)}', line 1: .*{message}"):
            load_config(None, [override])
    # JSON (a Snakemake config file may be) is read even where YAML is not (tabs), its duplicate keys refused too
    (tmp_path / "tabs.json").write_text('{\n\t"seed": 3,\n\t"model": {"d_ff": 64}\n}')
    assert load_config(tmp_path / "tabs.json").seed == 3
    (tmp_path / "tabs.json").write_text('{\n\t"seed": 3,\n\t"seed": 4\n}')
    with pytest.raises(ConfigError, match="tabs.json is not valid YAML: key 'seed' appears twice in one object"):
        load_config(tmp_path / "tabs.json")
    # what scalelm writes it reads back: a list held twice is written out twice, not as an alias
    shared = [0.8, 0.9]
    write_settings({"optim": {"betas": shared}, "other": shared}, tmp_path / "written.yaml")
    assert "&" not in (tmp_path / "written.yaml").read_text()


def test_an_error_quotes_at_most_a_few_hundred_characters_of_a_value(tmp_path):
    from scalelm.settings_yaml import shown
    from scalelm.study.workflow import check_command_line_values

    long_list = "[" + ", ".join(["12345"] * 2000) + "]"
    for override in (f"train.epochs={long_list}", f"model={long_list}", f"seed='{'x' * 100_000}'"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert len(str(err.value)) < 500, str(err.value)[:100]
    with pytest.raises(ConfigError, match=r"^results: 'x{100}.*\.\.\. holds ;") as err:
        check_command_line_values({"results": "x" * 1_000_000 + ";"})
    assert len(str(err.value)) < 600
    nested = []
    for _ in range(100_000):  # deeper than Python's stack: quoting stops after the limit
        nested = [nested]
    assert shown(nested, 50) == "[" * 50 + "..."
    assert shown({"a": [1, "b"], "c": None}) == "{'a': [1, 'b'], 'c': None}"


def test_set_merges_a_mapping_into_its_section_and_refuses_a_value_in_place_of_a_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  n_layers: 5\n  d_ff: 64\ndata:\n")  # data: null, every key commented out: defaults
    c = load_config(path, ["model={d_model: 64, n_heads: 2}", "optim={betas: [0.8, 0.9]}"])
    assert (c.model.d_model, c.model.n_heads, c.model.n_layers, c.model.d_ff) == (64, 2, 5, 64)
    assert c.optim.betas == (0.8, 0.9) and c.optim.lr == Config().optim.lr and c.data.seq_len == Config().data.seq_len
    for override, message in [
        (
            "model=null",
            r"cannot set 'model' to None: it is a section of settings \(n_layers, d_ff\); set its keys "
            r"\(model.KEY=VALUE\) or merge a mapping into it \(model=\{KEY: VALUE\}\)",
        ),
        ("model=0", r"cannot set 'model' to 0: it is a section"),
        ("data=0", r"^data: expected a mapping of settings, got 0$"),
        ("train=[]", r"^train: expected a mapping of settings, got \[\]$"),
        ("train=", r"^train: expected a mapping of settings, got ''$"),
        ("model={n_layers: {x: 1}}", r"^model.n_layers: expected an integer, got \{'x': 1\}$"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, [override])
    path.write_text("train: 0\n")
    with pytest.raises(ConfigError, match=r"^train: expected a mapping of settings, got 0$"):
        load_config(path)


def test_null_switches_an_optional_section_off_on_the_command_line(tmp_path):
    """model.moe's default is null (a dense model): --set model.moe=null turns a file's mixture back into it, as the
    workflow's merge does; a required section still refuses null (it would drop its settings)."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  moe: {experts: 8, top_k: 1}\n")
    assert load_config(path).model.moe.experts == 8
    assert load_config(path, ["model.moe=null"]).model.moe is None
    assert load_config(path, ["model={moe: null}"]).model.moe is None
    assert load_config(path, ["model.moe=null", "model.moe.experts=2"]).model.moe.experts == 2
    with pytest.raises(ConfigError, match=r"cannot set 'model' to None: it is a section"):
        load_config(path, ["model=null"])


def test_paths_and_names_on_the_command_line_are_taken_as_written(monkeypatch, capsys):
    """YAML would end `trial #2` at the '#', fold a line break and read 2 as a number: a text setting (run_dir, the
    data's directories, the strategy) keeps its text; null and a quoted string are still read as YAML, and --run-dir
    is a path, never YAML. An empty run_dir (an unset variable) would mean the current directory: refused."""
    import scalelm.train.run as train

    c = load_config(None, ["run_dir=trial #2", "data.prepared_dir=a\nb", "data.stage_dir=2", "optim.lr=1e-3 # x"])
    assert (c.run_dir, c.data.prepared_dir, c.data.stage_dir, c.optim.lr) == ("trial #2", "a\nb", "2", 1e-3)
    c = load_config(None, ["run_dir='quoted #1'", "data.stage_dir=null", "parallel.strategy=null"])
    assert (c.run_dir, c.data.stage_dir, c.parallel.strategy) == ("quoted #1", None, None)
    for override in ("run_dir=", "run_dir=  ", "data.prepared_dir="):
        key = override.split("=")[0]
        with pytest.raises(ConfigError, match=rf"^{key} is empty \(an unset variable in --set {key}=\$VAR\?\)"):
            load_config(None, [override])

    ran = []
    monkeypatch.setattr(train, "run", ran.append)
    for given in ("trial #2", "null", "'quoted'"):
        train.main(["--set", "run_dir=elsewhere", "--run-dir", given])
        assert ran.pop().run_dir == given
    with pytest.raises(SystemExit):
        train.main(["--run-dir", ""])
    assert "error: run_dir is empty" in capsys.readouterr().err and not ran


def test_the_planner_refuses_machine_figures_that_are_not_finite_or_fall_back_to_the_site(capsys, tmp_path):
    from scalelm.plan.__main__ import main as plan_main

    site = tmp_path / "site.yaml"
    site.write_text("gpus_per_node: 4\ngpu_memory_gb: 80\n")
    model = ["--vocab-size", "1000", "--site", str(site)]
    speeds = ["--elementwise-gbps", "1000", "--busbw-intra-gbps", "100"]
    for args, message in [
        (["--gpu-memory-gb", "inf"], r"--gpu-memory-gb must be a finite number, got inf"),
        (["--gpu-memory-gb", "1e999"], r"--gpu-memory-gb must be a finite number, got inf"),
        (["--gpu-memory-gb", "nan"], r"--gpu-memory-gb must be a finite number, got nan"),
        (["--matmul-tflops", "inf", *speeds], r"--matmul-tflops must be a finite number, got inf"),
        (["--gpu-memory-gb", "0"], r"--gpu-memory-gb must be one GPU's memory in GB \(positive\), got 0.0"),
        (["--gpus-per-node", "0"], r"the machine's gpus-per-node must be at least 1 \(--gpus-per-node\), got 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            plan_main([*model, *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and re.fullmatch(f"error: {message}\n", err), err


def test_a_lock_line_that_is_not_an_exact_pin_is_refused_naming_the_line(tmp_path, monkeypatch):
    from scalelm.version import check_lock, read_lock

    lock = tmp_path / "lock.txt"
    pinned = "pyyaml==6.0.2 \\\n    --hash=sha256:00\n    # via scalelm\npywin32==306 ; sys_platform == 'win32'\n"
    lock.write_text(pinned)
    assert read_lock(lock) == {"pyyaml": "6.0.2"}
    for line, problem in [
        ("numpy>=1,<3", "is not an exact pin"),
        ("numpy>=1", "is not an exact pin"),
        ("numpy", "is not an exact pin"),
        ("numpy==1.*", "is not an exact pin"),
        ("numpy = 1", "is not a requirement"),
    ]:
        lock.write_text(f"{pinned}{line} \\\n    --hash=sha256:11\n")
        with pytest.raises(ConfigError, match=rf"^the lock file {lock}, line 5: '{re.escape(line)}' {problem}"):
            read_lock(lock)
    monkeypatch.setenv("SCALELM_LOCK", str(lock))
    with pytest.raises(
        ConfigError,
        match="a lock holds exact pins, as scripts/lock.sh exports them .*: point SCALELM_LOCK at one, or unset it",
    ):
        check_lock()
    lock.write_bytes(b"numpy==1.0 # \xff\n")
    with pytest.raises(ConfigError, match=rf"^the lock file {lock} cannot be read"):
        check_lock()


def test_a_training_refuses_a_lock_that_is_not_exact_before_touching_its_run_directory(
    tiny_config, tmp_path, monkeypatch
):
    from conftest import run_dir_of, train_here

    lock = tmp_path / "lock.txt"
    lock.write_text("numpy>=1,<3\n")
    monkeypatch.setenv("SCALELM_LOCK", str(lock))
    config = tiny_config()
    with pytest.raises(ConfigError, match="is not an exact pin"):
        train_here(config)
    assert not run_dir_of(config).exists()


class CountingDict(dict):
    """A mapping that counts how often its items are listed."""

    listed = 0

    def items(self):
        CountingDict.listed += 1
        return super().items()


def test_the_shell_value_check_visits_each_value_once_however_often_the_config_holds_it():
    from scalelm.study.workflow import check_command_line_values

    shared = CountingDict(leaf="ok")
    for _ in range(16):  # 2^16 paths to the leaf, as nested YAML aliases load: one object held twice at each level
        shared = CountingDict(a=shared, b=[shared])
    CountingDict.listed = 0
    check_command_line_values({"experiments": shared})
    assert CountingDict.listed == 17
    shared["c"] = "x;y"
    with pytest.raises(ConfigError, match=r"^experiments.c: 'x;y' holds ;"):
        check_command_line_values({"experiments": shared})
    deep = "rm -rf ~;"
    for _ in range(50_000):  # deeper than Python's stack
        deep = [deep]
    with pytest.raises(ConfigError, match=r"^\.\.\.[0\[\]]{200}: 'rm -rf ~;' holds ;"):
        check_command_line_values(deep)


def test_the_workflow_refuses_a_duplicate_key_in_its_config_files(tmp_path):
    """Snakemake's own loader keeps the last of a duplicate key: the workflow reads its config files again with
    scalelm's, and stops before any job."""
    import shutil
    import subprocess

    from conftest import REPO

    for part in ("workflow", "config", "profiles", "resources"):
        shutil.copytree(REPO / part, tmp_path / part)
    local = tmp_path / "config/local.yaml"
    lines = len(local.read_text().splitlines())
    local.write_text(local.read_text() + "local:\n  results: results/elsewhere\n")
    result = subprocess.run(["snakemake", "-n"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert (
        f"invalid config: config file {local}, line {lines + 1}: key 'local' appears twice (first on line "
        in result.stdout + result.stderr
    ), result.stdout + result.stderr
    assert not (tmp_path / "results").exists()
