"""The simulated cluster: node containers reached over SSH, the test and benchmark infrastructure.

Production rooms (`cluster/`, `launch/`, `netcheck/`, `training/`) never import it; tests and
`bench/` do.
"""
