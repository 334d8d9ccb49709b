#!/usr/bin/env bash
# Builds the local control plane from the Go module proxy and caches the binaries
# outside the repo, keyed by version:
#   $RFT_CACHE/bin/k8s-$K8S_VERSION/{kube-apiserver,kube-controller-manager,kube-scheduler}
#   $RFT_CACHE/bin/etcd-$ETCD_VERSION/etcd
#   $RFT_CACHE/bin/kwok-$KWOK_VERSION/kwok
#   $RFT_CACHE/bin/k8s-$K8S_VERSION/{kubelet,kube-proxy}          (the real node)
#   $RFT_CACHE/bin/coredns-$COREDNS_VERSION/coredns                (cluster DNS)
#   $RFT_CACHE/bin/registry-$REGISTRY_VERSION/registry             (CNCF distribution)
#   $RFT_CACHE/bin/seaweedfs-$SEAWEEDFS_VERSION/weed               (the S3 server)
#   $RFT_CACHE/bin/kstatus-$CLI_UTILS_VERSION-lua$GOPHER_LUA_VERSION/kstatus (kstatus, Argo CD's Lua; tests)
#   $RFT_CACHE/bin/helm-$HELM_VERSION/{helm,untt-$HELM_UNITTEST_VERSION}  (Helm v4, helm-unittest; tests)
#   $RFT_CACHE/bin/kueue-$KUEUE_VERSION/{kueue,crds/,manifests.yaml}  (Kueue and its CRDs and
#                                   webhooks, run as a host process by e2e/kueue.py; tests)
#   $RFT_CACHE/bin/training-operator-$TRAINING_OPERATOR_VERSION/{training-operator,crds/}
#                                   (Kubeflow's, the peer of bench/reconcile.py --peer; not
#                                    built by default)
# A warm cache skips every build. `go install` refuses k8s.io/kubernetes and etcd's
# server module (their go.mod files use replace directives), so each is built through a
# small wrapper module that pins the staging modules instead.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=e2e/versions.env
source "$here/versions.env"
RFT_CACHE=${RFT_CACHE:-$HOME/.cache/rftjob}
# GOAMD64=v1 (Go's default, pinned against a caller's GOAMD64=v3/v4): the cached binaries
# run on any x86-64 CPU, with or without AVX2 or AVX-512.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false GOAMD64=v1
# Go's build and module caches serve only these builds (the binaries are cached by version,
# above), and a cold build leaves about 12 GB in them that a CI machine's disk needs for the
# images and the tests: they live in a temp dir of this invocation, removed when it ends.
# RFT_KEEP_GO_CACHE=1 keeps Go's own (for work on these builds).
if [ -z "${RFT_KEEP_GO_CACHE:-}" ]; then
  gotmp=$(mktemp -d "${TMPDIR:-/tmp}/rft-go.XXXXXX")
  export GOCACHE=$gotmp/build GOMODCACHE=$gotmp/mod
  trap 'chmod -R u+w "$gotmp" 2>/dev/null; rm -rf "$gotmp"' EXIT
fi

log() { echo "[build-binaries] $*" >&2; }

have() { for f in "$@"; do [ -x "$f" ] || return 1; done; }

