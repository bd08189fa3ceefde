"""One rank of a data-parallel run of examples/train_gpt.py on CPU (gloo), for tests/test_train_parallel.py.

    PYTHONPATH=examples RANK=r WORLD_SIZE=w python tests/parallel_worker.py STORE GRADS [train_gpt flags...]

Joins the process group through a FileStore at STORE (no network port to
pick), then, if GRADS is not empty, takes one training step's gradients
(rank 0 saves the loss and every full gradient to GRADS), then runs
``train_gpt.main`` with the flags.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import train_gpt
from gpt import GPT
from training import Batches, Ranks, load_text, parallelize, split


def first_gradients(flags: list[str], ranks: Ranks) -> tuple[float, dict]:
    """The loss of the first training batch and every parameter's full gradient, as train_gpt's wiring computes them."""
    args = train_gpt.parse_args(flags)
    torch.manual_seed(args.seed)
    model = GPT(train_gpt.model_config(args, args.depth_kv[0], args.norm[0]))
    run = parallelize(model, args.parallel, args.compile, torch.device("cpu"))
    data = Batches(*split(load_text(args.data)), args.batch_size, args.block_size, torch.device("cpu"), ranks)
    x, y = data.get(data.train, torch.Generator().manual_seed(args.seed))
    _, loss = run(x, y)
    loss.backward()
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in model.named_parameters()
    }
    return ranks.mean(loss), grads


def main() -> None:
    store, grads_path, *flags = sys.argv[1:]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        if grads_path:
            loss, grads = first_gradients(flags, Ranks(rank, world))
            if rank == 0:
                torch.save({"loss": loss, "grads": grads}, grads_path)
        train_gpt.main(flags)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Gloo's worker threads can still be joinable while the interpreter finalizes, and
    # std::terminate then aborts a finished run (pytorch/pytorch#179291): leave without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
