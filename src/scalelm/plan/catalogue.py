"""A catalogue of machines no one here has measured: named accelerators and networks (catalogue.yaml, every figure with
its source), and the model of what their datasheets do not give, turned into the same record a measured baseline is
(scalelm.plan.machine.MachineBaseline), so that a plan from either is the same code. Torch-free, as the plan is.

- a matrix product's rate by its shape: the dense peak of the dtype times the share a large product reaches, times
  the share of the last wave of output tiles that has work (tile and wave quantisation), capped by the roofline (its
  bytes over the HBM bandwidth) where k or the other sides are small; the model's rate is its products' FLOPs over
  their summed time, at the shapes of its own forward and backward on one device, as the baseline times them;
- elementwise work at a share of the HBM bandwidth, its bytes counted op by op (scalelm.plan.elementwise);
- a fused causal attention kernel at a share of the dense peak (`attention_share`: flash attention's published
  figures), its work as it counts it (scalelm.plan.steptime.attention_kernel_flops);
- a collective of S bytes over n ranks: a latency of hops(n) x a hop's, plus its bus bytes (nccl-tests' convention)
  over the link's bus bandwidth; rows at message sizes from 1 KiB to 16 GiB, as a baseline measures them. Collectives
  over the job cross the nodes' adapters, all of them at once (a ring over every rank runs one ring per adapter); a
  send/recv crosses one GPU's share of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from scalelm.errors import ConfigError
from scalelm.plan.machine import Collective, Figure, MachineBaseline, Rank
from scalelm.settings_yaml import from_mapping, parse_settings

if TYPE_CHECKING:
    from scalelm.plan.memory import Workload

OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
DTYPES = ("bf16", "fp16", "tf32", "fp32")
MESSAGE_BYTES = [2**power for power in range(10, 35, 2)]  # 1 KiB to 16 GiB, as measure.baseline's sizes span


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_tflops: dict[str, float]  # dense, by DTYPES
    memory_gb: float
    hbm_gbps: float
    units: int  # SMs or compute units: the tiles of one wave
    gpus_per_node: int
    node_link: str  # a network of scope node
    source: str


@dataclass(frozen=True)
class Network:
    name: str
    scope: str  # node: a GPU's link within its node; inter: the node's adapters
    gbps: float  # one direction, per GPU (node) or per adapter (inter)
    source: str
    domain: int | None = None  # node: the GPUs a switch joins
    rails: int | None = None  # inter: adapters per node


@dataclass(frozen=True)
class Catalogue:
    accelerators: dict[str, Accelerator]
    networks: dict[str, Network]
    model: dict[str, Any]

    def accelerator(self, name: str) -> Accelerator:
        return self._named(self.accelerators, name, "GPU")

    def network(self, name: str, scope: str = "inter") -> Network:
        known = {key: net for key, net in self.networks.items() if net.scope == scope}
        return self._named(known, name, "network" if scope == "inter" else "node link")

    @staticmethod
    def _named(entries: dict, name: str, what: str):
        if name not in entries:
            raise ConfigError(f"unknown {what} {name!r}: the catalogue knows {', '.join(sorted(entries))}")
        return entries[name]


def check_site(gpu: str | None, network: str | None) -> None:
    """A site file's `gpu:` and `network:` (scalelm.site), refused by name unless the catalogue knows them."""
    if gpu is not None:
        catalogue().accelerator(gpu)
    if network is not None:
        catalogue().network(network)


def gpu_memory_gb(given: float | None, gpu: str | None) -> float | None:
    """One GPU's memory to plan against: the figure given (a flag, the site file's gpu_memory_gb), else the
    catalogue's for the GPU named (a flag, the site file's gpu:), else None (unknown)."""
    if given is not None or gpu is None:
        return given
    return catalogue().accelerator(gpu).memory_gb


