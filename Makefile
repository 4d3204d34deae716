# The two commands of README.md:
#   make demo   install what is missing, build (Release), run the main job
#   make test   install what is missing, check the formatting, build, run every test (C++, Python, ASan + UBSan)
# And for contributors:
#   make format        apply .clang-format to every tracked C/C++ file (make format-check: only check)
#   make api-docs      the C++ API reference (Doxygen) from include/mha's /// comments; not part of make test
BUILD       ?= build
BUILD_ASAN  ?= build-asan
BUILD_TSAN  ?= build-tsan
JOBS        ?= $(shell nproc)
PYTHON      ?= /usr/bin/python3
DEMO_OUT    ?= mha-demo
# New build trees use Ninja (scripts/install-deps.sh installs it): it compiles the objects of every target
# in parallel, where CMake's Makefiles finish each target's objects before starting its dependents'
# (1.4 of 2 cores busy over a build). A tree configured already keeps its generator.
export CMAKE_GENERATOR ?= Ninja

.PHONY: all deps build demo test test-cpp test-python test-asan test-tsan test-fuzz test-install test-pip clean format format-check \
  check-structure api-docs

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON) -Wno-dev
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/mha demo --out $(DEMO_OUT)

# The phases run one after another; the last line says how long each took (scripts/timed-phases.sh).
test: format-check check-structure
	@bash scripts/timed-phases.sh "$(MAKE)" build test-cpp test-python test-install test-pip test-asan test-fuzz

test-cpp:
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python:
	PYTHONPATH=$(BUILD)/python $(PYTHON) -m pytest -q -p no:cacheprovider tests/python

# The C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer (no Python, no apps), built at
# -O1 with assertions on and Highway's kernels for this machine's target only (cmake/SanitizerBuild.cmake).
# The suite runs with the storage cache off (src/storage_cache.hpp), so that ASan sees every use of
# freed tensor storage; the cache's own tests then run with it on.
test-asan: deps
	cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DMHA_SANITIZE=ON -DMHA_BUILD_PYTHON=OFF \
	  -DMHA_BUILD_APPS=OFF -Wno-dev
	cmake --build $(BUILD_ASAN) -j $(JOBS)
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  MHA_STORAGE_CACHE_MIB=0 ctest --output-on-failure -j $(JOBS)
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  tests/mha_tests --gtest_filter='StorageCache.*:Tensor*'

# The threads contracts' tests (PagedKVCache's reader/writer hold) under ThreadSanitizer, in a tree of
# their own (library at -O1, this machine's Highway target, one OpenMP thread: Debian's libgomp is not
# instrumented). Not part of make test: the tree takes a few minutes to build; run it after changing
# anything shared between threads.
test-tsan: deps
	cmake -S . -B $(BUILD_TSAN) -DCMAKE_BUILD_TYPE=Debug -DMHA_SANITIZE_THREAD=ON -DMHA_BUILD_PYTHON=OFF \
	  -DMHA_BUILD_APPS=OFF -DMHA_BUILD_DISTRIBUTED=OFF -Wno-dev
	cmake --build $(BUILD_TSAN) -j $(JOBS) --target mha_threads_tests
	cd $(BUILD_TSAN) && ctest --output-on-failure -R mha_threads_tests

# libFuzzer + ASan + UBSan on the safetensors and .npy readers, FUZZ_TIME seconds each (default 30);
# fails on any crash, leak, sanitizer report or oversized allocation (fuzz/run.sh, docs/FUZZING.md).
test-fuzz: deps
	bash fuzz/run.sh

clean:
	rm -rf $(BUILD) $(BUILD_ASAN) $(BUILD_TSAN)

# clang-format (Debian's, 14) with .clang-format on every tracked .cpp/.hpp/.h/.cc: scripts/format.sh
# rewrites the files; scripts/format.sh --check lists those that differ and fails (make test runs it first:
# it takes a second or two).
format:
	@bash scripts/install-deps.sh clang-format
	@bash scripts/format.sh

