"""What runs on the nodes: the training workloads, each run as `python -m training.<name>` (under
torchrun where it says so; the launcher maps MODULE=training.<name> to
torch_multinode.training.<name>), and the pieces they share.

Workloads:

    ddp             DDP image classification: the workload the cluster is verified with
    manual_dp       the same training with hand-written gradient averaging instead of DDP
    fsdp            a GPT sharded with FSDP2 (fully_shard), distributed checkpoints and their
                    replicas, resharding
    model_parallel  ResNet-50 split over two devices, optionally pipelined, optionally under DDP
    pipeline        pipeline parallelism across processes (torch.distributed.pipelining)
    comm_demo       every point-to-point and collective operation, each checked
    dp_vs_ddp       DataParallel against DDP on one multi-GPU node
    selftest        every GPU path on every node, a table (`make selftest`)
    spawn           DDP started with torch.multiprocessing.spawn instead of torchrun

Launcher shims the launcher runs by name, not workloads:

    legacy          hands a torch.distributed.launch-era script its --local_rank flag
    local_launch    torchrun for a job on this machine, ending as a job on the nodes ends

Subpackages, one concern each (each one's __init__ indexes its modules):

    settings        torch-free: each workload's config and command line, the console; `train`
                    checks a job's arguments with them on the controller
    distributed     the process group, device and DDP wrapping; the all-reduce levers; the
                    Flight Recorder trace
    loop            the training loop of ddp and manual_dp, its data, metrics, virtual ranks
    modeling        the models: the image classifiers, the GPT fsdp shards
    checkpointing   both checkpoint formats, when one is complete, the durable write, and the
                    replicas between nodes
    selftesting     the checks `make selftest` runs
    fixtures        the jobs of the benchmarks and tests (bench_scaling, init_methods)
"""
