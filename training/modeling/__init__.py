"""The models the workloads train. Each is an ordinary nn.Module; how it is distributed is the
workload's.

    models  the image classifiers, built by name from the MODELS of the config
    gpt     the GPT-style decoder fsdp shards, its token data, and the arithmetic of model FLOPs
            utilisation (its peak-FLOPs table)
"""
