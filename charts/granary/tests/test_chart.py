"""Renders charts/granary with real Helm code (helm-python-sdk embeds Helm v4) for the
default values and every value set in ci/, lints it in strict mode, validates every
manifest against the Kubernetes 1.30 schemas (kubernetes-validate, offline, strict), and
checks what the manifests say: peers, cache paths, the FUSE mount's propagation, no
secret in a ConfigMap, the schema's refusals, and that every granary command and flag the
chart uses is one the binary accepts.

    python charts/granary/tests/test_chart.py GRANARY_BIN

Exit 0 when every check holds; each failure is printed with the value set it came from.
"""

import base64
import json
import os
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import helm_python as helm
import kubernetes_validate as kv
import yaml
from helm_python import _native

CHART = Path(__file__).resolve().parent.parent
KUBE = "v1.30.0"
NAMESPACE = "ml"
RELEASE = "granary"
# Kinds of CRDs the chart may render (cert-manager, Prometheus operator): no schema in
# kubernetes-validate; checked for their required fields here instead.
CRDS = {
    "cert-manager.io/v1/Certificate": ["secretName", "issuerRef"],
    "cert-manager.io/v1/Issuer": [],
    "monitoring.coreos.com/v1/ServiceMonitor": ["selector", "endpoints"],
}
FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
    return cond


def load_values(name):
    if name == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / name).read_text()) or {}


def render(values):
    """{template path: [manifest dicts]} for the values, at Kubernetes 1.30 with the CRD
    APIs available."""
    opts = {
        "name": RELEASE,
        "namespace": NAMESPACE,
        "kube_version": KUBE,
        "api_versions": list(CRDS),
    }
    with helm.Chart.load(str(CHART)) as ch:
        raw = _native.call_string("helm_render", ch._raw(), json.dumps(values), json.dumps(opts))
    out = {}
    for path, text in json.loads(raw).items():
        if path.endswith(".yaml"):
            out[path] = [d for d in yaml.safe_load_all(text) if d]
    return out


def manifests(rendered):
    return [d for docs in rendered.values() for d in docs]


def find(docs, kind, suffix):
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return hits[0] if len(hits) == 1 else None


def container(workload, name):
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def config_of(docs):
    cm = find(docs, "ConfigMap", "-config")
    return cm["data"]["granary.toml"], tomllib.loads(cm["data"]["granary.toml"])


def validate_kubernetes(label, docs):
    for d in docs:
        key = f'{d["apiVersion"]}/{d["kind"]}'
        try:
            kv.validate(d, KUBE.lstrip("v"), strict=True)
        except kv.SchemaNotFoundError as e:
            if check(key in CRDS, f"{label}: no schema for {key}: {e.message}"):
                for field in CRDS[key]:
                    check(field in d.get("spec", {}), f"{label}: {key} {d['metadata']['name']} lacks spec.{field}")
        except kv.ValidationError as e:
            path = ".".join(map(str, e.path))
            FAILURES.append(f"{label}: {key} {d['metadata'].get('name')}: {path}: {e.message}")


def lint(label, values):
    r = helm.lint(str(CHART), values, strict=True, kube_version=KUBE, namespace=NAMESPACE)
    check(r["total_charts_linted"] == 1, f"{label}: lint did not lint the chart: {r}")
    check(not r["errors"], f"{label}: helm lint --strict: {r['errors']}")


