# The README's two commands: `make local` (install, then run the local heterogeneous job) and
# `make test` (install, then lint, type-check and run the tests). Both work from a fresh clone
# on a machine with Python 3.11+; `make test` also needs Node and npm.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20

.PHONY: install install-dev local test lint proto bench clean aws-calls images image-test

# Reinstall only when pyproject.toml or the pins change. containers/constraints.txt is the one set
# of versions: the image installs from it too, and a test fails when the two drift apart.
$(VENV)/.installed: pyproject.toml containers/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --constraint containers/constraints.txt -e '.[dev]'
	touch $@

# checkov (tests/infra/test_infra_checkov.py) is a command-line tool in a virtualenv of its own, as
# pipx would install it: every checkov 3 release pins boto3==1.35.49, which the project's boto3 pin
# excludes. Its one pin is CHECKOV_VERSION; the stamp names the version, so changing it rebuilds the
# tool's virtualenv from scratch and nothing else.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV := .venv-tools/checkov

$(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION):
	rm -rf $(CHECKOV_VENV)
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install --quiet --upgrade pip
	$(CHECKOV_VENV)/bin/pip install --quiet checkov==$(CHECKOV_VERSION)
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed node_modules/.installed $(CHECKOV_VENV)/.installed-$(CHECKOV_VERSION)

local: install
	$(BIN)/hetero local --spec specs/local-cpu.toml

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The tests run on every core (pytest-xdist); tests/conftest.py starts the longest first. The
# tests marked alone run after, on a quiet machine, collected from the files that have them only
# (collecting every test file takes ~15 s); both runs share HETERO_TEST_SHARED
# (tests/made_once.py: the rehearsal baseline is made once).
test: install-dev lint
	shared=$$(mktemp -d) && trap 'rm -rf "$$shared"' EXIT && \
	HETERO_TEST_SHARED=$$shared $(BIN)/pytest -n auto --dist worksteal --durations=10 -m "not alone and not image" && \
	HETERO_TEST_SHARED=$$shared $(BIN)/pytest --durations=3 -m alone \
		$$(grep -rl --include='*.py' 'pytest.mark.alone' tests)

# The two images of containers/Dockerfile, hetero-train:trainer and hetero-train:data-server, built
# with the Docker this machine has (scripts/with_docker.sh installs and starts it under CI; it says
# what to install anywhere else). Where Docker Hub, AWS's EFA installer or PyTorch's CPU index
# cannot be reached, scripts/images.sh says so and builds with the build argument that stands in.
images:
	scripts/with_docker.sh scripts/images.sh

# The images run in real containers (tests/images/, marked image; .ci/run runs this after `make
# test`). Where Docker cannot run, it says why and fails; HETERO_SKIP_IMAGE_TESTS=1 skips it.
image-test: install-dev
	@if [ -n "$${HETERO_SKIP_IMAGE_TESTS:-}" ]; then \
		echo "make image-test: skipped (HETERO_SKIP_IMAGE_TESTS is set)"; exit 0; fi; \
	scripts/with_docker.sh scripts/images.sh && \
	scripts/with_docker.sh $(BIN)/pytest -p no:cacheprovider --durations=10 -m image tests/images

# Rebuild tests/aws_calls.json from every test that records AWS calls (marked aws_calls), then the
# generated IAM section of docs/security.md from it (tests/aws_calls.py, tests/infra/iam_docs.py).
aws-calls: install-dev
	echo '[]' > tests/aws_calls.json
	HETERO_UPDATE_AWS_CALLS=1 $(BIN)/pytest -n auto --dist worksteal -m aws_calls -p no:cacheprovider
	$(BIN)/python tests/infra/iam_docs.py

proto: install
	$(BIN)/python scripts/gen_proto.py

bench: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .venv-tools node_modules cdk.out runs
