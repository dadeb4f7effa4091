"""The training loop of ddp and manual_dp and what feeds and watches it; fsdp takes its numerics
and learning rate from numerics, model_parallel and pipeline their synthetic images from data.

    trainer        steps, checkpoint and resume, validation, a slow rank named
    numerics       --precision resolved for the device, the optimizer, the learning-rate schedule
    pace           the slow-rank detector's part in a rank: its own work per step timed, and which
                   ranks are slow against the others
    data           the data sets, synthetic and real, and their per-rank resumable samplers
    metrics        progress lines, TensorBoard scalars and the profiler
    virtual_ranks  which planned ranks a rank plays where a job continues on fewer ranks than it
                   was planned for (TMN_PLANNED_WORLD_SIZE)
    fsdp_report    what fsdp measures and says: bytes held, its clock, header, progress lines,
                   the summary, its BENCH row and the exported model
"""
