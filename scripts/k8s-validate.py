"""Checks rendered Kubernetes manifests against the API schemas, offline.

Run by scripts/k8s-validate.sh inside its virtualenv (kubernetes-validate, PyYAML); not
meant to be called on its own. Every document of every file given is validated with
kubernetes-validate's strict schemas for one Kubernetes version, so an unknown field, a
wrong type or a misspelt kind is an error. Two things the command-line tool of
kubernetes-validate does not do, done here:

* a kind it has no schema for fails, where the tool only warns (a typo in `kind` would
  otherwise pass); agent-sandbox's custom resources, which no core schema describes, are
  skipped by name and said so, and a SandboxTemplate's pod template is still checked as a
  core Pod;
* with --sandbox-label, the file must hold a NetworkPolicy that selects every pod with
  that label key and denies it all ingress and egress (the broker's sandbox isolation).

Exit status: 0 when everything passed, 1 when anything failed.
"""

import argparse
import sys

import kubernetes_validate
import yaml
from kubernetes_validate.utils import (
    InvalidSchemaError,
    SchemaNotFoundError,
    ValidationError,
    VersionNotSupportedError,
)

# agent-sandbox's API groups (v1alpha1, releases v0.1.x) and the kinds they define.
AGENT_SANDBOX_KINDS = {
    "agents.x-k8s.io": {"Sandbox"},
    "extensions.agents.x-k8s.io": {"SandboxClaim", "SandboxTemplate", "SandboxWarmPool"},
}


def describe(doc):
    """`Kind/name` of a document, for messages."""
    name = (doc.get("metadata") or {}).get("name", "?")
    return f"{doc.get('kind', '?')}/{name}"


def validate_core(doc, version):
    """Validates one object against the strict core schema; returns an error or None."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except ValidationError as err:
        path = ".".join(str(p) for p in err.path) or "(top)"
        return f"{path}: {err.message}"
    except SchemaNotFoundError as err:
        return f"no schema (unknown kind or apiVersion): {err.message}"
    except InvalidSchemaError as err:
        return f"schema unreadable: {err.message}"
    except VersionNotSupportedError as err:
        sys.exit(f"kubernetes-validate has no schemas for Kubernetes {err.version}")
    return None


def check_document(doc, version):
    """Validates one document; returns (status, detail) with status ok, skip or FAIL."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return "FAIL", "not a Kubernetes object (no apiVersion or kind)"
    group = doc["apiVersion"].rpartition("/")[0]
    if group in AGENT_SANDBOX_KINDS:
        if doc["kind"] not in AGENT_SANDBOX_KINDS[group]:
            return "FAIL", f"{doc['kind']} is not an agent-sandbox kind of {group}"
        if doc["kind"] == "SandboxTemplate":
            template = (doc.get("spec") or {}).get("podTemplate") or {}
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": template.get("metadata") or {"name": "template"},
                "spec": template.get("spec"),
            }
            pod["metadata"].setdefault("name", "template")
            error = validate_core(pod, version)
            if error:
                return "FAIL", f"spec.podTemplate as a Pod: {error}"
            return "skip", "agent-sandbox CRD, no core schema (its pod template passed as a Pod)"
        return "skip", "agent-sandbox CRD, no core schema"
    error = validate_core(doc, version)
    if error:
        return "FAIL", error
    return "ok", ""


def denies_all(policy, label):
    """Whether a NetworkPolicy selects every pod with `label` and lets nothing in or out."""
    spec = policy.get("spec") or {}
    selector = spec.get("podSelector") or {}
    selects = not selector.get("matchLabels") and selector.get("matchExpressions") == [
        {"key": label, "operator": "Exists"}
    ]
    return (
        selects
        and sorted(spec.get("policyTypes") or []) == ["Egress", "Ingress"]
        and not spec.get("ingress")
        and not spec.get("egress")
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", required=True)
    parser.add_argument(
        "--sandbox-label",
        help="require a deny-all NetworkPolicy selecting pods with this label key",
    )
    parser.add_argument("files", nargs="+")
    args = parser.parse_args()

    failed = 0
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as file:
                docs = [d for d in yaml.safe_load_all(file) if d is not None]
        except (OSError, yaml.YAMLError) as err:
            print(f"FAIL {path}: cannot read: {err}")
            failed += 1
            continue
        if not docs:
            print(f"FAIL {path}: no objects")
            failed += 1
        for doc in docs:
            status, detail = check_document(doc, args.kubernetes_version)
            label = describe(doc) if isinstance(doc, dict) else "?"
            print(f"{status:4} {path}: {label}" + (f": {detail}" if detail else ""))
            failed += status == "FAIL"
        if args.sandbox_label:
            policies = [
                d
                for d in docs
                if isinstance(d, dict) and d.get("kind") == "NetworkPolicy"
            ]
            if any(denies_all(p, args.sandbox_label) for p in policies):
                print(f"ok   {path}: sandbox pods ({args.sandbox_label}) denied all traffic")
            else:
                print(
                    f"FAIL {path}: no NetworkPolicy denies all ingress and egress to pods "
                    f"labelled {args.sandbox_label}"
                )
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
