"""Training workloads, each run as `python -m training.<name>` (under torchrun where it says so).

    ddp             DDP image classification: the workload the cluster is verified with
    manual_dp       the same training with hand-written gradient averaging instead of DDP
    fsdp            a GPT sharded with FSDP2 (fully_shard), distributed checkpoints, resharding
    model_parallel  ResNet-50 split over two devices, optionally pipelined, optionally under DDP
    pipeline        pipeline parallelism across processes (torch.distributed.pipelining)
    comm_demo       every point-to-point and collective operation, each checked
    dp_vs_ddp       DataParallel against DDP on one multi-GPU node
    selftest        every GPU path on every node, a table (`make selftest`; its checks: selftesting)
    spawn           DDP started with torch.multiprocessing.spawn instead of torchrun

Not workloads: legacy and local_launch are launcher shims the launcher runs by name (legacy hands a
torch.distributed.launch-era script its --local_rank flag; local_launch is torchrun for a job on
this machine), and fixtures holds the jobs of the benchmarks and tests (bench_scaling,
init_methods).

The pieces the workloads share, one subpackage per concern: settings (config, fsdp_config,
arguments, console: torch-free, `train` checks a job's arguments on the controller with them),
distributed (parallel: process group, device, DDP wrapping; levers: comm hooks), loop (trainer,
data, metrics), modeling (models, gpt), checkpointing (checkpoint, dcp, and the durable write both
use).
"""
