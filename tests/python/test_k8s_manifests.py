"""The Kubernetes examples (examples/kubernetes/*.yaml) are valid and wired to muster's contract.

Validation runs tests/containers/k8s_check.py in a small cached virtualenv with kubernetes-validate
(from PyPI, created on first use like the PyTorch one): core kinds against the Kubernetes schema,
CRD kinds (PyTorchJob, JobSet, Volcano Job) against closed structural schemas with their pod/job
templates validated as core kinds, and muster's own rules (flags, grace period, probes, exit codes
in failure policies). The mutation tests prove each layer rejects a typo.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from conftest import REPO, muster_bin

sys.path.insert(0, str(REPO / "tests" / "containers"))
from muster_probes import Capabilities  # noqa: E402

pytestmark = pytest.mark.timeout(600)

EXAMPLES = REPO / "examples" / "kubernetes"
CHECKER = REPO / "tests" / "containers" / "k8s_check.py"
EXIT_CODES = REPO / "agent" / "src" / "exit_code.rs"
K8S_VALIDATE = "kubernetes-validate==1.37.0"
# Validate against the oldest Kubernetes the examples target: podFailurePolicy (GA 1.31) and
# Indexed Jobs' pod hostnames are all they need.
K8S_VERSION = "1.33.0"
MANIFESTS = sorted(EXAMPLES.glob("*.yaml"))


@pytest.fixture(scope="module")
def k8s_python() -> str:
    cache = Path(os.environ.get("MUSTER_CACHE_DIR")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "muster")
    env_dir = cache / "venv-k8s"
    python = env_dir / "bin" / "python"
    stamp = env_dir / ".muster-ready"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".venv-k8s.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test runs must not race the install
        if not (stamp.exists() and stamp.read_text() == K8S_VALIDATE):
            venv.EnvBuilder(clear=True, with_pip=True).create(env_dir)
            proc = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                 K8S_VALIDATE],
                capture_output=True, text=True, timeout=540, check=False,
            )
            if proc.returncode != 0:
                pytest.fail(f"installing {K8S_VALIDATE} failed: {proc.stderr[-2000:]}", pytrace=False)
            stamp.write_text(K8S_VALIDATE)
    return str(python)


def check(k8s_python: str, *files: Path) -> dict:
    proc = subprocess.run(
        [k8s_python, str(CHECKER), "--exit-codes", str(EXIT_CODES), "--k8s-version", K8S_VERSION,
         *map(str, files)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def results(k8s_python) -> dict:
    return check(k8s_python, *MANIFESTS)


def test_every_example_kind_is_present():
    kinds = set()
    for m in MANIFESTS:
        kinds.update(re.findall(r"^kind: (\w+)", m.read_text(), re.M))
    assert {"PyTorchJob", "JobSet", "Job", "Service"} <= kinds
    texts = "\n".join(m.read_text() for m in MANIFESTS)
    assert "schedulerName: volcano" in texts and "kueue.x-k8s.io/queue-name" in texts


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(results, manifest):
    r = results[str(manifest)]
    assert not r["errors"], "\n".join(r["errors"])
    # Something was really validated: every document, and every embedded pod or job template.
    docs = len([d for d in re.split(r"^---$", manifest.read_text(), flags=re.M) if "kind:" in d])
    assert len(r["validated"]) >= docs, r["validated"]


# Each mutation is one realistic typo; the checker must name it.
MUTATIONS = [
    ("indexed-job.yaml", "publishNotReadyAddresses: true", "publishNotReadyAdresses: true",
     "publishNotReadyAdresses"),  # core kind, strict OpenAPI schema
    ("indexed-job.yaml", "values: [202]", "values: [222]", "222"),  # not a muster code
    ("indexed-job.yaml", "action: FailJob", "action: Count", "should be FailJob"),
    ("indexed-job.yaml", "- --rdzv-endpoint=llm-train-0.", "- --rdzv-endpont=llm-train-0.",
     "--rdzv-endpont"),
    ("indexed-job.yaml", "- --rdzv-endpoint=llm-train-0.", "- --rdzv-endpoint=llm-train-1.",
     "pod 0's headless name"),
    ("jobset.yaml", "terminationGracePeriodSeconds: 90", "terminationGracePeriodSeconds: 30",
     "!= muster grace period"),
    ("jobset.yaml", "action: FailJobSet", "action: FailJobset", "FailJobset"),  # CRD enum
    ("jobset.yaml", "          backoffLimit: 0", "          backofLimit: 0", "backofLimit"),  # embedded Job
    ("pytorchjob.yaml", "  runPolicy:", "  runPolicies:", "runPolicies"),  # CRD field
    ("pytorchjob.yaml", "              livenessProbe:", "              livenesProbe:",
     "livenesProbe"),  # pod template inside a CRD
    ("volcano-job.yaml", "  minAvailable: 3", "  minAvailible: 3", "minAvailible"),
    ("volcano-job.yaml", "- exitCode: 202\n          action: TerminateJob",
     "- exitCode: 202\n          action: RestartJob", "config error"),
    ("indexed-job-kueue.yaml", "prometheus.io/port: \"8000\"", "prometheus.io/port: \"9000\"",
     "prometheus.io/port"),
]


@pytest.mark.parametrize("name,old,new,expect", MUTATIONS, ids=[m[3] for m in MUTATIONS])
def test_checker_rejects_typos(k8s_python, tmp_path, name, old, new, expect):
    text = (EXAMPLES / name).read_text()
    assert old in text, f"mutation target {old!r} not in {name}"
    broken = tmp_path / name
    broken.write_text(text.replace(old, new, 1))
    errors = check(k8s_python, broken)[str(broken)]["errors"]
    assert any(expect in e for e in errors), errors


@pytest.fixture(scope="module")
def caps() -> Capabilities:
    return Capabilities(muster_bin())


def muster_help() -> str:
    return subprocess.run([muster_bin(), "--help"], capture_output=True, text=True, timeout=30,
                          check=False).stdout


def test_flags_exist_in_the_muster_under_test(results, caps):
    """Every flag the examples pass is one `muster --help` documents."""
    caps.require("launch")
    text = muster_help()
    missing = [f"{Path(m).name}: {flag}" for m, r in results.items() for flag in r["flags"]
               if not re.search(rf"{re.escape(flag)}\b", text)]
    assert not missing, "used in examples but not in `muster --help`: " + ", ".join(missing)


def test_variables_exist_in_the_muster_under_test(results, caps):
    """Every MUSTER_* variable the examples set (the grace period, and the exit code of a preempted
    pod, which a Job needs to be non-zero) is one `muster --help` documents. Both belong to the
    preemption feature, so this switches on with it."""
    caps.require("launch", "preemption")
    text = muster_help()
    missing = [f"{Path(m).name}: {var}" for m, r in results.items() for var in r["env"]
               if not re.search(rf"\b{var}\b", text)]
    assert not missing, "set in examples but not in `muster --help`: " + ", ".join(missing)
