"""What a workload is told and how it answers, all of it torch-free (the controller imports it:
`train` checks a job's arguments before starting it, see CONTRIBUTING.md). Nothing here may
import torch at module level.

    config       the typed configs of ddp and manual_dp, and their parser: flags over a --config
                 file over defaults
    fsdp_config  fsdp's typed settings, through config's parser
    arguments    each workload's command line and its checks (CHECKS, which `train` runs)
    console      the argument parser whose errors are one line, and rank-aware output
"""
