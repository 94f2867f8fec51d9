"""Secrets are redacted wherever the environment, the command line and a dump show them:
by a variable's name, in values (URL credentials, secret query parameters) and in the
values of secret options on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernel_probe.redaction import REDACTED, redact_argv, redact_env, redact_text, secret_name

SECRET = "hunter2"


@pytest.mark.parametrize("name,value,shown", [
    ("DATABASE_URL", f"postgres://admin:{SECRET}@db.internal:5432/app", f"postgres://admin:{REDACTED}@db.internal:5432/app"),
    ("PIP_INDEX_URL", f"https://__token__:{SECRET}@pypi.example/simple", f"https://__token__:{REDACTED}@pypi.example/simple"),
    ("PIP_EXTRA_INDEX_URL", f"https://a.example/simple https://{SECRET}@b.example/simple",
     f"https://a.example/simple https://{REDACTED}@b.example/simple"),
    ("UPLOAD_URL", f"https://s3.example/b/o?X-Amz-Signature={SECRET}&x=1", f"https://s3.example/b/o?X-Amz-Signature={REDACTED}&x=1"),
    ("MYSQL_PWD", SECRET, REDACTED),
    ("SENTRY_DSN", f"https://{SECRET}@o1.ingest.sentry.io/5", REDACTED),
    ("PGPASSWORD", SECRET, REDACTED),
    ("SMTP_PASS", SECRET, REDACTED),
    ("PROBING_AUTH_TOKEN", SECRET, REDACTED),
    ("PWD", "/home/me/work", "/home/me/work"),
    ("OLDPWD", "/home/me", "/home/me"),
    ("MASTER_ADDR", "10.0.0.1", "10.0.0.1"),
    ("HTTP_PROXY", "http://proxy.example:3128", "http://proxy.example:3128"),
])
def test_env_values(name, value, shown):
    assert redact_env(name, value) == shown


@pytest.mark.parametrize("argv,shown", [
    (["train.py", "--password", SECRET, "--epochs", "3"], ["train.py", "--password", REDACTED, "--epochs", "3"]),
    (["train.py", f"--password={SECRET}"], ["train.py", f"--password={REDACTED}"]),
    (["train.py", "--token", SECRET], ["train.py", "--token", REDACTED]),
    (["train.py", f"--hf-token={SECRET}"], ["train.py", f"--hf-token={REDACTED}"]),
    (["train.py", "--api-key", SECRET], ["train.py", "--api-key", REDACTED]),
    (["train.py", "--api_key", SECRET], ["train.py", "--api_key", REDACTED]),
    (["train.py", "--secret", SECRET], ["train.py", "--secret", REDACTED]),
    (["train.py", "--db", f"mysql://root:{SECRET}@h/db"], ["train.py", "--db", f"mysql://root:{REDACTED}@h/db"]),
    (["env", f"WANDB_API_KEY={SECRET}", "python"], ["env", f"WANDB_API_KEY={REDACTED}", "python"]),
    (["train.py", "--token", "--lr", "0.1"], ["train.py", "--token", "--lr", "0.1"]),  # a flag, not a value
    (["train.py", "--token-limit", "5", "--keep", "3"], ["train.py", "--token-limit", "5", "--keep", "3"]),
])
def test_argv(argv, shown):
    assert redact_argv(argv) == shown


def test_names_and_plain_text():
    assert secret_name("aws_secret_access_key") and secret_name("GITHUB_PAT") and not secret_name("HOME")
    assert redact_text("no secrets here: a=b, http://host/path") == "no secrets here: a=b, http://host/path"


def test_env_and_process_tables_redact_values(monkeypatch):
    from kernel_probe.tables import live

    monkeypatch.setenv("DATABASE_URL", f"postgres://admin:{SECRET}@db/app")
    monkeypatch.setenv("MYSQL_PWD", SECRET)
    monkeypatch.setenv("SENTRY_DSN", f"https://{SECRET}@o1.ingest.sentry.io/5")
    monkeypatch.setattr(sys, "argv", ["train.py", "--password", SECRET, f"--api-key={SECRET}"])
    env = dict(live.env_rows())
    assert env["DATABASE_URL"] == f"postgres://admin:{REDACTED}@db/app"
    assert SECRET not in repr(env)
    argv = live.process_row("h")[4]
    assert SECRET not in argv and "--password" in argv and "--api-key=" in argv


@pytest.mark.processes
def test_a_dump_holds_no_secret(tmp_path):
    main = tmp_path / "main.py"
    main.write_text(textwrap.dedent(f"""
        import kernel_probe
        kernel_probe.start(wait=5)
        raise ConnectionError("could not reach postgres://admin:{SECRET}@db/app")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PROBING_RUNTIME_DIR": str(tmp_path / "rt"),
           "PROBING_DUMP_DIR": str(tmp_path / "dumps"), "PROBING_DUMP_BUDGET_SEC": "15",
           "DATABASE_URL": f"postgres://admin:{SECRET}@db/app", "MYSQL_PWD": SECRET,
           "PIP_INDEX_URL": f"https://user:{SECRET}@pypi.example/simple"}
    p = subprocess.run([sys.executable, str(main), "--password", SECRET, f"--token={SECRET}"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert "could not reach" in p.stderr
    (rank,) = Path(tmp_path / "dumps").glob("*/rank0")
    import pyarrow.parquet as pq

    shown = {name: pq.read_table(rank / f"{name}.parquet").to_pylist() for name in ("env", "process", "reason")}
    assert shown["env"] and shown["process"] and shown["reason"]
    text = json.dumps(shown, default=str) + (rank / "dump.json").read_text()
    assert SECRET not in text
    assert "--password" in shown["process"][0]["argv"] and "postgres://admin:" in shown["reason"][0]["message"]