def read_catalogue(text: str) -> Catalogue:
    """The catalogue of a YAML text: every entry typed and with its source, its node link known; ConfigError naming the
    entry otherwise."""
    data = parse_settings(text)
    accelerators = {
        name: typed(Accelerator, entry, f"accelerators.{name}") for name, entry in data["accelerators"].items()
    }
    networks = {name: typed(Network, entry, f"networks.{name}") for name, entry in data["networks"].items()}
    for name, gpu in accelerators.items():
        if set(gpu.peak_tflops) != set(DTYPES) or not all(peak > 0 for peak in gpu.peak_tflops.values()):
            raise ConfigError(f"accelerators.{name}: peak_tflops needs a positive {', '.join(DTYPES)}")
        if networks.get(gpu.node_link, Network("", "", 0, "")).scope != "node":
            raise ConfigError(f"accelerators.{name}: node_link {gpu.node_link!r} is no network of scope node")
    for name, net in networks.items():
        if net.scope not in ("node", "inter") or (net.scope == "inter") != (net.rails is not None):
            raise ConfigError(f"networks.{name}: scope node (with a domain) or inter (with rails)")
    for part, constants in data["model"].items():
        if not constants.get("source"):
            raise ConfigError(f"model.{part}: names no source")
    return Catalogue(accelerators, networks, data["model"])


