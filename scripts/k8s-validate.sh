#!/usr/bin/env bash
# Checks deploy/kubernetes without a cluster: renders the base and every overlay with
# `kubectl kustomize`, validates each object against the strict API schemas of one
# Kubernetes version with kubernetes-validate (its schemas ship in the package, so this
# runs offline once it is installed), checks that the sandbox pods are denied all
# traffic, and then proves the check has teeth: broken copies of the base must fail.
#
#   scripts/k8s-validate.sh
#
# KUBECTL names the kubectl to use (default: the one on PATH);
# K8S_VALIDATE_KUBERNETES_VERSION the Kubernetes version to validate against (1.30).
# kubernetes-validate is installed, pinned, into a virtualenv under
# ${XDG_CACHE_HOME:-~/.cache}/codebroker-k8s-validate the first time (PyPI must be
# reachable then, and only then). Exit status 0 only when everything passed.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
deploy=$root/deploy/kubernetes
kubectl=${KUBECTL:-kubectl}
# Pinned: the schemas come with the package (Kubernetes 1.22 to 1.33 in this release).
validator_version=1.33.1
kubernetes_version=${K8S_VALIDATE_KUBERNETES_VERSION:-1.30}
venv=${XDG_CACHE_HOME:-$HOME/.cache}/codebroker-k8s-validate/kubernetes-validate-$validator_version

die() {
  echo "k8s-validate: $*" >&2
  exit 1
}

# The kustomizations use `labels` and `patches`, which the kustomize built into kubectl
# has since 1.22 (kustomize v4.2; checked here with kubectl 1.32, kustomize v5.5.0).
# Debian 12's kubernetes-client is 1.20: too old.
kubectl_hint="install kubectl 1.22 or later (https://kubernetes.io/docs/tasks/tools/) or set KUBECTL to its path"
command -v "$kubectl" >/dev/null 2>&1 || die "kubectl not found: $kubectl_hint"
"$kubectl" kustomize --help >/dev/null 2>&1 ||
  die "'$kubectl kustomize' does not work: $kubectl_hint"

# The virtualenv is (re)made whenever it does not import the pinned version.
if ! "$venv/bin/python" -c "import sys, kubernetes_validate as k;
sys.exit(k.__version__ != '$validator_version')" >/dev/null 2>&1; then
  command -v python3 >/dev/null 2>&1 || die "python3 not found (needed for kubernetes-validate)"
  echo "k8s-validate: installing kubernetes-validate==$validator_version into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv" ||
    die "cannot create a virtualenv (Debian: apt-get install python3-venv)"
  "$venv/bin/pip" install --quiet --disable-pip-version-check \
    "kubernetes-validate==$validator_version" ||
    die "cannot install kubernetes-validate==$validator_version from PyPI"
fi
validate=("$venv/bin/python" "$root/scripts/k8s-validate.py" --kubernetes-version "$kubernetes_version")

# The label key every sandbox pod carries, from the broker's source, so that the
# NetworkPolicy cannot drift away from what the broker actually sets.
sandbox_label=$(sed -n 's/.*const INSTANCE: &str = "\([^"]*\)";.*/\1/p' \
  "$root/broker/src/sandbox/mod.rs")
[ -n "$sandbox_label" ] || die "no sandbox label (labels::INSTANCE) in broker/src/sandbox/mod.rs"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Render the base, every overlay and the example overlay, found rather than listed, so a
# new one is checked too.
rendered=()
for dir in "$deploy/base" "$deploy"/overlays/*/ "$deploy"/examples/*/; do
  dir=${dir%/}
  [ -f "$dir/kustomization.yaml" ] || continue
  name=${dir#"$deploy"/}
  out=${name//\//-}.yaml
  "$kubectl" kustomize "$dir" >"$work/$out" ||
    die "kubectl kustomize $name failed (an error above, or a kubectl older than 1.22)"
  rendered+=("$out")
done
[ "${#rendered[@]}" -ge 3 ] || die "expected the base and at least two overlays under $deploy"

cd "$root"
examples=(deploy/kubernetes/examples/*.yaml deploy/kubernetes/overlays/*/examples/*.yaml)

kustomize_version=$("$kubectl" version --client 2>/dev/null | sed -n 's/^Kustomize Version: //p')
echo "k8s-validate: Kubernetes $kubernetes_version, kubernetes-validate $validator_version" \
  "(strict), rendered by kustomize ${kustomize_version:-of $kubectl}"
status=0
# Rendered files are named after their directory (base.yaml, overlays-gvisor.yaml, ...).
(cd "$work" && "${validate[@]}" --sandbox-label "$sandbox_label" "${rendered[@]}") || status=1
"${validate[@]}" "${examples[@]}" || status=1
[ "$status" = 0 ] || die "invalid manifests (FAIL lines above)"

# Negative checks: each broken copy of the base must be rejected, or the validation
# above proves nothing.
base=$work/base.yaml
broken=0
expect_rejected() {
  local what=$1 expression=$2 copy=$work/broken-$broken.yaml output
  broken=$((broken + 1))
  sed "$expression" "$base" >"$copy"
  cmp -s "$base" "$copy" && die "negative check '$what': the edit changed nothing"
  if output=$("${validate[@]}" --sandbox-label "$sandbox_label" "$copy"); then
    echo "$output" >&2
    die "negative check '$what': the broken copy passed validation"
  fi
  echo "rejected, as it must be: $what: $(grep -m1 '^FAIL' <<<"$output" | sed 's/^FAIL [^:]*: //')"
}
expect_rejected "misspelt field" 's/readOnlyRootFilesystem:/readOnlyRootFileSystem:/'
expect_rejected "misspelt kind" 's/^kind: Deployment$/kind: Deploymnet/'
expect_rejected "wrong type" 's/^  replicas: 1$/  replicas: one/'
expect_rejected "sandbox policy selecting nothing" 's/operator: Exists/operator: DoesNotExist/'

echo "k8s-validate: ${#rendered[@]} renders and ${#examples[@]} example files valid;" \
  "$broken broken copies rejected"
