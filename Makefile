# Two commands on a fresh machine: `make demo` and `make test`. Both install first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
UV     := $(VENV)/bin/uv
# uv, given the package sources pip is configured with here (tools/pip_sources.py: uv reads no pip configuration)
UV_INSTALL := $(UV) pip install -q --native-tls --python $(PY) $$($(PY) tools/pip_sources.py) -c constraints.txt
PYTEST_ARGS ?=
DUCKDB_1X := 1.2.2

.PHONY: install demo lab test test-fast bench clean chromium openmpi slurm soak

# the Probing panel (labextension/) is built by the editable install: rebuild when its sources change
$(STAMP): pyproject.toml constraints.txt labextension/package.json labextension/yarn.lock $(wildcard labextension/src/* labextension/style/* labextension/schema/*)
	python3 -m venv $(VENV)
	# uv resolves as pip does, in 27 s where pip took 64 (its cache warm; most of the rest is the panel's build)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt uv
	$(UV_INSTALL) -e '.[test]'
	# bytecode after, on every core (uv writes none): 11,000 files, but for the packages' own test suites (a
	# quarter of them), which nothing here imports; a few files written for newer Pythons fail to compile
	$(PY) -c 'import compileall, re, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0, rx=re.compile(r"/tests?/"))'
	# the panel's lint and unit-test tools (make test runs them): installed even when the build above was skipped
	cd labextension && $(abspath $(VENV))/bin/jlpm install
	# a DuckDB 1.x beside ours, for one test only: it makes a rare exit race frequent (tests/test_engine.py)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --target $(VENV)/duckdb-1x 'duckdb==$(DUCKDB_1X)'
	# our bytecode too, as a wheel install leaves it (ranks then skip compiling, even with PYTHONDONTWRITEBYTECODE)
	$(PY) -m compileall -q -j 0 kernel_probe probing_magics
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) examples/demo.py

# The demo job and JupyterLab with the Cluster panel (extra `jupyter lab` arguments: LAB_ARGS=...).
lab: install
	$(PY) examples/lab.py $(LAB_ARGS)

# First the modules that start processes or jobs, on $(TEST_WORKERS) workers, a module each at a time (its
# shared jobs stay in one process), the longest first (tests/conftest.py): four modules at once, as the
# modules wait more than they compute since torch is imported once per worker for plain ranks
# (tests/support/forkserver.py): 466 s against three's 514 s.
# Then the `serial` tests (latency and resource bounds), and beside
# them, at the lowest priority and on two workers, the tests that start no process (about two and a half
# minutes of CPU) and the `untimed` ones (the wheel's build, the panel's lint and jest: 45 CPU-s): they
# take only the CPU the serial tests leave idle (a core for the serial part's minute of waits). A session of their own, its scheduling group at
# nice 19 too: where the kernel groups CPU time by session (autogroup), a process's own nice counts
# only inside its session, against the ranks' sessions. Their report follows the serial part's. Every
# part always runs; exit status 5 (nothing selected, e.g. PYTEST_ARGS=one file) is fine.
# Bytecode is written even where the environment says not to: each pytest run rewrites and compiles
# every test module otherwise (about 5 s of CPU a run), and every rank its test helpers.
TEST_WORKERS ?= 4
NO_PROCESS := not processes and not cluster
test: install chromium openmpi slurm
	@export PYTHONDONTWRITEBYTECODE=; report=$$(mktemp); \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not ($(NO_PROCESS)) and not serial and not untimed" $(PYTEST_ARGS); a=$$?; \
	setsid -w sh -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 "$$@"' lowest \
	  $(PY) -m pytest -n 2 -p no:cacheprovider -m "($(NO_PROCESS) or untimed) and not serial" $(PYTEST_ARGS) >$$report 2>&1 & \
	pure=$$!; trap 'kill $$pure 2>/dev/null' EXIT; \
	$(PY) -m pytest -m serial $(PYTEST_ARGS); b=$$?; \
	wait $$pure; p=$$?; echo "--- the tests that start no process and the untimed ones (beside the serial part):"; cat $$report; rm -f $$report; \
	for s in $$a $$p $$b; do [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s; done; [ $$a -eq 0 ] || [ $$p -eq 0 ] || [ $$b -eq 0 ]

# The browser test drives Debian's Chromium (Playwright downloads nothing): install it when missing.
chromium:
	@test -x /usr/bin/chromium || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	  else echo "make test needs /usr/bin/chromium: install the Debian package chromium (apt-get install chromium)" >&2; \
	    exit 1; fi; }

# The launcher tests start a job with mpirun: install Debian's Open MPI when missing.
openmpi:
	@command -v mpirun >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q openmpi-bin; \
	  else echo "make test needs mpirun: install the Debian package openmpi-bin (apt-get install openmpi-bin)" >&2; \
	    exit 1; fi; }

# ... and with srun on a one-node Slurm the test starts itself: Debian's slurm-wlm and munge.
slurm:
	@command -v slurmd >/dev/null && command -v munged >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge; \
	  else echo "make test needs slurmd and munged: install the Debian packages slurm-wlm and munge" >&2; \
	    exit 1; fi; }

# No test starts a process (tests/support/process_guard.py holds every test to its marker): the
# sans-IO cores, the planner, differential SQL through the simulator, the wire; on two pytest workers
# (about a minute; the one `serial` test among them spins one core, which two workers leave it).
test-fast: install
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 -m "$(NO_PROCESS)" $(PYTEST_ARGS)

# The long versions of what make test runs short: a 10-minute soak (make test: 30 s), a minute of
# hostile peers against a live root (make test: 20 s) and 90 s of attack over every rank (make test: 30 s).
soak: install
	KP_SOAK_SEC=600 KP_HOSTILE_SEC=60 KP_PINNING_SEC=90 $(PY) -m pytest tests/test_soak.py tests/test_hostile.py \
	  tests/test_memory_pinning.py -m cluster -s $(PYTEST_ARGS)

bench: install
	$(UV_INSTALL) -e '.[test,bench]'
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache build dist *.egg-info
