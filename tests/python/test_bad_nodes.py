"""Bad nodes remembered: a pod whose GPU pre-flight fails in a fixed-size gang records its
Kubernetes node (`NODE_NAME`) as bad in the gang's store; a later pod of the job on that node
exits at once with the original finding (204 and the check's message) without running the
pre-flight again, while a pod on another node goes on. The gang's store here is `muster store`
(no node 0 ever forms a round, so each agent ends at its short join timeout)."""

import os
import subprocess

import pytest

from conftest import REPO, finish, muster_bin, muster_env

FIXTURES = REPO / "tests" / "fixtures" / "nvml"
UNHEALTHY_GPU = 204


def fake_nvml():
    path = os.environ.get("MUSTER_FAKE_NVML") or str(REPO / "target" / "release" / "libfake_nvml.so")
    if not os.path.exists(path):
        pytest.fail(f"fake NVML not found at {path}; build it or set MUSTER_FAKE_NVML", pytrace=False)
    return path


def launch(store, node_name, fixture, tmp_path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the workers must not start')\n")
    p = subprocess.Popen(
        [muster_bin(), "--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "job", "--gpu-check",
         "require", "--metrics-addr", "none", "--rdzv-conf", "join_timeout=3", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=muster_env({"NODE_NAME": node_name, "MUSTER_NVML_LIBRARY": fake_nvml(),
                        "MUSTER_FAKE_NVML_FIXTURE": str(FIXTURES / fixture)}))
    return finish(p, 60)


@pytest.mark.timeout(120)
def test_a_pod_on_a_node_found_bad_fails_fast_with_the_original_finding(muster_store, tmp_path):
    code, _, err = launch(muster_store, "gpu-node-7", "ecc-gpu2-volatile-uncorrectable.json",
                          tmp_path)
    assert code in (UNHEALTHY_GPU, 203), err
    assert "GPU pre-flight failed" in err, err
    # The replacement pod lands on the same node; its GPUs even look healthy now.
    code, _, err = launch(muster_store, "gpu-node-7", "healthy-hgx-h100-8gpu.json", tmp_path)
    assert code == UNHEALTHY_GPU, err
    assert "node gpu-node-7 was found bad earlier in this job (by " in err, err
    assert "exit 204): " in err and "ecc_errors" in err, err
    assert "not running the checks again" in err, err
    # No check ran, no rendezvous: the refusal is all it says.
    assert len(err.strip().splitlines()) == 1, err
    # A pod on another node of the same job goes on to the rendezvous.
    code, _, err = launch(muster_store, "gpu-node-8", "healthy-hgx-h100-8gpu.json", tmp_path)
    assert code == 203, err
    assert "found bad" not in err, err
