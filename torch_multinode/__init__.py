"""torch-multinode's code, importable under this one name and no generic one.

The rooms keep their folders at the checkout's top level (`cluster/`, `provision/`, `launch/`,
`netcheck/`, `training/`, `bench/`, `sim/`) and are imported as `torch_multinode.<room>`: a user's
project with its own `training/` or `cluster/` package can neither hide ours nor be hidden by it.
This directory holds a relative symlink to each room (`torch_multinode/cluster -> ../cluster`),
which makes them this package's subpackages on disk, so Python, the editable install, type
checkers and editors all follow `torch_multinode.cluster.errors` to `cluster/errors.py` without
any import-time trick. On a node, the rooms a job needs are sent into a `torch_multinode/`
directory of their own (a namespace package: neither this file nor the symlinks travel), so
nothing else of ours is on the job's import path.
"""
