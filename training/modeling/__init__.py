"""The models the workloads train: models (the image classifiers, built by name from the MODELS of
the config) and gpt (the GPT-style decoder fsdp shards, its shapes and peak-FLOPs table).
"""
