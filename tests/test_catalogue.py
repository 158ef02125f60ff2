"""The catalogue of machines (scalelm.plan.catalogue): its entries and their sources, the model of what datasheets do
not give, a plan from a catalogue GPU the same as from its record given as a baseline, names refused, the site
file's gpu key, the published runs' bench script on one row and docs/plan.md's table of them all; the GPU step's
elementwise bytes counted op by op (scalelm.plan.elementwise), the optimizer's and the attention kernel's, checked
against counts made by hand. Each check is also shown to fail on a broken input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from scalelm.config import load_config
from scalelm.errors import ConfigError
from scalelm.parallel.dims import ParallelDims
from scalelm.plan.__main__ import main as plan_main
from scalelm.plan.catalogue import (
    attention_share,
    baseline,
    catalogue,
    check_site,
    collective_rows,
    matmul_tflops,
    model_products,
    product_rate,
    read_catalogue,
)
from scalelm.plan.elementwise import (
    ADAMW_BYTES,
    Widths,
    block_bytes,
    edge_bytes,
    llama_block,
    loss_bytes,
    optimizer_bytes_per_parameter,
)
from scalelm.plan.machine import MachineBaseline
from scalelm.plan.memory import Workload, block_bytes_per_token
from scalelm.plan.steptime import Speeds, attention_kernel_flops, stage_work
from scalelm.site import load_site

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "src/scalelm/plan/catalogue.yaml"
GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "gh200", "mi250x", "mi300x")
NETWORKS = ("nvlink3", "nvlink4", "hdr-4x", "hdr-8x", "ndr-4x", "ndr-8x", "slingshot-11")
GPT2 = ["--vocab-size", "50304", "--set", "model.d_model=768", "--set", "model.n_layers=12", "--set",
        "model.n_heads=12", "--set", "model.d_ff=3072", "--set", "data.seq_len=1024", "--set", "batch.size=16"]  # fmt: skip


def test_the_catalogue_holds_the_named_machines_each_with_its_source():
    book = catalogue()
    assert set(GPUS) <= set(book.accelerators) and set(NETWORKS) <= set(book.networks)
    for entry in [*book.accelerators.values(), *book.networks.values()]:
        assert re.search(r"https?://", entry.source), entry.name  # a datasheet or measurement, by address
    h100 = book.accelerator("h100-sxm")
    assert (h100.peak_tflops["bf16"], h100.memory_gb, h100.hbm_gbps) == (989, 80, 3350)
    assert book.network("ndr-8x").rails == 8 and book.network("nvlink4", scope="node").domain == 8


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("accelerators", "h100-pcie", "source"), " ", r"accelerators.h100-pcie: names no source"),
        (("networks", "ndr-8x", "source"), "", r"networks.ndr-8x: names no source"),
        (("model", "matmul", "source"), "", r"model.matmul: names no source"),
        (("accelerators", "h100-pcie", "memory_gb"), 0, r"accelerators.h100-pcie.memory_gb must be positive"),
        (("accelerators", "h200", "node_link"), "nvlink9", r"node_link 'nvlink9' is no network of scope node"),
        (("accelerators", "h200", "peak_tflops"), {"bf16": 989}, r"accelerators.h200: peak_tflops needs a positive"),
        (("accelerators", "h200", "units"), "many", r"accelerators.h200.units"),
        (("networks", "ndr-8x", "rails"), None, r"networks.ndr-8x: scope node \(with a domain\) or inter"),
    ],
)
def test_a_broken_catalogue_is_refused_naming_the_entry(path, value, message):
    data = yaml.safe_load(CATALOGUE.read_text())
    read_catalogue(yaml.safe_dump(data))  # the catalogue as it is passes
    *parents, key = path
    entry = data
    for name in parents:
        entry = entry[name]
    entry[key] = value
    with pytest.raises(ConfigError, match=message):
        read_catalogue(yaml.safe_dump(data))


def test_a_products_rate_falls_with_its_last_waves_idle_units_and_below_the_roofline():
    book = catalogue()
    h100, matmul = book.accelerator("h100-sxm"), book.model["matmul"]
    full = product_rate(h100, matmul, "bf16", 256 * 12, 128 * 11, 8192)  # 132 tiles: one full wave
    one_more = product_rate(h100, matmul, "bf16", 256 * 12, 128 * 11 + 1, 8192)  # 144 tiles: a second, mostly idle
    assert full == pytest.approx(989 * 0.8) and one_more == pytest.approx(989 * 0.8 * 144 / 264)
    thin = product_rate(h100, matmul, "bf16", 8192, 8192, 16)  # k = 16: its bytes, not its FLOPs, bound it
    assert thin == pytest.approx(3350 * 2 * 8192 * 8192 * 16 / (2 * (2 * 8192 * 16 + 8192 * 8192)) / 1e3)
    assert matmul_tflops(h100, "bf16", model_products(16384, 768, 3072, 50304)) < 989 * 0.8


def test_a_collectives_rows_follow_latency_plus_bus_bytes_over_bandwidth():
    rows = {(r.op, r.bytes): r for r in collective_rows("job", 16, dict.fromkeys(
        ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all"), 100.0), 1e-5)}  # fmt: skip
    large, small = rows[("all_reduce", 2**34)], rows[("all_reduce", 2**10)]
    assert large.busbw_gbps.median == pytest.approx(100, rel=0.01)  # the bandwidth where bytes dominate
    assert small.time_s.median == pytest.approx(2 * 4 * 1e-5, rel=0.01)  # 2 log2(16) hops where latency does
    assert rows[("send_recv", 2**10)].time_s.median == pytest.approx(1e-5, rel=0.01)


def plan_json(capsys, *args: str) -> list[dict]:
    plan_main([*args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_a_catalogue_gpus_plan_equals_the_plan_from_its_record_given_as_a_baseline(capsys, tmp_path):
    from scalelm.config import load_config
    from scalelm.plan.catalogue import machine_record
    from scalelm.plan.memory import Workload

    machine = ["--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gb", "80"]
    named = plan_json(capsys, *GPT2, *machine, "--gpu", "h100-sxm", "--network", "ndr-8x")
    sets = [GPT2[i + 1] for i in range(2, len(GPT2), 2)]
    record = machine_record(Workload(load_config(None, sets), 50304), 2, 8, "h100-sxm", "ndr-8x")
    written = tmp_path / "baseline.json"
    written.write_text(json.dumps(record.to_json()))
    assert MachineBaseline.from_json(json.loads(written.read_text())) == record
    assert plan_json(capsys, *GPT2, *machine, "--baseline", str(written)) == named
    assert all(plan["step_time"]["total_s"] > 0 for plan in named)
    # the check fails where the figures differ: a baseline twice as fast at its products
    faster = record.to_json() | {"matmul_tflops_min": 2 * record.matmul_tflops}
    written.write_text(json.dumps(faster))
    assert plan_json(capsys, *GPT2, *machine, "--baseline", str(written)) != named


def test_the_plan_says_which_machine_it_used_and_a_measured_baseline_wins(capsys, tmp_path):
    plan_main([*GPT2, "--gpu", "h100-sxm", "--network", "ndr-8x", "--nodes", "2"])
    out = capsys.readouterr().out
    assert "8 GPU(s) of 80 GB" in out  # the GPU's node and memory, where no flag gives them
    assert "speeds from the catalogue's h100-sxm (nvlink4) x 2 nodes on ndr-8x" in out
    measured = tmp_path / "measured.json"
    from scalelm.config import load_config
    from scalelm.plan.catalogue import machine_record
    from scalelm.plan.memory import Workload

    sets = [GPT2[i + 1] for i in range(2, len(GPT2), 2)]
    base = machine_record(Workload(load_config(None, sets), 50304), 1, 8, "a100-40gb", None)
    measured.write_text(json.dumps(base.to_json() | {"modelled": None}))  # stands in for a measured one
    with pytest.raises(SystemExit):  # a measured record without its model step is refused: an older scalelm's
        plan_main([*GPT2, "--gpu", "h100-sxm", "--baseline", str(measured)])
    assert "lacks the step-time model's figures" in capsys.readouterr().err
    modelled = tmp_path / "modelled.json"
    modelled.write_text(json.dumps(base.to_json()))
    plan_main([*GPT2, "--gpu", "h100-sxm", "--baseline", str(modelled)])
    assert f"speeds from {modelled} (measured: it wins over the catalogue's h100-sxm)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpu", "h100"], r"unknown GPU 'h100': the catalogue knows a100-40gb, a100-80gb, gh200, h100-pcie"),
        (["--gpu", "h100-sxm", "--network", "ndr"], r"unknown network 'ndr': the catalogue knows hdr-4x, hdr-8x"),
        (["--gpu", "h100-sxm", "--network", "nvlink4"], r"unknown network 'nvlink4'"),  # a node's link, not one
        (["--gpu", "h100-sxm", "--nodes", "2"], r"2 nodes need a network between them: --network \(known: hdr-4x"),
        (["--gpu", "h100-sxm", "--matmul-tflops", "300"], r"either as --gpu or as flags, not both"),
        (["--network", "ndr-8x", "--gpus-per-node", "8", "--gpu-memory-gb", "80"], r"give --gpu too"),
    ],
)
def test_unknown_names_are_refused_listing_the_known_ones(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        plan_main([*GPT2, *flags])
    assert exit_.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_known_name_is_not_refused(capsys):
    plan_main([*GPT2, "--gpu", "mi300x"])
    assert "8 GPU(s) of 192 GB" in capsys.readouterr().out


def test_the_site_files_gpu_key(capsys, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("gpus_per_node: 4\ngpu: a100-40gb\nnetwork: hdr-4x\n")
    assert load_site(site).gpu == "a100-40gb"
    plan_main([*GPT2, "--site", str(site), "--nodes", "2"])
    out = capsys.readouterr().out
    assert "2 node(s) x 4 GPU(s) of 40 GB" in out  # the site's node, the catalogue's memory
    assert "speeds from the catalogue's a100-40gb (nvlink3) x 2 nodes on hdr-4x" in out
    site.write_text("gpu: a100\n")
    with pytest.raises(ConfigError, match=r"unknown GPU 'a100': the catalogue knows a100-40gb, a100-80gb"):
        check_site(load_site(site).gpu, None)  # as the workflow checks it at parse time, and the planner
    with pytest.raises(SystemExit):
        plan_main([*GPT2, "--site", str(site), "--nodes", "2"])
    assert "error: unknown GPU 'a100': the catalogue knows a100-40gb, a100-80gb" in capsys.readouterr().err


TORCH_FREE = "import sys, {modules}; sys.exit('torch' in sys.modules)"


@pytest.mark.parametrize(
    "modules, imports_torch",
    [("scalelm.plan.__main__, scalelm.plan.catalogue, scalelm.site", False), ("scalelm.plan.catalogue, torch", True)],
)
def test_the_plan_and_its_catalogue_stay_torch_free(modules, imports_torch):
    """The second case, which imports torch, shows the check catches a module that would."""
    run = subprocess.run([sys.executable, "-c", TORCH_FREE.format(modules=modules)], cwd=ROOT, capture_output=True)
    assert run.returncode == int(imports_torch), run.stderr.decode()


def published_runs():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import published_runs
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return published_runs


def test_the_bench_script_plans_a_published_run():
    bench = published_runs()
    row = next(run for run in bench.RUNS if run.name == "scalelm gpt2_small, 1 H200, eager")
    prediction = bench.plan_run(row)
    assert prediction.fits and 0 < prediction.step_s < 1
    assert prediction.step_error == pytest.approx(prediction.step_s / (16 * 1024 / 350543) - 1)
    assert prediction.memory_error == pytest.approx(prediction.memory_gb / (11922 * 2**20 / 1e9) - 1)
    # the planning fails on a broken row: a layout its machine cannot hold
    broken = replace(row, settings=(*row.settings, "parallel.strategy=ddp"), gpus_per_node=1)
    with pytest.raises(ConfigError):
        bench.plan_run(replace(broken, settings=(*row.settings, "parallel.tp=2")))


def test_the_docs_table_of_published_runs_is_the_bench_scripts_on_the_catalogue():
    """docs/plan.md's "Against published runs" table and its mean error are what the bench script plans today on the
    catalogue (all analytic: no speed measured here); a row planned otherwise would fail here."""
    bench = published_runs()
    predictions = {run.name: bench.plan_run(run) for run in bench.RUNS}
    section = (ROOT / "docs/plan.md").read_text().split("## Against published runs")[1].split("\n## ")[0]
    rows = {cells[0]: cells for cells in (line.strip("| ").split(" | ") for line in section.splitlines()) if cells}
    for name, prediction in predictions.items():
        assert rows[name][2] == f"{prediction.step_s:.4g}" and rows[name][3] == bench.percent(prediction.step_error)
    mean = sum(abs(p.step_error) for p in predictions.values()) / len(predictions)
    assert f"Mean absolute step-time error: {mean:.0%} over {len(predictions)} runs" in section
    # the check fails on a row planned otherwise: the eager run planned as compiled
    eager = next(run for run in bench.RUNS if run.name.endswith("eager"))
    compiled = bench.plan_run(replace(eager, settings=(*eager.settings, "train.compile=true")))
    assert f"{compiled.step_s:.4g}" != rows[eager.name][2]


def tiny_work(*settings: str) -> Workload:
    """A model small enough to count its bytes by hand: d 8, f 32, 2 heads, 4 tokens a sequence, bf16 on a GPU."""
    base = ["model.d_model=8", "model.d_ff=32", "model.n_heads=2", "model.n_layers=1", "model.dropout=0.0"]
    return Workload(load_config(None, [*base, "data.seq_len=4", "model.max_seq_len=4", *settings]), 100, "cuda")


def test_a_course_blocks_elementwise_bytes_counted_op_by_op_by_hand():
    """Per token, bf16 under autocast (fp32 residual: r 4, e 2, a cast 6 bytes an element), d 8, qkv 24, f 32."""
    work = tiny_work()
    eager = (
        2 * 2 * 4 * 8  # two norms: the fp32 residual read, written
        + 2 * 6 * 8  # their outputs cast to bf16
        + 2 * (4 + 2 + 4) * 8  # two residual adds: fp32 stream and bf16 branch read, stream written
        + 2 * 2 * 32  # ReLU read and written
        + 2 * 6 * 8  # backward: the residual branches' gradients cast to bf16
        + 2 * 6 * 8  # the products' input gradients cast back to fp32
        + 2 * 5 * 4 * 8  # two norms' backward: dY, X read, dX written; dY and X again for their weights
        + 2 * 3 * 4 * 8  # the residual gradient summed at each norm's input
        + 3 * 2 * 32  # ReLU's backward
        + 2 * (24 + 8 + 32 + 8)  # four biases' gradients read their outputs' gradients
        + 2 * 2 * 2 * 24  # q, k, v gradients stacked, then copied into qkv's layout
    )
    assert eager == 1744 and block_bytes(work, ParallelDims(), False, compiled=False) == eager
    # compiled: each fused region reads its inputs and writes its outputs once
    compiled = (4 + 2) * 8 + (8 + 4) * 8 + 2 * 2 * 32 + (8 + 2) * 8  # forward's four regions
    compiled += (4 + 4) * 8 + 4 * 2 * 32 + (16 + 6) * 8 + 2 * 8 + 3 * 2 * 24 + (16 + 4) * 8  # backward's six
    assert compiled == 1168 and block_bytes(work, ParallelDims(), False, compiled=True) == compiled
    # FSDP's policy casts the parameters to bf16: a bf16 residual stream, no casts (r = e = 2)
    sharded = (24 * 2 + 4 * 2) * 8 + 5 * 2 * 24 + 6 * 2 * 32
    assert block_bytes(work, ParallelDims(dp_shard=2), False, compiled=False) == sharded
    # tp 2 with sequence parallelism: the stream's width halved (D 4), qkv's (12) and the FFN's (16) split
    split = tiny_work("parallel.sequence_parallel=true")
    split_eager = (24 * 4 + 4 * 2 + 6 * 6) * 4 + 10 * 12 + 12 * 16
    assert block_bytes(split, ParallelDims(tp=2), False, compiled=False) == split_eager
    # a check that fails: the count is not the three passes over what the block keeps
    kept, _ = block_bytes_per_token(work, ParallelDims())
    assert 3 * kept != eager


def test_a_llama_blocks_elementwise_bytes_by_hand():
    """d 8, 2 heads of 4, one key/value head (h 4: qkv 16), SwiGLU of width 32; bf16 under autocast."""
    work = tiny_work("model.family=llama", "model.n_kv_heads=1")
    w = Widths.of(work, ParallelDims())
    assert (w.D, w.Q, w.A, w.K, w.F) == (8, 16, 8, 4, 32)
    eager = (24 * 4 + 5 * 2) * 8 + 6 * 6 * 8 + 9 * 2 * 16 + 4 * 2 * 8 + 18 * 2 * (8 + 4) + 14 * 2 * 32
    assert sum(llama_block(w, compiled=False).values()) == eager == 2816
    compiled = (14 * 4 + 11 * 2) * 8 + 2 * 2 * 16 + 2 * 2 * (8 + 4) + 8 * 2 * 32
    assert sum(llama_block(w, compiled=True).values()) == compiled == 1248


def test_the_loss_the_optimizer_and_attentions_kernel_counted_by_hand():
    work = tiny_work()  # vocabulary 100, 10 tokens
    # eager: the bf16 logits cast to fp32 and back (6 + 6), the log-softmax's three passes (16) and its backward (16),
    # nll's zero-filled gradient (4), the padded rows' gradient (3 x 2), the head's bias gradient (2)
    assert loss_bytes(work, ParallelDims(), 10, compiled=False) == 10 * 100 * (12 + 16 + 4 + 16 + 6 + 2)
    # compiled: the bf16 logits read three times, their gradient written, read again for the bias
    assert loss_bytes(work, ParallelDims(), 10, compiled=True) == 10 * 100 * (4 * 2 + 2)
    # AdamW as torch's fused kernel runs it (one pass: 16 read, 12 written) and the trainer's gradient norm (4)
    assert ADAMW_BYTES["fused"] == 4 * 4 + 3 * 4 and optimizer_bytes_per_parameter(work) == 28 + 4
    assert optimizer_bytes_per_parameter(tiny_work("optim.grad_clip=1.0")) == 28 + 4 + 8  # the in-place scaling
    # torch's uncompiled capturable foreach step, pass by pass (torch/optim/adam.py's _multi_tensor_adam): decay,
    # lerp_, mul_, addcmul_, sqrt, div_, add_, div_, addcdiv_, each reading its tensors and writing one
    assert ADAMW_BYTES["foreach"] == 8 + 12 + 8 + 12 + 8 + 8 + 8 + 8 + 16 == 88
    # the gpt2_small check (docs/benchmarks.md): 2.2 ms of AdamW with clipping on an H200, 9.4 GB at the measured copy
    # rate, is ~85 bytes a parameter of its 110.6 M: the fused count explains half (the kernel is slower than a copy)
    assert 2.2e-3 * 4.25e12 / 110.6e6 > 2 * (28 + 4 + 8)
    # attention's causal kernel: 2 s d forward and 5 s d backward per token (the forward again under full
    # checkpointing), over tp
    assert attention_kernel_flops(work, ParallelDims()) == 7 * 4 * 8
    assert attention_kernel_flops(tiny_work("train.activation_checkpointing=full"), ParallelDims(tp=2)) == 9 * 4 * 8 / 2


def test_the_catalogue_prices_attention_at_flash_attentions_published_share():
    book = catalogue()
    assert attention_share("a100-80gb", book.model) == 0.5 and attention_share("h200", book.model) == 0.35
    record = baseline("h200", None, 1, 1, "bf16", model_products(16384, 768, 3072, 33278))
    assert record.attention_tflops == pytest.approx(989 * 0.35)
    assert Speeds.from_baseline(record).attention_tflops == record.attention_tflops
    # a measured baseline has none (attention timed with its products), and its file is written back unchanged
    measured = MachineBaseline.from_json(record.to_json() | {"attention_tflops": None, "modelled": None})
    assert measured.attention_tflops is None and "attention_tflops" not in measured.to_json()


def test_a_catalogue_steps_work_sums_its_counted_parts():
    """stage_work by operation on one GPU: the products (the tied head's included), attention's kernel and the
    elementwise bytes of the block, the embedding and final norm, the loss, the weights' casts and AdamW."""
    work = tiny_work("model.tie_weights=true", "batch.size=2", "model.norm=pre")
    tokens, dims = 8, ParallelDims()
    ((products, attention, moved),) = stage_work(work, dims, by_operation=True)
    block_weights, head = 8 * 24 + 8 * 8 + 8 * 32 + 32 * 8, 100 * 8
    assert products == tokens * 6 * (block_weights + head) and attention == tokens * 7 * 4 * 8
    parameters = count_parameters(work)
    expected = tokens * (block_bytes(work, dims, False, False) + edge_bytes(work, dims, True, True, False))
    expected += loss_bytes(work, dims, tokens, False) + 12 * (block_weights + head) + 32 * parameters
    assert moved == pytest.approx(expected)
    # the legacy count, which measured baselines keep, prices the tied head's products too (it used to leave them out)
    legacy, none, _ = stage_work(work, dims)[0]
    assert none == 0 and legacy == products + tokens * 12 * 4 * 8


def count_parameters(work: Workload) -> int:
    from scalelm.model.architecture import parameter_counts

    return parameter_counts(work.config.model, work.vocab_size)["total"]
