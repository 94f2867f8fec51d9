"""Playbooks: the steps a person or an agent takes to answer one question about a job.

Each is a TOML file in ``kernel_probe/playbooks/`` (shipped in the wheel): a title, a
description, a goal, and steps, each a tool call (``tool``, ``args``) with what to say
before it and what to look for in its answer. The MCP server offers each as a prompt (the
steps written out for an agent to follow); ``kernel-probe playbook NAME`` runs the same
steps and prints each answer under its step, for a person without an agent.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, AsyncIterator

from .tools import Answer, Toolbox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOOLS = ("jobs", "nodes", "sql", "stacks", "diagnose", "profile", "dump")
RUNS_BY_DEFAULT = ("jobs", "nodes", "sql", "stacks", "diagnose")  # a person's run skips what takes long or writes


@dataclass(frozen=True)
class Step:
    tool: str
    say: str
    look_for: str
    args: dict[str, Any] = field(default_factory=dict)
    optional: str = ""  # when the step may not apply (its failure is then no failure of the run)


@dataclass(frozen=True)
class Playbook:
    name: str
    title: str
    description: str
    goal: str
    steps: tuple[Step, ...]

    def prompt(self, job: str | None = None) -> str:
        """The steps written out for an agent to follow with the tools."""
        lines = [f"# {self.title}", "", self.description, "", f"Goal: {self.goal}", "",
                 "Follow these steps with the tools of this server"
                 + (f", on job `{job}`" if job else "") + ". After each, note what you found; stop early when "
                 "the cause is clear. Read the catalog resource (probing://catalog) before writing SQL of your own.",
                 ""]
        for i, step in enumerate(self.steps, 1):
            args = {**step.args, **({"job": job} if job else {})}
            call = f"`{step.tool}`" + (f" with `{json.dumps(args)}`" if args else "")
            lines += [f"{i}. {step.say}", f"   Call {call}." + (f" (May not apply: {step.optional}.)"
                                                              if step.optional else ""),
                      f"   Look for: {step.look_for}", ""]
        lines.append(f"Then answer: {self.goal}")
        return "\n".join(lines)


class PlaybookError(ValueError):
    """A playbook file that does not hold a playbook (one line)."""


def _parse(name: str, text: str) -> Playbook:
    try:
        data = tomllib.loads(text)
        steps = tuple(Step(tool=s["tool"], say=s.get("say", ""), look_for=s.get("look_for", ""),
                           args=dict(s.get("args") or {}), optional=str(s.get("optional") or ""))
                      for s in data["steps"])
        book = Playbook(name=name, title=data["title"], description=data["description"], goal=data["goal"],
                        steps=steps)
    except (tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise PlaybookError(f"playbook {name}: {type(exc).__name__}: {exc}") from None
    unknown = [s.tool for s in steps if s.tool not in TOOLS]
    if unknown:
        raise PlaybookError(f"playbook {name}: unknown tool(s) {', '.join(unknown)}")
    return book


def playbooks() -> dict[str, Playbook]:
    """Every playbook shipped with the package, by name (the file's name without .toml)."""
    found = {}
    for entry in resources.files("kernel_probe.playbooks").iterdir():
        if entry.name.endswith(".toml"):
            name = entry.name[:-len(".toml")]
            found[name] = _parse(name, entry.read_text(encoding="utf-8"))
    return dict(sorted(found.items()))


def playbook(name: str) -> Playbook:
    books = playbooks()
    if name not in books:
        raise PlaybookError(f"no playbook named {name!r}; there are: {', '.join(books)}")
    return books[name]


async def run(book: Playbook, toolbox: Toolbox, job: str | None = None,
              tools: tuple[str, ...] = RUNS_BY_DEFAULT) -> AsyncIterator[tuple[int, Step, Answer | None]]:
    """Each step with the tool's answer (None for a step whose tool is not in ``tools``)."""
    for i, step in enumerate(book.steps, 1):
        if step.tool not in tools:
            yield i, step, None
            continue
        args = dict(step.args)
        if job and step.tool != "jobs":
            args["job"] = job
        yield i, step, await toolbox.run(step.tool, **args)
