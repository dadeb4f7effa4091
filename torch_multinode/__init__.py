"""torch-multinode's code, importable under this one name and no generic one.

The rooms keep their folders beside this one (`cluster/`, `provision/`, `launch/`, `netcheck/`,
`training/`, `bench/`, `sim/`), and are imported as `torch_multinode.<room>`: a user's project
with its own `training/` or `cluster/` package can neither hide ours nor be hidden by it. In a
checkout this package's path is the checkout's root. On a node, the rooms a job needs are sent
into a `torch_multinode/` directory of their own (a namespace package: this file does not
travel), so nothing else of ours is on the job's import path.
"""

import os

__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
