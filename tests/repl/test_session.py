"""The conversation tree behind chat turns, /fork, /pick, /back and /save."""

from __future__ import annotations

import json

import pytest

from radixlang.repl.session import Conversation, SessionError, Usage


def chat(conv: Conversation, message: str, *replies: str) -> list:
    user = conv.add_user(message)
    turns = [conv.add_reply(user, r, Usage(10, 4, 3, "stop")) for r in replies]
    conv.select(turns[0])
    return turns


def test_messages_follow_the_active_path_with_the_system_first():
    conv = Conversation(system="be brief")
    chat(conv, "hi", "hello")
    chat(conv, "how are you?", "fine")
    assert conv.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "fine"},
    ]
    user = conv.last_user()
    assert conv.messages(upto=user)[-1] == {"role": "user", "content": "how are you?"}


def test_fork_replies_are_branches_numbered_in_order_and_pick_moves_the_path():
    conv = Conversation()
    (first,) = chat(conv, "tell a joke", "joke A")
    user = conv.last_user()
    forks = [conv.add_reply(user, t) for t in ("joke B", "joke C", "joke D")]
    assert conv.current is first  # forking alone does not move the path
    got_user, replies = conv.branches()
    assert got_user is user and replies == [first, *forks]
    assert [conv.branch_number(r) for r in replies] == [1, 2, 3, 4]
    assert conv.pick(3) is forks[1]
    assert conv.messages()[-1]["content"] == "joke C"
    with pytest.raises(SessionError, match="no branch 5: pick 1 to 4"):
        conv.pick(5)
    # the next turn continues the picked branch
    chat(conv, "another", "ok")
    assert [m["content"] for m in conv.messages()] == ["tell a joke", "joke C", "another", "ok"]


def test_back_undoes_the_last_turn_and_keeps_it_in_the_tree():
    conv = Conversation()
    chat(conv, "one", "1")
    chat(conv, "two", "2")
    undone = conv.back()
    assert undone.content == "two"
    assert [m["content"] for m in conv.messages()] == ["one", "1"]
    chat(conv, "three", "3")  # a new branch beside the undone turn
    reply_one = conv.path()[1]
    assert [c.content for c in reply_one.children] == ["two", "three"]
    conv.back()
    conv.back()
    assert conv.messages() == []
    with pytest.raises(SessionError, match="nothing to undo"):
        conv.back()


def test_errors_name_what_is_missing():
    conv = Conversation()
    with pytest.raises(SessionError, match="no branches yet"):
        conv.pick(1)
    user = conv.add_user("waiting")
    with pytest.raises(SessionError, match="no reply yet"):
        conv.add_user("again")
    conv.discard(user)
    assert conv.current is conv.root and conv.root.children == []


def test_transcript_holds_messages_and_every_branch():
    conv = Conversation(system="sys")
    chat(conv, "q", "a1", "a2")
    conv.pick(2)
    chat(conv, "q2", "b")
    conv.back()
    data = json.loads(json.dumps(conv.to_json()))
    assert data["version"] == 1 and data["system"] == "sys"
    assert [m["content"] for m in data["messages"]] == ["sys", "q", "a2"]
    (q,) = data["tree"]["children"]
    assert q["role"] == "user" and [c["content"] for c in q["children"]] == ["a1", "a2"]
    a2 = q["children"][1]
    assert a2["usage"] == {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3,
                           "finish_reason": "stop"}  # fmt: skip
    assert a2["children"][0]["content"] == "q2"  # the undone turn is still saved
    assert data["current"] == a2["id"]