format-check:
	@bash scripts/install-deps.sh clang-format
	@bash scripts/format.sh --check

# The limits on the library's code that docs/DESIGN.md sets (files <= 450 lines and functions <= 80
# lines in src/, one call of oneDNN's sgemm): scripts/check-structure.py, a second; make test runs it.
check-structure:
	@$(PYTHON) scripts/check-structure.py

# The C++ API reference: Doxygen (installed when missing) on the public headers (docs/Doxyfile) into
# $(API_DOCS)/html; fails on any Doxygen warning.
API_DOCS ?= $(BUILD)/api-docs
api-docs:
	@bash scripts/install-deps.sh doxygen
	rm -rf $(API_DOCS) && mkdir -p $(API_DOCS)
	{ cat docs/Doxyfile; echo "OUTPUT_DIRECTORY = $(API_DOCS)"; } | doxygen -
	@echo "api-docs: $(API_DOCS)/html/index.html"

# Install into a scratch prefix, then build and run examples/consumer against it, through the CMake
# package (shared and static) and through pkg-config.
PREFIX_TEST := $(abspath $(BUILD))/install-test
test-install:
	rm -rf $(PREFIX_TEST) $(BUILD)/consumer
	cmake --install $(BUILD) --prefix $(PREFIX_TEST) > /dev/null
	cmake -S examples/consumer -B $(BUILD)/consumer -DCMAKE_PREFIX_PATH=$(PREFIX_TEST) -Wno-dev > /dev/null
	cmake --build $(BUILD)/consumer -j $(JOBS)
	./$(BUILD)/consumer/consumer | grep -q 'consumer: out \[3, 8\], weights \[3, 3\]'
	./$(BUILD)/consumer/consumer_static | grep -q 'consumer: out \[3, 8\], weights \[3, 3\]'
	g++ -std=c++20 examples/consumer/main.cpp -o $(BUILD)/consumer/consumer_pkgconfig \
	  $$(PKG_CONFIG_PATH=$(PREFIX_TEST)/lib/pkgconfig pkg-config --cflags --libs mha) -Wl,-rpath,$(PREFIX_TEST)/lib
	./$(BUILD)/consumer/consumer_pkgconfig | grep -q 'consumer: out \[3, 8\], weights \[3, 3\]'
	OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 ./$(BUILD)/consumer/consumer_ring \
	  | grep 'consumer_ring: 2 ranks'
	@echo "test-install: 4 passed, 0 failed"

# pip install from the repository into a fresh virtual environment that sees Debian's numpy and torch
# (as README says), then use the installed package from outside the source tree. setup.py builds the
# extensions in $(BUILD) (MHA_CMAKE_BUILD_DIR), which `make build` has compiled, rather than compiling the
# library a third time; the configuration a plain `pip install .` makes (no apps, no tests) is generated
# into a scratch tree to show it stands.
VENV := $(BUILD)/venv-test
test-pip: deps
	rm -rf $(VENV) $(BUILD)/pip-build $(BUILD)/pip-configure
	cmake -S . -B $(BUILD)/pip-configure -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON) \
	  -DMHA_BUILD_APPS=OFF -DMHA_BUILD_TESTS=OFF -Wno-dev > /dev/null
	$(PYTHON) -m venv --system-site-packages $(VENV)
	MHA_CMAKE_BUILD_DIR=$(abspath $(BUILD)) $(VENV)/bin/pip install --no-build-isolation --no-index --quiet .
	cd / && $(abspath $(VENV))/bin/python -c "import mha, numpy as np; x = np.ones((3, 8), np.float32); \
	  out, w = mha.MultiheadAttention(8, 2, seed=1)(x, x, x); assert out.shape == (3, 8) and w.shape == (3, 3); \
	  print('test-pip: 1 passed, 0 failed (mha from', mha.__file__ + ')')"
	cd / && $(abspath $(VENV))/bin/python -c "import mha.distributed as d; assert d.shard_chunks(10, 2, 0) == [(0, 3), (8, 2)]; \
	  print('test-pip: mha.distributed imports (mpi4py, one rank)')"
