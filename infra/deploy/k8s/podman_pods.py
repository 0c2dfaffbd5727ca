"""Run the Kubernetes manifests' pods with plain podman, where `podman kube play` stops.

    python -m infra.deploy.k8s.podman_pods up [--prefix polark8s]   # prints the network
    python -m infra.deploy.k8s.podman_pods down [--prefix polark8s]

podman 4.3's kube play runs no StatefulSet, implements no Service, and publishes every
container port on the host (infra/deploy/README.md). This plays the controllers' part
on one machine, from the same files: every replica of every Deployment and StatefulSet
becomes a podman pod (StatefulSet pods named ``<set>-<i>``) on one network, reachable
by the names Kubernetes DNS would give it (``<pod>.<service>`` for a StatefulSet's
headless Service, the Service's name for what a Service selects: podman network
aliases); env as the kubelet builds it (ConfigMap ``envFrom``, Secret and pod-name
refs, ``$(VAR)`` expansion, in commands too); a podman volume per volume claim and per
``emptyDir``; containers restarted when they exit. Not played: probes, rolling
updates, rescheduling, anything else a controller does after the pods start.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
ORDER = ("nats", "valkey", "valkey-sentinel")  # the backbone first, as a readiness gate would


def load(directory: Path = K8S) -> list[dict]:
    return [
        d for f in sorted(directory.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d
    ]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` substitution (unknown names are left as written)."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def container_env(c: dict, pod: str, configmaps: dict, secrets: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        ref = e["valueFrom"]
        if "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "metadata.name", ref
            env[e["name"]] = pod
        else:
            key = ref["secretKeyRef"]
            env[e["name"]] = secrets[key["name"]][key["key"]]
    return env


def aliases(workload: dict, pod: str, services: list[dict]) -> list[str]:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    names = []
    for svc in services:
        selector = svc["spec"].get("selector", {})
        if selector and all(labels.get(k) == v for k, v in selector.items()):
            name = svc["metadata"]["name"]
            headless = svc["spec"].get("clusterIP") == "None"
            names.append(f"{pod}.{name}" if headless else name)
    return names


def pod_commands(docs: list[dict], image: str, prefix: str) -> list[list[str]]:
    """The podman commands that start every pod (in order)."""
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    secrets = {
        d["metadata"]["name"]: d.get("stringData", {}) for d in docs if d["kind"] == "Secret"
    }
    services = [d for d in docs if d["kind"] == "Service"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    workloads.sort(key=lambda w: ORDER.index(n) if (n := w["metadata"]["name"]) in ORDER else 9)
    net = f"{prefix}-net"
    cmds = []
    for w in workloads:
        name, spec = w["metadata"]["name"], w["spec"]
        for i in range(spec.get("replicas", 1)):
            pod = f"{name}-{i}"  # a Deployment's pods get a hash in Kubernetes; fine here
            alias = [a for n in aliases(w, pod, services) for a in ("--network-alias", n)]
            cmds.append(["podman", "pod", "create", "--name", f"{prefix}-{pod}",
                         "--hostname", pod, "--network", net, *alias])  # fmt: skip
            claims = [t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])]
            volumes = claims + [v["name"] for v in spec["template"]["spec"].get("volumes", [])]
            for c in spec["template"]["spec"]["containers"]:
                env = container_env(c, pod, configmaps, secrets)
                # restarted when it exits, as the kubelet would (restartPolicy: Always)
                args = ["podman", "run", "-d", "--pod", f"{prefix}-{pod}", "--restart", "always",
                        "--name", f"{prefix}-{pod}-{c['name']}"]  # fmt: skip
                for k, v in env.items():
                    args += ["-e", f"{k}={v}"]
                for m in c.get("volumeMounts", []):
                    assert m["name"] in volumes, m
                    args += ["-v", f"{prefix}-{pod}-{m['name']}:{m['mountPath']}"]
                image_ = image if c["image"] == "localhost/polar:latest" else c["image"]
                args += [image_, *(expand(a, env) for a in c["command"])]
                cmds.append(args)
    return cmds


def up(image: str, prefix: str) -> str:
    net = f"{prefix}-net"
    subprocess.run(["podman", "network", "create", net], check=True, capture_output=True)
    for cmd in pod_commands(load(), image, prefix):
        subprocess.run(cmd, check=True, capture_output=True)
    return net


def _remove_named(kind: str, list_verb: str, prefix: str) -> None:
    """Every podman ``kind`` (pod, volume) whose name starts with ``prefix-``."""
    names = subprocess.run(
        ["podman", kind, list_verb, "-q", "--filter", f"name=^{prefix}-"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    if names:
        subprocess.run(["podman", kind, "rm", "-f", *names], capture_output=True)


def down(prefix: str) -> None:
    _remove_named("pod", "ps", prefix)
    _remove_named("volume", "ls", prefix)
    subprocess.run(["podman", "network", "rm", "-f", f"{prefix}-net"], capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("up", "down", "print"))
    ap.add_argument("--prefix", default="polark8s")
    ap.add_argument("--image", default="localhost/polar:latest")
    args = ap.parse_args(argv)
    if args.action == "up":
        print(up(args.image, args.prefix))
    elif args.action == "down":
        down(args.prefix)
    else:
        for cmd in pod_commands(load(), args.image, args.prefix):
            print(" ".join(cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