def check_masters(label, values, docs):
    n = values.get("master", {}).get("replicas", 3)
    text, cfg = config_of(docs)
    sts = find(docs, "StatefulSet", "-master")
    svc = find(docs, "Service", "-master")
    check(sts["spec"]["replicas"] == n, f"{label}: StatefulSet replicas {sts['spec']['replicas']} != {n}")
    check(sts["spec"]["podManagementPolicy"] == "Parallel", f"{label}: masters must start in parallel")
    check(svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"],
          f"{label}: the masters' Service must be headless and publish unready pods")
    peers = cfg["master"]["peers"]
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    want = {str(i + 1): f"{name}-{i}.{service}.{NAMESPACE}.svc:{cfg_port(cfg)}" for i in range(n)}
    check(peers == want, f"{label}: --peers {peers} != {want}")
    check(cfg["masters"].split(",") == list(want.values()),
          f"{label}: clients' masters {cfg['masters']} != the peers")
    pdb = find(docs, "PodDisruptionBudget", "-master")
    if n == 1:
        check(pdb is None, f"{label}: a PDB for one master would block every drain")
    else:
        check(pdb is not None and pdb["spec"]["minAvailable"] == n // 2 + 1,
              f"{label}: the PDB must keep a quorum of {n // 2 + 1}")
    c = container(sts, "master")
    probe = c["readinessProbe"]["httpGet"]
    check(probe["path"] == "/ready", f"{label}: masters' readiness is not /ready")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    check(mounts.get("data") == cfg["master"]["data-dir"], f"{label}: the master's data dir is not its PVC")
    check(cfg["master"]["secrets-key-file"].startswith(mounts.get("secrets-key", "?") + "/"),
          f"{label}: the secrets key file is not mounted")
    check_master_identities(label, values, docs, sts, c, n)


