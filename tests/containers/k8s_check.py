"""Validates the Kubernetes manifests of examples/kubernetes/, run under a venv with
kubernetes-validate (tests/python/test_k8s_manifests.py makes one).

  python k8s_check.py --exit-codes agent/src/exit_code.rs --k8s-version 1.33.0 FILE...

Prints one JSON object: {file: {"errors": [...], "validated": [...], "flags": [...], "env": [...]}}.

Three layers, each of which fails on a typo:
1. Core kinds (Service, Job, ...) against the Kubernetes OpenAPI schema, strictly (unknown fields
   are errors), with kubernetes-validate.
2. CRD kinds (PyTorchJob, JobSet, Volcano Job) against hand-written schemas of the fields their Go
   types define (kubeflow/training-operator v1, kubernetes-sigs/jobset v1alpha2, volcano-sh
   batch/v1alpha1), closed to unknown fields; their embedded pod and job templates are then
   validated with layer 1 (as a v1 PodTemplate or a batch/v1 Job).
3. muster's own contract on every pod template: muster is the command, its flags and MUSTER_*
   variables exist, the grace period is wired, probes and Prometheus annotations are on port 8000,
   the rendezvous endpoint is pod 0's headless name, the exit codes in failure policies are the
   reserved ones documented in agent/src/exit_code.rs, with the actions README.md explains.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

# torchrun's flags (PyTorch 2.15, dash spelling) that muster accepts, plus muster's own.
MUSTER_FLAGS = {
    "--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id",
    "--rdzv-conf", "--standalone", "--max-restarts", "--monitor-interval", "--role", "--module",
    "--no-python", "--log-dir", "--redirects", "--tee", "--local-ranks-filter",
    "--log-line-prefix-template", "--master-addr", "--master-port", "--local-addr",
    "--shutdown-timeout", "--signals-to-handle",
    "--grace-period", "--metrics-addr", "--log-format",
}
MUSTER_ENV = {"MUSTER_GRACE_PERIOD", "MUSTER_PREEMPTED_EXIT_CODE", "MUSTER_METRICS_ADDR"}
PET_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
           "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_ID", "PET_RDZV_CONF", "PET_MAX_RESTARTS"}
METRICS_PORT = 8000
RDZV_PORT = 29500
CORE_KINDS = {("v1", "Service"), ("batch/v1", "Job"), ("v1", "ConfigMap"), ("v1", "PodTemplate")}

# What each reserved code should make the Job controller do (README.md explains each choice).
JOB_ACTIONS = {"PREEMPTED_CHECKPOINTED": "Ignore", "CHECKPOINT_ABORTED": "Ignore",
               "CONFIG_ERROR": "FailJob", "RENDEZVOUS_TIMEOUT": "Count", "UNHEALTHY_GPU": "Count",
               "STORE_HOST_LOST": "Ignore", "INTERNAL_ERROR": "Count"}
VOLCANO_FINAL = {"TerminateJob", "AbortJob"}


def obj(props: dict, required=(), extra=False) -> dict:
    return {"type": "object", "properties": props, "required": list(required),
            "additionalProperties": extra}


STR, INT, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
ANYOBJ = {"type": "object"}
STRS = {"type": "array", "items": STR}
META = obj({"name": STR, "namespace": STR, "labels": {"type": "object"},
            "annotations": {"type": "object"}}, required=["name"])
TEMPLATE = ANYOBJ  # embedded templates are validated by kubernetes-validate afterwards


def enum(*values) -> dict:
    return {"enum": list(values)}


PYTORCHJOB = obj({
    "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "PyTorchJob"}, "metadata": META,
    "spec": obj({
        "runPolicy": obj({
            "cleanPodPolicy": enum("All", "Running", "None"), "ttlSecondsAfterFinished": INT,
            "activeDeadlineSeconds": INT, "backoffLimit": INT, "suspend": BOOL, "managedBy": STR,
            "schedulingPolicy": obj({"minAvailable": INT, "queue": STR, "minResources": ANYOBJ,
                                     "priorityClass": STR, "scheduleTimeoutSeconds": INT}),
        }),
        "elasticPolicy": obj({
            "minReplicas": INT, "maxReplicas": INT, "rdzvBackend": STR, "rdzvPort": INT,
            "rdzvHost": STR, "rdzvId": STR, "standalone": BOOL, "nProcPerNode": INT,
            "maxRestarts": INT, "metrics": {"type": "array"},
            "rdzvConf": {"type": "array", "items": obj({"key": STR, "value": STR})},
        }),
        "nprocPerNode": STR,
        "pytorchReplicaSpecs": {
            "type": "object", "propertyNames": enum("Master", "Worker"), "minProperties": 1,
            "additionalProperties": obj({
                "replicas": INT, "template": TEMPLATE,
                "restartPolicy": enum("Always", "OnFailure", "Never", "ExitCode"),
            }, required=["template"]),
        },
    }, required=["pytorchReplicaSpecs"]),
}, required=["apiVersion", "kind", "metadata", "spec"])

JOBSET = obj({
    "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"}, "kind": {"const": "JobSet"},
    "metadata": META,
    "spec": obj({
        "replicatedJobs": {"type": "array", "minItems": 1, "items": obj({
            "name": STR, "replicas": INT, "template": TEMPLATE, "dependsOn": {"type": "array"},
        }, required=["name", "template"])},
        "network": obj({"enableDNSHostnames": BOOL, "subdomain": STR,
                        "publishNotReadyAddresses": BOOL}),
        "successPolicy": obj({"operator": enum("All", "Any"), "targetReplicatedJobs": STRS},
                             required=["operator"]),
        "failurePolicy": obj({
            "maxRestarts": INT, "restartStrategy": enum("Recreate", "BlockingRecreate"),
            "rules": {"type": "array", "items": obj({
                "name": STR,
                "action": enum("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"),
                "onJobFailureReasons": {"type": "array", "items": enum(
                    "BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                    "MaxFailedIndexesExceeded", "PodFailurePolicy")},
                "onJobFailureMessagePatterns": STRS, "targetReplicatedJobs": STRS,
            }, required=["name", "action"])},
        }),
        "startupPolicy": obj({"startupPolicyOrder": enum("AnyOrder", "InOrder")}),
        "suspend": BOOL, "managedBy": STR, "ttlSecondsAfterFinished": INT,
        "coordinator": obj({"replicatedJob": STR, "jobIndex": INT, "podIndex": INT}),
    }, required=["replicatedJobs"]),
}, required=["apiVersion", "kind", "metadata", "spec"])

VOLCANO_POLICY = obj({
    "action": enum("AbortJob", "RestartJob", "RestartTask", "RestartPod", "TerminateJob",
                   "CompleteJob", "ResumeJob"),
    "event": enum("*", "PodPending", "PodRunning", "PodFailed", "PodEvicted", "Unknown",
                  "TaskCompleted", "TaskFailed", "JobUnknown", "OutOfSync", "CommandIssued",
                  "JobUpdated"),
    "events": {"type": "array"}, "exitCode": INT, "timeout": STR,
}, required=["action"])
VOLCANO_JOB = obj({
    "apiVersion": {"const": "batch.volcano.sh/v1alpha1"}, "kind": {"const": "Job"},
    "metadata": META,
    "spec": obj({
        "schedulerName": STR, "minAvailable": INT, "queue": STR, "maxRetry": INT,
        "ttlSecondsAfterFinished": INT, "priorityClassName": STR, "minSuccess": INT,
        "runningEstimate": STR, "volumes": {"type": "array"},
        "plugins": {"type": "object", "additionalProperties": STRS,
                    "propertyNames": enum("svc", "env", "ssh", "pytorch", "tensorflow", "mpi")},
        "policies": {"type": "array", "items": VOLCANO_POLICY},
        "tasks": {"type": "array", "minItems": 1, "items": obj({
            "name": STR, "replicas": INT, "minAvailable": INT, "maxRetry": INT,
            "policies": {"type": "array", "items": VOLCANO_POLICY}, "template": TEMPLATE,
            "topologyPolicy": STR, "dependsOn": ANYOBJ,
        }, required=["name", "template"])},
    }, required=["tasks"]),
}, required=["apiVersion", "kind", "metadata", "spec"])

CRDS = {("kubeflow.org/v1", "PyTorchJob"): PYTORCHJOB,
        ("jobset.x-k8s.io/v1alpha2", "JobSet"): JOBSET,
        ("batch.volcano.sh/v1alpha1", "Job"): VOLCANO_JOB}


def reserved_codes(exit_code_rs: Path) -> dict[str, int]:
    """The reserved exit codes (>= 200) documented in agent/src/exit_code.rs, by constant name."""
    found = re.findall(r"pub const ([A-Z_]+): u8 = (\d+);", exit_code_rs.read_text())
    return {name: int(v) for name, v in found if int(v) >= 200}


class Checker:
    def __init__(self, codes: dict[str, int], k8s_version: str) -> None:
        self.codes = codes
        self.by_value = {v: k for k, v in codes.items()}
        self.version = k8s_version

    # layer 1
    def core(self, doc: dict, where: str, errors: list, validated: list) -> None:
        try:
            kubernetes_validate.validate(doc, self.version, strict=True)
            validated.append(where)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(str(p) for p in exc.absolute_path)
            errors.append(f"{where}: {exc.message} (at {path or '.'})")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{where}: kubernetes-validate has no schema for {doc.get('kind')}")

    def pod_template(self, tpl: dict, where: str, errors, validated) -> None:
        self.core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                   "template": tpl}, where, errors, validated)

    # layer 3
    def muster_pod(self, tpl: dict, where: str, ctx: dict, errors: list, used: dict) -> str | None:
        """Checks muster's contract on a pod template; returns the muster container's name."""
        spec = tpl.get("spec", {})
        ann = tpl.get("metadata", {}).get("annotations", {})
        want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
                "prometheus.io/path": "/metrics"}
        for k, v in want.items():
            if ann.get(k) != v:
                errors.append(f"{where}: annotation {k} must be {v!r}, is {ann.get(k)!r}")
        musters = [c for c in spec.get("containers", []) if (c.get("command") or [""])[0] == "muster"]
        if len(musters) != 1:
            errors.append(f"{where}: expected one container with command [muster], found {len(musters)}")
            return None
        c = musters[0]
        args = [str(a) for a in c.get("args", [])]
        flags = {}
        script = None
        for a in args:
            if not a.startswith("-"):
                script = a
                break
            name, _, value = a.partition("=")
            flags[name] = value
            used["flags"].add(name)
            if name not in MUSTER_FLAGS:
                errors.append(f"{where}: unknown muster flag {name}")
        if not script or not (script.endswith(".py") or "--module" in flags):
            errors.append(f"{where}: muster args name no training script")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        for name in env:
            if name.startswith("MUSTER_"):
                used["env"].add(name)
                if name not in MUSTER_ENV:
                    errors.append(f"{where}: unknown muster variable {name}")
            if name.startswith("PET_") and name not in PET_ENV:
                errors.append(f"{where}: unknown torchrun variable {name}")
        # The grace period: the pod's, repeated for muster (a pod cannot read its own).
        tgps = spec.get("terminationGracePeriodSeconds")
        grace = flags.get("--grace-period") or env.get("MUSTER_GRACE_PERIOD")
        if tgps is None or grace is None:
            errors.append(f"{where}: terminationGracePeriodSeconds and --grace-period/MUSTER_GRACE_PERIOD must both be set")
        elif str(tgps) != str(grace):
            errors.append(f"{where}: terminationGracePeriodSeconds {tgps} != muster grace period {grace}")
        pre = env.get("MUSTER_PREEMPTED_EXIT_CODE")
        if pre is not None and int(pre) != self.codes.get("PREEMPTED_CHECKPOINTED"):
            errors.append(f"{where}: MUSTER_PREEMPTED_EXIT_CODE {pre} is not the reserved "
                          f"{self.codes.get('PREEMPTED_CHECKPOINTED')}")
        ports = {p.get("containerPort") for p in c.get("ports", [])}
        if METRICS_PORT not in ports:
            errors.append(f"{where}: container port {METRICS_PORT} (metrics) missing")
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            http = c.get(probe, {}).get("httpGet", {})
            if http.get("path") != path or http.get("port") != METRICS_PORT:
                errors.append(f"{where}: {probe} must be GET {path} on port {METRICS_PORT}")
        # The job's shape.
        if ctx.get("endpoint") is not None:
            if "--nnodes" in flags and flags["--nnodes"] != str(ctx["nodes"]):
                errors.append(f"{where}: --nnodes={flags['--nnodes']} but the job has {ctx['nodes']} pods")
            if flags.get("--rdzv-endpoint") != ctx["endpoint"]:
                errors.append(f"{where}: --rdzv-endpoint={flags.get('--rdzv-endpoint')} is not pod 0's "
                              f"headless name {ctx['endpoint']}")
            if RDZV_PORT not in ports:
                errors.append(f"{where}: container port {RDZV_PORT} (rendezvous) missing")
        return c.get("name")

    def pod_failure_policy(self, job_spec: dict, container: str | None, where: str, errors) -> None:
        pfp = job_spec.get("podFailurePolicy")
        if not pfp:
            errors.append(f"{where}: no podFailurePolicy")
            return
        if job_spec.get("template", {}).get("spec", {}).get("restartPolicy") != "Never":
            errors.append(f"{where}: podFailurePolicy needs restartPolicy Never")
        seen: dict[int, str] = {}
        disruption = None
        for rule in pfp.get("rules", []):
            for cond in rule.get("onPodConditions", []):
                if cond.get("type") == "DisruptionTarget":
                    disruption = disruption or rule.get("action")
            oec = rule.get("onExitCodes")
            if not oec:
                continue
            if oec.get("containerName") != container:
                errors.append(f"{where}: onExitCodes.containerName {oec.get('containerName')!r} "
                              f"is not the muster container {container!r}")
            for code in oec.get("values", []):
                if code not in self.by_value:
                    errors.append(f"{where}: exit code {code} is not one of muster's reserved codes "
                                  f"{sorted(self.by_value)}")
                    continue
                seen.setdefault(code, rule.get("action"))
        if disruption != "Ignore":
            errors.append(f"{where}: pods with the DisruptionTarget condition must be ignored")
        for name, code in self.codes.items():
            want = JOB_ACTIONS.get(name)
            if want and seen.get(code) != want:
                errors.append(f"{where}: exit code {code} ({name}) should be {want}, is {seen.get(code)}")

    def check_doc(self, doc: dict, docs: list, where: str, errors, validated, used) -> None:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in CRDS:
            for err in jsonschema.Draft7Validator(CRDS[key]).iter_errors(doc):
                path = "/".join(str(p) for p in err.absolute_path)
                errors.append(f"{where}: {err.message} (at {path or '.'})")
            validated.append(f"{where} (structural)")
        elif key in CORE_KINDS:
            self.core(doc, where, errors, validated)
        else:
            errors.append(f"{where}: no validator for {key}")
            return
        name = doc.get("metadata", {}).get("name", "")
        spec = doc.get("spec", {})
        if key == ("batch/v1", "Job"):
            tspec = spec.get("template", {}).get("spec", {})
            sub = tspec.get("subdomain")
            svc = next((d for d in docs if d.get("kind") == "Service"
                        and d["metadata"].get("name") == sub), None)
            if svc is None:
                errors.append(f"{where}: no headless Service named by subdomain {sub!r}")
            else:
                s = svc.get("spec", {})
                if s.get("clusterIP") != "None" or s.get("publishNotReadyAddresses") is not True:
                    errors.append(f"{where}: Service {sub} must be headless with publishNotReadyAddresses")
                if s.get("selector", {}).get("batch.kubernetes.io/job-name") != name:
                    errors.append(f"{where}: Service {sub} does not select the Job's pods")
            if spec.get("completionMode") != "Indexed":
                errors.append(f"{where}: completionMode must be Indexed (JOB_COMPLETION_INDEX)")
            if "kueue.x-k8s.io/queue-name" in doc["metadata"].get("labels", {}) and spec.get("suspend") is not True:
                errors.append(f"{where}: a Kueue job is created suspended")
            ctx = {"nodes": spec.get("completions"), "endpoint": f"{name}-0.{sub}:{RDZV_PORT}"}
            c = self.muster_pod(spec.get("template", {}), f"{where} pod", ctx, errors, used)
            self.pod_failure_policy(spec, c, where, errors)
        elif key == ("jobset.x-k8s.io/v1alpha2", "JobSet"):
            net = spec.get("network", {})
            if net.get("publishNotReadyAddresses") is not True:
                errors.append(f"{where}: network.publishNotReadyAddresses must be true")
            sub = net.get("subdomain", name)
            for rj in spec.get("replicatedJobs", []):
                jt = rj.get("template", {})
                jw = f"{where} replicatedJobs[{rj.get('name')}]"
                self.core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
                           "spec": jt.get("spec", {})}, jw, errors, validated)
                js = jt.get("spec", {})
                ctx = {"nodes": js.get("completions", 1) * rj.get("replicas", 1),
                       "endpoint": f"{name}-{rj.get('name')}-0-0.{sub}:{RDZV_PORT}"}
                c = self.muster_pod(js.get("template", {}), f"{jw} pod", ctx, errors, used)
                self.pod_failure_policy(js, c, jw, errors)
        elif key == ("kubeflow.org/v1", "PyTorchJob"):
            for role, rs in spec.get("pytorchReplicaSpecs", {}).items():
                rw = f"{where} {role}"
                tpl = rs.get("template", {})
                self.pod_template(tpl, rw, errors, validated)
                c = self.muster_pod(tpl, f"{rw} pod", {"endpoint": None}, errors, used)
                if c != "pytorch":
                    errors.append(f"{rw}: the operator needs the training container named 'pytorch'")
                ports = {p.get("name"): p.get("containerPort")
                         for ct in tpl.get("spec", {}).get("containers", []) for p in ct.get("ports", [])}
                if ports.get("pytorchjob-port") != RDZV_PORT:
                    errors.append(f"{rw}: port 'pytorchjob-port' must be {RDZV_PORT} (PET_MASTER_PORT)")
        elif key == ("batch.volcano.sh/v1alpha1", "Job"):
            if spec.get("schedulerName") != "volcano":
                errors.append(f"{where}: schedulerName must be volcano")
            nodes = sum(t.get("replicas", 1) for t in spec.get("tasks", []))
            if spec.get("minAvailable") != nodes:
                errors.append(f"{where}: minAvailable {spec.get('minAvailable')} != {nodes} pods (gang)")
            svc = spec.get("plugins", {}).get("svc")
            if svc is None or "--publish-not-ready-addresses=true" not in svc:
                errors.append(f"{where}: the svc plugin must publish not-ready addresses")
            policies = list(spec.get("policies", []))
            if not any(p.get("event") == "PodEvicted" for p in policies):
                errors.append(f"{where}: no policy for PodEvicted")
            for t in spec.get("tasks", []):
                tw = f"{where} task {t.get('name')}"
                self.pod_template(t.get("template", {}), tw, errors, validated)
                ctx = {"nodes": nodes, "endpoint": f"{name}-{t.get('name')}-0.{name}:{RDZV_PORT}"}
                self.muster_pod(t.get("template", {}), f"{tw} pod", ctx, errors, used)
                by_code = {}
                for p in policies + list(t.get("policies", [])):
                    if "exitCode" in p and ("event" in p or "events" in p):
                        errors.append(f"{tw}: a policy has both exitCode and event")
                    if "exitCode" in p:
                        if p["exitCode"] not in self.by_value:
                            errors.append(f"{tw}: exit code {p['exitCode']} is not one of muster's reserved codes")
                        by_code.setdefault(p["exitCode"], p["action"])
                if by_code.get(self.codes["CONFIG_ERROR"]) not in VOLCANO_FINAL:
                    errors.append(f"{tw}: exit code {self.codes['CONFIG_ERROR']} (config error) must end the job")
                for n in ("PREEMPTED_CHECKPOINTED", "RENDEZVOUS_TIMEOUT"):
                    if by_code.get(self.codes[n]) != "RestartJob":
                        errors.append(f"{tw}: exit code {self.codes[n]} ({n}) should restart the job")

    def check_file(self, path: Path) -> dict:
        errors, validated, used = [], [], {"flags": set(), "env": set()}
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as exc:
            return {"errors": [f"{path.name}: not YAML: {exc}"], "validated": [], "flags": [], "env": []}
        for i, doc in enumerate(docs):
            where = f"{path.name}#{i} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            self.check_doc(doc, docs, where, errors, validated, used)
        return {"errors": errors, "validated": validated, "flags": sorted(used["flags"]),
                "env": sorted(used["env"])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exit-codes", required=True, type=Path)
    ap.add_argument("--k8s-version", default="1.33.0")
    ap.add_argument("files", nargs="+", type=Path)
    a = ap.parse_args()
    codes = reserved_codes(a.exit_codes)
    if not codes:
        print(json.dumps({"error": f"no reserved exit codes found in {a.exit_codes}"}))
        return 1
    checker = Checker(codes, a.k8s_version)
    print(json.dumps({str(f): checker.check_file(f) for f in a.files}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