def typed(cls: type, entry: dict[str, Any], where: str):
    """An entry as `cls` (an unknown key or a wrong type refused by from_mapping), its source given, its figures
    positive."""
    values = from_mapping(cls, entry, f"{where}.")
    if not values.source.strip():
        raise ConfigError(f"{where}: names no source")
    for field in fields(cls):
        value = getattr(values, field.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value > 0:
            raise ConfigError(f"{where}.{field.name} must be positive, got {value}")
    return values


@cache
def catalogue() -> Catalogue:
    """The package's catalogue (catalogue.yaml beside this module)."""
    return read_catalogue(resources.files("scalelm.plan").joinpath("catalogue.yaml").read_text())


def product_rate(gpu: Accelerator, matmul: dict[str, Any], dtype: str, m: int, n: int, k: int) -> float:
    """TFLOP/s of one (m x k) by (k x n) product: the achievable peak, less the last wave's idle units, capped by its
    bytes (inputs read, output written) over the HBM bandwidth."""
    tile_m, tile_n = matmul["tile"]
    tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
    waves = math.ceil(tiles / gpu.units)
    compute = gpu.peak_tflops[dtype] * matmul["achievable"] * tiles / (waves * gpu.units)
    width = 2 if dtype in ("bf16", "fp16") else 4
    intensity = 2 * m * n * k / (width * (m * k + k * n + m * n))  # FLOPs per byte
    return min(compute, gpu.hbm_gbps * intensity / 1e3)


def attention_share(gpu_name: str, model: dict[str, Any]) -> float:
    """The share of the dense peak a fused causal attention kernel reaches on a catalogue GPU: catalogue.yaml's
    `model.attention`, the GPU's own figure where it names one."""
    attention = model["attention"]
    return attention.get("by_gpu", {}).get(gpu_name, attention["achievable"])


def model_products(tokens: int, d_model: int, d_ff: int, vocab: int) -> list[tuple[int, int, int]]:
    """A block's and the head's products (m, n, k) in the forward, and the backward's two of each (the input's
    gradient, the weight's), as a training step on one device runs them."""
    forward = [(tokens, 3 * d_model, d_model), (tokens, d_model, d_model), (tokens, d_ff, d_model)]
    forward += [(tokens, d_model, d_ff), (tokens, vocab, d_model)]
    return [shape for m, n, k in forward for shape in ((m, n, k), (m, k, n), (k, n, m))]


def matmul_tflops(
    gpu: Accelerator, dtype: str, products: list[tuple[int, int, int]], model: dict | None = None
) -> float:
    """The rate of `products` together: their FLOPs over their summed time."""
    matmul = (model or catalogue().model)["matmul"]
    flops = [2 * m * n * k for m, n, k in products]
    seconds = sum(f / product_rate(gpu, matmul, dtype, *shape) for f, shape in zip(flops, products))
    return sum(flops) / seconds


def hops(op: str, ranks: int) -> float:
    """The latencies one collective over `ranks` pays (tree and doubling algorithms): catalogue.yaml's model."""
    if op == "send_recv":
        return 1.0
    steps = max(1.0, math.log2(ranks))
    return 2 * steps if op == "all_reduce" else steps


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus bytes per byte of a rank's buffer."""
    if op == "send_recv":
        return 1.0
    share = (ranks - 1) / ranks
    return 2 * share if op == "all_reduce" else share


def collective_rows(scope: str, ranks: int, busbw_gbps: dict[str, float], hop_s: float) -> list[Collective]:
    """The rows a baseline would have measured: each op at each of MESSAGE_BYTES, by the alpha-beta model."""
    rows = []
    for op in OPS:
        for size in MESSAGE_BYTES:
            bus = bus_factor(op, ranks) * size
            seconds = hop_s * hops(op, ranks) + bus / (busbw_gbps[op] * 1e9)
            rows.append(
                Collective(scope, op, size, Figure(bus / seconds / 1e9, rate=True), ranks, Figure(seconds),
                           size / seconds / 1e9)
            )  # fmt: skip
    return rows


def baseline(
    gpu_name: str,
    network_name: str | None,
    nodes: int,
    gpus_per_node: int,
    dtype: str,
    products: list[tuple[int, int, int]],
) -> MachineBaseline:
    """The baseline record of `nodes` nodes of `gpus_per_node` catalogue GPUs joined by a catalogue network, as the
    model says they would measure at the model's `products` in `dtype`. Several nodes need a network."""
    book = catalogue()
    gpu = book.accelerator(gpu_name)
    link = book.network(gpu.node_link, scope="node")
    if nodes > 1 and network_name is None:
        raise ConfigError(f"{nodes} nodes need a network between them: --network (known: {inter_names()})")
    network = book.network(network_name) if network_name else None
    share = book.model["collectives"]["achievable"]
    hop = {scope: us * 1e-6 for scope, us in book.model["collectives"]["hop_us"].items()}
    rows = collective_rows("node", gpus_per_node, dict.fromkeys(OPS, link.gbps * share), hop["node"])
    if nodes > 1:
        node_gbps = network.rails * network.gbps * share  # a ring over every rank: one ring per adapter
        per_gpu = node_gbps / max(gpus_per_node / network.rails, 1)  # a send/recv: one adapter, shared by its GPUs
        bandwidth = dict.fromkeys(OPS, node_gbps) | {"send_recv": min(per_gpu, node_gbps)}
        rows += collective_rows("job", nodes * gpus_per_node, bandwidth, hop["inter"])
    described = f"{gpu_name} ({gpu.node_link})" + (f" x {nodes} nodes on {network_name}" if nodes > 1 else "")
    return MachineBaseline(
        world_size=nodes * gpus_per_node,
        procs_per_node=gpus_per_node,
        hosts=[],
        device=gpu.name,
        matmul_tflops=matmul_tflops(gpu, dtype, products, book.model),
        elementwise_gbps=gpu.hbm_gbps * book.model["elementwise"]["achievable"],
        model_step=None,
        per_rank=[Rank(0, None, None, None, None, None)],
        collectives=rows,
        backend="nccl",
        modelled=f"the catalogue's {described}",
        attention_tflops=gpu.peak_tflops[dtype] * attention_share(gpu_name, book.model),
    )


def machine_record(work: Workload, nodes: int, gpus_per_node: int, gpu: str, network: str | None) -> MachineBaseline:
    """The catalogue's record of a machine for `work`, at its model's products on one device (a micro-batch: the
    batch's micro_size, else its size, over a pipeline's micro-batches), as a measured baseline times them."""
    config, model = work.config, work.config.model
    sequences = (config.batch.micro_size or config.batch.size) // (config.parallel.pp_microbatches or 1)
    tokens = max(1, sequences) * config.data.seq_len
    products = model_products(tokens, model.d_model, model.d_ff, work.vocab_size)
    return baseline(gpu, network, nodes, gpus_per_node, dtype_of(work.precision), products)


def inter_names() -> str:
    return ", ".join(sorted(name for name, net in catalogue().networks.items() if net.scope == "inter"))


def dtype_of(precision: str) -> str:
    """The catalogue's dtype of a compute precision: fp32 products run as TF32 (scalelm sets PyTorch's float32 matmul
    precision to high on CUDA, scalelm.parallel.numerics)."""
    return {"bf16": "bf16", "fp32": "tf32"}.get(precision, precision)
