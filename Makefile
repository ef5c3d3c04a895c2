# Two commands do everything from nothing: `make run` and `make test`.
.PHONY: explore setup run test test-fast lint bench bench-lifecycle bench-watchdog bench-proxy soak \
	bench-restart bench-failover bench-healthy-soak bench-proxy-routing bench-proxy-paced \
	bench-host-cost bench-plane bench-relay \
	bench-spec-decode clean

setup:
	bash scripts/setup.sh all

# The daemon in the foreground, supervising the real vLLM CPU engine with the tiny model
# (CONFIG=config.two-engines.toml: two engines, the second the first one's fallback).
run: setup
	.venv/bin/vllm-supervisor run --config $(or $(CONFIG),config.toml)

# The whole suite: lint, types, unit, component, systemd and end-to-end (real vLLM).
# The tests without the real engine run in 2 processes, a test file each (they mostly wait
# on sockets and timers); the end-to-end ones one at a time (two real engines at once on
# 2 cores stretched a failover's gaps past their bound).
PARALLEL ?= -n 2 --dist loadfile
test: setup
	.venv/bin/ruff check supervisor tests bench
	.venv/bin/mypy
	.venv/bin/python -m pytest -q -m "not e2e" $(PARALLEL) --durations=15
	.venv/bin/python -m pytest -q -m e2e --durations=25

# Everything but the real engine: seconds, for every edit (tests/test_fleet.py runs the
# real vllm-router, the Prometheus rules' tests promtool, the snapshot tests CRIU: all set
# up here too).
test-fast:
	bash scripts/setup.sh supervisor
	bash scripts/setup.sh prometheus
	bash scripts/setup.sh router
	bash scripts/setup.sh criu
	.venv/bin/python -m pytest -q -m "not e2e" $(PARALLEL)

# The property tests and the state machines on fresh random draws, five times as many as
# the suite's fixed ones (tests/hypothesis_profiles.py): to find new bugs, not to gate a
# change. A failure prints its steps and a blob to replay; make it a regression test.
explore: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider --hypothesis-profile=explore $(PARALLEL) \
		tests/test_pair_machine.py tests/test_weight_cache_machine.py \
		tests/test_continuation.py tests/test_plane_codec.py tests/test_policy_guardrails.py

lint:
	.venv/bin/ruff check supervisor tests bench
	.venv/bin/mypy

# Every benchmark, side by side with its baseline; each rewrites its own section of
# docs/benchmarks.md (about 8 + 10 + 12 + 4 + 8 + 8 minutes).
bench: bench-lifecycle bench-watchdog bench-proxy bench-restart bench-failover bench-host-cost

bench-lifecycle: setup
	.venv/bin/python bench/lifecycle_bench.py --out docs/benchmarks.md

bench-watchdog: setup
	.venv/bin/python bench/watchdog_bench.py --out docs/benchmarks.md

bench-proxy: setup
	bash scripts/setup.sh nginx
	.venv/bin/python bench/proxy_bench.py --out docs/benchmarks.md

# Streams paced as vLLM sends them (one event per stream per engine step: 256 streams at
# 20 ms, 64 at 5 ms) through direct, the proxy and nginx; CPU per chunk, chunks/s, added
# gaps (about 3 minutes; BASE=ref adds the proxy at that commit, before and after)
# The front door over several processes (issue 38): 8 engines paced at 16 ms x 256 streams
# (128,000 chunks/s offered) through 1, 2, 4 and 8 proxy workers beside direct; it wants
# 16 cores or more (about 2 minutes; on fewer, pass ARGS="--engines 2 --streams 64")
bench-plane: setup
	bash scripts/setup.sh nginx
	.venv/bin/python bench/plane_scale.py --out docs/benchmarks.md $(ARGS)

# A copy's relay (issue 49's route 3: every token of a restored standby crosses it) under
# streams paced as vLLM sends them, beside direct (about 2 minutes)
bench-relay: setup
	.venv/bin/python bench/relay_bench.py --out docs/benchmarks.md

bench-proxy-paced: setup
	bash scripts/setup.sh nginx
	.venv/bin/python bench/proxy_paced.py --out docs/benchmarks.md $(if $(BASE),--baseline $(BASE))

# The proxy with two engines (routing by model) beside one, and before the change (BASE=ref)
bench-proxy-routing: setup
	.venv/bin/python bench/proxy_bench.py --routed --out docs/benchmarks.md \
		$(if $(BASE),--baseline $(BASE))

bench-restart: setup
	.venv/bin/python bench/restart_bench.py --out docs/benchmarks.md

# A SIGKILL of the serving engine core under streams, with a standby and with a cold start
# side by side (ROUNDS=N, default 3; about 8 minutes, bounded to 25).
bench-failover: setup
	.venv/bin/python bench/failover_bench.py --rounds $(or $(ROUNDS),3) --out docs/benchmarks.md

# The daemon's own cost on the 8-GPU example (six fake engines, 8 scripted GPUs) beside one
# engine: RSS, idle CPU, CPU per request through the proxy, alternating (ROUNDS=N, default
# 3; about 8 minutes).
bench-host-cost: setup
	.venv/bin/python bench/host_cost_bench.py --rounds $(or $(ROUNDS),3) --out docs/benchmarks.md
# Speculative decoding for real (issue 24): n-gram speculation on the real CPU engine, a
# workload that accepts well then one that accepts badly; the shipped acceptance rules
# (times shortened) relaunch with one token more, then one fewer; with an awake standby
# (a swap) and without (a cold relaunch). About 10-15 minutes on two busy cores, bounded
# to 25.
bench-spec-decode: setup
	.venv/bin/python bench/spec_decode_run.py --out docs/benchmarks.md

# The watchdog's false-alarm budget (issue 48): an hour of a service's traffic against the
# real engine started cold, a CPU hog for its middle third, where every decision of the
# default rules is false (MINUTES=N, default 60); then faults (a core SIGKILL, a core
# SIGSTOP, a worker SIGSTOP) about every 2 minutes, each detected or not (FAULT_MINUTES=N,
# default 10; 0 skips them). About 75 minutes in all.
bench-healthy-soak: setup
	.venv/bin/python bench/healthy_soak.py --minutes $(or $(MINUTES),60) \
		--fault-minutes $(or $(FAULT_MINUTES),10) --out docs/benchmarks.md

# A bounded fault soak: streaming load through the proxy to the real engine, a fault
# about every minute (MINUTES=N, default 15); counts failed and truncated streams,
# continuations, orphans and the daemon's RSS into docs/benchmarks.md.
soak: setup
	.venv/bin/python bench/fault_soak.py --minutes $(or $(MINUTES),15) --out docs/benchmarks.md

clean:
	rm -rf .venv .venv-engine models .stamps run var
