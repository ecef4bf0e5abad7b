"""The Kubernetes examples (examples/kubernetes/*.yaml) are valid and wired to muster's contract.

Validation runs tests/containers/k8s_check.py in a small cached virtualenv with kubernetes-validate
(from PyPI, created on first use like the PyTorch one): core kinds against the Kubernetes schema,
CRD kinds (PyTorchJob, JobSet, Volcano Job, Trainer v2 ClusterTrainingRuntime and TrainJob) against
closed structural schemas with their pod/job templates validated as core kinds, and muster's own
rules: flags, grace period, probes only on endpoints examples/kubernetes/README.md documents as
independent of other pods, the restricted securityContext, the NetworkPolicy, exit codes in failure
policies, and a per-API simulation of what a preempted pod's exit code does to its job (never
success, never a consumed backoff budget where the API can avoid it). The mutation tests prove
each rule rejects a mistake.
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
# Its endpoint table says which endpoints depend on other pods: the one place the probes rule reads.
PROBE_DOC = EXAMPLES / "README.md"
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


def check(k8s_python: str, *files: Path, probe_doc: Path = PROBE_DOC) -> dict:
    proc = subprocess.run(
        [k8s_python, str(CHECKER), "--exit-codes", str(EXIT_CODES), "--probe-doc", str(probe_doc),
         "--k8s-version", K8S_VERSION, *map(str, files)],
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
    assert {"PyTorchJob", "JobSet", "Job", "Service", "NetworkPolicy", "ClusterTrainingRuntime",
            "TrainJob"} <= kinds
    texts = "\n".join(m.read_text() for m in MANIFESTS)
    assert "schedulerName: volcano" in texts and "kueue.x-k8s.io/queue-name" in texts
    # An Indexed Job with a spare (more pods than --nnodes), completed by node 0's success.
    assert (EXAMPLES / "indexed-job-spares.yaml") in MANIFESTS and "succeededIndexes" in texts


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(results, manifest):
    r = results[str(manifest)]
    assert not r["errors"], "\n".join(r["errors"])
    # Something was really validated: every document, and every embedded pod or job template.
    docs = len([d for d in re.split(r"^---$", manifest.read_text(), flags=re.M) if "kind:" in d])
    assert len(r["validated"]) >= docs, r["validated"]


# Each mutation is one realistic mistake; the checker must name it.
MUTATIONS = [
    ("indexed-job.yaml", "publishNotReadyAddresses: true", "publishNotReadyAdresses: true",
     "publishNotReadyAdresses"),  # core kind, strict OpenAPI schema
    ("indexed-job.yaml", "values: [202, 209]", "values: [222, 209]", "222"),  # not a muster code
    ("indexed-job.yaml", "action: FailJob", "action: Count", "should be FailJob"),
    # A crash loop (209) left to the default Count: the Job would recreate the pod into it.
    ("jobset.yaml", "values: [202, 209]", "values: [202]", "(NO_PROGRESS) should be FailJob"),
    ("indexed-job.yaml", "- --rdzv-endpoint=llm-train-0.", "- --rdzv-endpont=llm-train-0.",
     "--rdzv-endpont"),
    ("indexed-job.yaml", "- --rdzv-endpoint=llm-train-0.", "- --rdzv-endpoint=llm-train-1.",
     "pod 0's headless name"),
    ("jobset.yaml", "terminationGracePeriodSeconds: 90", "terminationGracePeriodSeconds: 30",
     "!= muster grace period"),
    ("jobset.yaml", "action: FailJobSet", "action: FailJobset", "FailJobset"),  # CRD enum
    ("jobset.yaml", "name: config_error_is_final", "name: config-error-is-final",
     "does not match"),  # CRD pattern: a rule name has no hyphens
    ("jobset.yaml", "          backoffLimit: 0", "          backofLimit: 0", "backofLimit"),  # embedded Job
    ("pytorchjob.yaml", "  runPolicy:", "  runPolicies:", "runPolicies"),  # CRD field
    ("pytorchjob.yaml", "              livenessProbe:", "              livenesProbe:",
     "livenesProbe"),  # pod template inside a CRD
    ("volcano-job.yaml", "  minAvailable: 3", "  minAvailible: 3", "minAvailible"),
    ("volcano-job.yaml", "- exitCode: 202\n          action: TerminateJob",
     "- exitCode: 202\n          action: RestartJob", "config error"),
    ("indexed-job-kueue.yaml", "prometheus.io/port: \"8000\"", "prometheus.io/port: \"9000\"",
     "prometheus.io/port"),
    ("trainer-v2.yaml", "  runtimeRef:", "  runtimeReference:", "runtimeReference"),  # TrainJob
    ("trainer-v2.yaml", "    torch: {}", "    pytorch: {}", "pytorch"),  # runtime's mlPolicy
    ("trainer-v2.yaml", "                    - name: node\n", "                    - name: trainer\n",
     "container `node`"),
    ("trainer-v2.yaml", "  trainer:\n    numNodes: 3", "  trainer:\n    env: [{name: PET_NNODES, value: \"3\"}]\n    numNodes: 3",
     "webhook rejects"),
    # Spares (#32): without a success policy on index 0, a spare still waiting hangs the Job.
    ("indexed-job-spares.yaml", "  successPolicy:\n    rules:\n      - succeededIndexes: \"0\"\n", "",
     "wait as spares"),
    ("indexed-job-spares.yaml", 'succeededIndexes: "0"', 'succeededIndexes: "0-3"', "wait as spares"),
    ("indexed-job-spares.yaml", "  parallelism: 4", "  parallelism: 3", "run alongside the gang"),
    ("indexed-job-spares.yaml", "- succeededIndexes:", "- succeedIndexes:", "succeedIndexes"),
    ("indexed-job-spares.yaml", "- --nnodes=3", "- --nnodes=5", "but the job has 4 pods"),
]

# What a preempted pod's exit code does to each API (#12): never success, never a budget.
PREEMPTION_MUTATIONS = [
    # A user asks for 0: the Job counts the pod as a completion.
    ("indexed-job.yaml", "            - name: MUSTER_GRACE_PERIOD\n",
     "            - name: MUSTER_PREEMPTED_EXIT_CODE\n              value: \"0\"\n"
     "            - name: MUSTER_GRACE_PERIOD\n", "would be taken as success by Job"),
    ("volcano-job.yaml", "              env:\n",
     "              env:\n                - name: MUSTER_PREEMPTED_EXIT_CODE\n                  value: \"0\"\n",
     "would be taken as success by Volcano"),
    ("pytorchjob.yaml", "              args: [/workspace/train.py]\n",
     "              args: [--preempted-exit-code=0, /workspace/train.py]\n",
     "would be taken as success by PyTorchJob"),
    # 201 without its Ignore rule: counted towards backoffLimit.
    ("indexed-job.yaml", "values: [200, 201]", "values: [200]",
     "exit code 201 would consume Job's backoff budget"),
    # In a JobSet whose Job has backoffLimit 0 a counted 200 restarts the whole JobSet.
    ("jobset.yaml", "values: [200, 201]", "values: [201]",
     "exit code 200 would consume JobSet's backoff budget"),
    ("trainer-v2.yaml", "values: [200, 201]", "values: [201]",
     "exit code 200 would consume TrainJob's backoff budget"),
    # A preempted code the operator's ExitCode treats as permanent.
    ("pytorchjob.yaml", "              args: [/workspace/train.py]\n",
     "              args: [--preempted-exit-code=100, /workspace/train.py]\n",
     "exit code 100 would fail the PyTorchJob"),
    ("pytorchjob.yaml", "      restartPolicy: ExitCode", "      restartPolicy: OnFailure",
     "would consume PyTorchJob's backoff budget"),
    ("volcano-job.yaml", "        - exitCode: 201\n          action: RestartJob",
     "        - exitCode: 201\n          action: CompleteJob", "201 would be taken as success by Volcano"),
]

# The probes (#23), the restricted container (#21) and the NetworkPolicy (#12).
POD_MUTATIONS = [
    ("jobset.yaml", "path: /readyz", "path: /gangz", "documented as depending on other pods"),
    ("pytorchjob.yaml", "path: /readyz", "path: /ready", "not documented as independent"),
    ("indexed-job.yaml", "            readOnlyRootFilesystem: true\n", "",
     "readOnlyRootFilesystem must be true"),
    ("volcano-job.yaml", "                allowPrivilegeEscalation: false\n",
     "                allowPrivilegeEscalation: true\n", "allowPrivilegeEscalation must be false"),
    ("trainer-v2.yaml", "                          drop: [ALL]\n", "                          drop: [NET_RAW]\n",
     "must drop ALL"),
    ("indexed-job-kueue.yaml", "            runAsNonRoot: true\n            runAsUser: 1000\n            runAsGroup: 1000\n            allowPrivilegeEscalation",
     "            runAsNonRoot: true\n            runAsUser: 0\n            runAsGroup: 1000\n            allowPrivilegeEscalation",
     "non-zero UID"),
    ("jobset.yaml", "                    - name: tmp\n                      mountPath: /tmp\n", "",
     "no emptyDir mounted at /tmp"),
    ("pytorchjob.yaml", "                medium: Memory\n", "", "memory-medium emptyDir"),
    ("indexed-job.yaml", "        - namespaceSelector:\n            matchLabels:\n              kubernetes.io/metadata.name: monitoring\n",
     "        - namespaceSelector: {}\n", "namespaceSelector admits other"),
    ("jobset.yaml", "      ports:\n        - protocol: TCP\n          port: 8000\n", "",
     "may reach port 8000 only"),
    ("volcano-job.yaml", "              volcano.sh/job-name: llm-vc\n    - from:",
     "              app: other\n    - from:", "admits pods outside the job"),
    ("trainer-v2.yaml", "      jobset.sigs.k8s.io/jobset-name: llm-tj\n  policyTypes",
     "      jobset.sigs.k8s.io/jobset-name: llm-other\n  policyTypes", "expected one NetworkPolicy"),
]


@pytest.mark.parametrize("name,old,new,expect", MUTATIONS + PREEMPTION_MUTATIONS + POD_MUTATIONS,
                         ids=[m[3] for m in MUTATIONS + PREEMPTION_MUTATIONS + POD_MUTATIONS])
def test_checker_rejects_mistakes(k8s_python, tmp_path, name, old, new, expect):
    text = (EXAMPLES / name).read_text()
    assert old in text, f"mutation target {old!r} not in {name}"
    broken = tmp_path / name
    broken.write_text(text.replace(old, new, 1))
    errors = check(k8s_python, broken)[str(broken)]["errors"]
    assert any(expect in e for e in errors), errors


def test_every_example_has_a_network_policy_and_hardened_trainer():
    """Cheap guard next to the checker: each file with a muster workload holds a NetworkPolicy
    and runs the trainer with a read-only root (the checker validates both in depth)."""
    for m in MANIFESTS:
        text = m.read_text()
        assert "kind: NetworkPolicy" in text, m.name
        assert text.count("readOnlyRootFilesystem: true") >= text.count('command: ["muster"]'), m.name


def test_the_probe_doc_decides_which_endpoints_a_probe_may_use(k8s_python, tmp_path):
    """The allowed set comes from the README's endpoint table: marking /readyz as depending on
    other pods there makes every example's readiness probe an error."""
    doc = PROBE_DOC.read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `/readyz`"))
    cells = row.split("|")
    cells[3] = " **yes** "
    changed = tmp_path / "README.md"
    changed.write_text(doc.replace(row, "|".join(cells)))
    results = check(k8s_python, *MANIFESTS, probe_doc=changed)
    for m in MANIFESTS:
        errors = results[str(m)]["errors"]
        assert any("readinessProbe GET /readyz is documented as depending on other pods" in e
                   for e in errors), (m.name, errors)


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
