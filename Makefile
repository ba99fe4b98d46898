# tally — the two commands:
#   make train   set up (Debian packages), build Release, run the main job
#   make test    set up, build, run the test suite (ctest) and print its summary
# Also: make build, make bench, make clean. BUILD_DIR, BUILD_TYPE, CMAKE_ARGS may be overridden.

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
# Cores this machine lets us use: nproc, lowered to a cgroup CPU quota where one is set (a
# container may see more CPUs than it may run on; oversubscribed OpenMP tests slow down tenfold).
JOBS       ?= $(shell n=$$(nproc); q=$$(awk '$$1 != "max" { print int(($$1 + $$2 - 1) / $$2) }' \
                /sys/fs/cgroup/cpu.max 2>/dev/null); [ -n "$$q" ] && [ "$$q" -ge 1 ] && [ "$$q" -lt "$$n" ] && n=$$q; echo $$n)

DEB_PACKAGES := cmake g++ make pkg-config googletest libgtest-dev libgmock-dev libbenchmark-dev \
                libopenblas-dev libcli11-dev nlohmann-json3-dev libfmt-dev zlib1g-dev dataset-fashion-mnist

.PHONY: train test build bench bootstrap configure clean

bootstrap:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ]; then \
	    echo "tally: installing missing Debian packages:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else \
	    echo "tally: missing Debian packages. Run:"; \
	    echo "  sudo apt-get install -y$$missing"; \
	    exit 1; \
	  fi; \
	fi

configure: bootstrap
	@cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

build: configure
	@cmake --build $(BUILD_DIR) -j $(JOBS)

RUN_DIR ?= runs/$(shell date +%Y%m%d-%H%M%S)

# The main job, the MBP demo: ResNet-20 on the built-in synthetic data with a batch of 256 in a
# 48 MiB memory limit (the batch does not fit: the planner splits it into micro-batches),
# leaving metrics.csv, summary.json, memory_trace.json and memory.svg in a run folder.
train: build
	@$(BUILD_DIR)/apps/tally train --model resnet20 --data synthetic --epochs 5 --batch-size 256 \
	  --memory-limit 48MiB --lr 0.1 --schedule onecycle --out $(RUN_DIR)
	@echo "run folder: $(RUN_DIR)"

# Each test process uses at most two OpenMP threads, which sleep rather than spin when idle:
# JOBS test processes share the cores without starving one another. The slowest test takes
# about 30 s here; 300 s names a hung test as one instead of eating the whole run's time.
test: build
	@cd $(BUILD_DIR) && OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-passive} \
	  ctest --output-on-failure -j $(JOBS) --timeout 300

bench: build
	@for b in $(BUILD_DIR)/bench/bench_*; do echo "== $$b"; $$b --benchmark_min_time=0.2 || exit 1; done

clean:
	@rm -rf $(BUILD_DIR)
