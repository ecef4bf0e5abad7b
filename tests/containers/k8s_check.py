"""Validates the Kubernetes manifests of examples/kubernetes/, run under a venv with
kubernetes-validate (tests/python/test_k8s_manifests.py makes one).

  python k8s_check.py --exit-codes agent/src/exit_code.rs --probe-doc examples/kubernetes/README.md \
      --k8s-version 1.33.0 FILE...

Prints one JSON object: {file: {"errors": [...], "validated": [...], "flags": [...], "env": [...]}}.

Three layers, each of which fails on a typo:
1. Core kinds (Service, Job, NetworkPolicy, ...) against the Kubernetes OpenAPI schema, strictly
   (unknown fields are errors), with kubernetes-validate.
2. CRD kinds (PyTorchJob, JobSet, Volcano Job, Trainer v2 ClusterTrainingRuntime and TrainJob)
   against hand-written schemas of the fields their Go types define (kubeflow/training-operator
   v1, kubernetes-sigs/jobset v1alpha2, volcano-sh batch/v1alpha1, kubeflow/trainer v1alpha1),
   closed to unknown fields; their embedded pod and job templates are then validated with layer 1
   (as a v1 PodTemplate or a batch/v1 Job).
3. muster's own contract on every pod template: muster is the command, its flags and MUSTER_*
   variables exist, the grace period is wired, probes and Prometheus annotations are on port 8000
   and every kubelet probe targets an endpoint the probe doc lists as independent of other pods,
   the rendezvous endpoint is pod 0's headless name, --nnodes is the number of pods (an Indexed
   Job may have more: spares, if a successPolicy completes it when index 0 succeeds), the trainer
   container runs restricted (non-root, no capabilities, no privilege escalation, RuntimeDefault
   seccomp, read-only root) with emptyDirs at /tmp and /dev/shm, a NetworkPolicy admits the job's
   own pods and the monitoring namespace's scrapes only, the exit codes in failure policies are the
   reserved ones documented in agent/src/exit_code.rs with the actions README.md explains, and —
   simulated per API — a preempted pod's exit code is never taken as success, never fails the
   job, and is retried without consuming the backoff budget wherever the API can do that.
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
    "--grace-period", "--metrics-addr", "--log-format", "--preempted-exit-code",
}
MUSTER_ENV = {"MUSTER_GRACE_PERIOD", "MUSTER_PREEMPTED_EXIT_CODE", "MUSTER_METRICS_ADDR"}
PET_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
           "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_ID", "PET_RDZV_CONF", "PET_MAX_RESTARTS"}
# What Trainer v2's torch plugin injects itself; a TrainJob that sets one is rejected by its webhook
# (kubeflow/trainer pkg/constants TorchRunReservedEnvNames).
TRAINER_RESERVED_ENV = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
                        "PET_MASTER_PORT"}
METRICS_PORT = 8000
RDZV_PORT = 29500
# The namespace Prometheus scrapes from; the examples' NetworkPolicies admit it to port 8000 only.
MONITORING_NAMESPACE = "monitoring"
CORE_KINDS = {("v1", "Service"), ("batch/v1", "Job"), ("v1", "ConfigMap"), ("v1", "PodTemplate"),
              ("networking.k8s.io/v1", "NetworkPolicy")}

# What each reserved code should make the Job controller do (README.md explains each choice).
JOB_ACTIONS = {"PREEMPTED_CHECKPOINTED": "Ignore", "CHECKPOINT_ABORTED": "Ignore",
               "CONFIG_ERROR": "FailJob", "RENDEZVOUS_TIMEOUT": "Count", "UNHEALTHY_GPU": "Count",
               "STORE_HOST_LOST": "Ignore", "INTERNAL_ERROR": "Count", "NO_PROGRESS": "FailJob"}
VOLCANO_FINAL = {"TerminateJob", "AbortJob"}
VOLCANO_RESTARTS = {"RestartJob", "RestartTask", "RestartPod", "RestartPartition"}

# What a pod's exit means to the API that owns it (see `Checker.preempted_outcome`).
SUCCESS, FREE, COUNTED, FAILS = "success", "resumed", "resumed, counted", "fails"
# APIs that can restart a preempted pod without consuming a budget. Volcano cannot: every restart
# action (RestartJob/RestartTask/RestartPod) increments status.retryCount, which maxRetry bounds
# (volcano-sh/volcano pkg/controllers/job/state/running.go), so there the best outcome is COUNTED.
FREE_RESTART = {"Job": True, "JobSet": True, "PyTorchJob": True, "TrainJob": True, "Volcano": False}


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

# kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go (JobSetSpec); also the `spec` of a
# Trainer v2 runtime's `template`.
JOBSET_SPEC = obj({
    "replicatedJobs": {"type": "array", "minItems": 1, "items": obj({
        "name": STR, "groupName": STR, "replicas": INT, "template": TEMPLATE,
        "dependsOn": {"type": "array", "items": obj({"name": STR, "status": enum("Ready", "Complete")},
                                                    required=["name", "status"])},
    }, required=["name", "template"])},
    "network": obj({"enableDNSHostnames": BOOL, "subdomain": STR,
                    "publishNotReadyAddresses": BOOL}),
    "successPolicy": obj({"operator": enum("All", "Any"), "targetReplicatedJobs": STRS},
                         required=["operator"]),
    "failurePolicy": obj({
        "maxRestarts": INT,
        "restartStrategy": enum("Recreate", "BlockingRecreate", "InPlaceRestart"),
        "rules": {"type": "array", "items": obj({
            # The CRD's pattern (and the webhook's ruleNameFmt): no hyphens.
            "name": {"type": "string", "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"},
            "action": enum("FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts",
                           "RestartJob", "RestartJobAndIgnoreMaxRestarts"),
            "onJobFailureReasons": {"type": "array", "items": enum(
                "BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                "MaxFailedIndexesExceeded", "PodFailurePolicy")},
            "onJobFailureMessagePatterns": STRS, "targetReplicatedJobs": STRS,
        }, required=["name", "action"])},
    }),
    "startupPolicy": obj({"startupPolicyOrder": enum("AnyOrder", "InOrder")},
                         required=["startupPolicyOrder"]),
    "suspend": BOOL, "managedBy": STR, "ttlSecondsAfterFinished": INT,
    "coordinator": obj({"replicatedJob": STR, "jobIndex": INT, "podIndex": INT},
                       required=["replicatedJob"]),
    "volumeClaimPolicies": {"type": "array", "items": obj({
        "templates": {"type": "array"}, "retentionPolicy": ANYOBJ})},
}, required=["replicatedJobs"])

JOBSET = obj({
    "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"}, "kind": {"const": "JobSet"},
    "metadata": META, "spec": JOBSET_SPEC,
}, required=["apiVersion", "kind", "metadata", "spec"])

VOLCANO_POLICY = obj({
    "action": enum("AbortJob", "RestartJob", "RestartTask", "RestartPod", "RestartPartition",
                   "TerminateJob", "CompleteJob", "ResumeJob"),
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

# kubeflow/trainer pkg/apis/trainer/v1alpha1/trainingruntime_types.go and trainjob_types.go.
ENV_VARS = {"type": "array", "items": obj({"name": STR, "value": STR, "valueFrom": ANYOBJ},
                                          required=["name"])}
TRAINING_RUNTIME_SPEC = obj({
    "mlPolicy": obj({
        "numNodes": INT,
        "torch": obj({"envInjection": obj({"targets": {"type": "array", "items": obj(
            {"jobName": STR, "containerNames": STRS})}})}),
        "mpi": obj({"numProcPerNode": INT, "mpiImplementation": enum("OpenMPI", "Intel", "MPICH"),
                    "sshAuthMountPath": STR, "runLauncherAsNode": BOOL}),
        "flux": obj({"numProcPerNode": INT}), "jax": obj({}), "xgboost": obj({}),
    }),
    "podGroupPolicy": obj({"coscheduling": obj({"scheduleTimeoutSeconds": INT}),
                           "volcano": obj({"networkTopology": ANYOBJ})}),
    "template": obj({"metadata": obj({"labels": ANYOBJ, "annotations": ANYOBJ}),
                     "spec": JOBSET_SPEC}),
}, required=["template"])
CLUSTER_TRAINING_RUNTIME = obj({
    "apiVersion": {"const": "trainer.kubeflow.org/v1alpha1"},
    "kind": {"const": "ClusterTrainingRuntime"}, "metadata": META, "spec": TRAINING_RUNTIME_SPEC,
}, required=["apiVersion", "kind", "metadata", "spec"])
INITIALIZER = obj({"storageUri": STR, "env": ENV_VARS, "secretRef": obj({"name": STR})})
TRAINJOB = obj({
    "apiVersion": {"const": "trainer.kubeflow.org/v1alpha1"}, "kind": {"const": "TrainJob"},
    # The CRD's XValidation: an RFC 1035 label of at most 63 characters.
    "metadata": obj({"name": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$",
                              "maxLength": 63},
                     "namespace": STR, "labels": ANYOBJ, "annotations": ANYOBJ},
                    required=["name"]),
    "spec": obj({
        "runtimeRef": obj({"name": {"type": "string", "minLength": 1}, "apiGroup": STR,
                           "kind": enum("ClusterTrainingRuntime", "TrainingRuntime")},
                          required=["name"]),
        "initializer": obj({"dataset": INITIALIZER, "model": INITIALIZER}),
        "trainer": obj({
            "image": STR, "command": STRS, "args": STRS, "env": ENV_VARS,
            "numNodes": {"type": "integer", "minimum": 0},
            "resourcesPerNode": obj({"limits": ANYOBJ, "requests": ANYOBJ,
                                     "claims": {"type": "array"}}),
            "numProcPerNode": {"type": "integer", "minimum": 1},
        }),
        "runtimePatches": {"type": "array"}, "suspend": BOOL,
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1}, "managedBy": STR,
    }, required=["runtimeRef"]),
}, required=["apiVersion", "kind", "metadata", "spec"])

CRDS = {("kubeflow.org/v1", "PyTorchJob"): PYTORCHJOB,
        ("jobset.x-k8s.io/v1alpha2", "JobSet"): JOBSET,
        ("batch.volcano.sh/v1alpha1", "Job"): VOLCANO_JOB,
        ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): CLUSTER_TRAINING_RUNTIME,
        ("trainer.kubeflow.org/v1alpha1", "TrainJob"): TRAINJOB}


def reserved_codes(exit_code_rs: Path) -> dict[str, int]:
    """The reserved exit codes (>= 200) documented in agent/src/exit_code.rs, by constant name."""
    found = re.findall(r"pub const ([A-Z_]+): u8 = (\d+);", exit_code_rs.read_text())
    return {name: int(v) for name, v in found if int(v) >= 200}


def pod_local_endpoints(probe_doc: Path) -> dict[str, bool]:
    """The endpoint table of the probe doc (examples/kubernetes/README.md): the first Markdown
    table with a column "depends on other pods"; returns {path: depends}. The one place that says
    which endpoints a kubelet probe may target."""
    rows = [line for line in probe_doc.read_text().splitlines() if line.startswith("|")]
    header = None
    table = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if any("depends on other pods" in c for c in cells):
                header = cells
            continue
        if set("".join(cells)) <= set("-: "):
            continue
        if len(cells) != len(header):
            break  # the next table
        row = dict(zip(header, cells))
        path = re.search(r"`(/[a-z]+)`", row.get(header[0], ""))
        dep = next(v for k, v in row.items() if "depends on other pods" in k)
        if path:
            table[path.group(1)] = not dep.strip("* ").lower().startswith("no")
    return table


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector.get("matchLabels")) and not selector.get("matchExpressions") and all(
        labels.get(k) == v for k, v in selector["matchLabels"].items())


class Checker:
    def __init__(self, codes: dict[str, int], k8s_version: str,
                 endpoints: dict[str, bool]) -> None:
        self.codes = codes
        self.by_value = {v: k for k, v in codes.items()}
        self.version = k8s_version
        # Paths a kubelet probe may target: documented as not depending on other pods.
        self.pod_local = {path for path, depends in endpoints.items() if not depends}
        self.endpoints = endpoints

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
    def muster_pod(self, tpl: dict, where: str, ctx: dict, errors: list, used: dict) -> dict | None:
        """Checks muster's contract on a pod template; returns the muster container's name and
        its preempted exit code ({"name", "preempted"}), or None."""
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
        # The code a preempted, checkpointed pod exits with: the flag, the variable, else muster's
        # default (PREEMPTED_CHECKPOINTED; agent/src/cli/hiargs.rs, unit-tested there).
        pre = flags.get("--preempted-exit-code") or env.get("MUSTER_PREEMPTED_EXIT_CODE")
        preempted = self.codes["PREEMPTED_CHECKPOINTED"] if pre is None else int(pre)
        ports = {p.get("containerPort") for p in c.get("ports", [])}
        if METRICS_PORT not in ports:
            errors.append(f"{where}: container port {METRICS_PORT} (metrics) missing")
        self.probes(c, where, errors)
        self.restricted(spec, c, where, errors)
        # The job's shape.
        if ctx.get("endpoint") is not None:
            most = flags.get("--nnodes", "").rpartition(":")[2]
            # Pods beyond --nnodes MAX wait as spares (docs/multinode.md, "Spares"); the caller
            # checks that its API lets the job end without them (`spares`).
            spares = ctx.get("spares") and most.isdigit() and int(most) < (ctx["nodes"] or 0)
            if "--nnodes" in flags and flags["--nnodes"] != str(ctx["nodes"]) and not spares:
                errors.append(f"{where}: --nnodes={flags['--nnodes']} but the job has {ctx['nodes']} pods")
            if flags.get("--rdzv-endpoint") != ctx["endpoint"]:
                errors.append(f"{where}: --rdzv-endpoint={flags.get('--rdzv-endpoint')} is not pod 0's "
                              f"headless name {ctx['endpoint']}")
            if RDZV_PORT not in ports:
                errors.append(f"{where}: container port {RDZV_PORT} (rendezvous) missing")
        return {"name": c.get("name"), "preempted": preempted,
                "max_nodes": int(most) if ctx.get("endpoint") is not None and most.isdigit() else None}

    def probes(self, c: dict, where: str, errors: list) -> None:
        """The kubelet's probes: liveness on /healthz, readiness on an endpoint the probe doc lists
        as not depending on other pods, and no probe of any kind on one that does (a pod's
        readiness gates its DNS record where the Service does not publish not-ready addresses, and
        the other pods need that record before anyone's gang can form)."""
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            if probe not in c:
                if probe != "startupProbe":
                    errors.append(f"{where}: no {probe}")
                continue
            http = c[probe].get("httpGet")
            if http is None:
                errors.append(f"{where}: {probe} must be an httpGet on port {METRICS_PORT}")
                continue
            path = http.get("path")
            if http.get("port") != METRICS_PORT:
                errors.append(f"{where}: {probe} must target port {METRICS_PORT}")
            if path not in self.pod_local:
                why = ("is documented as depending on other pods" if self.endpoints.get(path)
                       else "is not documented as independent of other pods")
                errors.append(f"{where}: {probe} GET {path} {why} (allowed: {sorted(self.pod_local)})")
            elif probe == "livenessProbe" and path != "/healthz":
                errors.append(f"{where}: livenessProbe must be GET /healthz (the agent's loop)")

    def restricted(self, spec: dict, c: dict, where: str, errors: list) -> None:
        """The Pod Security Standards' "restricted" profile plus a read-only root on the muster
        container, and the emptyDirs a training job needs."""
        pod_sc = spec.get("securityContext", {})
        sc = c.get("securityContext", {})

        def eff(key):
            return sc.get(key, pod_sc.get(key))
        if eff("runAsNonRoot") is not True:
            errors.append(f"{where}: securityContext.runAsNonRoot must be true")
        uid = eff("runAsUser")
        if not isinstance(uid, int) or uid <= 0:
            errors.append(f"{where}: securityContext.runAsUser must be a non-zero UID, is {uid!r}")
        if sc.get("allowPrivilegeEscalation") is not False:
            errors.append(f"{where}: securityContext.allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or caps.get("add"):
            errors.append(f"{where}: securityContext.capabilities must drop ALL and add none")
        if (eff("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            errors.append(f"{where}: securityContext.seccompProfile.type must be RuntimeDefault")
        if sc.get("readOnlyRootFilesystem") is not True:
            errors.append(f"{where}: securityContext.readOnlyRootFilesystem must be true")
        if sc.get("privileged"):
            errors.append(f"{where}: the muster container must not be privileged")
        volumes = {v.get("name"): v for v in spec.get("volumes", [])}
        mounts = {m.get("mountPath"): volumes.get(m.get("name"), {})
                  for m in c.get("volumeMounts", [])}
        if "emptyDir" not in mounts.get("/tmp", {}):
            errors.append(f"{where}: no emptyDir mounted at /tmp (the checkpoint helper's place)")
        shm = mounts.get("/dev/shm", {})
        if (shm.get("emptyDir") or {}).get("medium") != "Memory":
            errors.append(f"{where}: no memory-medium emptyDir mounted at /dev/shm")

    def job_rule_action(self, job_spec: dict, container: str, code: int) -> str:
        """The podFailurePolicy action for a pod whose container exited `code`: rules in order,
        the first match wins; no match counts towards backoffLimit."""
        for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
            oec = rule.get("onExitCodes")
            if not oec or oec.get("containerName", container) != container:
                continue
            inside = code in oec.get("values", [])
            if inside == (oec.get("operator") == "In"):
                return rule.get("action")
        return "Count"

    def job_outcome(self, job_spec: dict, container: str, code: int) -> str:
        """What a batch/v1 Job does with a pod of `container` exiting `code`."""
        if code == 0:
            return SUCCESS  # the pod is Succeeded: its index (or one completion) is done
        if job_spec.get("template", {}).get("spec", {}).get("restartPolicy") == "OnFailure":
            return COUNTED  # restarted in place by the kubelet, counted towards backoffLimit
        action = self.job_rule_action(job_spec, container, code)
        if action == "Ignore":
            return FREE  # replaced; the counter towards backoffLimit is not incremented
        if action in ("FailJob", "FailIndex"):
            return FAILS
        return COUNTED if job_spec.get("backoffLimit", 6) > 0 else FAILS

    def jobset_outcome(self, spec: dict, rjob: dict, container: str, code: int) -> str:
        """What a JobSet does: the Job decides first; a failed Job goes to the failurePolicy."""
        js = rjob.get("template", {}).get("spec", {})
        job = self.job_outcome(js, container, code)
        if job != FAILS:
            return job
        reason = ("PodFailurePolicy" if self.job_rule_action(js, container, code) in ("FailJob", "FailIndex")
                  else "BackoffLimitExceeded")
        policy = spec.get("failurePolicy")
        if not policy:
            return FAILS
        for rule in policy.get("rules", []):
            if rule.get("targetReplicatedJobs") and rjob.get("name") not in rule["targetReplicatedJobs"]:
                continue
            if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
                continue
            action = rule.get("action")
            if action == "FailJobSet":
                return FAILS
            return FREE if action.endswith("IgnoreMaxRestarts") else COUNTED
        return COUNTED if policy.get("maxRestarts", 0) > 0 else FAILS  # default: RestartJobSet

    @staticmethod
    def pytorchjob_outcome(restart_policy: str | None, code: int) -> str:
        """kubeflow/training-operator v1.9.0 pkg/controller.v1/common/pod.go: ExitCode deletes and
        recreates a pod whose code is >= 128 (pkg/util/train IsRetryableExitCode) and fails the job
        on 1-127; those recreated pods run with restartPolicy Never, so they add no container
        restarts to what pkg/core PastBackoffLimit counts."""
        if code == 0:
            return SUCCESS  # the replica Succeeded (a Master that succeeds ends the job Succeeded)
        if restart_policy == "ExitCode":
            return FREE if code >= 128 else FAILS
        if restart_policy in ("OnFailure", "Always"):
            return COUNTED  # restarted in place, container restarts count towards backoffLimit
        return FAILS

    @staticmethod
    def volcano_action(job_policies: list, task: dict, event: str, code: int | None) -> str | None:
        """Volcano's applyPolicies (pkg/controllers/job/job_controller_util.go): the task's
        policies, then the job's, each in order; a policy matches by event or by exit code."""
        for policy in list(task.get("policies", [])) + list(job_policies):
            events = policy.get("events") or ([policy["event"]] if "event" in policy else [])
            if event in events or "*" in events:
                return policy.get("action")
            if code is not None and policy.get("exitCode") == code:
                return policy.get("action")
        return None

    def volcano_outcome(self, job_policies: list, task: dict, code: int) -> str:
        if code == 0:
            return SUCCESS  # the pod is Succeeded; once all are, the job is Completed
        action = self.volcano_action(job_policies, task, "PodFailed", code)
        if action in VOLCANO_RESTARTS:
            return COUNTED  # every restart increments status.retryCount (bounded by maxRetry)
        if action == "CompleteJob":
            return SUCCESS
        return FAILS  # TerminateJob/AbortJob, or no policy: the pod stays failed

    def preempted(self, api: str, where: str, codes: list[int], outcome, errors: list) -> None:
        """A preempted pod exits with `codes` (the container's preempted code and the aborted code):
        the API must resume the job, without consuming a budget where it can."""
        for code in codes:
            got = outcome(code)
            if got == SUCCESS:
                errors.append(f"{where}: a preempted pod's exit code {code} would be taken as "
                              f"success by {api} (the job could end Complete, training unfinished)")
            elif got == FAILS:
                errors.append(f"{where}: a preempted pod's exit code {code} would fail the {api}")
            elif got == COUNTED and FREE_RESTART[api]:
                errors.append(f"{where}: a preempted pod's exit code {code} would consume {api}'s "
                              f"backoff budget")

    def preempted_codes(self, c: dict) -> list[int]:
        return sorted({c["preempted"], self.codes["CHECKPOINT_ABORTED"]})

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

    @staticmethod
    def job_spares(spec: dict, max_nodes: int, where: str, errors: list) -> None:
        """An Indexed Job with more pods than --nnodes MAX: the extra indexes are spares, which may
        never train and so never succeed. The Job must be able to complete without them: a
        successPolicy rule on index 0 alone (node 0 exits last, after the gang's exit barrier).
        Without it the Job waits for every index and hangs on a spare that is still waiting."""
        pods = spec.get("completions")
        rules = (spec.get("successPolicy") or {}).get("rules", [])
        if not any(r.get("succeededIndexes") == "0" and r.get("succeededCount") is None for r in rules):
            errors.append(f"{where}: {pods} pods for --nnodes {max_nodes}: the pods beyond it wait as "
                          f"spares, which may never succeed; the Job needs successPolicy rules "
                          f"[{{succeededIndexes: \"0\"}}] to complete when node 0 does")
        if spec.get("parallelism", 1) != pods:
            errors.append(f"{where}: parallelism {spec.get('parallelism', 1)} != completions {pods}: "
                          f"a spare must run alongside the gang, not after an index finished")

    def network_policy(self, docs: list, pod_labels: dict, identity: set, where: str,
                       errors: list) -> None:
        """One NetworkPolicy selects the job's pods and admits exactly: every port from the job's
        own pods (the rendezvous, the workers' store on a per-attempt port, NCCL/gloo), and the
        metrics port from the monitoring namespace. TCPStore has no authentication; this is the
        control. `identity`: the label keys that name this job (a selector must use one)."""
        policies = [d for d in docs if d.get("kind") == "NetworkPolicy"
                    and selects(d.get("spec", {}).get("podSelector", {}), pod_labels)]
        if len(policies) != 1:
            errors.append(f"{where}: expected one NetworkPolicy selecting the job's pods "
                          f"({pod_labels}), found {len(policies)}")
            return
        np = policies[0]
        nw = f"{where} NetworkPolicy/{np['metadata'].get('name')}"
        spec = np.get("spec", {})
        if not identity & set(spec.get("podSelector", {}).get("matchLabels", {})):
            errors.append(f"{nw}: podSelector must name the job by one of {sorted(identity)}")
        if "Ingress" not in spec.get("policyTypes", ["Ingress"]):
            errors.append(f"{nw}: policyTypes must include Ingress")
        if "Egress" in spec.get("policyTypes", []):
            errors.append(f"{nw}: egress is the cluster's policy; the example restricts ingress only")
        own = scrape = False
        for i, rule in enumerate(spec.get("ingress", [])):
            rw = f"{nw} ingress[{i}]"
            peers = rule.get("from") or []
            ports = rule.get("ports")
            if not peers:
                errors.append(f"{rw}: no `from` admits every source")
                continue
            for peer in peers:
                if "ipBlock" in peer:
                    errors.append(f"{rw}: an ipBlock admits addresses outside the job")
                elif "namespaceSelector" in peer:
                    ns = peer["namespaceSelector"].get("matchLabels", {})
                    if ns != {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}:
                        errors.append(f"{rw}: namespaceSelector admits other than the "
                                      f"{MONITORING_NAMESPACE} namespace")
                    elif [(p.get("port"), p.get("protocol", "TCP")) for p in ports or []] != [(METRICS_PORT, "TCP")]:
                        errors.append(f"{rw}: the {MONITORING_NAMESPACE} namespace may reach port "
                                      f"{METRICS_PORT} only")
                    else:
                        scrape = True
                else:
                    sel = peer.get("podSelector", {})
                    if not (selects(sel, pod_labels) and identity & set(sel.get("matchLabels", {}))):
                        errors.append(f"{rw}: podSelector {sel} admits pods outside the job")
                    elif ports:
                        errors.append(f"{rw}: the job's own pods need every port (the workers' "
                                      f"store and NCCL/gloo use ephemeral ones)")
                    else:
                        own = True
        if not own:
            errors.append(f"{nw}: nothing admits the job's own pods (the rendezvous could not form)")
        if not scrape:
            errors.append(f"{nw}: nothing admits Prometheus from the {MONITORING_NAMESPACE} namespace "
                          f"to port {METRICS_PORT}")

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
            ctx = {"nodes": spec.get("completions"), "endpoint": f"{name}-0.{sub}:{RDZV_PORT}",
                   "spares": True}
            c = self.muster_pod(spec.get("template", {}), f"{where} pod", ctx, errors, used)
            if c and c["max_nodes"] is not None and c["max_nodes"] < (spec.get("completions") or 0):
                self.job_spares(spec, c["max_nodes"], where, errors)
            if c:
                self.pod_failure_policy(spec, c["name"], where, errors)
                self.preempted("Job", where, self.preempted_codes(c),
                               lambda code: self.job_outcome(spec, c["name"], code), errors)
            labels = {**spec.get("template", {}).get("metadata", {}).get("labels", {}),
                      "batch.kubernetes.io/job-name": name, "job-name": name}
            self.network_policy(docs, labels, {"batch.kubernetes.io/job-name", "job-name"},
                                where, errors)
        elif key == ("jobset.x-k8s.io/v1alpha2", "JobSet"):
            self.jobset(doc["metadata"].get("name", ""), spec, docs, where, errors, validated, used,
                        api="JobSet")
        elif key == ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"):
            self.training_runtime(doc, docs, where, errors, validated, used)
        elif key == ("trainer.kubeflow.org/v1alpha1", "TrainJob"):
            self.trainjob(doc, docs, where, errors)
        elif key == ("kubeflow.org/v1", "PyTorchJob"):
            for role, rs in spec.get("pytorchReplicaSpecs", {}).items():
                rw = f"{where} {role}"
                tpl = rs.get("template", {})
                self.pod_template(tpl, rw, errors, validated)
                c = self.muster_pod(tpl, f"{rw} pod", {"endpoint": None}, errors, used)
                if c is None:
                    continue
                if c["name"] != "pytorch":
                    errors.append(f"{rw}: the operator needs the training container named 'pytorch'")
                ports = {p.get("name"): p.get("containerPort")
                         for ct in tpl.get("spec", {}).get("containers", []) for p in ct.get("ports", [])}
                if ports.get("pytorchjob-port") != RDZV_PORT:
                    errors.append(f"{rw}: port 'pytorchjob-port' must be {RDZV_PORT} (PET_MASTER_PORT)")
                if rs.get("restartPolicy") != "ExitCode":
                    errors.append(f"{rw}: restartPolicy must be ExitCode (muster's reserved codes are "
                                  f"retryable, a worker's own 1-127 are not)")
                self.preempted("PyTorchJob", rw, self.preempted_codes(c),
                               lambda code, rp=rs.get("restartPolicy"): self.pytorchjob_outcome(rp, code),
                               errors)
            self.network_policy(docs, {"training.kubeflow.org/job-name": name,
                                       "training.kubeflow.org/operator-name": "pytorchjob-controller"},
                                {"training.kubeflow.org/job-name"}, where, errors)
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
            for t in spec.get("tasks", []):
                tw = f"{where} task {t.get('name')}"
                if self.volcano_action(policies, t, "PodEvicted", None) not in VOLCANO_RESTARTS:
                    errors.append(f"{tw}: an evicted pod (PodEvicted) must restart the job")
                self.pod_template(t.get("template", {}), tw, errors, validated)
                ctx = {"nodes": nodes, "endpoint": f"{name}-{t.get('name')}-0.{name}:{RDZV_PORT}"}
                c = self.muster_pod(t.get("template", {}), f"{tw} pod", ctx, errors, used)
                by_code = {}
                for p in list(t.get("policies", [])) + policies:
                    if "exitCode" in p and ("event" in p or "events" in p):
                        errors.append(f"{tw}: a policy has both exitCode and event")
                    if "exitCode" in p:
                        if p["exitCode"] not in self.by_value:
                            errors.append(f"{tw}: exit code {p['exitCode']} is not one of muster's reserved codes")
                        by_code.setdefault(p["exitCode"], p["action"])
                if by_code.get(self.codes["CONFIG_ERROR"]) not in VOLCANO_FINAL:
                    errors.append(f"{tw}: exit code {self.codes['CONFIG_ERROR']} (config error) must end the job")
                if by_code.get(self.codes["RENDEZVOUS_TIMEOUT"]) != "RestartJob":
                    errors.append(f"{tw}: exit code {self.codes['RENDEZVOUS_TIMEOUT']} "
                                  f"(RENDEZVOUS_TIMEOUT) should restart the job")
                if c:
                    self.preempted("Volcano", tw, self.preempted_codes(c),
                                   lambda code, t=t: self.volcano_outcome(policies, t, code), errors)
            self.network_policy(docs, {"volcano.sh/job-name": name}, {"volcano.sh/job-name"},
                                where, errors)

    def jobset(self, name: str, spec: dict, docs: list, where: str, errors, validated, used,
               api: str, trainer: dict | None = None) -> None:
        """A JobSet, or the JobSet a Trainer v2 runtime describes (`trainer`: the TrainJob's shape
        and the replicated Job and container Trainer drives)."""
        net = spec.get("network", {})
        # JobSet's controller defaults publishNotReadyAddresses to true; the examples say so.
        if net.get("publishNotReadyAddresses") is not True:
            errors.append(f"{where}: network.publishNotReadyAddresses must be true")
        sub = net.get("subdomain", name)
        for rj in spec.get("replicatedJobs", []):
            jt = rj.get("template", {})
            jw = f"{where} replicatedJobs[{rj.get('name')}]"
            self.core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
                       "spec": jt.get("spec", {})}, jw, errors, validated)
            js = jt.get("spec", {})
            if trainer is None:
                ctx = {"nodes": js.get("completions", 1) * rj.get("replicas", 1),
                       "endpoint": f"{name}-{rj.get('name')}-0-0.{sub}:{RDZV_PORT}"}
            else:
                ctx = {"endpoint": None}  # Trainer injects PET_MASTER_ADDR/PORT
            c = self.muster_pod(js.get("template", {}), f"{jw} pod", ctx, errors, used)
            if c is None:
                continue
            if trainer is not None:
                labels = jt.get("metadata", {}).get("labels", {})
                if rj.get("name") != "node" or c["name"] != "node" or labels.get(
                        "trainer.kubeflow.org/trainjob-ancestor-step") != "trainer":
                    errors.append(f"{jw}: Trainer injects PET_* only into container `node` of the "
                                  f"replicated Job `node` labelled trainjob-ancestor-step: trainer")
                tpl = js.get("template", {}).get("spec", {})
                muster = next(ct for ct in tpl.get("containers", []) if ct.get("name") == c["name"])
                if any(str(a).startswith("--rdzv-endpoint") or str(a).startswith("--nnodes")
                       for a in muster.get("args", [])):
                    errors.append(f"{jw}: the job shape comes from Trainer's PET_* variables, not flags")
            self.pod_failure_policy(js, c["name"], jw, errors)
            self.preempted(api, jw, self.preempted_codes(c),
                           lambda code, rj=rj, c=c: self.jobset_outcome(spec, rj, c["name"], code),
                           errors)
        self.network_policy(docs, {"jobset.sigs.k8s.io/jobset-name": name},
                            {"jobset.sigs.k8s.io/jobset-name"}, where, errors)

    def training_runtime(self, doc: dict, docs: list, where: str, errors, validated, used) -> None:
        spec = doc.get("spec", {})
        if "torch" not in spec.get("mlPolicy", {}):
            errors.append(f"{where}: mlPolicy.torch is what makes Trainer inject the PET_* variables")
        jobs = [d for d in docs if d.get("kind") == "TrainJob"
                and d.get("spec", {}).get("runtimeRef", {}).get("name") == doc["metadata"].get("name")]
        if not jobs:
            errors.append(f"{where}: no TrainJob in this file uses the runtime")
        for tj in jobs:
            self.jobset(tj["metadata"].get("name", ""), spec.get("template", {}).get("spec", {}),
                        docs, f"{where} for TrainJob/{tj['metadata'].get('name')}", errors,
                        validated, used, api="TrainJob", trainer=tj)

    def trainjob(self, doc: dict, docs: list, where: str, errors) -> None:
        spec = doc.get("spec", {})
        ref = spec.get("runtimeRef", {})
        if ref.get("kind", "ClusterTrainingRuntime") != "ClusterTrainingRuntime" or not any(
                d.get("kind") == "ClusterTrainingRuntime" and d["metadata"].get("name") == ref.get("name")
                for d in docs):
            errors.append(f"{where}: runtimeRef {ref} names no ClusterTrainingRuntime in this file")
        trainer = spec.get("trainer")
        if trainer is None:
            errors.append(f"{where}: without spec.trainer Trainer injects no PET_* variables")
            return
        reserved = sorted({e.get("name") for e in trainer.get("env", [])} & TRAINER_RESERVED_ENV)
        if reserved:
            errors.append(f"{where}: spec.trainer.env sets {reserved}, which Trainer's webhook rejects")
        if trainer.get("command"):
            errors.append(f"{where}: spec.trainer.command would replace muster; set args only")
        if not trainer.get("numNodes"):
            errors.append(f"{where}: spec.trainer.numNodes sets PET_NNODES")

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
    ap.add_argument("--probe-doc", required=True, type=Path,
                    help="the Markdown file whose endpoint table says which endpoints depend on "
                         "other pods (examples/kubernetes/README.md)")
    ap.add_argument("--k8s-version", default="1.33.0")
    ap.add_argument("files", nargs="+", type=Path)
    a = ap.parse_args()
    codes = reserved_codes(a.exit_codes)
    if not codes:
        print(json.dumps({"error": f"no reserved exit codes found in {a.exit_codes}"}))
        return 1
    endpoints = pod_local_endpoints(a.probe_doc)
    if not any(not depends for depends in endpoints.values()):
        print(json.dumps({"error": f"no endpoint table (column 'depends on other pods') in {a.probe_doc}"}))
        return 1
    checker = Checker(codes, a.k8s_version, endpoints)
    print(json.dumps({str(f): checker.check_file(f) for f in a.files}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
