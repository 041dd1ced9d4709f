"""OpenClaw-RL judge parsing, majority vote, hints, prompts and next-state lookup."""

from __future__ import annotations

import pickle

import pytest

from scoring_workers.judge.errors import JudgeFailedError
from scoring_workers.judge.prompts import (
    HINT_SUFFIX_HEADER,
    append_hint_to_messages,
    build_hint_judge_messages,
    build_prm_judge_messages,
    parse_boxed_score,
    parse_hint_judgement,
    select_best_hint,
)
from scoring_workers.judge.voting import majority_vote
from scoring_workers.prm._frozen import freeze
from scoring_workers.scorers.conversation import (
    NextState,
    locate_next_state,
    message_text,
    normalize_template_messages,
    render_chatml,
    render_response_text,
)


# --------------------------------------------------------------------------- \boxed{}
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{1}", 1),
        (r"\boxed{0}", 0),
        (r"\boxed{-1}", -1),
        (r"\boxed{+1}", 1),
        (r"\boxed{-0}", 0),
        (r"\boxed{+0}", 0),
        (r"\boxed{1.0}", None),
        (r"\boxed{ 1 }", None),
        (r"\boxed{10}", None),
        (r"\boxed{2}", None),
        (r"\boxed{-2}", None),
        (r"\boxed{+-1}", None),
        (r"\boxed{}", None),
        (r"\boxed{one}", None),
        ("no box at all", None),
        ("", None),
        (None, None),
        (r"boxed{1}", None),  # no backslash
        (r"\Boxed{1}", None),
        (r"\boxed {1}", None),
        # last *matching* box counts ...
        (r"\boxed{-1} first, final answer \boxed{1}", 1),
        (r"\boxed{1} ... \boxed{0}", 0),
        (r"think \boxed{1} then \boxed{1.0}", 1),  # \boxed{1.0} is not a candidate
        (r"\boxed{-1} and \boxed{ 1 }", -1),
        # ... and an invalid last candidate does not fall back to an earlier one
        (r"\boxed{1} then \boxed{5}", None),
        (r"\boxed{-1} then \boxed{-7}", None),
        (r"\boxed{\boxed{1}}", 1),
        ("\\boxed{1}\n\nMultiline \\boxed{-1}\n", -1),
        ("\\boxed{\uff11}", 1),  # full-width digit: Python's \d, exactly as OpenClaw-RL's regex
    ],
)
def test_parse_boxed_score(text, expected):
    assert parse_boxed_score(text) == expected


# --------------------------------------------------------------------------- majority
@pytest.mark.parametrize(
    ("votes", "expected"),
    [
        ([1, 1, 1], 1.0),
        ([1, 1, -1], 1.0),
        ([1, -1, 0], 0.0),  # three-way tie
        ([1, -1, None], 0.0),  # two valid, tie
        ([None, None, 1], 1.0),  # the only valid vote
        ([None, None, None], 0.0),
        ([], 0.0),
        ([-1, -1, 1], -1.0),
        ([0, 0, 1], 0.0),
        ([0, 1, 1], 1.0),
        ([-1], -1.0),
        ([1, 1, -1, -1], 0.0),
        ([1, 1, -1, -1, 0], 0.0),
        ([1, 1, -1, 0, 0], 0.0),
        ([-1, -1, 1, 0, None], -1.0),
    ],
)
def test_majority_vote(votes, expected):
    result = majority_vote(votes)
    assert result == expected and isinstance(result, float)


# --------------------------------------------------------------------------- hints
def test_parse_hint_judgement():
    text = "Reasoning...\n\\boxed{1}\n[HINT_START]\n  Use the metric system.\nAsk first.  \n[HINT_END]"
    assert parse_hint_judgement(text) == (1, "Use the metric system.\nAsk first.")
    assert parse_hint_judgement("\\boxed{-1}") == (-1, "")
    assert parse_hint_judgement("\\boxed{0} [HINT_START]x[HINT_END]") == (None, "x")  # 0 is not a hint score
    assert parse_hint_judgement("\\boxed{+1}[HINT_START]a[HINT_END][HINT_START] b [HINT_END]") == (1, "b")
    assert parse_hint_judgement("[HINT_START]unterminated") == (None, "")
    assert parse_hint_judgement("\\boxed{1} \\boxed{3}") == (None, "")
    assert parse_hint_judgement(None) == (None, "")


