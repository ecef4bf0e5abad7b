"""Hostile values through every flag and variable: no invocation of muster panics or dies by a
signal. A bad value is a configuration error (202) naming the flag; an accepted one runs as
usual. The flags are read from each command's own `--help`, so a new flag is swept too.

Every launch runs `--no-python true` on one node (a real launch of a program that exits at once);
a `store` that accepted its value serves until the sweep stops it (that is no failure).
"""

import os
import re
import subprocess

from conftest import muster_bin, muster_env

HOSTILE = [b"1e20", b"99999999999999999999", b"18446744073709551616", b"NaN", b"-1", b"",
           b"\xff\xfe", b"9" * 100_000]
# A Rust panic exits 101; an abort (a panic while panicking, a failed allocation) is SIGABRT.
PANIC_CODES = {101, 134}
LAUNCH_BASE = ["--standalone", "--nproc-per-node", "1", "--metrics-addr", "none",
               "--gpu-release-timeout", "0", "--gpu-check", "off"]


def flags_of(help_text):
    """(flag, takes a value) for every `--flag` the help lists, but --help itself."""
    found = {}
    for m in re.finditer(r"^\s{2,6}(?:-\w, )?--([a-z0-9-]+)(?:[ =](\S+))?", help_text, re.M):
        name, value = m.group(1), m.group(2)
        if name != "help":
            found.setdefault(name, value is not None)
    return sorted(found.items())


def help_of(*command):
    out = subprocess.run([muster_bin(), *command, "--help"], capture_output=True, text=True,
                         timeout=30, env=muster_env())
    return out.stdout + out.stderr


def run(args, env=None, timeout=20, cwd=None):
    """(exit status or None when it ran past `timeout`, its output). `cwd`: where a value taken
    for a directory or file name (`--log-dir 1e20`) lands."""
    environ = {k.encode(): v.encode() for k, v in muster_env().items()}
    environ.update(env or {})
    try:
        p = subprocess.run([muster_bin().encode(), *args], capture_output=True, timeout=timeout,
                           env=environ, stdin=subprocess.DEVNULL, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        return None, (e.stdout or b"") + (e.stderr or b"")
    return p.returncode, p.stdout + p.stderr


def sweep(cwd, prefix, flags, tail, env_prefix, timeout=20):
    failures = []
    for flag, takes_value in flags:
        for value in HOSTILE:
            shown = value[:40] + (b"..." if len(value) > 40 else b"")
            if takes_value:
                attempts = [([f"--{flag}".encode(), value], None, f"--{flag} {shown!r}")]
            else:
                attempts = [([f"--{flag}={value.decode('latin-1')}".encode('latin-1')], None,
                             f"--{flag}={shown!r}")]
            if env_prefix and value:
                var = env_prefix + flag.upper().replace("-", "_")
                attempts.append(([], {var.encode(): value}, f"{var}={shown!r}"))
            for args, env, what in attempts:
                code, out = run([*prefix, *args, *tail], env, timeout, cwd)
                if code is not None and (code < 0 or code in PANIC_CODES) or b"panicked at" in out:
                    failures.append(f"{what}: exit {code}: {out[-400:]!r}")
    return failures


def test_the_launch_form_survives_hostile_values_in_every_flag_and_variable(tmp_path):
    flags = flags_of(help_of())
    assert len(flags) > 40, flags
    base = [a.encode() for a in LAUNCH_BASE]
    flags = [(f, v) for f, v in flags if f not in ("no-python",)]
    failures = sweep(tmp_path, base, flags, [b"--no-python", b"true"], "MUSTER_")
    assert not failures, "\n".join(failures)


def test_the_subcommands_survive_hostile_values(tmp_path):
    failures = []
    dry_run = [(f, v) for f, v in flags_of(help_of("dry-run"))
               if f in ("fault", "replace-after", "spares", "chaos", "chaos-kinds",
                        "chaos-interval", "chaos-recovery-bound")]
    assert len(dry_run) == 7, dry_run
    failures += sweep(tmp_path, [b"dry-run", b"--nnodes", b"1", b"--nproc-per-node", b"1",
                       b"--metrics-addr", b"none", b"--gpu-check", b"off"], dry_run,
                      [b"--no-python", b"true"], None, timeout=60)
    gpu = flags_of(help_of("gpu-check"))
    assert ("fabric-wait", True) in gpu, gpu
    failures += sweep(tmp_path, [b"gpu-check", b"--skip-cuda"],
                      [(f, v) for f, v in gpu if f not in ("cuda-smoke-child", "dump-snapshot")],
                      [], None)
    stacks = flags_of(help_of("stacks"))
    failures += sweep(tmp_path, [b"stacks"], stacks, [], None)
    store = flags_of(help_of("store"))
    assert ("port", True) in store, store
    failures += sweep(tmp_path, [b"store", b"--port", b"0"], store, [], "MUSTER_STORE_", timeout=3)
    assert not failures, "\n".join(failures)


def test_a_duration_too_large_is_a_configuration_error_naming_the_flag_and_the_range():
    for flag in ("--monitor-interval", "--grace-period", "--hang-timeout", "--startup-timeout"):
        code, out = run([*(a.encode() for a in LAUNCH_BASE), flag.encode(), b"1e20",
                         b"--no-python", b"true"])
        assert code == 202, (flag, out)
        text = out.decode(errors="replace")
        assert f"invalid {flag} `1e20`" in text and "from 0 to 31536000" in text, text
    code, out = run([b"gpu-check", b"--fabric-wait", b"1e20"])
    assert code == 202, out
    assert b"from 0 to 31536000" in out, out
