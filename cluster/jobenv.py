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
