"""The checks `make selftest` runs (training.selftest): each GPU path of the project as a function
of this rank's Job, with what a check that does not apply or fails says. training.selftest itself
keeps the list, runs the checks on every rank and prints the table; it is the workload, this is
what it runs.
"""
