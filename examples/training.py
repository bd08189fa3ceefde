"""The training loop of the examples, written once: byte data, the schedule, the loop, data parallelism, checkpoints.

    data = Batches(*split(load_text(None)), batch_size=8, block_size=128, device=torch.device("cpu"))
    training = Training(model, model, data, Schedule(lr=2e-3, warmup=30, steps=400), seed=1337,
                        weight_decay=0.1, eval_interval=100, eval_iters=20, skip_timing=3, autocast=nullcontext())
    for step in training:
        print(step.done, step.loss, step.val_loss)   # val_loss every eval_interval steps, else None
    training.curve, training.clock                   # the validation points, the step times

``train_gpt.py`` trains one model per configuration with it; ``compare_models.py``
runs the learning-rate sweeps and the seeds of its study through it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
import warnings
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from gpt import GPT

PYDOC = "the standard library's pydoc_data.topics (Python's help text)"
VAL_FRACTION = 0.1  # the last tenth of the bytes is the validation text
# Below this share of its threads' time on the CPU, a run's step times measure the other processes on the machine,
# not the model: an idle machine gives the training loop nearly all of its threads' time, one busy process beside it
# takes a core's worth away from two threads (a share near 0.5).
UNDISTURBED_SHARE = 0.8


# ---- data ---------------------------------------------------------------------------------------


def load_text(path: str | None) -> bytes:
    """The training text as UTF-8 bytes: ``path``, or the stdlib's pydoc topics."""
    if path is not None:
        return Path(path).read_bytes()
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def split(data: bytes, val_fraction: float = VAL_FRACTION) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens (N,) int64 as a train and a validation tensor (the last ``val_fraction`` of the bytes)."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n_val = int(len(tokens) * val_fraction)
    return tokens[:-n_val], tokens[-n_val:]


