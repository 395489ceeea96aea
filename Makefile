# Two commands on a fresh machine:  `make demo` (compile + train the tiny example)  and  `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: setup demo test test-slow bench docs clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch is pinned to the CPU build (an unpinned torch pulls a multi-GB CUDA build)
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

demo: $(STAMP)
	bash examples/demo.sh

test: $(STAMP)
	$(VENV)/bin/lint-imports
	# no function over cyclomatic complexity 20 where the code is already split (the planner)
	$(VPY) tools/check_complexity.py --max 20 h2ir/planner
	$(VPY) -m pytest -q -x -n 2 --durations=10

test-slow: $(STAMP)
	$(VPY) -m pytest -q -m slow

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(VPY) $$b || exit 1; done

docs: $(STAMP)
	$(VPY) tools/gen_docs.py

clean:
	rm -rf build build-moe build-gpt2 B .pytest_cache
