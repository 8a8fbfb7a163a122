# codebroker: the commands people type.
#   make image   build the sandbox image (runner and kernel included)
#   make run     build and start the broker on 127.0.0.1:8000 without auth (local trial)
#   make test    unit tests, then end-to-end tests against Docker and the image (the
#                Docker-daemon restart test last)
#   make leftovers  containers and workspaces a test run left behind (fails on any)
#   make test-runsc the core, hostile and LibreChat suites with every sandbox under gVisor
#                (register it first: scripts/runsc-up.sh)
#   make test-runner-files  the file, upload, exec and LibreChat suites with files moved
#                through the runner (CODEBROKER_FILE_TRANSFER=runner)
#   make test-k8s  the language, file, limit, lifecycle, streaming, upload and LibreChat
#                suites (and a few more) on the Kubernetes backend, against tests/k8s_standin
#                (a stand-in API server, test code only, that runs each pod as a Docker container)
#   make k8s-validate  the Kubernetes manifests (deploy/kubernetes) rendered and schema-checked offline
#   make bench   one table of latency, throughput and footprint beside goals and baselines (BENCH_QUICK=1: smoke run)

IMAGE ?= codebroker-sandbox:latest
# The broker, the tests and the bench all read the image name from here.
export CODEBROKER_IMAGE := $(IMAGE)
CARGO ?= cargo

.PHONY: k8s-validate image run test unit-test e2e-test bench lint kernel-test librechat-test e2b-test jupyter-test lobe-test playground-test daemon-test leftovers registries test-runsc test-runner-files test-k8s

image:
	docker build -f sandbox-image/Dockerfile -t $(IMAGE) .

run: image
	CODEBROKER_AUTH=$${CODEBROKER_AUTH:-none} $(CARGO) run --release -p codebroker

test: image registries
	$(CARGO) test --workspace --lib --bins
	$(CARGO) test -p sandbox-runner --tests
	$(CARGO) test -p codebroker --tests -- --test-threads=4
	$(MAKE) --no-print-directory kernel-test
	$(MAKE) --no-print-directory lobe-test
	$(MAKE) --no-print-directory librechat-test
	$(MAKE) --no-print-directory e2b-test
	$(MAKE) --no-print-directory jupyter-test
	$(MAKE) --no-print-directory playground-test
	$(MAKE) --no-print-directory daemon-test

# Restarts the Docker daemon under a running broker, which disrupts anything else using
# it: last, on its own (the test is #[ignore]d in the run above).
daemon-test:
	$(CARGO) test -p codebroker --test hostile_daemon -- --ignored --test-threads=1

# The suites that say whether sandboxes behave the same under gVisor (runsc, registered
# with the daemon by scripts/runsc-up.sh). Skipped there, each a known difference of the
# runtime (SECURITY.md): the host's pids limit counts gVisor's own threads, so a fork bomb
# ends the whole sandbox instead of failing its forks; nproc shows the host's CPUs, not
# the CPU limit; 64-session bursts take longer than this suite is worth; runsc cannot change
# a running container's CPU weight, so the two tests of the preload's weight do not apply.
RUNSC_SUITES ?= --test python --test languages --test files --test limits --test streaming \
	--test lifecycle --test uploads --test hostile_sandbox --test hostile_host --test egress
RUNSC_SKIP ?= --skip a_bash_fork_bomb_is_contained --skip a_python_fork_loop_is_contained \
	--skip nproc_reports_no_more_cpus_than_the_limit --skip sixty_four_sessions \
	--skip an_exec_right_after_the_take_stops_the_preload_and_gets_the_usual_weight \
	--skip a_first_exec_in_another_language_stops_the_preload_too
test-runsc: image
	CODEBROKER_RUNTIME=runsc $(CARGO) test -p codebroker $(RUNSC_SUITES) -- --test-threads=2 $(RUNSC_SKIP)
	CODEBROKER_RUNTIME=runsc $(MAKE) --no-print-directory librechat-test

# The suites that move files, with every file through the runner instead of the host
# directory: the path of a backend whose sandboxes the broker cannot see the disk of. The
# egress suite with its connections tunnelled over the runner channel, as on Kubernetes.
RUNNER_FILES_SUITES ?= --test files --test uploads --test python --test programmatic \
	--test lifecycle --test file_transfer --test shared_files --test python_state \
	--test e2b_protocol --test jupyter_protocol
test-runner-files: image registries
	CODEBROKER_FILE_TRANSFER=runner $(CARGO) test -p codebroker $(RUNNER_FILES_SUITES) -- --test-threads=4
	CODEBROKER_EGRESS_TRANSPORT=runner $(CARGO) test -p codebroker --test egress -- --test-threads=2
	CODEBROKER_FILE_TRANSFER=runner $(MAKE) --no-print-directory librechat-test
	CODEBROKER_FILE_TRANSFER=runner $(MAKE) --no-print-directory e2b-test

# The Kubernetes backend's whole path (pod create, list and watch, attach, delete, the
# image read through a pod's log for /libraries) under the suites, against the stand-in API server of
# tests/k8s_standin (test code only), which runs each pod as a Docker container; its
# containers go when their pods are deleted and when it exits. Skipped, each a Docker-only
# behaviour a pod does not have: docker inspect of the Docker profile's lockdown (a pod's
# lockdown is its spec, checked request by request in the backend's unit tests); a pooled
# container's workspace handed to an upload session (a pod's emptyDir cannot be handed
# over: the session starts its own pod); the four tests of the preload's CPU weight (a
# pod's weight is its CPU request, fixed when it is created).
K8S_SUITES ?= --test languages --test files --test limits --test python --test uploads --test egress \
	--test lifecycle --test streaming --test bad_input --test file_transfer --test shared_files \
	--test kubernetes --test e2b_protocol --test jupyter_protocol
