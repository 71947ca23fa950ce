"""Chapter 7's real-model recipe on CPU: GSM8K with a Python tool. A scripted policy calls
the tool between single-token markers, the sandbox runs the code, its output comes back as
observation tokens (no chat template around them, no special token added), and the final
answer is scored as chapter 5's GSM8K task scores it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from avrid.agents.episodes import run_episodes
from avrid.agents.gsm8k_tool import CLOSE, OPEN, Gsm8kToolTask
from avrid.agents.sandbox import use_sandbox
from avrid.ppo.engines.torch_engine import Completion, SamplingParams
from avrid.ppo.setup.tokenizer import HFTokenizer
from tests.test_agents_sandbox import local_sandbox

pytestmark = pytest.mark.chapter(7)

WORDS = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":", "print", "(", ")", "*", "6", "7",
         "42", "41", "####", "what", "is", "?"]


def tokenizer(path: Path) -> HFTokenizer:
    """A word-level tokenizer with a chat template and Qwen's tool markers as single tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    # One token each, as in Qwen2.5's vocabulary.
    fast.add_tokens([OPEN, CLOSE, "<tool_response>", "</tool_response>"])
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}")
    fast.save_pretrained(str(path))
    return HFTokenizer(path, chat_template=True)


class ScriptedPolicy:
    """Says `turns[i]` at its i-th call for an episode (by context length order), stopping at
    the first stop id as an engine does."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.calls = turns, 0

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams) -> list[Completion]:
        ids = self.turns[self.calls]
        self.calls += 1
        cut = next((i + 1 for i, t in enumerate(ids) if t in params.stop_token_ids), len(ids))
        ids = ids[:cut]
        return [Completion(token_ids=tuple(ids), logprobs=(-0.1,) * len(ids),
                           finish_reason="stop" if cut <= len(self.turns[self.calls - 1])
                           else "length") for _ in prompts]


@pytest.mark.parametrize("answer, reward", [("42", 1.0), ("41", 0.0)])
def test_a_python_call_then_the_answer(tmp_path: Path, answer: str, reward: float) -> None:
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps({"question": "what is 6 * 7 ?",
                                          "answer": "6 * 7 = 42\n#### 42"}) for _ in range(4)))
    task = Gsm8kToolTask(data, instruction="", max_tokens=64, turn_tokens=16)
    tok = tokenizer(tmp_path / "tok")
    stop = tok.encode_text(task.turn_stops)
    assert len(stop) == 1  # the marker is one token: the turn stops exactly there
    call = tok.encode_text(f"{OPEN} print ( 6 * 7 ) {CLOSE}")
    final = tok.encode_text(f"#### {answer}") + [tok.eos_token_id]
    # The scripted call goes on past the marker: the stop must cut it there.
    policy = ScriptedPolicy([call + tok.encode_text("41 41"), final])
    prompt = task.train_prompts()[0]
    with use_sandbox(local_sandbox()):
        [traj], _ = run_episodes(policy, [task.make_env(prompt)], tokenizer=tok,
                                 limits=task.limits, prompts=[prompt],
                                 params=SamplingParams(max_new_tokens=1,
                                                       stop_token_ids=(tok.eos_token_id,
                                                                       *stop)))
    assert list(traj.prompt) == tok.encode(prompt.text)  # the chat template, as prompts get
    kinds = [kind for kind, _, _ in traj.turns]
    assert kinds == ["policy", "observation", "policy"]
    (_, a, b), (_, c, d), (_, e, f) = traj.turns
    assert traj.ids[a:b] == call
    shown = tok.decode(traj.ids[c:d])
    assert "42" in shown and "<tool_response>" in shown
    # Observation ids are the text's own: no template, no special token around them.
    assert traj.ids[c:d] == tok.encode_text("\n<tool_response>\n42\n\n</tool_response>\n")
    assert traj.ids[e:f] == final
    assert (traj.reward, traj.done, traj.tool_calls, traj.tool_errors) == (reward, True, 1, 0)


def test_the_tool_cannot_read_the_answer_key(tmp_path: Path) -> None:
    """A red team's policy read the GSM8K file through the tool and printed the answer: in
    the default sandbox the file, and anything next to it, is not there to read."""
    from tests.test_agents_sandbox import namespaces_or_skip

    namespaces_or_skip()
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("\n".join(json.dumps({"question": "what is 6 * 7 ?",
                                          "answer": "#### 987654321"}) for _ in range(4)))
    (tmp_path / "notes.txt").write_text("the answer is 987654321")
    task = Gsm8kToolTask(data, instruction="", max_tokens=64, turn_tokens=16)
    env = task.make_env(task.train_prompts()[0])
    for code in (f"print(open({str(data)!r}).read())",
                 f"import os; print(os.listdir({str(tmp_path)!r}))",
                 "import glob; print(glob.glob('/tmp/**', recursive=True))"):
        step = env.step([], f"{OPEN}\n{code}\n{CLOSE}")
        assert "987654321" not in str(step.observation) and "notes.txt" not in \
            str(step.observation), step
