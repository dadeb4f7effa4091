# torch-multinode: from bare Linux GPU machines to a verified multi-node PyTorch run.
# `make` alone lists the targets. Knobs below can be set on the command line:
#   make train INVENTORY=my-cluster.yml NNODES=2

# Empty: every node of INVENTORY (the simulated cluster starts 2).
NNODES    ?=
INVENTORY ?=
# Empty: the hosts of INVENTORY's group "nodes"; GROUP=gpu_boxes picks another Ansible group.
GROUP     ?=
LINK      ?=
FRESH     ?=
FINGERPRINTS ?=
NO_PASSWORD_LOGIN ?=
SCRIPT    ?=
WORKDIR   ?=
# The project's Python dependencies (make train): empty, requirements.txt at its root, else its
# pyproject.toml's dependencies; REQUIREMENTS=path for another file; REQUIREMENTS=none for none.
REQUIREMENTS ?=
ENV       ?=
SRC       ?=
RUN       ?=
# make rerun SAME_OUTPUTS=1: the rerun writes the original run's outputs (resuming from its
# checkpoints) instead of places of its own (NAME-rerun-ID).
SAME_OUTPUTS ?=
MODULE    ?=
ARGS      ?=
GPUS      ?=
# Processes per node (torchrun's --nproc-per-node); empty: one per GPU, 1 on a CPU node, 2 locally.
NPROC     ?=
RESTARTS  ?=
# MIN_NODES=k with RESTARTS: a node lost for good, with no spare (an inventory host beyond
# NNODES) to take its place, is dropped while k nodes remain (the workloads keep the global batch);
# under Slurm as over SSH: a new job on the nodes left.
MIN_NODES ?=
# FT=1: each node one replica group (torchft); a node lost is dropped at the next step and the
# others go on in the same processes (MIN_NODES: the fewest groups to go on with; default 1).
FT        ?=
# Seconds without progress that make a job a hang (0: never; empty: from its step times), and
# what a hang does after its report: stop (the default) or wait for a person.
STALL     ?=
ON_HANG   ?=
# ALLOW_DRIFT=1: run on nodes whose versions changed since netcheck locked them (said in the record).
ALLOW_DRIFT ?=
# make exits 2 whenever train fails, whatever the launcher's code: train and selftest write that
# code (0 success, 1 job failed, 2 bad input, 130 Ctrl-C, 143 SIGTERM) to this file instead.
EXIT_CODE ?= .runs/exit-code
DEBUG     ?=
ANSIBLE_ARGS ?=
BENCH_ARGS ?=
PYTHON    ?= python3
VENV      ?= .venv
IMAGE     ?= torch-multinode/train:latest
# make image: KIND=cuda|cpu forces a kind (else CUDA where nvidia-smi works); BASE_IMAGE= builds
# on an image that brings its own torch (NVIDIA's), refused below the project's minimum.
KIND      ?=
BASE_IMAGE ?=
# Test workers: most simulated-cluster tests wait on SSH, apt and image I/O, not on the CPU.
TEST_WORKERS ?= 3

BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

.PHONY: help  ## list the targets and the knobs
help:
	@echo "Usage: make TARGET [INVENTORY=path.yml] [GROUP=nodes] [NNODES=2] [LINK=1gbit] [SCRIPT=train.py ARGS='...']"
	@echo "                   [WORKDIR=dir] [REQUIREMENTS=path|none] [ENV='HF_TOKEN WANDB_MODE=offline'] [MODULE=training.comm_demo] [GPUS=0,2] [NPROC=2]"
	@echo "                   [DEBUG=1] [RESTARTS=1] [MIN_NODES=2] [FT=1] [STALL=300] [ON_HANG=wait] [ALLOW_DRIFT=1] [EXIT_CODE=.runs/exit-code] [IMAGE=torch-multinode/train:latest]"
	@echo "                   [SRC=dataset-dir] [RUN=job-id] [SAME_OUTPUTS=1] [JOB=slurm-id]"
	@echo
	@grep -E '^\.PHONY: [a-z0-9-]+ +## ' $(MAKEFILE_LIST) | \
		sed -E 's/^\.PHONY: ([a-z0-9-]+) +## (.*)/\1\t\2/' | awk -F'\t' '{printf "  %-15s %s\n", $$1, $$2}'

# The first target that needs Python creates the environment (torch and torchvision pinned).
$(STAMP): pyproject.toml ansible/requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "Error: $(PYTHON) is not installed (try apt-get install python3 python3-venv)"; exit 1; }
	@echo "Creating $(VENV) with torch and torchvision (once, about 2 minutes)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]' -r ansible/requirements.txt
	@touch $@

.PHONY: venv  ## create the Python environment (.venv) now
venv: $(STAMP)

.PHONY: bootstrap  ## first contact with freshly installed nodes: key, host keys, sudo (FINGERPRINTS=file, NO_PASSWORD_LOGIN=1)
bootstrap: $(STAMP)
	$(BIN)/cluster bootstrap -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(FINGERPRINTS)),--fingerprints "$(FINGERPRINTS)") \
		$(if $(filter 1 yes true,$(NO_PASSWORD_LOGIN)),--disable-password-login)

