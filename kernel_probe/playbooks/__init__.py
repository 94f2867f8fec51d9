"""Playbooks as data: one TOML file per question (read by ``kernel_probe.mcp.playbooks``)."""
