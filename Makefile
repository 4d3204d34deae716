# The two commands of README.md:
#   make demo   install what is missing, build (Release), run the main job
#   make test   install what is missing, build, run every test (C++, Python, ASan + UBSan)
BUILD       ?= build
BUILD_ASAN  ?= build-asan
JOBS        ?= $(shell nproc)
PYTHON      ?= /usr/bin/python3
DEMO_OUT    ?= $(BUILD)/demo

.PHONY: all deps build demo test test-cpp test-python test-asan clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE=$(PYTHON) -Wno-dev
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	./$(BUILD)/mha demo --out $(DEMO_OUT)

test: build
	$(MAKE) --no-print-directory test-cpp test-python test-asan

test-cpp:
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python:
	PYTHONPATH=$(BUILD)/python $(PYTHON) -m pytest -q -p no:cacheprovider tests/python

# The C++ tests again under AddressSanitizer + UndefinedBehaviorSanitizer (no Python, no apps).
test-asan: deps
	cmake -S . -B $(BUILD_ASAN) -DCMAKE_BUILD_TYPE=Debug -DMHA_SANITIZE=ON -DMHA_BUILD_PYTHON=OFF \
	  -DMHA_BUILD_APPS=OFF -Wno-dev
	cmake --build $(BUILD_ASAN) -j $(JOBS)
	cd $(BUILD_ASAN) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --output-on-failure -j $(JOBS)

clean:
	rm -rf $(BUILD) $(BUILD_ASAN)
