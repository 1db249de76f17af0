# Quickstart targets: `make run` and `make test` create .venv when missing, install, then run.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.kvchain-installed
JOBS    ?= 2

.PHONY: run test lint install clean mutation

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@bash scripts/install-torch.sh $(PY)
	@bash scripts/install-nixl.sh $(PY)
	@$(PY) -m pip install -q -e '.[test]' -c constraints.txt
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	@$(VENV)/bin/kvchain simulate --model qwen3-next-80b --budget 80GiB --workload mixed --jobs $(JOBS)

test: $(STAMP)
	@$(VENV)/bin/ruff check src tests examples
	@$(VENV)/bin/lint-imports --no-cache --no-logo
	@$(PY) -m pytest -q -n $(JOBS)

lint: $(STAMP)
	@$(VENV)/bin/ruff check src tests examples
	@$(VENV)/bin/lint-imports --no-cache --no-logo

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache .hypothesis

# Mutation score of the pricing, demand, admission and capacity modules ([tool.mutmut] in
# pyproject.toml; docs/testing.md, "Mutation score"). Slow (tens of minutes), so not part of `test`.
mutation: $(STAMP)
	@$(PY) -m pip install -q -e '.[test,mutation]'
	@rm -rf mutants && mkdir mutants
	@$(VENV)/bin/mutmut run --max-children $(JOBS) > mutants/run.log 2>&1 || { tail -c 4000 mutants/run.log; exit 1; }
	@$(VENV)/bin/mutmut results
	@$(PY) scripts/mutation_score.py