K8S_SKIP ?= --skip lockdown_flags_read_back_from_docker_inspect \
	--skip an_upload_session_is_handed_a_pooled_sandbox_that_survives_a_restart \
	--skip a_pooled_kernel_has_the_data_stack_loaded_and_leaves_nothing_else \
	--skip without_preload_a_pooled_kernel_imports_nothing_ahead \
	--skip an_exec_right_after_the_take_stops_the_preload_and_gets_the_usual_weight \
	--skip a_first_exec_in_another_language_stops_the_preload_too
test-k8s: image registries
	$(CARGO) build -p k8s-standin -p codebroker --bins
	@set -e; dir=$$(mktemp -d); \
	$(CARGO) run -q -p k8s-standin -- --kubeconfig "$$dir/kubeconfig" & standin=$$!; \
	trap 'kill $$standin 2>/dev/null; wait $$standin; rm -rf "$$dir"' EXIT; \
	while [ ! -s "$$dir/kubeconfig" ]; do \
		kill -0 $$standin 2>/dev/null || { echo "k8s-standin did not start" >&2; exit 1; }; \
		sleep 0.2; \
	done; \
	export CODEBROKER_BACKEND=kubernetes KUBECONFIG="$$dir/kubeconfig"; \
	if [ -n "$$CARGO_TARGET_DIR" ] && [ -z "$$CODEBROKER_BIN" ]; then \
		export CODEBROKER_BIN="$$CARGO_TARGET_DIR/debug/codebroker"; fi; \
	$(CARGO) test -p codebroker $(K8S_SUITES) -- --test-threads=4 $(K8S_SKIP); \
	$(MAKE) --no-print-directory librechat-test; \
	$(MAKE) --no-print-directory e2b-test; \
	$(MAKE) --no-print-directory jupyter-test

# What a test run left behind: containers with codebroker labels, session workspaces.
leftovers:
	.ci/leftovers

# The package registries the egress suite starts on loopback (tests/common/registries.rs):
# pypiserver in a virtualenv, verdaccio 6.8 from npm (later versions need Node 22).
registries:
	cd tests/registries && npm ci --no-audit --no-fund
	test -x tests/registries/.venv/bin/pypi-server || { python3 -m venv tests/registries/.venv \
		&& tests/registries/.venv/bin/pip install -q -r tests/registries/requirements.txt; }

# kernel.py's own tests over its fd 3/fd 4 protocol, run in the image (its Python, numpy
# and matplotlib) with the kernels directory mounted read-only: the tests are not shipped.
kernel-test:
	docker run --rm --network none --entrypoint python3 \
		-v "$(CURDIR)/sandbox-image/kernels:/opt/kernel-test:ro" \
		$(IMAGE) /opt/kernel-test/test_kernel.py

# The real LibreChat client (@librechat/agents, three generations) and LibreChat's file
# flows against the debug broker binary; ends with node's test summary.
librechat-test:
	$(CARGO) build -p codebroker && cd tests/librechat && npm ci --no-audit --no-fund && npm test

# E2B's own SDKs against the debug broker binary: Python (e2b, e2b-code-interpreter, in a
# venv made once) and JavaScript (@e2b/code-interpreter, e2b), pinned (tests/e2b).
e2b-test:
	$(CARGO) build -p codebroker
	test -x tests/e2b/.venv/bin/pytest || { python3 -m venv tests/e2b/.venv \
		&& tests/e2b/.venv/bin/pip install -q -r tests/e2b/requirements.txt; }
	cd tests/e2b && .venv/bin/pytest -q -p no:cacheprovider
	cd tests/e2b/js && npm ci --no-audit --no-fund && npm test

# Jupyter's kernel protocol at /jupyter, by its real clients against the debug broker
# binary: Open WebUI's code interpreter (execute_code_jupyter) and a Jupyter Server using
# codebroker as its kernel gateway, in a venv made once (tests/jupyter). open-webui goes
# in without its dependencies (gigabytes): requirements.txt has what its client imports.
jupyter-test:
	$(CARGO) build -p codebroker
	test -x tests/jupyter/.venv/bin/pytest || { python3 -m venv tests/jupyter/.venv \
		&& tests/jupyter/.venv/bin/pip install -q -r tests/jupyter/requirements.txt \
		&& tests/jupyter/.venv/bin/pip install -q --no-deps open-webui==0.12.4; }
	cd tests/jupyter && .venv/bin/pytest -q -p no:cacheprovider

# The LobeChat plugin checked by LobeChat's own code: the manifest against the SDK's
# pluginManifestSchema, runCode through its plugin gateway, against the debug broker binary.
lobe-test:
	$(CARGO) build -p codebroker && cd tests/lobe && npm ci --no-audit --no-fund && npm test

# The web playground (GET /) in headless Chromium (Debian's /usr/bin/chromium) through
# playwright-core, against the debug broker binary; ends with node's test summary.
playground-test:
	$(CARGO) build -p codebroker && cd tests/playground && npm ci --no-audit --no-fund && npm test

k8s-validate:
	scripts/k8s-validate.sh

bench: image
	$(CARGO) bench -p codebroker --bench exec

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
