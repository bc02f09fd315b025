"""Conversations: follow-ups on one fork of a document's prefix, kept across processes
(`ask --continue`, `chat --resume`), dropping the oldest turns when the room runs out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import make_tiny_model
from longctx import asking
from longctx import conversation, kvcache, session
from longctx.errors import ConfigError, EntryNotFound


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("conv") / "tiny", context=2048, attn_gain=2.0)


@pytest.fixture
def doc(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("LONGCTX_MODEL", str(tiny))
    path = tmp_path / "facts.txt"
    path.write_text("The lighthouse keeper is Ada Quill. The island has 412 sheep.\n" * 6)
    session.ingest(path)
    return path


def test_turns_follow_on_one_fork_and_persist(doc):
    conv = asking.open_conversation()
    a1 = "".join(conv.ask("Who keeps the lighthouse?", max_tokens=8))
    a2 = "".join(conv.ask("How many sheep?", max_tokens=8))
    assert [t.answer for t in conv.turns] == [a1, a2]
    assert conv.cache[0].offset == conv.entry.tokens + conv.tokens  # exactly the turns' tokens
    assert conv.prefix[0].offset == conv.entry.tokens  # the document's prefix never changes
    conv.save()
    again = asking.open_conversation(cid=conv.cid)  # restored: appended, nothing prefilled
    assert [t.answer for t in again.turns] == [a1, a2] and again.tokens == conv.tokens
    keys = kvcache.new_tokens(again.cache, again.entry.tokens)
    live = kvcache.new_tokens(conv.cache, conv.entry.tokens)
    assert keys.keys() == live.keys()
    a3_live = "".join(conv.ask("And the keeper's name again?", max_tokens=8))
    a3_saved = "".join(again.ask("And the keeper's name again?", max_tokens=8))
    assert a3_live == a3_saved


def test_a_follow_up_differs_from_a_first_question(doc):
    conv = asking.open_conversation()
    "".join(conv.ask("Who keeps the lighthouse?", max_tokens=6))
    second = conv.turns and conv._prompt("How many sheep?", first=False)
    first = conv._prompt("How many sheep?", first=True)
    assert second != first  # laid out as a new user turn of the chat template
    after_answer, after_question = conversation.turn_text(conv.lm.tokenizer)
    assert after_answer.startswith("<|im_end|>") and after_question.endswith("assistant\n")


def test_the_oldest_turns_go_when_the_room_runs_out(doc, monkeypatch):
    monkeypatch.setattr(conversation, "MAX_EXACT", 140)
    conv = asking.open_conversation()
    for i in range(6):
        "".join(conv.ask(f"Question number {i} about the sheep?", max_tokens=10))
        assert conv.tokens <= 140
    assert conv.dropped >= 1 and conv.turns[-1].question.startswith("Question number 5")
    assert conv.cache[0].offset == conv.entry.tokens + conv.tokens


def test_a_question_beyond_the_room_is_one_line(doc):
    conv = asking.open_conversation()
    with pytest.raises(Exception, match="shorten the question"):
        "".join(conv.ask("word " * 3000))


def test_continue_without_a_conversation_and_unknown_ids(doc):
    with pytest.raises(EntryNotFound, match="no earlier conversation"):
        asking.open_conversation(cid="last")
    with pytest.raises(EntryNotFound, match="No conversation 'nope'"):
        asking.open_conversation(cid="nope")


def test_ask_continue_across_processes_and_chat(doc, tiny, tmp_path):
    env = {**os.environ, "LONGCTX_MODEL": str(tiny), "LONGCTX_HOME": os.environ["LONGCTX_HOME"]}

    def cli(*args, stdin=None):
        return subprocess.run(
            [sys.executable, "-m", "longctx", *args], env=env, capture_output=True, text=True, input=stdin, timeout=300
        )

    first = cli("ask", "Who keeps the lighthouse?", "--max-tokens", "6", "--json")
    assert first.returncode == 0, first.stderr
    cid = json.loads(first.stdout)["conversation"]
    second = cli("ask", "-c", "How many sheep?", "--max-tokens", "6", "--json")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["conversation"] == cid
    saved = conversation.read(cid)
    assert [t["question"] for t in saved["turns"]] == ["Who keeps the lighthouse?", "How many sheep?"]
    res = cli("chat", "--resume", "--max-tokens", "6", stdin="And the boat?\n/sources\n/reset\nHello?\n/quit\n")
    assert res.returncode == 0, res.stderr
    assert "3 turns" not in res.stderr and "(2 turns)" in res.stderr and "answers come from facts.txt" in res.stderr
    assert len(conversation.read(cid)["turns"]) == 3  # the resumed one got its third turn
    newer = conversation.saved()[0]  # /reset started another, saved with its one turn
    assert newer["id"] != cid and [t["question"] for t in newer["turns"]] == ["Hello?"]


def test_segmented_documents_refuse_a_conversation(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("LONGCTX_MODEL", str(tiny))
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(f"Paragraph {i}: " + "the sheep graze by the sea. " * 20 for i in range(40)))
    from longctx import multidoc

    multidoc.ingest_files([str(big)], None, None, "tq4")
    with pytest.raises(ConfigError, match="segments"):
        asking.open_conversation("big.txt")


def test_info_says_how_much_room_an_entry_has_and_ingest_keeps_a_chat_reserve(doc, tiny):
    from typer.testing import CliRunner

    from longctx.cli import app

    res = CliRunner().invoke(app, ["info", "facts.txt", "--json"])
    data = json.loads(res.stdout)
    assert data["room_tokens"] == 2048 - data["tokens"]
    assert session.answer_reserve(2048) == 256 and session.answer_reserve(8192) == 1024
    assert session.answer_reserve(32768) == session.CHAT_RESERVE == 4096
    assert session.answer_reserve(131072) == 4096
