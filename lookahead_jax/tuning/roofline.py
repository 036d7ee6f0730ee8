"""A roofline model of one decoding step per accelerator: what a step costs, what it buys.

Lookahead decoding runs a step of T tokens instead of one and emits S tokens per step on
average (the step compression). Its speed-up over plain decoding is

    speed-up = S x (plain step time / lookahead step time).

At batch 1 a step reads every weight and the KV cache once, whatever T is, so on an
accelerator it is memory-bound (time ~ bytes / HBM bandwidth) until its FLOPs over the peak
rate exceed that. `predict_step_time` reads a compiled step's FLOPs and bytes
(`lookahead_jax.tuning.program_cost.ProgramCost`) against a `Device`:

    time = max(bytes / bandwidth, FLOPs / peak) + layers x overhead_s

The overhead term is what a pure roofline leaves out: kernel launches and host work, paid per
layer per step whatever the step's size. `PAPER_STACK_OVERHEAD_S` is calibrated, not
measured: it is the per-layer cost that makes a (15,5,15) step of Llama-2-7B on an A100 80GB
cost 1.1 plain steps, the ratio the Lookahead Decoding paper's own figures imply (7B, XSum:
S 1.77 -> 1.60x; CNN/DM: S 1.72 -> 1.57x; `calibrate_overhead` solves for it). It describes the
paper's software stack (PyTorch, Hugging Face, one kernel launch per op), not the chip; a
compiled JAX decode loop pays less. `DEVICES` carries it on every accelerator; pass
`dataclasses.replace(device, overhead_s=0.0)` for the bare roofline.

Devices are the vendors' published figures (`source` says which page and what it states).
`measure_device` builds a `Device` for the machine it runs on from probes (a large array copy
and a large read for bandwidth, a large float32 matmul for FLOP/s).

Tensor parallelism (a mesh's "model" axis, `lookahead_jax.mesh`): each device runs one
device's share of the step (`program_cost.forward_cost(..., mesh=...)` reads that program:
its FLOPs and bytes are per device), and the row-parallel projections add two all-reduces per
layer of the step's activations [tokens x hidden] over the interconnect (`Device.interconnect`):

    time = max(bytes / bandwidth, FLOPs / peak) + layers x overhead_s
           + 2 x layers x allreduce_time(tokens x hidden x itemsize)

(`predict_tp_step_time`). A ring all-reduce sends and receives 2 (n - 1) / n of the buffer per
device; the collectives' latency is not counted (see `allreduce_time`).

Looped models (Ouro, Raven, recursive Llamas) spend loops of a shared block per token. Plain
decoding runs every token through all R loops in one step; a LoopSpec / LoopAhead step is one
call of the block over its whole candidate tree, with the embedding (a prelude) before it and
the readout (a coda, the LM head) after it, so a step reads the prelude's and the coda's
weights as well as the block's. `predict_looped_token_time` is steps per token x the time of
one such step (`program_cost.tree_step_cost`); where the prelude and coda are most of the
model (smol_loop: 22 of its 24 distinct layers), fewer loops per token need not mean less
time.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from lookahead_jax.tuning.program_cost import ProgramCost
from models.config import LlamaConfig, LoopedConfig
from pallas_kernels.gpu_bench import time_call

GB = 1e9
GIB = 1 << 30
TFLOPS = 1e12

# Seconds per layer per step that make a Llama-2-7B (15,5,15) step cost 1.1 plain steps on an
# A100 80GB (cache 512, bfloat16 bytes): `calibrate_overhead(..., ratio=1.1, layers=32)` on the
# program_cost figures of this checkout; `python -m benchmarks.roofline` recomputes it and
# prints both. It stands for the paper's PyTorch/Hugging Face stack (see the module docstring).
PAPER_STACK_OVERHEAD_S = 6.4e-4
PAPER_STEP_RATIO = 1.1  # a (15,5,15) step in plain steps, 7B on A100 (ALGORITHM_NOTES)


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator as the roofline sees it. peak_flops: dense bfloat16 FLOP/s (no
    sparsity); bandwidth: HBM bytes/s; memory: bytes; overhead_s: seconds per layer per step
    on top of the roofline (launches, host work); source: where the figures come from.
    interconnect: bytes/s one chip can send (and, at the same time, receive) to its peers in
    one direction, what an all-reduce is limited by (0: not in the table);
    interconnect_source: where that figure comes from."""

    name: str
    peak_flops: float
    bandwidth: float
    memory: float
    source: str
    overhead_s: float = PAPER_STACK_OVERHEAD_S
    interconnect: float = 0.0
    interconnect_source: str = ""

    def __post_init__(self):
        if min(self.peak_flops, self.bandwidth, self.memory) <= 0 or self.overhead_s < 0:
            raise ValueError(f"device {self.name}: peak, bandwidth and memory must be > 0 "
                             f"and the overhead >= 0")
        if self.interconnect < 0:
            raise ValueError(f"device {self.name}: the interconnect bandwidth must be >= 0")

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a step is compute-bound (peak / bandwidth)."""
        return self.peak_flops / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), ridge=self.ridge)


_NVIDIA = "NVIDIA {} datasheet: "
_GCP = "Google Cloud TPU docs, page 'TPU {}': "
# Interconnects, one direction per chip. NVLink figures in the datasheets are bidirectional
# totals per GPU (over NVSwitch on the 8-GPU HGX boards, any GPU reaches any other at that
# rate); the TPU docs give ICI bandwidth per chip, bidirectional, over all of its ports (a 2D
# torus on v5e: an all-reduce over 8 chips reaches it only with rings in both directions on
# every port, so for a TPU the figure is an upper bound).
_NVLINK3 = (_NVIDIA.format("A100 Tensor Core GPU") + "NVIDIA NVLink 600GB/s (third "
            "generation, bidirectional per GPU): 300 GB/s each way")
_NVLINK4 = ("NVIDIA NVLink 900GB/s (fourth generation, bidirectional per GPU): 450 GB/s each "
            "way")

DEVICES: tuple[Device, ...] = (
    Device("A100 40GB SXM", 312 * TFLOPS, 1555 * GB, 40 * GB,
           _NVIDIA.format("A100 Tensor Core GPU") + "BF16 Tensor Core 312 TFLOPS (624 with "
           "sparsity); A100 40GB SXM: 40GB HBM2, 1,555GB/s",
           interconnect=300 * GB, interconnect_source=_NVLINK3),
    Device("A100 80GB SXM", 312 * TFLOPS, 2039 * GB, 80 * GB,
           _NVIDIA.format("A100 Tensor Core GPU") + "BF16 Tensor Core 312 TFLOPS (624 with "
           "sparsity); A100 80GB SXM: 80GB HBM2e, 2,039GB/s",
           interconnect=300 * GB, interconnect_source=_NVLINK3),
    Device("H100 SXM", 989 * TFLOPS, 3350 * GB, 80 * GB,
           _NVIDIA.format("H100 Tensor Core GPU") + "H100 SXM BF16 Tensor Core 1,979 TFLOPS "
           "with sparsity (989 dense); 80GB, 3.35TB/s",
           interconnect=450 * GB,
           interconnect_source=_NVIDIA.format("H100 Tensor Core GPU") + "H100 SXM " + _NVLINK4),
    Device("H200", 989 * TFLOPS, 4800 * GB, 141 * GB,
           _NVIDIA.format("H200 Tensor Core GPU") + "H200 SXM BF16 Tensor Core 1,979 TFLOPS "
           "with sparsity (989 dense); 141GB HBM3e, 4.8TB/s",
           interconnect=450 * GB,
           interconnect_source=_NVIDIA.format("H200 Tensor Core GPU") + "H200 SXM " + _NVLINK4),
    Device("L4", 121 * TFLOPS, 300 * GB, 24 * GB,
           _NVIDIA.format("L4 Tensor Core GPU") + "BF16 Tensor Core 242 TFLOPS with sparsity "
           "(121 dense); 24GB GDDR6, 300GB/s"),
    Device("TPU v4", 275 * TFLOPS, 1200 * GB, 32 * GIB,
           _GCP.format("v4") + "peak compute per chip 275 teraflops (bf16 or int8); HBM2 32 "
           "GiB, 1200 GBps"),
    Device("TPU v5e", 197 * TFLOPS, 819 * GB, 16 * GB,
           _GCP.format("v5e") + "peak compute per chip (bf16) 197 TFLOPs; HBM2 16 GB, 819 "
           "GBps",
           interconnect=200 * GB,
           interconnect_source=_GCP.format("v5e") + "bidirectional inter-chip interconnect (ICI) "
           "bandwidth (per chip) 400 GBps, 4 ICI ports per chip, 2D torus (older revisions of "
           "the page: 'Interchip Interconnect BW 1,600 Gbps'): 200 GB/s each way"),
    Device("TPU v5p", 459 * TFLOPS, 2765 * GB, 95 * GB,
           _GCP.format("v5p") + "peak compute per chip (bf16) 459 TFLOPs; HBM2e 95GB, 2765 "
           "GBps",
           interconnect=600 * GB,
           interconnect_source=_GCP.format("v5p") + "bidirectional inter-chip interconnect (ICI) "
           "bandwidth (per chip) 1200 GBps, 3D torus (older revisions: 'Interchip Interconnect "
           "BW 4800 Gbps'): 600 GB/s each way"),
    Device("TPU v6e", 918 * TFLOPS, 1638 * GB, 32 * GB,
           _GCP.format("v6e") + "(Trillium) peak compute per chip (bf16) 918 TFLOPs; HBM 32 "
           "GB, 1638 GBps"),
)


def layers_of(cfg: LlamaConfig | LoopedConfig) -> int:
    """Layers one step (Llama) or one loop (looped: Ouro's stack, Raven's or a recursive
    Llama's core) runs: what the per-layer overhead term is multiplied by."""
    if isinstance(cfg, LoopedConfig):
        return cfg.loop_layers
    return cfg.num_layers


def device(name: str) -> Device:
    """The entry of `DEVICES` called `name`."""
    for d in DEVICES:
        if d.name == name:
            return d
    raise KeyError(f"no device {name!r}; known: {[d.name for d in DEVICES]}")


# -- the model ---------------------------------------------------------------------------------
def memory_time(cost: ProgramCost, dev: Device, itemsize: int = 2) -> float:
    """Seconds to move the step's bytes (read as `itemsize` bytes per element) over HBM."""
    return cost.scaled_bytes(itemsize) / dev.bandwidth


def compute_time(cost: ProgramCost, dev: Device) -> float:
    """Seconds to run the step's FLOPs at the device's peak."""
    return cost.flops / dev.peak_flops


def roofline_time(cost: ProgramCost, dev: Device, itemsize: int = 2) -> float:
    """max(memory time, compute time): the step with no overhead."""
    return max(memory_time(cost, dev, itemsize), compute_time(cost, dev))


def predict_step_time(cost: ProgramCost, dev: Device, itemsize: int = 2, *,
                      layers: int) -> float:
    """Predicted seconds of one step: the roofline plus `layers` x the device's per-layer
    overhead. itemsize: bytes per element of the deployed weights and cache (2: bfloat16)."""
    return roofline_time(cost, dev, itemsize) + layers * dev.overhead_s


def bound(cost: ProgramCost, dev: Device, itemsize: int = 2) -> str:
    """'memory' or 'compute': which side of the roofline the step is on."""
    return "memory" if memory_time(cost, dev, itemsize) >= compute_time(cost, dev) else "compute"


def model_bytes(cost: ProgramCost, itemsize: int = 2) -> float:
    """Weights plus the allocated KV cache, at `itemsize` bytes per element."""
    return cost.ideal_bytes * itemsize / cost.itemsize


def fits(nbytes: float, dev: Device) -> bool:
    """Whether `nbytes` (weights + cache) fit in the device's memory."""
    return nbytes <= dev.memory


def speedup(S: float, plain_time: float, method_time: float) -> float:
    """S x plain step time / method step time: the speed-up of a method that emits S tokens
    per step over plain decoding (one token per step)."""
    if plain_time <= 0 or method_time <= 0:
        raise ValueError("step times must be > 0")
    return S * plain_time / method_time


def predict_speedup(S: float, plain: ProgramCost, method: ProgramCost, dev: Device,
                    itemsize: int = 2, *, layers: int) -> float:
    """`speedup` with both step times predicted on `dev` (`predict_step_time`)."""
    return speedup(S, predict_step_time(plain, dev, itemsize, layers=layers),
                   predict_step_time(method, dev, itemsize, layers=layers))


def calibrate_overhead(plain: ProgramCost, method: ProgramCost, dev: Device, *, ratio: float,
                       layers: int, itemsize: int = 2) -> float:
    """The per-layer overhead o >= 0 that makes (method + L o) / (plain + L o) = ratio on
    `dev` (roofline times); 0 when the bare roofline is already at or below the ratio."""
    if ratio <= 1 or layers < 1:
        raise ValueError("calibration needs ratio > 1 and layers >= 1")
    p, m = roofline_time(plain, dev, itemsize), roofline_time(method, dev, itemsize)
    return max(0.0, (m - ratio * p) / (layers * (ratio - 1)))


def overhead_from_step(measured_s: float, cost: ProgramCost, dev: Device, *, layers: int,
                       itemsize: int) -> float:
    """Per-layer overhead that makes the prediction of `cost` equal a measured step time
    (0 when the roofline alone is slower than the measurement)."""
    return max(0.0, (measured_s - roofline_time(cost, dev, itemsize)) / layers)


# -- tensor parallelism -------------------------------------------------------------------------
def allreduce_time(nbytes: float, devices: int, dev: Device) -> float:
    """Seconds of one all-reduce of an `nbytes` buffer over `devices` devices on `dev`'s
    interconnect: a ring all-reduce (a reduce-scatter, then an all-gather) sends and receives
    2 (devices - 1) / devices x nbytes per device, at `dev.interconnect` bytes/s each way.
    0 on one device. Bandwidth only: the fixed latency of a collective (microseconds per
    call: launch and synchronisation) is not counted; the per-layer overhead term stands
    for such fixed costs."""
    if devices < 1 or nbytes < 0:
        raise ValueError(f"allreduce_time: need devices >= 1 and nbytes >= 0, got {devices}, "
                         f"{nbytes}")
    if devices == 1:
        return 0.0
    if dev.interconnect <= 0:
        raise ValueError(f"device {dev.name}: no interconnect bandwidth in the table, so no "
                         f"all-reduce time (set Device.interconnect)")
    return 2.0 * (devices - 1) / devices * nbytes / dev.interconnect


def tp_allreduce_bytes(cfg: LlamaConfig, tokens: int, itemsize: int = 2, batch: int = 1) -> int:
    """Bytes of one tensor-parallel all-reduce of a step of `tokens` tokens per row: the
    residual stream's [batch, tokens, hidden] after a row-parallel projection (o_proj or
    down_proj), at `itemsize` bytes per element."""
    return int(batch * tokens * cfg.hidden_size * itemsize)


def tp_collective_time(cfg: LlamaConfig, tokens: int, model_devices: int, dev: Device,
                       itemsize: int = 2, batch: int = 1) -> float:
    """Seconds of a step's tensor-parallel all-reduces: 2 per layer (after the attention's
    output projection and after the MLP's down projection), each `tp_allreduce_bytes`, over
    `model_devices` devices. Not counted: the embedding's (one more of the same size, when
    the table is split over the vocabulary) and the logits' (the readout rows' argmax or
    values over a vocabulary split, a few kilobytes)."""
    per = allreduce_time(tp_allreduce_bytes(cfg, tokens, itemsize, batch), model_devices, dev)
    return 2 * cfg.num_layers * per


def predict_tp_step_time(cost: ProgramCost, dev: Device, cfg: LlamaConfig, itemsize: int = 2,
                         *, model_devices: int, batch: int = 1) -> float:
    """Predicted seconds of one tensor-parallel step: `predict_step_time` of one device's
    program (`cost` from `forward_cost(..., mesh=...)`: per-device FLOPs and bytes) plus the
    step's all-reduces (`tp_collective_time` of `cost.tokens` tokens over `model_devices`)."""
    return (predict_step_time(cost, dev, itemsize, layers=layers_of(cfg))
            + tp_collective_time(cfg, cost.tokens, model_devices, dev, itemsize, batch))


# -- looped models -------------------------------------------------------------------------------
def pass_layers(cfg: LoopedConfig, loops: int) -> int:
    """Layers a looped model's pass runs that calls the shared block `loops` times: the
    prelude and the readout's coda (Raven, recursive) once, the block's layers per loop. Plain
    decoding runs R loops per token; a LoopSpec / LoopAhead step runs one."""
    return cfg.prelude_layers + loops * cfg.loop_layers + cfg.coda_layers


def predict_looped_token_time(steps_per_token: float, step: ProgramCost, dev: Device,
                              itemsize: int = 2, *, layers: int) -> float:
    """Seconds per output token of a looped-model method that runs `steps_per_token` steps
    per token, each costing `step`: plain decoding, one step per token and R loops in it
    (`program_cost.forward_cost` at one token); LoopSpec and LoopAhead, one call of the shared
    block per step over the whole candidate tree, with the embedding (prelude) and the readout
    (coda, LM head) around it (`program_cost.tree_step_cost` at the tree's capacity).
    `layers`: the step's layers (`pass_layers`), for the per-layer overhead."""
    if steps_per_token < 0:
        raise ValueError("steps per token must be >= 0")
    return steps_per_token * predict_step_time(step, dev, itemsize, layers=layers)


# -- this machine ------------------------------------------------------------------------------
def measure_bandwidth(nbytes: int = 512 << 20, *, kind: str = "copy", iters: int = 5,
                      repeats: int = 5) -> float:
    """Bytes/s of one pass over `nbytes` of float32, jitted, warmed, median of repeats.
    kind 'copy': x + 1 into a new array (read + written: 2 x nbytes move); 'read': a column
    sum (nbytes read, a row written), the access pattern of a decode step reading weights.
    On a CPU the copy pays first-touch page faults on its fresh output and runs on one
    thread, so it reads well below what a decode step gets; on an accelerator they agree."""
    x = jnp.ones((max(1, nbytes // 4096), 1024), jnp.float32)
    if kind == "copy":
        return 2 * x.size * 4 / time_call(jax.jit(lambda a: a + 1.0), (x,), iters, repeats)
    if kind == "read":
        return x.size * 4 / time_call(jax.jit(lambda a: a.sum(0)), (x,), iters, repeats)
    raise ValueError(f"measure_bandwidth: kind must be 'copy' or 'read', not {kind!r}")


def measure_matmul(n: int = 2048, *, iters: int = 3, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n float32 matmul (2 n^3 FLOPs). Jitted, warmed, median."""
    a = jnp.ones((n, n), jnp.float32)
    b = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    return 2.0 * n ** 3 / time_call(mm, (a, b), iters, repeats)


def host_memory_bytes() -> float:
    """Physical memory of this host (0 if the OS does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def measure_device(name: str = "this machine", *, copy_bytes: int = 512 << 20,
                   matmul_n: int = 2048, repeats: int = 5, overhead_s: float = 0.0) -> Device:
    """This machine as a `Device`: bandwidth the larger of the copy and read probes (a
    roofline is a bound, so the best rate seen), peak from the float32 matmul probe (what
    the step programs run here), memory from the device or else the host. overhead_s is
    left to the caller (see `overhead_from_step`)."""
    copy = measure_bandwidth(copy_bytes, kind="copy", repeats=repeats)
    read = measure_bandwidth(copy_bytes, kind="read", repeats=repeats)
    peak = measure_matmul(matmul_n, repeats=repeats)
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    mem = float(stats.get("bytes_limit", 0)) or host_memory_bytes() or 1.0
    return Device(name, peak, max(copy, read), mem,
                  f"measured here ({jax.default_backend()}, {jax.device_count()} device(s)): "
                  f"copy probe {copy / GB:.1f} GB/s, read probe {read / GB:.1f} GB/s "
                  f"({copy_bytes >> 20} MiB float32), matmul probe {matmul_n}^3 float32 "
                  f"{peak / TFLOPS * 1000:.0f} GFLOP/s; median of {repeats}",
                  overhead_s=overhead_s)