.PHONY: provision  ## provision INVENTORY's nodes: names, SSH mesh, firewall, Docker, image
provision: $(STAMP)
	$(BIN)/cluster check -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP))
	$(BIN)/cluster ready -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) \
		$(if $(filter -K --ask-become-pass,$(ANSIBLE_ARGS)),--ask-become-pass)
	$(BIN)/cluster image -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP))
	ANSIBLE_CONFIG=ansible/ansible.cfg $(BIN)/ansible-playbook -i "$(INVENTORY)" ansible/site.yml \
		$(if $(strip $(GROUP)),-e node_group=$(GROUP)) $(ANSIBLE_ARGS)
	$(if $(filter --check -C --tags -t,$(ANSIBLE_ARGS)),@echo "Not shipping the training image \
	(ANSIBLE_ARGS has --check or --tags): make ship INVENTORY=$(INVENTORY) does it.",\
	$(BIN)/cluster ship -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) && \
	$(BIN)/cluster lock -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)))

.PHONY: ship  ## ship INVENTORY's training image to its nodes (by layers through the controller's registry)
ship: $(STAMP)
	$(BIN)/cluster ship -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(VIA)),--via $(VIA))

.PHONY: netcheck  ## pre-flight check of INVENTORY's nodes (NNODES=N: the first N; FT=1: their way to the lighthouse port too)
netcheck: $(STAMP)
	$(BIN)/netcheck -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(NNODES)),--nnodes $(NNODES)) $(if $(filter 1 yes true,$(FT)),--ft)

# Not echoed: ENV may hold a secret's value, and the launcher says what it runs anyway.
.PHONY: train  ## train on INVENTORY's nodes (NNODES=N: the first N; no INVENTORY: the default job, locally)
train: $(STAMP)
	@rm -f "$(EXIT_CODE)"
	@TMN_EXIT_CODE_FILE="$(abspath $(EXIT_CODE))" $(BIN)/train $(if $(strip $(INVENTORY)),-i "$(INVENTORY)") $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(NNODES)),--nnodes $(NNODES)) \
		$(if $(strip $(GPUS)),--gpus $(GPUS)) $(if $(strip $(NPROC)),--nproc-per-node $(NPROC)) $(if $(strip $(RESTARTS)),--restarts $(RESTARTS)) $(if $(strip $(MIN_NODES)),--min-nodes $(MIN_NODES)) $(if $(strip $(STALL)),--stall $(STALL)) $(if $(strip $(ON_HANG)),--on-hang $(ON_HANG)) $(if $(filter 1 yes true,$(ALLOW_DRIFT)),--allow-drift) $(if $(filter 1 yes true,$(FT)),--ft) $(if $(filter 1 yes true,$(DEBUG)),--debug) $(if $(filter detail,$(DEBUG)),--debug detail) \
		$(if $(strip $(SCRIPT)),--script "$(SCRIPT)") $(if $(strip $(MODULE)),--module $(MODULE)) \
		$(if $(strip $(WORKDIR)),--workdir "$(WORKDIR)") $(if $(strip $(REQUIREMENTS)),--requirements "$(REQUIREMENTS)") $(if $(strip $(ENV)),--env '$(ENV)') \
		$(if $(strip $(ARGS)),-- $(ARGS))

.PHONY: selftest  ## every GPU path on every node of INVENTORY (no INVENTORY: this machine): a table; exit 1 on a failure
selftest: $(STAMP)
	@rm -f "$(EXIT_CODE)"
	@TMN_EXIT_CODE_FILE="$(abspath $(EXIT_CODE))" $(BIN)/train $(if $(strip $(INVENTORY)),-i "$(INVENTORY)") $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(NNODES)),--nnodes $(NNODES)) \
		$(if $(strip $(GPUS)),--gpus $(GPUS)) $(if $(strip $(NPROC)),--nproc-per-node $(NPROC)) $(if $(filter 1 yes true,$(DEBUG)),--debug) --module training.selftest \
		$(if $(strip $(ARGS)),-- $(ARGS))

.PHONY: data  ## copy dataset directory SRC into every node's data_root (only what changed travels)
data: $(STAMP)
	$(BIN)/cluster data -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(SRC)),"$(SRC)")

.PHONY: tensorboard  ## TensorBoard on a job's run directory, copied back to .runs/RUN
tensorboard: $(STAMP)
	@test -n "$(RUN)" || { echo "Error: RUN is not set (try make tensorboard RUN=<job id from the summary>; ls .runs)"; exit 2; }
	@test -d ".runs/$(RUN)" || { echo "Error: .runs/$(RUN) does not exist (try ls .runs)"; exit 2; }
	$(BIN)/tensorboard --logdir ".runs/$(RUN)"

.PHONY: runs  ## the runs launched from here, newest first (RUN=id: one whole; JSON=1: as JSON)
runs: $(STAMP)
	@$(BIN)/python -m torch_multinode.launch.runs $(if $(RUN),--run "$(RUN)") $(if $(filter 1 yes true,$(JSON)),--json)