build_k8s() {
  local out=$RFT_CACHE/bin/k8s-$K8S_VERSION
  local cmds="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy" missing="" c
  for c in $cmds; do have "$out/$c" || missing+=" $c"; done
  if [ -z "$missing" ]; then log "kubernetes $K8S_VERSION: cached in $out"; return; fi
  log "kubernetes $K8S_VERSION:$missing: building (about 6 min on 2 cores)"
  local work=$RFT_CACHE/src/k8s-$K8S_VERSION
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/k8s-build >/dev/null 2>&1
  go mod download -json "k8s.io/kubernetes@$K8S_VERSION" >download.json
  local gomod minor staging
  gomod=$(python3 -c 'import json,sys; print(json.load(open("download.json"))["GoMod"])')
  minor=${K8S_VERSION#v1.}   # 35.4 -> staging modules are v0.35.4
  # Every k8s.io module that k8s.io/kubernetes requires at v0.0.0 is a staging module.
  staging=$(awk '$1 ~ /^k8s\.io\// && $2 == "v0.0.0" {print $1}' "$gomod" | sort -u)
  [ -n "$staging" ] || { log "no staging modules found in $gomod"; exit 1; }
  {
    echo "require k8s.io/kubernetes $K8S_VERSION"
    for m in $staging; do echo "replace $m => $m v0.$minor"; done
    grep -E '^godebug' "$gomod" || true
  } >>go.mod
  cat >tools.go <<'GO'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
GO
  go mod tidy >/dev/null
  local major=1 min=${minor%%.*} commit date ld=""
  date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
  commit=$(python3 -c 'import json; print(json.load(open("download.json")).get("Origin",{}).get("Hash",""))')
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$min"
    ld+=" -X $pkg.gitCommit=$commit -X $pkg.gitTreeState=clean -X $pkg.buildDate=$date"
  done
  mkdir -p "$out"
  for c in $missing; do
    log "  go build $c"
    go build -trimpath -ldflags "-s -w $ld" -o "$out/$c.tmp" "k8s.io/kubernetes/cmd/$c"
    mv "$out/$c.tmp" "$out/$c"
  done
}

build_etcd() {
  local out=$RFT_CACHE/bin/etcd-$ETCD_VERSION
  if have "$out/etcd"; then log "etcd $ETCD_VERSION: cached in $out"; return; fi
  log "etcd $ETCD_VERSION: building"
  local work=$RFT_CACHE/src/etcd-$ETCD_VERSION
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/etcd-build >/dev/null 2>&1
  echo "require go.etcd.io/etcd/server/v3 $ETCD_VERSION" >>go.mod
  printf '//go:build tools\n\npackage tools\n\nimport _ "go.etcd.io/etcd/server/v3"\n' >tools.go
  go mod tidy >/dev/null
  mkdir -p "$out.tmp"
  go build -trimpath -ldflags "-s -w" -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3
  rm -rf "$out"; mv "$out.tmp" "$out"
}

build_kwok() {
  local out=$RFT_CACHE/bin/kwok-$KWOK_VERSION
  if have "$out/kwok"; then log "kwok $KWOK_VERSION: cached in $out"; return; fi
  log "kwok $KWOK_VERSION: building"
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"
}

build_coredns() {
  local out=$RFT_CACHE/bin/coredns-$COREDNS_VERSION
  if have "$out/coredns"; then log "coredns $COREDNS_VERSION: cached in $out"; return; fi
  log "coredns $COREDNS_VERSION: building"
  local work=$RFT_CACHE/src/coredns-$COREDNS_VERSION
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/coredns-build >/dev/null 2>&1
  echo "require github.com/coredns/coredns $COREDNS_VERSION" >>go.mod
  # Only the plugins the cluster's Corefile uses (e2e/node.py); no forward: there is no
  # upstream DNS to forward to.
  cat >main.go <<'GO'
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "cache", "kubernetes"}
}

func main() { coremain.Run() }
GO
  go mod tidy >/dev/null
  mkdir -p "$out.tmp"
  go build -trimpath -ldflags "-s -w" -o "$out.tmp/coredns" .
  rm -rf "$out"; mv "$out.tmp" "$out"
}

build_registry() {
  local out=$RFT_CACHE/bin/registry-$REGISTRY_VERSION
  if have "$out/registry"; then log "registry $REGISTRY_VERSION: cached in $out"; return; fi
  log "registry (CNCF distribution) $REGISTRY_VERSION: building"
  mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath -ldflags "-s -w" \
    "github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION"
  rm -rf "$out"; mv "$out.tmp" "$out"
}

build_seaweedfs() {
  local out=$RFT_CACHE/bin/seaweedfs-$SEAWEEDFS_VERSION
  if have "$out/weed"; then log "seaweedfs $SEAWEEDFS_VERSION: cached in $out"; return; fi
  log "seaweedfs $SEAWEEDFS_VERSION: building (about 6 min on 2 cores)"
  local work=$RFT_CACHE/src/seaweedfs-$SEAWEEDFS_VERSION
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/seaweedfs-build >/dev/null 2>&1
  go mod download -json "github.com/seaweedfs/seaweedfs@$SEAWEEDFS_VERSION" >download.json
  local gomod
  gomod=$(python3 -c 'import json; print(json.load(open("download.json"))["GoMod"])')
  # `go install` refuses a module with replace directives; carry them over.
  { echo "require github.com/seaweedfs/seaweedfs $SEAWEEDFS_VERSION"
    grep -E '^replace ' "$gomod" || true; } >>go.mod
  printf '//go:build tools\n\npackage tools\n\nimport _ "github.com/seaweedfs/seaweedfs/weed"\n' >tools.go
  go mod tidy >/dev/null
  mkdir -p "$out.tmp"
  go build -trimpath -ldflags "-s -w" -o "$out.tmp/weed" github.com/seaweedfs/seaweedfs/weed
  rm -rf "$out"; mv "$out.tmp" "$out"
}

