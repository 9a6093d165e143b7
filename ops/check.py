"""Consistency checks of the ops stack files (run by scripts/test.sh; docker is not needed).

- docker-compose.yml parses; every file it mounts exists in the repository;
- every stage that serves metrics (--metrics-addr HOST:PORT) is discovered in
  prometheus.yml on that port, and every discovered name is such a stage;
- Grafana's provisioning points at the folders compose mounts, and the datasource uid is
  the one the dashboard's datasource variable resolves to (the default datasource);
- `promtool check config` accepts prometheus.yml;
- every stage is found by DNS service discovery (all replicas of a scaled service);
- .dockerignore leaves the build output, virtual environments and runs out of the context;
- docker-compose.sentinel.yml overrides only stages the base file has, mounts files that
  exist, and its stages' `redis+sentinel://` URL names every sentinel service and the
  primary name sentinel.conf monitors.
"""
import json
import pathlib
import re
import shutil
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"


def fail(msg):
    print(f"ops check failed: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    compose = yaml.safe_load((OPS / "docker-compose.yml").read_text())
    prom = yaml.safe_load((OPS / "prometheus.yml").read_text())
    services = compose["services"]
    for want in ["redis", "prometheus", "grafana", "feed", "gen", "score", "train"]:
        if want not in services:
            fail(f"docker-compose.yml has no `{want}` service")

    # Mounted files exist (paths are relative to ops/).
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                if not (OPS / src).resolve().exists():
                    fail(f"service {name} mounts {src}, which does not exist")
        build = svc.get("build")
        if build:
            ctx = (OPS / build["context"]).resolve()
            if not (ctx / build["dockerfile"]).exists():
                fail(f"service {name} builds from a missing {build['dockerfile']}")

    # Stage metrics ports == Prometheus targets.
    served = {}
    for name, svc in services.items():
        cmd = svc.get("command") or []
        text = " ".join(cmd) if isinstance(cmd, list) else cmd
        m = re.search(r"--metrics-addr[ =](\S+):(\d+)", text)
        if m:
            served[f"{name}:{m.group(2)}"] = name
    targets = set()
    for job in prom["scrape_configs"]:
        if job.get("static_configs"):
            fail("static targets see one replica of a scaled stage (`--scale gen=3`): "
                 "find the stages with dns_sd_configs")
        for sd in job.get("dns_sd_configs", []):
            if sd.get("type") != "A" or "port" not in sd:
                fail("each dns_sd_config must ask for A records and give the stage's port")
            for name in sd["names"]:
                targets.add(f"{name}:{sd['port']}")
        for rl in job.get("relabel_configs", []):
            if rl.get("target_label") == "stage":
                fail("a target label named `stage` would clash with the metrics' own `stage` label")
    if set(served) != targets:
        fail(f"stages serving metrics {sorted(served)} != prometheus targets {sorted(targets)}")
    for stage in ["gen", "score", "train"]:
        if not any(v == stage for v in served.values()):
            fail(f"stage {stage} does not serve metrics in docker-compose.yml")

    # The image is built from the repository root: the build context must leave out build
    # output, virtual environments and runs (gigabytes), or every build sends them.
    ignore = ROOT / ".dockerignore"
    if not ignore.exists():
        fail("no .dockerignore at the repository root: `docker compose build` would send target/ as context")
    patterns = {line.strip().rstrip("/") for line in ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    for want in ["target", ".venv", "runs", ".git"]:
        if want not in patterns and f"/{want}" not in patterns:
            fail(f".dockerignore does not leave out {want}/")

    # Grafana provisioning matches the mounts.
    graf = services["grafana"]["volumes"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in graf}
    if mounts.get("/etc/grafana/provisioning") != "../grafana/provisioning":
        fail("grafana must mount ../grafana/provisioning at /etc/grafana/provisioning")
    prov = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/rlstream.yml").read_text())
    path = prov["providers"][0]["options"]["path"]
    if mounts.get(path) != "../grafana/dashboards":
        fail(f"dashboard provider reads {path}, but grafana mounts the dashboards elsewhere")
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    source = ds["datasources"][0]
    if not source.get("isDefault") or source["type"] != "prometheus":
        fail("the provisioned Prometheus datasource must be the default (the dashboard variable resolves to it)")
    if not source["url"].startswith("http://prometheus:"):
        fail("the datasource must point at the compose `prometheus` service")
    dash = json.loads((ROOT / "grafana/dashboards/rlstream.json").read_text())
    var = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    if not var or var[0]["query"] != "prometheus":
        fail("the dashboard needs a prometheus datasource variable")

    promtool = shutil.which("promtool")
    if promtool is None:
        fail("promtool not found: run scripts/setup-prometheus.sh")
    r = subprocess.run([promtool, "check", "config", str(OPS / "prometheus.yml")],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"promtool check config:\n{r.stdout}{r.stderr}")
    check_sentinel(services)
    print(f"ops files consistent: {len(services)} services, targets {sorted(targets)}")


def check_sentinel(base):
    over = yaml.safe_load((OPS / "docker-compose.sentinel.yml").read_text())["services"]
    sentinels = sorted(n for n in over if n.startswith("sentinel-"))
    if len(sentinels) < 3:
        fail("docker-compose.sentinel.yml needs three sentinels (a quorum of 2 that survives one)")
    monitor = re.search(r"^sentinel monitor (\S+) (\S+) (\d+) (\d+)$",
                        (OPS / "sentinel.conf").read_text(), re.M)
    if not monitor or monitor.group(2) not in base:
        fail("sentinel.conf must monitor the compose `redis` service")
    for name, svc in over.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith(".") and not (OPS / src).resolve().exists():
                fail(f"service {name} mounts {src}, which does not exist")
        env = svc.get("environment")
        if name in ["feed", "gen", "score", "train"]:
            if name not in base:
                fail(f"docker-compose.sentinel.yml overrides `{name}`, which the base file lacks")
            url = (env or {}).get("RLSTREAM__REDIS", "")
            m = re.fullmatch(r"redis\+sentinel://([^/]+)/(\S+)", url)
            hosts = sorted(h.split(":")[0] for h in m.group(1).split(",")) if m else []
            if not m or hosts != sentinels or m.group(2) != monitor.group(1):
                fail(f"{name}'s RLSTREAM__REDIS `{url}` must name {sentinels} and `{monitor.group(1)}`")


if __name__ == "__main__":
    main()
