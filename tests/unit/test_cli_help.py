"""`--help` reads well: the engine flags grouped by topic in a fixed order, the serve-only
flags in their own section, every flag's help ending with its default, no empty section.

Owner: tests (cli).
"""

from __future__ import annotations

import argparse
import dataclasses

from metrale.cli import build_parser
from metrale.config import EngineConfig
from metrale.engine_flags import DEFAULT_TOPIC, FLAG_TOPICS, TOPICS, add_engine_arguments


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_serve_help_groups_by_topic_with_defaults() -> None:
    serve = _subparser("serve")
    text = serve.format_help()
    titles = [g.title for g in serve._action_groups if g._group_actions]
    assert titles[1:] == [
        "server",
        "vLLM compatibility",
        "model",
        "memory",
        "scheduling",
        "speculation",
        "lora",
        "vision",
        "parallel",
    ], titles
    assert f"{DEFAULT_TOPIC}:" not in text  # empty sections hidden
    for group in serve._action_groups:
        for action in group._group_actions:
            if action.help in (None, argparse.SUPPRESS) or action.dest in ("help", "log_level"):
                continue
            assert "default" in action.help, (group.title, action.dest, action.help)
    assert "(default: 128)" in " ".join(text.split())  # --max-num-seqs
    assert "(default: on)" in " ".join(text.split())  # --enable-prefix-caching


def test_every_field_has_a_topic_group() -> None:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(FLAG_TOPICS) <= fields and set(FLAG_TOPICS.values()) <= set(TOPICS)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    grouped = {
        a.dest: g.title
        for g in parser._action_groups
        for a in g._group_actions
        if g.title in TOPICS
    }
    assert set(grouped) == fields  # a field without a topic still lands in a section
    assert all(grouped[name] == FLAG_TOPICS.get(name, DEFAULT_TOPIC) for name in fields)
