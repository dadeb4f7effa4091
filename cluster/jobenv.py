"""Names the launcher and the workloads share through the job's environment.

Imported by the workloads inside the training image, which holds torch, torchvision, pyyaml and
TensorBoard only: this module must import nothing beyond the standard library.
"""

RUN_DIR_VARIABLE = "TMN_RUN_DIR"  # where a workload writes its outputs; the launcher copies it back
# The process group backend the launcher decided for the whole job (nccl or gloo): every rank uses
# it, and a rank that cannot (an NCCL job on a node whose GPUs do not answer) stops at once.
BACKEND_VARIABLE = "TMN_BACKEND"
# The node's name in the inventory, for messages that name it.
NODE_NAME_VARIABLE = "TMN_NODE_NAME"
# The world size a job was started with (nodes x processes per node), set when the launcher
# continues it on fewer nodes (MIN_NODES): a data-parallel workload then plays the missing ranks
# itself (training.loop.virtual_ranks), keeping the global batch and the steps' mathematics.
PLANNED_WORLD_VARIABLE = "TMN_PLANNED_WORLD_SIZE"
# The Flight Recorder (torch's ring of each rank's last collectives): on by default, small. A
# rank that runs training.distributed.flight.start() (every workload of ours does; our
# sitecustomize does in a user's script) writes its trace to FLIGHT_DUMP in the run directory
# when the launcher creates FLIGHT_REQUEST there (a hang). Both are file names in TMN_RUN_DIR.
FLIGHT_BUFFER_VARIABLE = "TORCH_FR_BUFFER_SIZE"
FLIGHT_BUFFER_DEFAULT = "256"
FLIGHT_REQUEST = "flight-request"
FLIGHT_DUMP = "flight-rank-{rank}.json"
# NCCL's watchdog ends a rank whose collective timed out before Python could write the trace:
# torch writes it itself (a pickle), to this prefix followed by the rank (TORCH_FR_DUMP_TEMP_FILE,
# with TORCH_NCCL_DUMP_ON_TIMEOUT=1; the launcher sets both).
FLIGHT_TIMEOUT_DUMP = "flight-timeout-rank-"
# Each rank's time waiting in collectives, its totals rewritten every few seconds
# (training.distributed.waits) and read by the launcher's straggler watch (launch.stragglers): a
# file name in TMN_RUN_DIR.
PACE_FILE = "pace-rank-{rank}.json"
# Per-step fault tolerance (FT=1, torchft): each node is one replica group, run by its own
# torchrun; its environment names the group (0-based), how many the job was planned with, the
# fewest that may train a step, and the seconds a cross-node collective waits before a silent
# group is dropped (the launcher's FT=1 sets them: launch.replicated). torchft itself reads the
# lighthouse's address from TORCHFT_LIGHTHOUSE.
REPLICA_GROUP_VARIABLE = "TMN_REPLICA_GROUP"
REPLICA_GROUPS_VARIABLE = "TMN_REPLICA_GROUPS"
REPLICA_MIN_GROUPS_VARIABLE = "TMN_REPLICA_MIN_GROUPS"
REPLICA_TIMEOUT_VARIABLE = "TMN_REPLICA_TIMEOUT"
# The address the group's manager and its checkpoint server give the others (the node's own on
# the job's network; torchft's default is the host name, which may resolve to another network).
REPLICA_ADDRESS_VARIABLE = "TMN_REPLICA_ADDRESS"
# Seconds the groups started together wait at step 0 for each other before the first step (a
# group started on its own later, a restart or a spare, waits for nothing: it heals).
REPLICA_START_WAIT_VARIABLE = "TMN_REPLICA_START_WAIT"
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
