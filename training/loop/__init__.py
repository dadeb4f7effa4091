"""The training loop of ddp and manual_dp and what feeds and watches it: trainer (steps, precision,
resume, evaluation), data (data sets, synthetic and real, and their distributed samplers) and
metrics (TensorBoard scalars and the profiler).
"""
