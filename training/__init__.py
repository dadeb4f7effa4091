"""Training workloads, each run as `python -m training.<name>` (under torchrun where it says so).

    ddp             DDP image classification: the workload the cluster is verified with
    manual_dp       the same training with hand-written gradient averaging instead of DDP
    fsdp            a GPT sharded with FSDP2 (fully_shard), distributed checkpoints, resharding
    model_parallel  ResNet-50 split over two devices, optionally pipelined, optionally under DDP
    pipeline        pipeline parallelism across processes (torch.distributed.pipelining)
    comm_demo       every point-to-point and collective operation, each checked
    dp_vs_ddp       DataParallel against DDP on one multi-GPU node

The pieces they share: config (typed settings, CLI over file over defaults), arguments (each
workload's command line, checked without torch: `train` checks it on the controller too),
data, models, parallel (process group, device, DDP wrapping), trainer (the loop), checkpoint,
metrics.
"""
