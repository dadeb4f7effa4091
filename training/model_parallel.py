"""Model parallel ResNet-50: one model split over two devices, optionally pipelined, optionally
replicated with DDP.

    python -m training.model_parallel                      # one process, two devices
    python -m training.model_parallel --split-size 4       # micro-batches overlap the devices
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m training.model_parallel

conv1..layer2 run on the first device and layer3..fc on the second: cuda:0 and cuda:1 with two
GPUs, otherwise cpu and cpu (the same code path, minus the speed). Under torchrun each process
holds one such two-device replica (GPUs 2*LOCAL_RANK and 2*LOCAL_RANK+1) and DDP, which spans
the devices when given device_ids=None, keeps the replicas equal; a job on GPUs needs 2 of them
per process on every node (fewer is an error), a job on gloo runs on the CPU.

Without --split-size the second device idles while the first works and vice versa. With it,
each batch is cut into micro-batches of that size and micro-batch i+1 enters the first device
while micro-batch i is on the second; CUDA's asynchronous launches make the two overlap.
BatchNorm then normalises per micro-batch, so train-mode outputs differ from the unsplit
model's; eval-mode outputs do not.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch import nn

from torch_multinode.cluster.errors import UserError
from torch_multinode.training.distributed import parallel
from torch_multinode.training.loop.data import SyntheticImages
from torch_multinode.training.settings import arguments, console


def stage_devices(env: parallel.DistEnv) -> tuple[torch.device, torch.device]:
    """The two devices this process's replica spans.

    Indices are those torch sees, i.e. counted within CUDA_VISIBLE_DEVICES (what GPUS= sets).
    A job on GPUs (NCCL) whose node has fewer than 2 per process stops here: falling back to
    the CPU would leave DDP's first collective with CPU tensors NCCL cannot carry ("No backend
    type associated with device type cpu")."""
    cpu = torch.device("cpu")
    if not env.launched:
        if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
            return torch.device("cuda:0"), torch.device("cuda:1")
        return cpu, cpu  # one process, no collective: the CPU does
    if env.device.type != "cuda":
        return cpu, cpu  # gloo: the job computes on the CPU
    found = torch.cuda.device_count()
    needed = 2 * env.local_world_size
    if found < needed:
        processes = "process" if env.local_world_size == 1 else "processes"
        fewer = f"NPROC={found // 2}, " if found >= 2 else ""
        raise UserError(
            f"on {parallel.node_name()}: {env.local_world_size} {processes} x 2 GPUs each need "
            f"{needed} GPUs, found {found}",
            hint=f"a node with 2 GPUs per process, {fewer}or GPUS= naming two GPU indices per "
            "process, e.g. GPUS=0,1",
        )
    first = 2 * env.local_rank
    return torch.device(f"cuda:{first}"), torch.device(f"cuda:{first + 1}")


def _resnet50(num_classes: int) -> nn.Module:
    from torchvision.models import resnet50

    return resnet50(weights=None, num_classes=num_classes)


class ModelParallelResNet50(nn.Module):
    """torchvision's resnet50 in two stages, one per device. Pass `base` to split an existing
    resnet50 (its modules are moved, not copied): the weights are then exactly that model's."""

    def __init__(
        self, num_classes: int = 1000, devices=("cpu", "cpu"), base: nn.Module | None = None
    ):
        super().__init__()
        base = base if base is not None else _resnet50(num_classes)
        self.devices = tuple(torch.device(device) for device in devices)
        self.seq1 = nn.Sequential(
            base.conv1, base.bn1, base.relu, base.maxpool, base.layer1, base.layer2
        ).to(self.devices[0])
        self.seq2 = nn.Sequential(base.layer3, base.layer4, base.avgpool).to(self.devices[1])
        self.fc = base.fc.to(self.devices[1])

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.seq2(hidden), 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self._head(self.seq1(images.to(self.devices[0])).to(self.devices[1]))


class PipelinedModelParallelResNet50(ModelParallelResNet50):
    """The same two stages, fed micro-batches of `split_size` so both devices work at once."""

    def __init__(self, split_size: int = 20, **kwargs):
        super().__init__(**kwargs)
        self.split_size = split_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        chunks = iter(images.to(self.devices[0]).split(self.split_size, dim=0))
        in_flight = self.seq1(next(chunks)).to(self.devices[1])
        outputs = []
        for chunk in chunks:
            # Queued on the second device, then the next chunk on the first: they overlap.
            outputs.append(self._head(in_flight))
            in_flight = self.seq1(chunk).to(self.devices[1])
        outputs.append(self._head(in_flight))
        return torch.cat(outputs)


def build(split_size: int, num_classes: int, devices, base: nn.Module | None = None) -> nn.Module:
    if split_size:
        return PipelinedModelParallelResNet50(
            split_size=split_size, num_classes=num_classes, devices=devices, base=base
        )
    return ModelParallelResNet50(num_classes=num_classes, devices=devices, base=base)


def main(argv: list[str] | None = None) -> int:
    args = arguments.model_parallel(argv)
    env = parallel.read_env()
    devices = stage_devices(env)
    # The process's own device is its first stage's, not cuda:LOCAL_RANK; its group is bound to
    # no one GPU, since DDP reduces each stage's gradients on that stage's GPU.
    env = dataclasses.replace(env, device=devices[0])
    parallel.start(env, bind=False)
    torch.manual_seed(args.seed)
    model = build(args.split_size, args.num_classes, devices)
    if env.launched:
        from torch.nn.parallel import DistributedDataParallel

        # device_ids=None: the module spans two devices, so DDP must not pin it to one.
        model = DistributedDataParallel(model, device_ids=None)
    mode = f"pipelined, micro-batches of {args.split_size}" if args.split_size else "no pipelining"
    console.say(
        env,
        f"world    {env.describe()}",
        f"stages   conv1..layer2 on {devices[0]}, layer3..fc on {devices[1]} ({mode})",
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dataset = SyntheticImages(
        split="train",
        size=1 << 20,
        num_classes=args.num_classes,
        image_size=args.image_size,
        noise=1.0,
        seed=args.seed,
    )
    for step in range(1, args.steps + 1):
        first = ((step - 1) * env.world_size + env.rank) * args.batch_size
        samples = [dataset[first + i] for i in range(args.batch_size)]
        images = torch.stack([sample[0] for sample in samples])
        labels = torch.tensor([sample[1] for sample in samples], device=devices[1])
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)  # outputs arrive on the second device
        loss.backward()
        optimizer.step()
        for device in {d for d in devices if d.type == "cuda"}:
            torch.cuda.synchronize(device)
        console.say(
            env,
            f"step {step}/{args.steps}  loss {loss.item():.4f}  "
            f"{time.perf_counter() - started:.3f} s",
        )
    console.say_every_rank(env, f"parameters sha256 {parallel.parameter_digest(model)}")
    return 0


if __name__ == "__main__":
    parallel.run(main)