# Helm v4 (its go.mod has no replace directives: `go install` builds it) and the
# helm-unittest plugin's binary `untt`, whose go.mod replaces a module, which `go install`
# refuses: built from a wrapper module that carries the replace over. `untt` runs as the
# plugin would (`untt CHART`); tests/unit/test_chart.py and tests/e2e/test_helm.py use both.
build_helm() {
  local out=$RFT_CACHE/bin/helm-$HELM_VERSION
  if have "$out/helm" "$out/untt-$HELM_UNITTEST_VERSION"; then log "helm $HELM_VERSION: cached in $out"; return; fi
  log "helm $HELM_VERSION, helm-unittest $HELM_UNITTEST_VERSION: building (a few minutes on 2 cores)"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  GOBIN="$out.tmp" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
  local mod=github.com/helm-unittest/helm-unittest
  local work=$RFT_CACHE/src/helm-unittest-$HELM_UNITTEST_VERSION
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/helm-unittest-build >/dev/null 2>&1
  go mod download -json "$mod@$HELM_UNITTEST_VERSION" >download.json
  local gomod
  gomod=$(python3 -c 'import json; print(json.load(open("download.json"))["GoMod"])')
  { echo "require $mod $HELM_UNITTEST_VERSION"
    grep -E '^replace ' "$gomod" || true; } >>go.mod
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s/cmd/helm-unittest"\n' "$mod" >tools.go
  go mod tidy >/dev/null
  go build -trimpath -ldflags "-s -w" -o "$out.tmp/untt-$HELM_UNITTEST_VERSION" "$mod/cmd/helm-unittest"
  rm -rf "$out"; mv "$out.tmp" "$out"
}

# Kubeflow's training-operator, the peer that `bench/reconcile.py --peer` measures ours
# against: only on request (`bash e2e/build-binaries.sh training_operator`). Its go.mod
# has no replace directives, so a wrapper module that requires it and builds with
# -mod=mod (missing requirements resolved from the Go module proxy) is enough. The
# PyTorchJob CRD comes from the same module's manifests.
: "${TRAINING_OPERATOR_VERSION:=v1.9.3}"

build_training_operator() {
  local out=$RFT_CACHE/bin/training-operator-$TRAINING_OPERATOR_VERSION
  local mod=github.com/kubeflow/training-operator
  if have "$out/training-operator" && [ -f "$out/crds/kubeflow.org_pytorchjobs.yaml" ]; then
    log "training-operator $TRAINING_OPERATOR_VERSION: cached in $out"; return
  fi
  log "training-operator $TRAINING_OPERATOR_VERSION: building (a few minutes on 2 cores)"
  local work=$RFT_CACHE/src/training-operator-$TRAINING_OPERATOR_VERSION
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/training-operator-build >/dev/null 2>&1
  echo "require $mod $TRAINING_OPERATOR_VERSION" >>go.mod
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s/cmd/training-operator.v1"\n' "$mod" >tools.go
  rm -rf "$out.tmp"; mkdir -p "$out.tmp/crds"
  GOFLAGS="$GOFLAGS -mod=mod" go build -trimpath -ldflags "-s -w" -o "$out.tmp/training-operator" \
    "$mod/cmd/training-operator.v1"
  local dir
  dir=$(GOFLAGS="$GOFLAGS -mod=mod" go list -m -f '{{.Dir}}' "$mod")
  cp "$dir/manifests/base/crds/"kubeflow.org_*.yaml "$out.tmp/crds/"
  chmod -R u+w "$out.tmp"
  rm -rf "$out"; mv "$out.tmp" "$out"
}