def test_select_best_hint():
    long_a = "Check the units before answering."
    long_b = "Check the units before answering!!"  # longer by one
    assert select_best_hint([(1, long_a), (1, long_b), (-1, long_b + "xxxxxxxx")]) == long_b
    # ties -> earliest
    assert select_best_hint([(1, "A" * 20), (1, "B" * 20)]) == "A" * 20
    # > 10 characters after stripping, score must be exactly 1
    assert select_best_hint([(1, "   short     "), (None, long_a), (-1, long_a)]) is None
    assert select_best_hint([(1, "0123456789")]) is None
    assert select_best_hint([(1, " 0123456789A ")]) == "0123456789A"
    # a score equal to 1 counts, as OpenClaw-RL's ``v.get("score") == 1`` (True == 1, 1.0 == 1)
    assert select_best_hint([None, {"score": 1, "hint": long_a}, {"score": True, "hint": long_b}]) == long_b
    assert select_best_hint([(1.0, long_a), (False, long_b), ("1", long_b)]) == long_a
    assert select_best_hint([]) is None


def test_append_hint_to_messages_targets_last_user_message_without_mutation():
    messages = freeze(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "image", "url": "x"}]},
            {"role": "tool", "content": "tool out"},
        ]
    )
    out = append_hint_to_messages(messages, "  Be precise.  ")
    assert out[3]["content"] == f"second\n\n{HINT_SUFFIX_HEADER}\nBe precise."
    assert [m["content"] for m in out[:3]] == ["sys", "first", "a"]
    assert messages[3]["content"][0]["text"] == "second"  # frozen input untouched
    out[0]["content"] = "mutable"  # a private, mutable copy
    assert append_hint_to_messages([{"role": "assistant", "content": "x"}], "h")[0]["content"] == (
        f"x\n\n{HINT_SUFFIX_HEADER}\nh"
    )
    assert append_hint_to_messages([], "h") == [{"role": "user", "content": f"{HINT_SUFFIX_HEADER}\nh"}]


# --------------------------------------------------------------------------- prompts
def test_prm_prompt_is_role_aware():
    msgs = build_prm_judge_messages("I ran ls.", "file1 file2", "tool")
    assert [m["role"] for m in msgs] == ["system", "user"]
    system, user = msgs[0]["content"], msgs[1]["content"]
    assert "A successful, non-error tool output means the assistant's action worked correctly" in system
    assert "A change request IS negative feedback" in system
    assert "\\boxed{1}" in system and "\\boxed{-1}" in system and "\\boxed{0}" in system
    assert "## Assistant output\nI ran ls.\n\n## Next state [role: tool]\nfile1 file2\n\n" in user


def test_hint_prompt():
    msgs = build_hint_judge_messages("resp", "no, wrong file", "user")
    assert "hindsight hint extraction" in msgs[0]["content"]
    assert "[HINT_START] and [HINT_END]" in msgs[0]["content"]
    assert "## Next state (turn t+1) [role: user]\nno, wrong file" in msgs[1]["content"]


def test_render_helpers():
    assert (
        render_chatml([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert message_text({"content": None}) == "" and message_text(None) == ""
    # a null text part is empty, as a missing one (OpenClaw-RL's join raises TypeError on it)
    parts = [{"type": "text", "text": None}, {"type": "text"}, {"type": "text", "text": "b"}, {"type": "image_url"}]
    assert message_text({"content": parts}) == "  b"
    assert message_text({"content": tuple(parts)}) == "  b"  # a tuple is flattened like a list
    out = [
        {
            "role": "assistant",
            "content": "Listing.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/"}'}}],
        }
    ]
    assert render_response_text(out) == 'Listing.\n<tool_call>{"name": "ls", "arguments": {"path": "/"}}</tool_call>'
    dict_args = [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {"b": 1}}}]}
    ]
    assert render_response_text(dict_args) == '<tool_call>{"name": "f", "arguments": {"b": 1}}</tool_call>'


# --------------------------------------------------------------------------- next state
SYS = {"role": "system", "content": "sys"}
U1 = {"role": "user", "content": "list files"}
A1 = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]}
T1 = {"role": "tool", "content": "a.txt b.txt"}
A2 = {"role": "assistant", "content": "There are two files."}
U2 = {"role": "user", "content": "thanks! now delete a.txt"}
A3 = {"role": "assistant", "content": "Deleted."}
CONV = [SYS, U1, A1, T1, A2, U2, A3]


def test_locate_next_state_prefix_rule():
    assert locate_next_state([SYS, U1], [A1], CONV) == (True, NextState("tool", "a.txt b.txt", 3))
    assert locate_next_state([SYS, U1, A1, T1], [A2], CONV) == (True, NextState("user", U2["content"], 5))
    assert locate_next_state([SYS, U1, A1, T1, A2, U2], [A3], CONV) == (True, None)  # last turn


