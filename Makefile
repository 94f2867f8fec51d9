# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# No processes: the sans-IO cores, the planner, differential SQL through the simulator (~2 min).
test-fast: install
	$(PY) -m pytest -m "not cluster" $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