# kstatus (sigs.k8s.io/cli-utils), the library Flux's health checks use, and Argo CD's Lua
# health check run as Argo CD runs it (gopher-lua, the interpreter Argo CD embeds): a small
# program that prints what each says of each object it reads (tests/integration/test_kstatus.py).
build_kstatus() {
  local tag=$CLI_UTILS_VERSION-lua$GOPHER_LUA_VERSION
  local out=$RFT_CACHE/bin/kstatus-$tag
  if have "$out/kstatus"; then log "kstatus ($tag): cached in $out"; return; fi
  log "kstatus ($tag): building"
  local work=$RFT_CACHE/src/kstatus-$tag
  rm -rf "$work"; mkdir -p "$work"; cd "$work"
  go mod init rftjob.local/kstatus >/dev/null 2>&1
  printf 'require (\n\tsigs.k8s.io/cli-utils %s\n\tgithub.com/yuin/gopher-lua %s\n)\n' \
    "$CLI_UTILS_VERSION" "$GOPHER_LUA_VERSION" >>go.mod
  cat >main.go <<'GO'
// kstatus: reads a JSON array of Kubernetes objects on stdin and prints, per object, one
// JSON line {"name", "status", "message"} from cli-utils' status.Compute. With
// -argo-health FILE it adds "argo": {"status", "message"}, what that Lua health check
// returns when run the way Argo CD runs a resource customization: gopher-lua with only
// the package, base and table libraries open, the object as the global `obj` (numbers
// as Lua numbers), a 1 s limit, and a status outside Argo CD's set read as Unknown.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	lua "github.com/yuin/gopher-lua"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

var argoStatuses = map[string]bool{"Unknown": true, "Progressing": true, "Suspended": true,
	"Healthy": true, "Degraded": true, "Missing": true}

func toLua(l *lua.LState, v interface{}) lua.LValue {
	switch x := v.(type) {
	case bool:
		return lua.LBool(x)
	case float64:
		return lua.LNumber(x)
	case int64:
		return lua.LNumber(x)
	case string:
		return lua.LString(x)
	case []interface{}:
		t := l.CreateTable(len(x), 0)
		for _, item := range x {
			t.Append(toLua(l, item))
		}
		return t
	case map[string]interface{}:
		t := l.CreateTable(0, len(x))
		for k, item := range x {
			t.RawSetH(lua.LString(k), toLua(l, item))
		}
		return t
	}
	return lua.LNil
}

func argoHealth(obj map[string]interface{}, script string) (map[string]string, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	for name, open := range map[string]lua.LGFunction{lua.LoadLibName: lua.OpenPackage,
		lua.BaseLibName: lua.OpenBase, lua.TabLibName: lua.OpenTable} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(open), Protect: true}, lua.LString(name)); err != nil {
			return nil, err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", toLua(l, obj))
	if err := l.DoString(script); err != nil {
		return nil, err
	}
	ret, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return nil, fmt.Errorf("expect table output from Lua script, not %s", l.Get(-1).Type())
	}
	out := map[string]string{"status": lua.LVAsString(ret.RawGetString("status")),
		"message": lua.LVAsString(ret.RawGetString("message"))}
	if !argoStatuses[out["status"]] {
		out = map[string]string{"status": "Unknown", "message": "Lua returned an invalid health status"}
	}
	return out, nil
}

func main() {
	healthFile := flag.String("argo-health", "", "an Argo CD health.lua to run on each object too")
	flag.Parse()
	script := ""
	if *healthFile != "" {
		b, err := os.ReadFile(*healthFile)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		script = string(b)
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(data, &items); err != nil {
		fmt.Fprintln(os.Stderr, "stdin: not a JSON array of objects:", err)
		os.Exit(2)
	}
	for _, raw := range items {
		u := &unstructured.Unstructured{}
		// UnmarshalJSON keeps integers integers (status.Compute rejects float generations).
		if err := u.UnmarshalJSON(raw); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		res, err := status.Compute(u)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", u.GetName(), err)
			os.Exit(1)
		}
		line := map[string]interface{}{"name": u.GetName(), "status": res.Status.String(), "message": res.Message}
		if script != "" {
			argo, err := argoHealth(u.Object, script)
			if err != nil {
				fmt.Fprintf(os.Stderr, "%s: argo health: %v\n", u.GetName(), err)
				os.Exit(1)
			}
			line["argo"] = argo
		}
		b, _ := json.Marshal(line)
		fmt.Println(string(b))
	}
}
GO
  go mod tidy >/dev/null
  mkdir -p "$out.tmp"
  go build -trimpath -ldflags "-s -w" -o "$out.tmp/kstatus" .
  rm -rf "$out"; mv "$out.tmp" "$out"
}

