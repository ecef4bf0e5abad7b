"""The images: docker/Dockerfile (users' image, linted here because CI cannot pull its bases) and
docker/test-image/build.sh (the offline image the container end-to-end tests run)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO, muster_bin, torch_python

sys.path.insert(0, str(REPO / "tests" / "containers"))
import dockerjob  # noqa: E402

DOCKERFILE = REPO / "docker" / "Dockerfile"
# Every instruction Dockerfile syntax knows; anything else is a typo the builder would reject.
INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
    "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}
# glibc of Ubuntu 22.04, the distribution of the PyTorch runtime images BASE defaults to.
BASE_GLIBC = (2, 35)


def parse_dockerfile(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(parser directives, [(INSTRUCTION, arguments)]) with continuations joined, comments dropped."""
    directives, instructions, pending = [], [], ""
    in_header = True
    for raw in text.splitlines():
        line = raw.strip()
        if in_header and re.match(r"^#\s*\w+\s*=", line):
            directives.append(line.lstrip("#").strip())
            continue
        in_header = False
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        instructions.append((word.upper() if word.upper() in INSTRUCTIONS else word, rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return directives, instructions


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


def stages(instructions):
    out, current = [], None
    for word, args in instructions:
        if word == "FROM":
            current = {"from": args, "body": []}
            out.append(current)
        elif current is not None:
            current["body"].append((word, args))
    return out


def test_dockerfile_instructions_are_known(dockerfile):
    directives, instructions = dockerfile
    assert "syntax=docker/dockerfile:1" in directives, "cache mounts need the dockerfile:1 syntax"
    unknown = [w for w, _ in instructions if w not in INSTRUCTIONS]
    assert not unknown, f"unknown Dockerfile instructions: {unknown}"


def test_dockerfile_is_multistage_builder_then_base(dockerfile):
    _, instructions = dockerfile
    global_args = {}
    for word, args in instructions:
        if word == "FROM":
            break
        assert word == "ARG", f"{word} before the first FROM"
        name, _, default = args.partition("=")
        global_args[name] = default
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime",
                        global_args.get("BASE", "")), global_args
    rust_version = tuple(int(x) for x in global_args["RUST_VERSION"].split("."))
    workspace = tomllib.loads((REPO / "Cargo.toml").read_text())
    msrv = tuple(int(x) for x in workspace["workspace"]["package"]["rust-version"].split("."))
    assert rust_version >= msrv[: len(rust_version)], f"builder Rust {rust_version} < rust-version {msrv}"

    builder, runtime = stages(instructions)
    assert re.fullmatch(r"rust:\$\{RUST_VERSION\}-\S+ AS builder", builder["from"]), builder["from"]
    assert runtime["from"] == "${BASE}"

    # The builder copies every workspace member (a new crate not copied breaks the user's build).
    copied = set()
    for word, args in builder["body"]:
        if word == "COPY":
            copied.update(a for a in args.split() if not a.startswith("--"))
    for member in workspace["workspace"]["members"] + ["Cargo.toml", "Cargo.lock"]:
        assert member in copied, f"builder stage does not COPY {member}"
    # Files the sources compile in from outside their crate must be copied too.
    for source in (REPO / "agent" / "src").rglob("*.rs"):
        for included in re.findall(r'include_str!\("([^"]+)"\)', source.read_text()):
            path = (source.parent / included).resolve().relative_to(REPO)
            assert any(path == Path(c) or Path(c) in path.parents for c in copied), \
                f"{source.relative_to(REPO)} compiles in {path}, which the builder does not COPY"
    runs = " ".join(args for word, args in builder["body"] if word == "RUN")
    for needed in ("cargo build", "--release", "--locked", "-p muster"):
        assert needed in runs, f"builder RUN lacks {needed!r}"


def test_dockerfile_runtime_contract(dockerfile):
    _, instructions = dockerfile
    runtime = stages(instructions)[-1]["body"]
    body = dict(runtime)
    assert json.loads(body["ENTRYPOINT"]) == ["muster"], "ENTRYPOINT must be the exec form of muster"
    assert body["STOPSIGNAL"] == "SIGTERM"
    assert "8000" in body["EXPOSE"].split()
    copies = [args for word, args in runtime if word == "COPY"]
    assert any(c.startswith("--from=builder") and c.endswith(" /usr/local/bin/muster") for c in copies)
    text = " ".join(f"{w} {a}" for w, a in instructions).lower()
    for init in ("tini", "dumb-init"):
        assert init not in text, f"muster is the init; {init} must not be installed"
    # Non-root by default, numerically (Kubernetes' runAsNonRoot cannot resolve a name).
    users = [args for word, args in runtime if word == "USER"]
    assert users, "the runtime stage must set a non-root USER (docker/README.md)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: not a numeric non-root user"
    # The offline test image follows the same contract.
    build_sh = (REPO / "docker" / "test-image" / "build.sh").read_text()
    assert "ENTRYPOINT [\"/usr/local/bin/muster\"]" in build_sh


def test_dockerignore_keeps_the_context_small():
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert "**/target" in ignore and ".git" in ignore


def test_release_binary_runs_on_the_base_images_glibc():
    """The binary must not ask for glibc symbols newer than the runtime base provides."""
    data = Path(muster_bin()).read_bytes()
    versions = {tuple(int(x) for x in m.split(b".")) for m in re.findall(rb"GLIBC_(\d+\.\d+)", data)}
    assert versions, "no GLIBC symbol versions found: not a glibc-linked binary?"
    assert max(versions) <= BASE_GLIBC, f"needs GLIBC_{max(versions)} > Ubuntu 22.04's {BASE_GLIBC}"


def test_offline_test_image_is_content_addressed(tmp_path):
    """Same binary → same image (reused); a changed binary → a new image, with that binary."""
    why = dockerjob.docker_available()
    if why:
        pytest.skip(why)
    first = dockerjob.build_image(muster_bin(), torch_python())
    assert dockerjob.build_image(muster_bin(), torch_python()) == first
    changed = tmp_path / "muster"
    shutil.copy2(muster_bin(), changed)
    with changed.open("ab") as f:
        f.write(b"\0changed")  # trailing bytes after the ELF sections: still a runnable binary
    second = dockerjob.build_image(str(changed), torch_python())
    try:
        assert second != first and second.split(":")[0] == first.split(":")[0]
        inside = subprocess.run(
            ["docker", "run", "--rm", "--entrypoint", "/usr/bin/cat", second,
             "/usr/local/bin/muster"],
            capture_output=True, timeout=60, check=True,
        ).stdout
        assert inside == changed.read_bytes()
    finally:
        dockerjob.docker("rmi", second, check=False)


def test_sweep_removes_only_leftovers_of_dead_test_runs():
    """A killed pytest leaves labelled objects behind; the next run removes those, and never the
    objects of a run that is still alive (a concurrent suite on the same machine)."""
    why = dockerjob.docker_available()
    if why:
        pytest.skip(why)
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = dockerjob.OWNER.rpartition(":")[0]
    names = {"dead": f"mt-sweep-dead-{dead.pid}", "alive": f"mt-sweep-alive-{dead.pid}"}
    owners = {"dead": f"{host}:{dead.pid}", "alive": dockerjob.OWNER}
    try:
        for key, name in names.items():
            dockerjob.docker("network", "create", "--internal", "--label", dockerjob.LABEL,
                             "--label", f"{dockerjob.OWNER_LABEL}={owners[key]}", name)
        removed = dockerjob.sweep_stale()
        existing = dockerjob.docker("network", "ls", "--format", "{{.Name}}").stdout.split()
        assert names["dead"] not in existing, removed
        assert names["alive"] in existing
    finally:
        for name in names.values():
            dockerjob.docker("network", "rm", name, check=False)