def test_locate_next_state_tolerates_rewritten_assistant_history():
    # The agent stripped reasoning from history: the assistant text differs, roles match.
    history_a1 = {"role": "assistant", "content": "<think>long</think>", "tool_calls": A1["tool_calls"]}
    assert locate_next_state([SYS, U1, history_a1, T1], [A2], CONV)[1].position == 5


def test_locate_next_state_fallback_search_and_not_found():
    # History truncated (system prompt dropped): the prefix rule fails, the output is searched.
    assert locate_next_state([U1, A1, T1], [A2], CONV) == (True, NextState("user", U2["content"], 5))
    # Output nowhere in the conversation.
    assert locate_next_state([U1], [{"role": "assistant", "content": "never said"}], CONV) == (False, None)
    # Several matches: the one closest to len(turn_messages).
    a = {"role": "assistant", "content": "ok"}
    conv = [U1, a, {"role": "user", "content": "again"}, a, {"role": "user", "content": "thanks"}, A3]
    assert locate_next_state([U1, a, {"role": "user", "content": "AGAIN?"}], [a], conv)[1].text == "thanks"


def test_locate_next_state_first_rule_skips_system_and_stops_at_assistant():
    conv = [U1, A2, {"role": "system", "content": "reminder"}, U2]
    assert locate_next_state([U1], [A2], conv, "first")[1] == NextState("user", U2["content"], 3)
    conv = [U1, A2, A3, U2]  # another assistant message follows: no environment feedback
    assert locate_next_state([U1], [A2], conv, "first") == (True, None)
    # No recorded output messages: the assistant run at the output position is skipped.
    assert locate_next_state([U1], [], conv, "first")[1] == NextState("user", U2["content"], 3)
    with pytest.raises(ValueError, match="next-state rule"):
        locate_next_state([U1], [A2], conv, "middle")


TA = {"role": "tool", "content": "A"}
TB = {"role": "tool", "content": "B"}
UX = {"role": "user", "content": "next"}
SX = {"role": "system", "content": "note"}


@pytest.mark.parametrize(
    ("between", "upstream", "ours"),
    [
        # OpenClaw-RL's table: the last message of the next request (before the next assistant turn).
        ([UX], ("user", "next"), ("user", "next")),
        ([TA, TB], ("tool", "B"), ("tool", "A")),
        ([TA, UX], ("user", "next"), ("tool", "A")),
        ([UX, SX], ("system", "note"), ("user", "next")),
        ([SX, UX], ("user", "next"), ("user", "next")),
        ([{"content": "no role"}], ("user", "no role"), None),
        (
            [{"role": "developer", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}],
            ("developer", "x y"),
            None,
        ),
    ],
)
def test_next_state_upstream_last_rule_and_our_first_rule(between, upstream, ours):
    conv = [U1, A1, *between, A3]
    located, state = locate_next_state([U1], [A1], conv)  # default: OpenClaw-RL's rule
    assert located and (state.role, state.text) == upstream and state.position == 1 + len(between)
    _, mine = locate_next_state([U1], [A1], conv, "first")
    assert (None if mine is None else (mine.role, mine.text)) == ours


def test_next_state_upstream_edges():
    # The next request adds nothing after the output: its last message is the output itself (role assistant).
    assert locate_next_state([U1], [A1], [U1, A1, A3]) == (True, NextState("assistant", "", 1))
    # No later assistant turn (the session's last turn): no next request, no next state.
    assert locate_next_state([U1], [A1], [U1, A1, TA, UX]) == (True, None)
    assert locate_next_state([U1], [A1], [U1, A1]) == (True, None)


def test_judge_failed_error_reason_and_pickling():
    exc = JudgeFailedError("all failed", interaction_id="t1", calls=3, errors=2, invalid=1, last_error="boom")
    assert exc.reason == "judge_failed" and exc.reason == "judge_failed"
    assert not isinstance(exc, TimeoutError)
    again = pickle.loads(pickle.dumps(exc))
    assert (again.reason, again.interaction_id, again.calls, again.errors, again.invalid) == (
        "judge_failed",
        "t1",
        3,
        2,
        1,
    )


def test_normalize_template_messages_as_upstream():
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "image"}]},
        {"role": "user", "content": "hi", "name": "u"},
    ]
    out = normalize_template_messages(messages)
    assert out == [{"role": "system", "content": "a"}, {"role": "user", "content": "hi", "name": "u"}]
    assert messages[0]["role"] == "developer"  # copies: the input is untouched
