"""The one inventory, SSH to the nodes, and the simulated cluster: what every part shares."""

__version__ = "0.1.0"
