"""The router examples (docker/router/: compose and Kubernetes) against the CLI and each other, so they cannot
silently rot: every kernelsight command line in them parses with kernelsight's own parser, the replicas publish
KV events on distinct topics and ports, the router names exactly the replicas, and the endpoint picker's
settings (selector, port, block size, hash seed, topic filter, ZeroMQ port) match the pods it scores; in the P/D
example (compose-pd.yaml) vllm-router's --prefill and --decode URLs name the prefill and decode services and ports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

pytest.importorskip("fastapi")

from kernelsight.cli import build_parser  # noqa: E402
from kernelsight.server.integrations.kv_events.config import endpoint_binds  # noqa: E402

ROUTER = Path(__file__).resolve().parents[1] / "docker" / "router"
K8S = ROUTER / "k8s"


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def parse(parser, argv: list[str], where: str):
    """``kernelsight ARGV`` as the CLI parses it; an unknown or malformed flag fails naming its source."""
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: `kernelsight {' '.join(argv)}` does not parse") from exc


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


# == compose ===================================================================================================
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROUTER / "compose.yaml").read_text())["services"]


@pytest.fixture(scope="module")
def replicas(compose, parser) -> dict:
    out = {}
    for name, s in compose.items():
        if s.get("image") == "kernelsight:local" and "entrypoint" not in s:
            out[name] = parse(parser, ["serve", *s["command"]], f"compose {name}")
    return out


def test_compose_replicas_publish_kv_events_on_distinct_topics_and_host_ports(compose, replicas):
    assert len(replicas) >= 2
    topics = set()
    for name, ns in replicas.items():
        kv = ns.kv_events_config
        assert kv is not None and kv.enable_kv_cache_events and kv.publisher == "zmq", name
        assert endpoint_binds(kv.endpoint), f"{name}: the PUB socket binds in its container"
        topics.add(kv.topic)
        published = {int(p.split(":")[1]) for p in compose[name]["ports"]}
        assert {ns.port, endpoint_port(kv.endpoint), endpoint_port(kv.replay_endpoint)} == published, name
        assert compose[name]["environment"]["PYTHONHASHSEED"] == "0", f"{name}: block hashes must be reproducible"
    assert len(topics) == len(replicas)
    host_ports = [p.split(":")[0] for s in compose.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"


def test_compose_router_names_exactly_the_replicas(compose, replicas):
    router = compose["router"]
    assert router["image"].startswith("lmcache/lmstack-router:")
    cmd = router["command"]
    opt = {cmd[i]: cmd[i + 1] for i in range(len(cmd) - 1) if cmd[i].startswith("--") and
           not cmd[i + 1].startswith("--")}
    assert opt["--service-discovery"] == "static"
    assert opt["--routing-logic"] in ("roundrobin", "session", "kvaware", "prefixaware")
    backends = [urlparse(u) for u in opt["--static-backends"].split(",")]
    assert {(b.hostname, b.port) for b in backends} == {(name, ns.port) for name, ns in replicas.items()}
    models = opt["--static-models"].split(",")
    assert len(models) == len(backends)
    by_host = {name: ns.model_tag or ns.model for name, ns in replicas.items()}
    assert [by_host[b.hostname] for b in backends] == models
    assert set(router["depends_on"]) == set(replicas)
    # the router reads the pre-0.12 metric names, which the replicas must bring back
    assert all(ns.show_hidden_metrics_for_version for ns in replicas.values())


def test_compose_load_goes_through_the_router(compose, parser):
    load = compose["load"]
    assert load["entrypoint"] == ["kernelsight", "bench"]
    ns = parse(parser, ["bench", *load["command"]], "compose load")
    url = urlparse(ns.base_url)
    router_port = int(compose["router"]["command"][compose["router"]["command"].index("--port") + 1])
    assert (url.hostname, url.port) == ("router", router_port)


# == compose, prefill/decode behind vllm-router =================================================================
@pytest.fixture(scope="module")
def compose_pd() -> dict:
    return yaml.safe_load((ROUTER / "compose-pd.yaml").read_text())["services"]


@pytest.fixture(scope="module")
def pd_instances(compose_pd, parser) -> dict:
    return {name: parse(parser, ["serve", *s["command"]], f"compose-pd {name}") for name, s in compose_pd.items()
            if s.get("image") == "kernelsight:local" and "entrypoint" not in s}


def _router_opts(cmd: list[str]) -> dict[str, list[str]]:
    """vllm-router's command line as {flag: [values...]} (--prefill and --decode repeat)."""
    out: dict[str, list[str]] = {}
    for i, arg in enumerate(cmd):
        if arg.startswith("--"):
            vals = out.setdefault(arg, [])
            if i + 1 < len(cmd) and not cmd[i + 1].startswith("--"):
                vals.append(cmd[i + 1])
    return out


