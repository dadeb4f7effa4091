"""What a workload is told and how it answers, all of it torch-free (the controller imports it:
`train` checks a job's arguments before starting it, see CONTRIBUTING.md): config (typed settings,
CLI over a --config file over defaults), fsdp_config (fsdp's), arguments (each workload's command
line and its checks), console (the argument parser whose errors are one line, and rank-aware
output). Nothing here may import torch at module level.
"""