# Kueue (sigs.k8s.io/kueue: its go.mod has no replace directives, so `go install` builds it),
# with the CRDs and the webhook configurations of the same module, which e2e/kueue.py
# installs before it runs the manager as a host process against the test cluster.
build_kueue() {
  local out=$RFT_CACHE/bin/kueue-$KUEUE_VERSION mod=sigs.k8s.io/kueue
  if have "$out/kueue" && [ -f "$out/crds/kueue.x-k8s.io_workloads.yaml" ] && [ -f "$out/manifests.yaml" ]; then
    log "kueue $KUEUE_VERSION: cached in $out"; return
  fi
  log "kueue $KUEUE_VERSION: building (a few minutes on 2 cores)"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp/crds"
  GOBIN="$out.tmp" go install -trimpath \
    -ldflags "-s -w -X $mod/pkg/version.GitVersion=$KUEUE_VERSION" "$mod/cmd/kueue@$KUEUE_VERSION"
  local dir
  dir=$(cd "$out.tmp" && go mod download -json "$mod@$KUEUE_VERSION" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  cp "$dir/config/components/crd/bases/"*.yaml "$out.tmp/crds/"
  cp "$dir/config/components/webhook/manifests.yaml" "$out.tmp/manifests.yaml"
  chmod -R u+w "$out.tmp"
  rm -rf "$out"; mv "$out.tmp" "$out"
}

# promtool (Prometheus' rule checker and rule unit-test runner), for the alert tests
# (tests/unit/test_monitoring.py), and the prometheus server itself, which
# tests/integration/test_prometheus.py runs against the operator (e2e/prometheus.py):
# Debian's `prometheus` package at the pinned version, downloaded (no install, no service),
# unpacked in a temp dir, both binaries kept.
build_promtool() {
  local out=$RFT_CACHE/bin/prometheus-$PROMETHEUS_DEB_VERSION
  if have "$out/promtool" "$out/prometheus"; then log "promtool, prometheus $PROMETHEUS_DEB_VERSION: cached in $out"; return; fi
  log "promtool $PROMETHEUS_DEB_VERSION: apt-get download prometheus"
  local work
  work=$(mktemp -d "${TMPDIR:-/tmp}/rft-promtool.XXXXXX"); chmod 755 "$work"
  ( cd "$work" && apt-get download -q "prometheus=$PROMETHEUS_DEB_VERSION" >/dev/null ) || {
    log "apt-get download prometheus=$PROMETHEUS_DEB_VERSION failed (run apt-get update?)"; rm -rf "$work"; exit 1; }
  dpkg -x "$work"/prometheus_*.deb "$work/root"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  cp "$work/root/usr/bin/promtool" "$work/root/usr/bin/prometheus" "$out.tmp/"
  rm -rf "$work" "$out"; mv "$out.tmp" "$out"
}

# prometheus-operator's CRDs (ServiceMonitor, PodMonitor, PrometheusRule) from its Go module,
# for tests/integration/test_prometheus.py (the monitoring objects, dry-run on the server).
build_prometheus_crds() {
  local out=$RFT_CACHE/bin/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION/crds
  local kinds="servicemonitors podmonitors prometheusrules" k missing=""
  for k in $kinds; do [ -f "$out/monitoring.coreos.com_$k.yaml" ] || missing+=" $k"; done
  if [ -z "$missing" ]; then log "prometheus-operator $PROMETHEUS_OPERATOR_VERSION CRDs: cached in $out"; return; fi
  log "prometheus-operator $PROMETHEUS_OPERATOR_VERSION CRDs: go mod download"
  local work dir
  work=$(mktemp -d "${TMPDIR:-/tmp}/rft-promop.XXXXXX")
  dir=$(cd "$work" && go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  rm -rf "$out.tmp"; mkdir -p "$out.tmp"
  for k in $kinds; do cp "$dir/example/prometheus-operator-crd/monitoring.coreos.com_$k.yaml" "$out.tmp/"; done
  chmod -R u+w "$out.tmp"; rm -rf "$work" "$out"; mv "$out.tmp" "$out"
}

want=${*:-etcd kwok k8s coredns registry seaweedfs kstatus helm kueue}
mkdir -p "$RFT_CACHE/bin"
for w in $want; do
  # One build of a component at a time (`make -j`, or a demo and tests started together);
  # a second caller waits, then finds it cached.
  exec {lock}>"$RFT_CACHE/bin/.build-$w.lock"
  flock "$lock"
  started=$SECONDS
  ( "build_$w" )
  [ $((SECONDS - started)) -lt 2 ] || log "$w: $((SECONDS - started))s"
  exec {lock}>&-
done
log "done"