def test_compose_pd_instances_run_the_nixl_connector(compose_pd, pd_instances):
    assert set(pd_instances) == {"prefill", "decode"}
    for name, ns in pd_instances.items():
        cfg = ns.kv_transfer_config
        assert cfg is not None and cfg.kv_connector == "NixlConnector" and cfg.kv_role == "kv_both", name
        assert [int(p.split(":")[1]) for p in compose_pd[name]["ports"]] == [ns.port], name
        assert ns.model == pd_instances["prefill"].model and ns.max_model_len == pd_instances["prefill"].max_model_len
    # the decode side notifies the prefill side at the remote_host it was handed: a name it can resolve
    assert compose_pd["prefill"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "prefill"
    assert pd_instances["decode"].kv_transfer_link is not None
    host_ports = [p.split(":")[0] for s in compose_pd.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), "two services publish the same host port"


def test_compose_pd_router_sends_prefill_and_decode_to_the_right_services(compose_pd, pd_instances):
    router = compose_pd["router"]
    assert "pip install --no-cache-dir vllm-router==" in router["build"]["dockerfile_inline"]
    assert 'ENTRYPOINT ["vllm-router"]' in router["build"]["dockerfile_inline"]
    opt = _router_opts(router["command"])
    assert "--vllm-pd-disaggregation" in opt and opt["--kv-connector"] == ["nixl"]
    for flag, name in (("--prefill", "prefill"), ("--decode", "decode")):
        (url,) = [urlparse(u) for u in opt[flag]]
        assert (url.scheme, url.hostname, url.port) == ("http", name, pd_instances[name].port), flag
    assert opt["--policy"][0] in ("random", "round_robin", "cache_aware", "kv_aware", "power_of_two",
                                  "consistent_hash", "sticky_least_loaded")
    published = {int(p.split(":")[1]) for p in router["ports"]}
    assert {int(opt["--port"][0]), int(opt["--prometheus-port"][0])} == published
    assert set(router["depends_on"]) == set(pd_instances)


def test_compose_pd_load_goes_through_the_router(compose_pd, parser):
    load = compose_pd["load"]
    assert load["entrypoint"] == ["kernelsight", "bench"]
    ns = parse(parser, ["bench", *load["command"]], "compose-pd load")
    url = urlparse(ns.base_url)
    assert (url.hostname, url.port) == ("router", int(_router_opts(compose_pd["router"]["command"])["--port"][0]))


# == Kubernetes ================================================================================================
@pytest.fixture(scope="module")
def k8s() -> dict:
    docs = {}
    for f in ("kernelsight-pool.yaml", "httproute.yaml"):
        for d in yaml.safe_load_all((K8S / f).read_text()):
            docs[(d["kind"], d["metadata"]["name"])] = d
    return docs


@pytest.fixture(scope="module")
def epp() -> dict:
    return yaml.safe_load((K8S / "epp-values.yaml").read_text())


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args, for the variables the container defines."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.fixture(scope="module")
def pod(k8s, parser):
    dep = k8s[("Deployment", "kernelsight-pool")]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value", "10.0.0.7") for e in c["env"]}     # a field ref resolves to a pod IP
    ns = parse(parser, ["serve", *[_expand(a, env) for a in c["args"]]], "k8s kernelsight-pool")
    return dep, c, env, ns


def test_k8s_pods_push_kv_events_to_the_epp_service(pod, epp):
    dep, c, env, ns = pod
    kv = ns.kv_events_config
    assert kv.enable_kv_cache_events and kv.publisher == "zmq"
    host = urlparse(kv.endpoint.replace("tcp://", "http://")).hostname
    assert not endpoint_binds(kv.endpoint), "the EPP binds; each pod connects to it"
    assert host == f"{dep['metadata']['name']}-epp", "the chart names the EPP Service <release>-epp"
    zmq_ports = {p["port"] for p in epp["inferenceExtension"]["extraServicePorts"] if p["name"] == "zmq"}
    assert zmq_ports == {endpoint_port(kv.endpoint)}
    assert kv.topic == "kv@10.0.0.7@meta-llama/Llama-3.1-8B", "the topic names the pod once $(POD_IP) expands"


def test_k8s_epp_scores_the_pods_with_their_own_hashing(pod, epp):
    dep, c, env, ns = pod
    labels = dep["spec"]["template"]["metadata"]["labels"]
    pool = epp["inferencePool"]
    assert pool["modelServers"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["targetPorts"]] == [ns.port] == [p["containerPort"] for p in c["ports"]]
    cfg = yaml.safe_load(epp["inferenceExtension"]["pluginsCustomConfig"]["precise-prefix-cache-config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in cfg["plugins"]}
    scorer = plugins["precise-prefix-cache-scorer"]
    assert scorer["tokenProcessorConfig"]["blockSize"] == ns.block_size
    assert scorer["tokenProcessorConfig"]["hashSeed"] == env["PYTHONHASHSEED"]
    assert scorer["indexerConfig"]["tokenizersPoolConfig"]["modelName"] == (ns.model_tag or ns.model)
    assert ns.kv_events_config.topic.startswith(scorer["kvEventsConfig"]["topicFilter"])
    assert endpoint_binds(scorer["kvEventsConfig"]["zmqEndpoint"])
    refs = {r["pluginRef"] for prof in cfg["schedulingProfiles"] for r in prof["plugins"]}
    assert refs <= set(plugins) and "precise-prefix-cache-scorer" in refs


def test_k8s_route_targets_the_pool(k8s, pod):
    dep = pod[0]
    route = k8s[("HTTPRoute", "kernelsight-pool")]
    refs = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert [(b["kind"], b["name"]) for b in refs] == [("InferencePool", dep["metadata"]["name"])]


def test_kv_events_json_in_the_examples_is_what_vllm_takes():
    """The JSON strings are the ones a vLLM pod would be given: the same keys vLLM's KVEventsConfig has."""
    allowed = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
               "max_queue_size", "topic"}
    texts = [(ROUTER / "compose.yaml").read_text(), (K8S / "kernelsight-pool.yaml").read_text()]
    found = [json.loads(m) for t in texts for m in re.findall(r"'(\{\"enable_kv_cache_events\".*?\})'", t)]
    assert len(found) >= 4
    for cfg in found:
        assert set(cfg) <= allowed
