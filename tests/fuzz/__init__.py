"""Fuzz tests: every input to the inventory loader, the training config and the CLIs ends
in a valid result or in one `Error:` line with exit 2, and nothing reaches a host."""