def get_batch(tokens: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator, device):
    """Random windows: inputs and next-token targets, both (batch_size, block_size)."""
    start = torch.randint(len(tokens) - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size + 1)
    window = tokens[start[:, None] + offsets]  # (batch_size, block_size + 1)
    return window[:, :-1].to(device), window[:, 1:].to(device)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place among the processes of a data-parallel run (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0 prints and saves."""
        return self.rank == 0

    def shard(self, *batches: torch.Tensor) -> tuple:
        """This rank's slice of each (global batch, ...) tensor: rows ``rank * b .. (rank + 1) * b``."""
        return tuple(t.tensor_split(self.world)[self.rank] for t in batches)

    def say(self, *args, **kwargs) -> None:
        """``print`` on rank 0; the other ranks stay quiet."""
        if self.main:
            print(*args, **kwargs)

    def mean(self, value: torch.Tensor) -> float:
        """The mean over ranks of a scalar tensor (each rank's mean over an equal slice: the global mean)."""
        if self.world > 1:
            value = value.detach().clone()
            dist.all_reduce(value)  # a sum: gloo has no average
            value /= self.world
        return value.item()


@dataclasses.dataclass(frozen=True)
class Batches:
    """Train and validation tokens (N,), cut into global batches of (batch_size, block_size) windows.

    Every rank draws the same global batch from the one generator and takes
    its slice, so the data of a data-parallel run are those of one process.
    """

    train: torch.Tensor
    val: torch.Tensor
    batch_size: int
    block_size: int
    device: torch.device
    ranks: Ranks = Ranks()

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size

    def get(self, tokens: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets, (batch_size / world, block_size) each, of a global batch of ``tokens``."""
        return self.ranks.shard(*get_batch(tokens, self.batch_size, self.block_size, generator, self.device))


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Batches, iters: int, autocast: AbstractContextManager) -> float:
    """Mean validation loss over ``iters`` batches, the same batches for every model (and every rank count)."""
    model.eval()
    generator = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(iters):
        x, y = data.get(data.val, generator)
        torch.compiler.cudagraph_mark_step_begin()  # under CUDA graphs: the last call's outputs are consumed
        with autocast:
            total += data.ranks.mean(model(x, y)[1])
    model.train()
    return total / iters


# ---- the loop -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The learning rate of each of ``steps`` steps: linear warmup over ``warmup``, then cosine decay to a tenth."""

    lr: float
    warmup: int
    steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class CPUClock:
    """Wall time and this process's CPU time over the timed steps, and what share of its threads' time it got.

    The first ``skip`` steps (compilation, allocator warm-up, kernel
    autotuning) are left out of the totals; ``laps`` keeps every step's wall
    time. On a CPU, a step's wall time is a measurement of the model only while the
    process's threads run: when other processes hold the cores, the threads
    wait, the wall time grows and the CPU time does not. The share, CPU time
    over wall time times threads, says so (on CUDA the host waits for the GPU,
    so there it says nothing and is None).
    """

    def __init__(self, device: torch.device, skip: int = 0):
        # Threads beyond the cores this process may use wait for each other, not for other processes.
        self.threads = min(torch.get_num_threads(), len(os.sched_getaffinity(0))) if device.type == "cpu" else None
        self.skip = skip
        self.laps: list[float] = []
        self.wall = self.cpu = 0.0
        self.steps = 0

    def start(self) -> None:
        self._started = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        """One step has ended."""
        wall, cpu = self._started
        lap = time.perf_counter() - wall
        self.laps.append(lap)
        if len(self.laps) > self.skip:
            self.wall += lap
            self.cpu += time.process_time() - cpu
            self.steps += 1

    @property
    def share(self) -> float | None:
        """CPU time / (wall time * threads) so far; None on CUDA or before a timed step."""
        if self.threads is None or not self.wall:
            return None
        return self.cpu / (self.wall * self.threads)

    @property
    def disturbed(self) -> bool:
        share = self.share
        return share is not None and share < UNDISTURBED_SHARE


@dataclasses.dataclass(frozen=True)
class Step:
    """What one training step reports: steps done, its loss (mean over ranks), the validation loss if it took one."""

    done: int
    loss: float
    val_loss: float | None


class Training:
    """One model's run: AdamW (0.9, 0.95), ``schedule``, gradient clipping at 1.0, a validation point every
    ``eval_interval`` steps and after the last.

    Iterating runs the steps and yields a :class:`Step` after each, so that
    the caller reports progress. ``run`` is the module that computes
    (``model`` compiled, or wrapped for data parallelism), ``model`` the one
    that owns the parameters. With ``stop_if_diverged`` a loss that is not
    finite ends the run before that step's evaluation (``diverged``);
    without, the run goes on to its last step.

    Attributes:
        curve: the validation points: tokens seen, val loss, mean train loss since the previous point.
        clock: the steps' times (:class:`CPUClock`, ``skip_timing`` steps left out).
        eval_times: seconds of each evaluation.
    """

    def __init__(
        self,
        run: torch.nn.Module,
        model: GPT,
        data: Batches,
        schedule: Schedule,
        *,
        seed: int,
        weight_decay: float,
        eval_interval: int,
        eval_iters: int,
        skip_timing: int,
        autocast: AbstractContextManager,
        stop_if_diverged: bool = False,
    ):
        self.run, self.model, self.data, self.schedule, self.autocast = run, model, data, schedule, autocast
        self.eval_interval, self.eval_iters, self.stop_if_diverged = eval_interval, eval_iters, stop_if_diverged
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=schedule.lr,
            betas=(0.9, 0.95),
            fused=data.device.type == "cuda",
        )
        self.generator = torch.Generator().manual_seed(seed)
        if data.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(data.device)
        self.clock = CPUClock(data.device, skip_timing)
        self.curve: list[dict] = []
        self.eval_times: list[float] = []
        self.diverged = False

    def __iter__(self) -> Iterator[Step]:
        losses = []  # the training losses since the last validation point
        for step in range(self.schedule.steps):
            self.clock.start()
            for group in self.optimizer.param_groups:
                group["lr"] = self.schedule(step)
            x, y = self.data.get(self.data.train, self.generator)
            torch.compiler.cudagraph_mark_step_begin()  # a new step: CUDA graphs may overwrite the last one's outputs
            with self.autocast:
                _, loss = self.run(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss_value = self.data.ranks.mean(loss)  # synchronizes, so the step time is real
            self.clock.stop()
            if self.stop_if_diverged and not math.isfinite(loss_value):
                self.diverged = True
                return
            losses.append(loss_value)
            val_loss = None
            if (step + 1) % self.eval_interval == 0 or step + 1 == self.schedule.steps:
                started = time.perf_counter()
                val_loss = evaluate(self.run, self.data, self.eval_iters, self.autocast)
                self.eval_times.append(time.perf_counter() - started)
                self.curve.append({"tokens": self.data.tokens_per_step * (step + 1), "val_loss": val_loss,
                                   "train_loss": statistics.fmean(losses)})  # fmt: skip
                losses = []
            yield Step(step + 1, loss_value, val_loss)

    @property
    def peak_mb(self) -> float | None:
        """The peak of CUDA memory allocated since the run began, in MiB; None on CPU."""
        device = self.data.device
        return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the cores this process may use and the CPU's model: ``"2-core CPU (Intel(R) ...)"``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = f"{len(os.sched_getaffinity(0))}-core CPU"
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []  # fmt: skip
    return f"{name} ({models[0]})" if models else name


# ---- data parallelism and checkpoints -----------------------------------------------------------


def join(parallel: str, device: str) -> Ranks:
    """This process's ranks: the process group of torchrun's environment, joined here unless already joined."""
    if parallel == "none":
        return Ranks()
    if not dist.is_initialized():
        if device.startswith("cuda"):
            cuda = torch.device(device)
            torch.cuda.set_device(cuda)
            dist.init_process_group("nccl", device_id=cuda)
        else:
            dist.init_process_group("gloo")
    return Ranks(dist.get_rank(), dist.get_world_size())


def parallelize(model: GPT, parallel: str, compile: bool, device: torch.device) -> torch.nn.Module:
    """The module to train: ``model`` compiled (``compile``), under DDP or FSDP2 (``parallel``: none, ddp, fsdp).

    DDP wraps the compiled model, as one process compiles it whole. FSDP2
    shards every block and then the root (which keeps the tied embedding);
    its hooks run between blocks, so each block is compiled on its own.
    """
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # A block returns its depth entries, some of them views; FSDP2 warns that an in-place op on such a
        # view would skip its hooks. Nothing writes to a depth entry in place (the stream is a value).
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

        if compile:
            # Each block reads a depth stream of its own length: one graph per block for training and one
            # for evaluation (no grad), where the limit would otherwise stop a deep model at 8.
            limit = 2 * len(model.blocks) + 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        for block in model.blocks:
            if compile:
                block.compile(fullgraph=True)
            fully_shard(block)
        fully_shard(model)
        return model
    run = torch.compile(model, fullgraph=True) if compile else model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(run, device_ids=[device.index] if device.type == "cuda" else None)
    return run


def save_checkpoint(model: GPT, path: Path, ranks: Ranks, step: int, val_loss: float) -> None:
    """The model's whole state, its config, ``step`` and ``val_loss`` at ``path``, on rank 0 (FSDP2's shards gathered
    to its CPU).

    Every rank must call it; ``gpt.load_checkpoint`` reads it back.
    """
    if ranks.world == 1:
        state = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ranks.main:
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = {"model": state, "config": dataclasses.asdict(model.config), "step": step, "val_loss": val_loss}
        torch.save(checkpoint, path)
