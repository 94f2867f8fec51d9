"""The MCP server's pieces without a job: the tables an agent reads, the playbooks, the
declared tools and their argument errors (through the SDK's own in-process client)."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest

from kernel_probe.mcp.playbooks import TOOLS, PlaybookError, _parse, playbooks
from kernel_probe.mcp.render import table_text


def test_a_table_over_the_byte_cap_says_how_many_rows_it_shows():
    rows = [[i, "x" * 50] for i in range(1000)]
    text, shown = table_text(["n", "s"], rows, max_bytes=4000)
    assert len(text.encode()) <= 4000
    assert 0 < shown < 1000
    assert text.splitlines()[-1] == f"(showing {shown} of 1000 rows; cut at 4000 bytes; ask with a smaller LIMIT " \
                                    "or fewer columns for the rest)"
    csv_text, _ = table_text(["n", "s"], [[1, "a,b"]], fmt="csv")
    assert csv_text.splitlines() == ["n,s", '1,"a,b"']
    md, _ = table_text(["a"], [["x|y"]])
    assert "x\\|y" in md  # a pipe in a value does not break the Markdown table


def test_rows_left_out_by_the_limit_are_said():
    text, shown = table_text(["n"], [[1], [2]], total_rows=50)
    assert shown == 2 and text.endswith("(showing 2 of 50 rows; ask with a smaller LIMIT or fewer columns for the rest)")


def test_every_shipped_playbook_parses_and_calls_only_known_tools():
    books = playbooks()
    assert {"why-stuck", "why-slow", "why-died", "is-healthy", "find-straggler"} <= set(books)
    for book in books.values():
        assert book.steps and all(s.tool in TOOLS and s.look_for for s in book.steps)
        prompt = book.prompt("job-7")
        assert book.goal in prompt and '"job": "job-7"' in prompt


def test_a_broken_playbook_is_one_line():
    with pytest.raises(PlaybookError, match=r"playbook x: unknown tool\(s\) shell"):
        _parse("x", 'title="t"\ndescription="d"\ngoal="g"\n[[steps]]\ntool="shell"\n')
    with pytest.raises(PlaybookError, match="playbook y: KeyError"):
        _parse("y", 'title="t"\n')


def _with_client(fn):
    from mcp import Client

    from kernel_probe.mcp.jobs import OneTarget
    from kernel_probe.mcp.server import build_server

    async def main():
        async with Client(build_server(OneTarget("dump:///nonexistent/run"))) as client:
            return await fn(client)

    return anyio.run(main)


def test_the_server_declares_its_tools_with_typed_inputs_resources_and_prompts():
    async def listing(client):
        return await client.list_tools(), await client.list_resources(), await client.list_prompts(), \
            await client.list_resource_templates()

    tools, resources, prompts, templates = _with_client(listing)
    by_name = {t.name: t for t in tools.tools}
    assert set(by_name) == {"jobs", "nodes", "sql", "stacks", "diagnose", "profile", "dump"}
    sql = by_name["sql"].input_schema
    assert sql["required"] == ["query"]
    assert sql["properties"]["limit"]["maximum"] == 1000 and sql["properties"]["limit"]["minimum"] == 1
    assert by_name["sql"].annotations.read_only_hint and not by_name["profile"].annotations.read_only_hint
    assert all(len(t.description) > 60 for t in tools.tools)
    assert {str(r.uri) for r in resources.resources} == {"probing://catalog", "probing://playbooks"}
    assert [t.uri_template for t in templates.resource_templates] == ["probing://jobs/{job}/catalog"]
    assert {p.name for p in prompts.prompts} == set(playbooks())


def test_a_bad_argument_is_an_error_naming_it_not_a_traceback():
    async def calls(client):
        return [await client.call_tool("sql", {"query": "SELECT 1", "limit": 5000}),
                await client.call_tool("sql", {"limit": 5}),
                await client.call_tool("stacks", {"ranks": "3-1"}),
                await client.call_tool("nodes", {})]

    too_many, missing, ranks, no_job = _with_client(calls)
    assert too_many.is_error and too_many.content[0].text == \
        "argument 'limit': Input should be less than or equal to 1000"
    assert too_many.structured_content["error"]["argument"] == "limit"
    assert missing.is_error and missing.content[0].text == "argument 'query': Field required"
    assert ranks.is_error and ranks.content[0].text.startswith("argument 'ranks': ")
    assert no_job.is_error and "Traceback" not in no_job.content[0].text
    assert len(no_job.content[0].text.splitlines()) == 1


def test_a_prompt_is_the_playbooks_steps():
    async def get(client):
        return await client.get_prompt("why-stuck", {"job": "j1"})

    result = _with_client(get)
    text = result.messages[0].content.text
    assert text.startswith("# Why is it stuck?") and "Call `diagnose` with `{\"job\": \"j1\"}`" in text


@pytest.mark.processes
def test_config_prints_a_clients_json_without_a_token(monkeypatch):
    monkeypatch.setenv("PROBING_AUTH_TOKEN", "s3cret-token")
    out = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "-t", "tcp://h:1", "mcp", "--config",
                          "--token-env", "PROBING_AUTH_TOKEN"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "s3cret" not in out.stdout
    config = json.loads(out.stdout)
    server = config["mcpServers"]["probing"]
    assert server["args"][-3:] == ["mcp", "-t", "tcp://h:1"]
    assert server["env"]["PROBING_AUTH_TOKEN"] == "${PROBING_AUTH_TOKEN}"
    assert config["http"]["urls"][0].endswith("probing/mcp")


@pytest.mark.processes
def test_importing_kernel_probe_and_its_mcp_package_loads_no_sdk():
    out = subprocess.run([sys.executable, "-c", "import kernel_probe, kernel_probe.mcp, kernel_probe.mcp.tools, "
                          "kernel_probe.mcp.playbooks, sys; print(any(m == 'mcp' or m.startswith('mcp.') "
                          "for m in sys.modules))"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
