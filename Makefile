# torch-multinode: from bare Linux GPU machines to a verified multi-node PyTorch run.
# `make` alone lists the targets. Knobs below can be set on the command line:
#   make train INVENTORY=my-cluster.yml NNODES=2

NNODES    ?= 2
INVENTORY ?=
LINK      ?=
SCRIPT    ?=
MODULE    ?=
ARGS      ?=
GPUS      ?=
RESTARTS  ?=
DEBUG     ?=
ANSIBLE_ARGS ?=
BENCH_ARGS ?=
PYTHON    ?= python3
VENV      ?= .venv
IMAGE     ?= torch-multinode/train:latest
# Test workers: most simulated-cluster tests wait on SSH, apt and image I/O, not on the CPU.
TEST_WORKERS ?= 3

BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help

.PHONY: help  ## list the targets and the knobs
help:
	@echo "Usage: make TARGET [NNODES=2] [INVENTORY=path.yml] [LINK=1gbit] [SCRIPT=train.py ARGS='...']"
	@echo "                   [MODULE=training.comm_demo] [GPUS=0,2] [DEBUG=1] [RESTARTS=1] [IMAGE=torch-multinode/train:latest]"
	@echo
	@grep -E '^\.PHONY: [a-z0-9-]+ +## ' $(MAKEFILE_LIST) | \
		sed -E 's/^\.PHONY: ([a-z0-9-]+) +## (.*)/  \1|\2/' | awk -F'|' '{printf "%-17s %s\n", $$1, $$2}'

# The first target that needs Python creates the environment (torch and torchvision pinned).
$(STAMP): pyproject.toml ansible/requirements.txt
	@command -v $(PYTHON) >/dev/null || { echo "Error: $(PYTHON) is not installed (try apt-get install python3 python3-venv)"; exit 1; }
	@echo "Creating $(VENV) with torch and torchvision (once, about 2 minutes)..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]' -r ansible/requirements.txt
	@touch $@

.PHONY: venv  ## create the Python environment (.venv) now
venv: $(STAMP)

.PHONY: provision  ## provision INVENTORY's nodes: names, SSH mesh, firewall, Docker, image
provision: $(STAMP)
	$(BIN)/cluster check -i "$(INVENTORY)"
	$(BIN)/cluster image -i "$(INVENTORY)"
	ANSIBLE_CONFIG=ansible/ansible.cfg $(BIN)/ansible-playbook -i "$(INVENTORY)" ansible/site.yml $(ANSIBLE_ARGS)

.PHONY: netcheck  ## pre-flight check of the first NNODES nodes of INVENTORY
netcheck: $(STAMP)
	$(BIN)/netcheck -i "$(INVENTORY)" --nnodes $(NNODES)

.PHONY: train  ## train on NNODES nodes of INVENTORY (no INVENTORY: the default job, locally)
train: $(STAMP)
	$(BIN)/train $(if $(strip $(INVENTORY)),-i "$(INVENTORY)" --nnodes $(NNODES)) \
		$(if $(strip $(GPUS)),--gpus $(GPUS)) $(if $(strip $(RESTARTS)),--restarts $(RESTARTS)) $(if $(filter 1 yes true,$(DEBUG)),--debug) $(if $(filter detail,$(DEBUG)),--debug detail) \
		$(if $(strip $(SCRIPT)),--script "$(SCRIPT)") $(if $(strip $(MODULE)),--module $(MODULE)) \
		$(if $(strip $(ARGS)),-- $(ARGS))

.PHONY: bench  ## benchmarks on fresh simulated nodes: bench-results/bench.md, .json, plots (~20 min)
bench: $(STAMP)
	$(BIN)/bench $(BENCH_ARGS)

.PHONY: image  ## build the training image: CUDA where nvidia-smi works, else the CPU twin
image: $(STAMP)
	$(BIN)/cluster image --tag $(IMAGE)

.PHONY: train-spawn  ## the default job on this machine started with mp.spawn, as the seeds do it
train-spawn: $(STAMP)
	$(BIN)/python -m training.spawn $(if $(strip $(ARGS)),-- $(ARGS))

.PHONY: check-inventory  ## validate INVENTORY (and NNODES) without touching any host
check-inventory: $(STAMP)
	$(BIN)/cluster check -i "$(INVENTORY)" --nnodes $(NNODES)

.PHONY: sim-up  ## start NNODES (1-4) simulated nodes and write .sim/inventory.yml; LINK=1gbit shapes
sim-up: $(STAMP)
	$(BIN)/cluster sim up --nodes $(NNODES) $(if $(strip $(LINK)),--link $(LINK))

.PHONY: sim-down  ## remove every container, network and volume of the simulated cluster
sim-down: $(STAMP)
	$(BIN)/cluster sim down

.PHONY: lint  ## ruff, hadolint, yamllint and ansible-lint (production profile)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint docker/Dockerfile docker/sim-node/Dockerfile
	$(BIN)/yamllint ansible
	cd ansible && PATH="$(abspath $(BIN)):$$PATH" ansible-lint --profile production

.PHONY: test  ## run the test suite (simulated-cluster tests need a Docker engine)
test: $(STAMP)
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup

.PHONY: test-e2e  ## only the whole flow (part of make test): provision fresh nodes, netcheck and train in the image
test-e2e: $(STAMP)
	$(BIN)/pytest -m image_e2e tests/test_end_to_end.py

.PHONY: check  ## exactly what CI runs: lint, then the tests
check: lint test