def check_master_identities(label, values, docs, sts, c, n):
    """Masters and workers are distinct identities: each master runs with the master
    certificate of its own id (never the workers' node certificate)."""
    tls = values.get("tls", {})
    if not tls.get("enabled", True):
        return
    prefix = tls.get("secrets", {}).get("master", "granary-master-tls")
    node = tls.get("secrets", {}).get("node", "granary-node-tls")
    vol = next(v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    sources = vol.get("projected", {}).get("sources", [])
    names = [s["secret"]["name"] for s in sources]
    check(names == [f"{prefix}-{i}" for i in range(1, n + 1)],
          f"{label}: the masters' TLS volume holds {names}, not one master Secret per id")
    check(node not in names, f"{label}: masters mount the workers' node identity")
    for s in sources:
        i = s["secret"]["name"].rsplit("-", 1)[1]
        paths = sorted(it["path"] for it in s["secret"]["items"])
        check(paths == [f"master-{i}/{f}" for f in ("ca.crt", "tls.crt", "tls.key")],
              f"{label}: master {i}'s files are at {paths}")
    script = c["args"][0]
    check('--tls-dir "/etc/granary/tls/master-$(( ${HOSTNAME##*-} + 1 ))"' in script
          and '--id "$(( ${HOSTNAME##*-} + 1 ))"' in script,
          f"{label}: a master does not use the identity of its own id: {script}")
    check(not any(e["name"] == "GRANARY_TLS_DIR" for e in c.get("env", [])),
          f"{label}: GRANARY_TLS_DIR on masters (they name their own --tls-dir)")
    if tls.get("certManager", {}).get("enabled"):
        certs = [d for d in docs if d["kind"] == "Certificate"]
        for i in range(1, n + 1):
            cert = [d for d in certs if d["spec"]["secretName"] == f"{prefix}-{i}"]
            ok = len(cert) == 1
            spec = cert[0]["spec"] if ok else {}
            check(ok and spec.get("uris") == [f"granary:master:{i}"]
                  and spec["subject"]["organizationalUnits"] == ["master"]
                  and "granary-master" in spec.get("dnsNames", []),
                  f"{label}: no master certificate for master {i}: {spec}")
        worker = [d for d in certs if d["spec"]["secretName"] == node]
        check(len(worker) == 1 and worker[0]["spec"]["subject"]["organizationalUnits"] == ["node"]
              and "granary-master" not in worker[0]["spec"].get("dnsNames", [])
              and not worker[0]["spec"].get("uris"),
              f"{label}: the workers' certificate could pose as a master: {worker}")


def cfg_port(cfg):
    return cfg["master"]["listen"].rsplit(":", 1)[1]


def check_worker(label, values, docs):
    text, cfg = config_of(docs)
    ds = find(docs, "DaemonSet", "-worker")
    c = container(ds, "worker")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    tiers = (values.get("worker", {}).get("tiers")) or {}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]["tiers"]
    enabled = {k: {**defaults[k], **tiers.get(k, {})} for k in defaults}
    enabled = {k: v for k, v in enabled.items() if v["enabled"]}
    check(len(cfg["worker"]["tier"]) == len(enabled), f"{label}: tiers {cfg['worker']['tier']} != {list(enabled)}")
    for t in cfg["worker"]["tier"]:
        kind, path, size = t.split(":")
        vol = vols.get(mounts.get(path, "?"))
        if not check(vol is not None, f"{label}: tier {t}: {path} is not mounted in the worker"):
            continue
        key = {"mem": "memory", "ssd": "nvme", "hdd": "hdd"}[kind]
        check(size == enabled[key]["size"], f"{label}: tier {t} size != {enabled[key]['size']}")
        if kind == "mem":
            check(vol.get("emptyDir", {}).get("medium") == "Memory", f"{label}: the memory tier is not a Memory emptyDir")
            check(vol["emptyDir"].get("sizeLimit") == size.removesuffix("B"), f"{label}: memory tier sizeLimit")
        else:
            check(vol.get("hostPath", {}).get("path") == enabled[key]["hostPath"],
                  f"{label}: tier {t} is not on host path {enabled[key]['hostPath']}")
    check(mounts.get(cfg["worker"]["cache-dir"]) is not None, f"{label}: the worker's cache-dir is not mounted")
    mem = int(enabled["memory"]["size"].removesuffix("GiB")) if "memory" in enabled else 0
    overhead = values.get("worker", {}).get("memoryOverheadGiB", 2)
    want = f"{mem + overhead}Gi"
    res = c["resources"]
    check(res["requests"]["memory"] == want and res["limits"]["memory"] == want,
          f"{label}: worker memory {res} != {want} (memory tier + overhead)")
    env = {e["name"]: e for e in c["env"]}
    check(env["GRANARY_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName",
          f"{label}: the worker's node name is not the node's")


def check_fuse(label, values, docs):
    _, cfg = config_of(docs)
    ds = find(docs, "DaemonSet", "-fuse")
    spec = ds["spec"]["template"]["spec"]
    c = container(ds, "fuse")
    vols = {v["name"]: v for v in spec["volumes"]}
    at = cfg["fuse"]["mount"]
    m = [v for v in c["volumeMounts"] if v["mountPath"] == at]
    check(len(m) == 1 and m[0].get("mountPropagation") == "Bidirectional",
          f"{label}: the mount point {at} is not mounted with Bidirectional propagation")
    if m:
        check(vols[m[0]["name"]]["hostPath"]["path"] == at, f"{label}: the mount point is not the host path")
    dev = [v for v in c["volumeMounts"] if v["mountPath"] == "/dev/fuse"]
    check(len(dev) == 1 and vols[dev[0]["name"]]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"},
          f"{label}: /dev/fuse is not passed to the FUSE pod")
    check(c["securityContext"].get("privileged") is True, f"{label}: the FUSE pod is not privileged")
    # The mount outlives its daemon: a supervisor replaces a crashed one, and a new pod takes
    # the node's mount over from the old one (the handover socket's host folder is shared),
    # started beside it; no preStop unmount (it would unmount the new pod's mount).
    args = c["args"]
    check("--supervise" in args and "--wait-after-handover" in args
          and args[args.index("--takeover") + 1] == "auto" if "--takeover" in args else False,
          f"{label}: the FUSE pod does not run --supervise --takeover auto --wait-after-handover: {args}")
    sock = [v for v in c["volumeMounts"] if v["mountPath"] == "/run/granary/fuse"]
    check(len(sock) == 1 and vols[sock[0]["name"]]["hostPath"]["path"] == "/run/granary/fuse",
          f"{label}: the handover socket's folder is not the host's /run/granary/fuse")
    ru = ds["spec"]["updateStrategy"]["rollingUpdate"]
    check(ru.get("maxSurge") == 1 and ru.get("maxUnavailable") == 0,
          f"{label}: FUSE pods are not replaced by a new pod started beside the old one: {ru}")
    check("preStop" not in c.get("lifecycle", {}), f"{label}: a preStop hook would unmount the successor's mount")
    # The worker's block files at the path the worker reports (short-circuit reads).
    worker = find(docs, "DaemonSet", "-worker")
    wmounts = {v["mountPath"]: v["name"] for v in container(worker, "worker")["volumeMounts"]}
    wvols = {v["name"]: v for v in worker["spec"]["template"]["spec"]["volumes"]}
    fmounts = {v["mountPath"]: v["name"] for v in c["volumeMounts"]}
    for t in cfg["worker"]["tier"]:
        kind, path, _ = t.split(":")
        if kind != "mem" and "hostPath" in wvols[wmounts[path]]:
            check(path in fmounts and vols[fmounts[path]]["hostPath"]["path"] == wvols[wmounts[path]]["hostPath"]["path"],
                  f"{label}: the FUSE pod does not see the worker's tier {path}")


def check_csi(label, values, docs):
    """The CSI node plugin: its socket where the registrar tells the kubelet it is, binds
    made under the kubelet's folder reaching the host (Bidirectional), the node's mount seen
    as the FUSE pod makes it (HostToContainer), volumes held to the FUSE mount's write mode;
    a CSIDriver that needs no attach and never chowns the namespace."""
    csi_values = {**yaml.safe_load((CHART / "values.yaml").read_text())["csi"], **values.get("csi", {})}
    driver = find(docs, "CSIDriver", csi_values["driverName"])
    ds = find(docs, "DaemonSet", "-csi-node")
    if not csi_values["enabled"]:
        check(driver is None and ds is None, f"{label}: CSI objects rendered though csi.enabled is false")
        return
    if not check(driver is not None and ds is not None, f"{label}: no CSIDriver or CSI node DaemonSet"):
        return
    spec = driver["spec"]
    check(spec["attachRequired"] is False and spec["fsGroupPolicy"] == "None",
          f"{label}: the CSIDriver must need no attach and never chown: {spec}")
    modes = spec["volumeLifecycleModes"]
    check(modes == (["Persistent", "Ephemeral"] if csi_values["inlineVolumes"] else ["Persistent"]),
          f"{label}: lifecycle modes {modes}")
    _, cfg = config_of(docs)
    pod = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    c = container(ds, "csi")
    reg = container(ds, "node-driver-registrar")
    args = c["args"]
    arg = lambda flag: args[args.index(flag) + 1] if flag in args else None
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    sock = arg("--endpoint").removeprefix("unix://")
    sock_dir = mounts.get(os.path.dirname(sock))
    plugin_dir = f'{csi_values["kubeletDir"]}/plugins/{csi_values["driverName"]}'
    check(sock_dir is not None and vols[sock_dir["name"]]["hostPath"]["path"] == plugin_dir,
          f"{label}: the CSI socket {sock} is not in the host's {plugin_dir}")
    check(f"--kubelet-registration-path={plugin_dir}/csi.sock" in reg["args"]
          and f"--csi-address={sock}" in reg["args"],
          f"{label}: the registrar does not register the plugin's socket: {reg['args']}")
    regmounts = {m["mountPath"]: m["name"] for m in reg["volumeMounts"]}
    check(vols[regmounts.get("/registration", "?")]["hostPath"]["path"] == f'{csi_values["kubeletDir"]}/plugins_registry'
          if "/registration" in regmounts else False, f"{label}: the registrar cannot reach plugins_registry")
    kubelet = mounts.get(csi_values["kubeletDir"])
    check(kubelet is not None and kubelet.get("mountPropagation") == "Bidirectional",
          f"{label}: binds into pods' folders would not reach the host")
    at = cfg["fuse"]["mount"]
    check(arg("--mount") == at and mounts.get(at, {}).get("mountPropagation") == "HostToContainer"
          and vols[mounts[at]["name"]]["hostPath"]["path"] == at,
          f"{label}: the plugin does not see the node's mount {at} as the FUSE pod makes it")
    check(arg("--write-mode") == cfg["fuse"]["write-mode"] and arg("--driver-name") == csi_values["driverName"],
          f"{label}: the plugin's write mode or driver name differs from the chart's: {args}")
    check(c["securityContext"].get("privileged") is True, f"{label}: the CSI plugin cannot mount")
    check(pod.get("nodeSelector") == find(docs, "DaemonSet", "-fuse")["spec"]["template"]["spec"].get("nodeSelector"),
          f"{label}: the CSI plugin does not run on the FUSE mount's nodes")


def check_examples():
    """The example manifests validate, and name the chart's driver."""
    driver = yaml.safe_load((CHART / "values.yaml").read_text())["csi"]["driverName"]
    for path in sorted((CHART / "examples").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        label = f"examples/{path.name}"
        validate_kubernetes(label, docs)
        pvs = [d for d in docs if d["kind"] == "PersistentVolume"]
        check(len(pvs) >= 1, f"{label}: no PersistentVolume")
        for pv in pvs:
            check(pv["spec"]["csi"]["driver"] == driver and pv["spec"]["csi"]["volumeAttributes"]["path"].startswith("/"),
                  f"{label}: {pv['metadata']['name']} does not name the driver and a Granary folder")
        claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
        pods = [d for d in docs if d["kind"] == "Pod"]
        check(bool(pods) and all(v["persistentVolumeClaim"]["claimName"] in claims
                                 for p in pods for v in p["spec"]["volumes"] if "persistentVolumeClaim" in v),
              f"{label}: a pod uses a claim the example does not make")


def check_secrets(label, values, docs):
    """No Secret value in any ConfigMap; credentials reach the setup Job only by reference."""
    secrets = []
    for d in docs:
        if d["kind"] == "Secret":
            secrets += [base64.b64decode(v).decode() for v in (d.get("data") or {}).values()]
            secrets += list((d.get("stringData") or {}).values())
    cms = [json.dumps(d.get("data", {})) for d in docs if d["kind"] == "ConfigMap"]
    for s in secrets:
        check(len(s) >= 16, f"{label}: a generated secret is too short")
        check(not any(s in cm for cm in cms), f"{label}: a Secret value appears in a ConfigMap")
    job = find(docs, "Job", "-setup")
    for m in values.get("mounts", []):
        # Each value is one word of the script, whatever quotes it holds.
        words = shlex.split(container(job, "setup")["args"][0])
        check(any(words[i:i + 5] == ["granary", "mount", "add", m["path"], m["uri"]] for i in range(len(words))),
              f"{label}: the setup Job does not mount {m['uri']} at {m['path']} as given")
        for so in m.get("secretOptions", []):
            env = [e for e in container(job, "setup")["env"] if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == so["secretName"]]
            check(len(env) == 1 and env[0]["valueFrom"]["secretKeyRef"]["key"] == so["secretKey"],
                  f"{label}: {so['option']} does not come from Secret {so['secretName']}")
            script = container(job, "setup")["args"][0]
            words = shlex.split(script)
            pairs = set(zip(words, words[1:]))
            check(bool(env) and ("--option-env", f"{so['option']}={env[0]['name']}") in pairs,
                  f"{label}: mount add does not take {so['option']} from the environment")
    for d in docs:
        text = json.dumps(d)
        check("SECRET-VALUE" not in text, f"{label}: a secret from values leaked")
    key_secret = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-secrets-key")]
    existing = values.get("secretsKey", {}).get("existingSecret")
    if existing:
        check(not key_secret, f"{label}: a secrets key was generated though {existing} was given")
    else:
        check(len(key_secret) == 1 and key_secret[0]["metadata"]["annotations"].get("helm.sh/resource-policy") == "keep",
              f"{label}: the generated secrets key must be kept on uninstall")


def granary_commands(docs):
    """(where, argv after `granary`) of every granary invocation in the workloads."""
    out = []
    for d in docs:
        if d["kind"] not in ("StatefulSet", "DaemonSet", "Job", "Deployment"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            where = f'{d["kind"]} {d["metadata"]["name"]}/{c["name"]}'
            if c["name"] == "node-driver-registrar":
                continue  # Kubernetes' sidecar, not granary
            if "command" not in c:
                out.append((where, c.get("args", [])))  # the image's entrypoint is granary
                continue
            check(c["command"][:2] == ["/bin/sh", "-ec"], f"{where}: unexpected command {c['command']}")
            for line in c["args"][0].splitlines():
                words = shlex.split(line)
                if words[:1] == ["exec"]:
                    words = words[1:]
                if not words:
                    continue
                if check(words[0] == "granary", f"{where}: a script line that is not granary: {line}"):
                    out.append((where, words[1:]))
    return out


def check_commands(label, docs, granary_bin):
    text, _ = config_of(docs)
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp, "granary.toml")
        conf.write_text(text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRANARY_")}
        cmds = granary_commands(docs)
        check(len(cmds) >= 3, f"{label}: found only {cmds}")
        for where, argv in cmds:
            argv = [str(conf) if a == "/etc/granary/config/granary.toml" else a for a in argv]
            argv = ["1" if a.startswith("$") else a for a in argv]  # shell arithmetic
            # clap answers --help only when every flag before it exists (exit 2 otherwise);
            # --config is applied first, so an unknown key of the rendered file fails too.
            r = subprocess.run([granary_bin, *argv, "--help"], env=env, capture_output=True, text=True)
            check(r.returncode == 0, f"{label}: {where}: granary {' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")


def check_refusals(granary_bin):
    """Invalid values are refused by the schema with a message naming the value."""
    bad = [
        ({"master": {"replicas": 2}}, "/master/replicas"),
        ({"worker": {"tiers": {"nvme": {"enabled": True, "size": "500"}}}}, "/worker/tiers/nvme/size"),
        ({"worker": {"tiers": {"memory": {"enabled": True, "size": "8G"}}}}, "/worker/tiers/memory/size"),
        ({"fuse": {"maxMemory": "2048"}}, "/fuse/maxMemory"),
        ({"mounts": [{"path": "/s3", "uri": "s3://b", "options": {"secret_access_key": "SECRET-VALUE"}}]},
         "invalid propertyName 'secret_access_key'"),
        ({"fuse": {"writeMode": "write-back"}}, "/fuse/writeMode"),
        ({"master": {"replicaz": 3}}, "replicaz"),
        ({"csi": {"driverName": "Granary CSI"}}, "/csi/driverName"),
        # A line break would end the setup Job's script block (YAML in a value).
        ({"mounts": [{"path": "/s3", "uri": "s3://b\n  x: y"}]}, "/mounts/0/uri"),
        ({"mounts": [{"path": "/s3", "uri": "s3://b", "options": {"region": "a\n  x: y"}}]},
         "/mounts/0/options/region"),
    ]
    for values, where in bad:
        try:
            render(values)
            FAILURES.append(f"schema: {values} was accepted")
        except helm.HelmValuesError as e:
            check(where in str(e), f"schema: {values}: the message does not name {where}: {e}")
    # The Dockerfile's entrypoint is the binary the chart's args-only containers run.
    docker = (CHART.parent.parent / "Dockerfile").read_text()
    check('ENTRYPOINT ["granary"]' in docker, "Dockerfile: the entrypoint is not granary")


def check_dashboard():
    """Every metric the Grafana dashboard queries is one Granary exports (docs/metrics.md)."""
    import re
    dash = json.loads((CHART / "dashboards" / "granary.json").read_text())
    documented = (CHART.parent.parent / "docs" / "metrics.md").read_text()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {re.sub(r"_bucket$", "", n) for e in exprs for n in re.findall(r"granary_[a-z_]+", e)}
    check(len(names) >= 10, f"dashboard: only {names}")
    for n in sorted(names):
        check(n in documented, f"dashboard: {n} is not an exported metric (docs/metrics.md)")


def main():
    granary_bin = sys.argv[1]
    sets = ["default"] + sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
    for name in sets:
        values = load_values(name)
        rendered = render(values)
        docs = manifests(rendered)
        before = len(FAILURES)
        lint(name, values)
        validate_kubernetes(name, docs)
        check_masters(name, values, docs)
        check_worker(name, values, docs)
        check_fuse(name, values, docs)
        check_csi(name, values, docs)
        check_secrets(name, values, docs)
        check_commands(name, docs, granary_bin)
        kinds = sorted({d["kind"] for d in docs})
        print(f"{name}: {len(docs)} manifests ({', '.join(kinds)}): "
              f"{'ok' if len(FAILURES) == before else 'FAILED'}")
    check_refusals(granary_bin)
    check_dashboard()
    check_examples()
    for f in FAILURES:
        print("FAIL:", f)
    print(f"{len(sets)} value sets, {len(FAILURES)} failures")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
