"""The process group and what runs over it. Every workload starts its ranks through parallel, and
its all-reduce through DDP or by hand over the same group.

    parallel  the job's environment read (RANK, LOCAL_RANK, WORLD_SIZE, TMN_BACKEND), each rank
              bound to its device, the group started and stopped, a model wrapped in DDP; a
              workload's main run through it (`run`, `call`: its errors said as one line)
    levers    the all-reduce levers: comm hooks, `--comm-hook auto` picked by measuring, no_sync
              accumulation
    flight    a rank's Flight Recorder trace, written when the launcher asks (a hang) or when the
              rank dies of an uncaught exception; parallel.start starts it
    waits     a rank's time waiting in collectives, its totals written for the launcher's
              straggler watch (launch.stragglers)
    site/     not a package: the sitecustomize that starts flight and waits in any script the
              launcher runs with a project (last on the job's PYTHONPATH)
"""
