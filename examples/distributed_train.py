"""A distributed training job that fails, and its diagnosis: one corrupted batch on one rank.

    torchrun --nproc_per_node=2 examples/distributed_train.py                # DDP
    torchrun --nproc_per_node=2 examples/distributed_train.py --wrap fsdp2   # FSDP2 (fully_shard)
    torchrun --nproc_per_node=4 examples/distributed_train.py --wrap hsdp    # 2 x 2 device mesh

Every rank trains a small MLP on its share of the batch; at step 30 one sample of the last
rank's batch is NaN (a corrupted record). The training loop is the plain one, unchanged; the
job's diagnosis is printed on rank 0 and written to runs/distributed.ndbg, which
`neuraldbg explain runs/distributed.ndbg` reads back. Runs on CPU (gloo) or GPUs (nccl).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from neuraldbg import NeuralDbg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=("ddp", "fsdp2", "hsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bad-step", type=int, default=30)
    parser.add_argument("--trace", default="runs/distributed.ndbg")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    if args.wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        shape = (2, world // 2) if args.wrap == "hsdp" else (world,)
        mesh = init_device_mesh(device.type, shape)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data

    with NeuralDbg(model, criterion=criterion, trace=args.trace) as dbg:
        for step in range(args.steps):
            x = torch.randn(16, 32, generator=data)
            y = torch.randint(0, 10, (16,), generator=data)
            if step == args.bad_step and rank == world - 1:
                x[3, 7] = float("nan")  # the corrupted record
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()

    if rank == 0:
        for h in dbg.explain_failure()[:3]:
            print(h)
        print(f"trace: {args.trace}  (neuraldbg explain {args.trace})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
