"""The training loop of ddp and manual_dp and what feeds and watches it: trainer (steps, precision,
resume, evaluation), data (data sets, synthetic and real, and their distributed samplers),
metrics (TensorBoard scalars and the profiler) and virtual_ranks (which planned ranks a rank plays
where a job continues on fewer ranks than it was planned for).
"""