.PHONY: rerun  ## run a recorded run again (RUN=id): its command, on the code as it was then, outputs apart (SAME_OUTPUTS=1: the original's)
rerun: $(STAMP)
	@test -n "$(RUN)" || { echo "Error: RUN is not set (try make rerun RUN=<job id from make runs>)"; exit 2; }
	@$(BIN)/python -m torch_multinode.launch.runs --rerun "$(RUN)" $(if $(filter 1 yes true,$(SAME_OUTPUTS)),--same-outputs)

.PHONY: hang-report  ## print again the report of a job that hung (RUN=job id), saved in .runs/RUN
hang-report:
	@test -n "$(RUN)" || { echo "Error: RUN is not set (try make hang-report RUN=<job id from the summary>; ls .runs)"; exit 2; }
	@test -d ".runs/$(RUN)" || { echo "Error: .runs/$(RUN) does not exist (try ls .runs)"; exit 2; }
	@test -f ".runs/$(RUN)/hang-report.txt" || { echo "Error: job $(RUN) has no hang report: it did not hang (its logs: .runs/$(RUN)/)"; exit 1; }
	@cat ".runs/$(RUN)/hang-report.txt"
	@echo "Every rank's stacks: .runs/$(RUN)/hang-stacks-NODE.txt"

.PHONY: bench  ## benchmarks on fresh simulated nodes: bench-results/bench.md, .json, plots (docs/benchmarks.md: how long)
bench: $(STAMP)
	$(BIN)/bench $(BENCH_ARGS)

.PHONY: image  ## build the training image: CUDA where nvidia-smi works, else the CPU twin (KIND=cuda|cpu, BASE_IMAGE=)
image: $(STAMP)
	$(BIN)/cluster image --tag $(IMAGE) $(if $(strip $(KIND)),--kind $(KIND)) $(if $(strip $(BASE_IMAGE)),--base-image $(BASE_IMAGE))

.PHONY: train-spawn  ## the default job on this machine started with mp.spawn, as the seeds do it
train-spawn: $(STAMP)
	$(BIN)/python -m torch_multinode.training.spawn $(if $(strip $(ARGS)),-- $(ARGS))

.PHONY: hostfile  ## print INVENTORY as a DeepSpeed/Horovod/MPI hostfile (make -s hostfile INVENTORY=x > hostfile)
hostfile: $(STAMP)
	@$(BIN)/cluster hostfile -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(NNODES)),--nnodes $(NNODES))

.PHONY: queue  ## Slurm's queue on INVENTORY (scheduler: slurm)
queue: $(STAMP)
	@$(BIN)/cluster queue -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP))

.PHONY: cancel  ## cancel Slurm job JOB on INVENTORY (scheduler: slurm)
cancel: $(STAMP)
	@$(BIN)/cluster cancel -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(JOB)

.PHONY: check-inventory  ## validate INVENTORY (and NNODES) without touching any host
check-inventory: $(STAMP)
	$(BIN)/cluster check -i "$(INVENTORY)" $(if $(strip $(GROUP)),--group $(GROUP)) $(if $(strip $(NNODES)),--nnodes $(NNODES))

.PHONY: sim-up  ## start NNODES (1-4) simulated nodes and write .sim/inventory.yml; LINK=1gbit shapes, FRESH=1 as fresh installs
sim-up: $(STAMP)
	$(BIN)/python -m torch_multinode.sim.cli up --nodes $(or $(strip $(NNODES)),2) $(if $(strip $(LINK)),--link $(LINK)) $(if $(filter 1 yes true,$(FRESH)),--fresh)

.PHONY: sim-down  ## remove every container, network and volume of the simulated cluster
sim-down: $(STAMP)
	$(BIN)/python -m torch_multinode.sim.cli down

.PHONY: format  ## put the Python code in the formatter's layout and fix what ruff can
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

.PHONY: lint  ## ruff, mypy, the import-graph check, hadolint, yamllint and ansible-lint (production profile)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m tests.import_graph
	$(BIN)/hadolint docker/Dockerfile docker/sim-node/Dockerfile
	$(BIN)/yamllint ansible
	cd ansible && PATH="$(abspath $(BIN)):$$PATH" ansible-lint --profile production

# A crashed worker ends the run: xdist's replacement worker left a grouped run waiting forever.
.PHONY: test  ## run the test suite but the extended tests (simulated-cluster tests need a Docker engine)
test: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0 --durations=25 -m "not extended"

# The extended tests: twins and repeats of what `make test` proves, kept out of CI's time
# (CONTRIBUTING.md, "Time and disk", says which and why). Run them before changing what they cover.
.PHONY: test-all  ## run every test, the extended ones too (CI runs make test)
test-all: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup --max-worker-restart 0 --durations=25

.PHONY: test-e2e  ## only the whole flows (part of make test): bootstrap, provision fresh nodes, netcheck and train in the image
test-e2e: $(STAMP)
	$(BIN)/pytest -m image_e2e tests/test_end_to_end.py tests/test_bootstrap.py

.PHONY: check  ## exactly what CI runs: lint, then the tests
check: lint test
