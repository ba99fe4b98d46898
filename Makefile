# tally — the two commands:
#   make train   set up (Debian packages), build Release, run the main job
#   make test    set up, build, run the test suite (ctest) and print its summary
# Also: make build, make test-isa, make bench, make fuzz, make fuzz-merge, make clean. BUILD_DIR, BUILD_TYPE, CMAKE_ARGS may be overridden.

BUILD_DIR  ?= build
BUILD_TYPE ?= Release
CMAKE_ARGS ?=
# Cores this machine lets us use: nproc, lowered to a cgroup CPU quota where one is set (a
# container may see more CPUs than it may run on; oversubscribed OpenMP tests slow down tenfold).
JOBS       ?= $(shell n=$$(nproc); q=$$(awk '$$1 != "max" { print int(($$1 + $$2 - 1) / $$2) }' \
                /sys/fs/cgroup/cpu.max 2>/dev/null); [ -n "$$q" ] && [ "$$q" -ge 1 ] && [ "$$q" -lt "$$n" ] && n=$$q; echo $$n)

DEB_PACKAGES := cmake g++ make pkg-config googletest libgtest-dev libgmock-dev libbenchmark-dev \
                libopenblas-dev libcli11-dev nlohmann-json3-dev libfmt-dev zlib1g-dev dataset-fashion-mnist \
                libopenmpi-dev openmpi-bin libdnnl-dev libturbojpeg0-dev libpng-dev ninja-build

# What the test suite alone needs: a real browser for the memory report's test
# (tests/memory_report_browser.sh). Not installed by `make train`.
TEST_PACKAGES := chromium

.PHONY: train test test-isa build bench bootstrap test-bootstrap configure clean fuzz fuzz-bootstrap fuzz-merge fuzz-build

# Installs the Debian packages of $(1) that are missing (as root), or names the command to run.
define install_missing
	@missing=""; for p in $(1); do \
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
endef

bootstrap:
	$(call install_missing,$(DEB_PACKAGES))

test-bootstrap:
	$(call install_missing,$(TEST_PACKAGES))

# Ninja for a new build folder (or one that is already Ninja's): it compiles a program's files while
# the libraries it links are still being built, where make's generator waits for them. With the
# libraries' unity units (CMakeLists.txt, TALLY_UNITY) a whole build took 465 s here, against 678
# with make, file by file and before apps/ went to -O1.
GENERATOR = $(shell if [ ! -f $(BUILD_DIR)/CMakeCache.txt ] || grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$$' \
              $(BUILD_DIR)/CMakeCache.txt; then command -v ninja >/dev/null && echo "-G Ninja"; fi)

configure: bootstrap
	@cmake -S . -B $(BUILD_DIR) $(GENERATOR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)

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
test: build test-bootstrap
	@cd $(BUILD_DIR) && OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-passive} \
	  ctest --output-on-failure -j $(JOBS) --timeout 300

# The plan, MBP, recomputation and mixed-precision tests as an AVX2 and an AVX-512 processor would
# run them (oneDNN capped; docs/testing.md, "Plans on every processor").
ISA_TESTS := ^cli\.|Mbp\.|PlannerExact|Recompute\.|MixedPrecision|^recompute|^plan
test-isa: build
	@cd $(BUILD_DIR) && for isa in AVX2 AVX512_CORE; do echo "== ONEDNN_MAX_CPU_ISA=$$isa"; \
	  ONEDNN_MAX_CPU_ISA=$$isa OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} OMP_WAIT_POLICY=passive \
	  ctest -j $(JOBS) --timeout 300 -R '$(ISA_TESTS)' -E 'Gpu|gpu' || exit 1; done

bench: build
	@for b in $(BUILD_DIR)/bench/bench_*; do echo "== $$b"; $$b --benchmark_min_time=0.2 || exit 1; done

# ---- fuzzing (docs/testing.md, "Fuzzing") -----------------------------------------------------
# make fuzz: every harness of fuzz/ under libFuzzer with AddressSanitizer and UBSan for
# FUZZ_SECONDS each, in its own clang build (FUZZ_DIR). New inputs go to FUZZ_DIR/corpus/<name>
# (the seeds of fuzz/corpus/<name> are read, never written); a crashing input is saved in
# FUZZ_DIR/findings/<name>/ and fails the target. Per harness it prints libFuzzer's final line
# (executions, cov: edges, ft: features, corpus) and its stat:: lines.
# make fuzz-merge: adds to fuzz/corpus/<name> the inputs of FUZZ_DIR/corpus/<name> that reach
# new coverage (libFuzzer -merge=1), for a commit.
FUZZ_DIR       ?= build-fuzz
FUZZ_SECONDS   ?= 180
FUZZ_MAX_LEN   ?= 65536
FUZZ_HARNESSES := safetensors idx cifar cli checkpoint image
FUZZ_PACKAGES  := clang-16 libclang-rt-16-dev libomp-16-dev

fuzz-bootstrap: bootstrap
	$(call install_missing,$(FUZZ_PACKAGES))

fuzz-build: fuzz-bootstrap
	@CC=clang-16 CXX=clang++-16 cmake -S . -B $(FUZZ_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTALLY_FUZZ=ON \
	  -DTALLY_CUDA=OFF -DTALLY_MPI=OFF -DTALLY_ONEDNN=OFF -DTALLY_BUILD_TESTS=OFF -DTALLY_BUILD_BENCH=OFF
	@cmake --build $(FUZZ_DIR) -j $(JOBS) --target $(addprefix fuzz_,$(FUZZ_HARNESSES))

fuzz: fuzz-build
	@status=0; for h in $(FUZZ_HARNESSES); do \
	  mkdir -p $(FUZZ_DIR)/corpus/$$h $(FUZZ_DIR)/findings/$$h; \
	  echo "== fuzz_$$h: $(FUZZ_SECONDS) s (log: $(FUZZ_DIR)/fuzz_$$h.log)"; \
	  $(FUZZ_DIR)/fuzz/fuzz_$$h -max_total_time=$(FUZZ_SECONDS) -max_len=$(FUZZ_MAX_LEN) -timeout=10 \
	    -print_final_stats=1 -artifact_prefix=$(FUZZ_DIR)/findings/$$h/ \
	    $(FUZZ_DIR)/corpus/$$h fuzz/corpus/$$h > $(FUZZ_DIR)/fuzz_$$h.log 2>&1 || status=1; \
	  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)' \
	    $(FUZZ_DIR)/fuzz_$$h.log; \
	  grep -E '^==[0-9]+==ERROR|^SUMMARY|^artifact_prefix|Test unit written' $(FUZZ_DIR)/fuzz_$$h.log; \
	done; \
	if [ $$status != 0 ]; then echo "tally: fuzzing found inputs that fail: $(FUZZ_DIR)/findings/"; fi; \
	exit $$status

fuzz-merge: fuzz-build
	@for h in $(FUZZ_HARNESSES); do \
	  $(FUZZ_DIR)/fuzz/fuzz_$$h -merge=1 -max_len=$(FUZZ_MAX_LEN) fuzz/corpus/$$h $(FUZZ_DIR)/corpus/$$h \
	    2>&1 | grep -E 'MERGE-OUTER: [0-9]+ new files' || exit 1; \
	done

clean:
	@rm -rf $(BUILD_DIR)
