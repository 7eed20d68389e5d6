# Two entry points do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The tests wait on sockets and children more than they compute: more workers than cores.
# worksteal: a worker that runs out takes queued tests from the others, so the few long
# tests do not leave the rest of the run waiting behind one worker.
WORKERS ?= 4
LINTED := protocol daemon client bench
# The tests are checked by ruff's rules (pyproject.toml's per-file ignores say what differs)
# but not formatted: they are written by hand, tables and all.
CHECKED := $(LINTED) tests
TYPECHECK := build/typecheck/toolsetd

# A shell (or CI) that sets PYTHONDONTWRITEBYTECODE would make every daemon, toolsetctl and
# pump a test starts compile toolsetd from source again: ~90 ms of each daemon start here.
# The checkout's __pycache__ folders are gitignored.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-fast bench lint typecheck-tree sandbox-deps sandbox-try clean

# The venv is rebuilt whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	@bash examples/run-demo.sh

# The whole suite, slow tests included, in parallel; the 15 slowest are reported.
test: $(STAMP) sandbox-try
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal --durations=15

# The edit-run loop: everything but the tests marked slow, the property tests at a tenth of
# their examples (tests/budget.py).
test-fast: $(STAMP) sandbox-try
	TOOLSETD_TESTS=fast $(BIN)/python -m pytest -n $(WORKERS) --dist worksteal -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m bench

# mypy resolves toolsetd.* through a tree of links that maps the three folders onto the
# import names, exactly as the package-dir mapping installs them.
typecheck-tree:
	@mkdir -p $(TYPECHECK)
	@for d in protocol daemon client; do ln -sfn ../../../$$d $(TYPECHECK)/$$d; done

lint: $(STAMP) typecheck-tree
	$(BIN)/ruff check $(CHECKED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy -p toolsetd.protocol -p toolsetd.daemon -p toolsetd.client -p bench

# The sandbox's one system dependency (Debian's bubblewrap), for CI and a fresh machine.
# The tests install it themselves when they can (root with apt-get) and skip otherwise.
# Before the tests: as root with apt-get, install bubblewrap when it is missing (a fresh CI
# machine), so no test has to wait for apt-get under its own timeout; elsewhere the
# sandbox tests skip with the reason.
sandbox-try:
	@command -v bwrap >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
		$(MAKE) --no-print-directory sandbox-deps >/dev/null 2>&1 || \
		echo "note: bubblewrap could not be installed; the sandbox tests will skip"

sandbox-deps:
	@command -v bwrap >/dev/null || { apt-get install -y -q bubblewrap || \
		{ apt-get update -q && apt-get install -y -q bubblewrap; }; }

clean:
	rm -rf $(VENV) build *.egg-info
