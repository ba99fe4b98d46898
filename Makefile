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
                libopenblas-dev libcli11-dev nlohmann-json3-dev libfmt-dev zlib1g-dev dataset-fashion-mnist \
                libopenmpi-dev openmpi-bin libdnnl-dev

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

# The main job: ResNet-20 on Fashion-MNIST (Debian's dataset-fashion-mnist, 60,000 real images)
# with a batch of 512 in a 32 MiB memory limit — a batch that does not fit, so the planner splits
# it into micro-batches — for 2 epochs (about 2.5 minutes on 2 cores), the learning rate scaled
# linearly for the batch (0.1 x 512/128) after a warm-up of half an epoch, then cosine; leaving
# metrics.csv, summary.json, memory_trace.json and memory.svg in a run folder.
train: build
	@$(BUILD_DIR)/apps/tally train --model resnet20 --data fashion-mnist --epochs 2 --batch-size 512 \
	  --memory-limit 32MiB --lr 0.4 --warmup-epochs 0.5 --schedule cosine --out $(RUN_DIR)
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
