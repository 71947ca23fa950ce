"""Chapter 5 — vLLM's engine run step by step, so each response is told the step it finishes.

``LLM.generate`` adds every request, steps the engine until none is left, and returns the
outputs together: the reward worker of ``rollout.stream_rewards`` (`roles/streaming.py`)
would wait for the long tail before it saw the first response. `run_streamed` does what
``LLM.generate`` does, with vLLM's engine API, and tells of each request in the engine step
that finishes it:

    prompts ──► renderer.render_cmpl ──► llm_engine.add_request  (all of them, in order)
    while one of them is unfinished:
        llm_engine.step() ──► the requests finished in this step ──► on_finish(i, completion)

The same requests with the same sampling params, added in the same order before the first
step, give the same scheduling and the same sampler draws as ``LLM.generate``: the
completions are the non-streamed call's bit for bit (`tests/test_vllm_stream.py`), per
request seeds or a batch seed alike (the caller's seeding scope covers the whole loop).

The requests carry ids of their own (``avrid-stream-<call>-<row>``, never an integer like
``LLM``'s counter, and vLLM adds a random suffix inside), and whatever raises mid-loop
(``on_finish`` included) aborts those still in the engine before it propagates, so the engine
is empty for the next call.

Not here: vLLM's outputs turned into `Completion`s and the sampling params (`vllm_engine.py`,
whose `VllmEngine.generate` calls this with an ``on_finish``). vllm is imported inside the
function only, as in `vllm_engine.py`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_CALLS = itertools.count()
"""Numbers this process's streamed calls, for request ids unique among the engine's."""


def run_streamed(llm: Any, prompts: Sequence[Any], sampling: Sequence[Any],
                 lora_request: Any, convert: Callable[[Any], T],
                 on_finish: Callable[[int, T], None]) -> list[T]:
    """`convert(output)` of each of `prompts` (vLLM ``TokensPrompt``s) generated with
    `sampling` (one vLLM ``SamplingParams`` each; their output kind is set to final-only, as
    ``LLM.generate`` sets it) and `lora_request` (None: the base model) on ``vllm.LLM``
    `llm`, in prompt order; `on_finish(i, converted)` is called for prompt i in the engine
    step that finishes it (the rows one step finishes in prompt order). On any exception
    the requests still in the engine are aborted first."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind

    if len(sampling) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(sampling)} sampling params")
    engine = llm.llm_engine
    # Rendered as vLLM's own docs show for a bypass of the deprecated raw-prompt path; token
    # ids in, so this only wraps them in the engine's input dict.
    rendered = engine.renderer.render_cmpl(
        [parse_model_prompt(llm.model_config, p) for p in prompts],
        engine.renderer.default_cmpl_tok_params)
    call = next(_CALLS)
    rows: dict[str, int] = {}
    added: list[str] = []  # the engine's internal ids, for the abort
    done: dict[int, T] = {}
    try:
        for i, (prompt, params) in enumerate(zip(rendered, sampling, strict=True)):
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output, when finished
            request_id = f"avrid-stream-{call}-{i}"
            added.append(engine.add_request(request_id, prompt, params,
                                            lora_request=lora_request))
            rows[request_id] = i
        while len(done) < len(rows):
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM has no request left to run, but "
                                   f"{len(rows) - len(done)} of this call's never finished")
            finished = sorted((rows[out.request_id], out) for out in engine.step()
                              if out.finished and out.request_id in rows)
            for i, out in finished:
                done[i] = convert(out.outputs[0])
                on_finish(i, done[i])
    except BaseException:
        # Finished requests are gone from the engine already: aborting them does nothing.
        engine.abort_request(added, internal=True)
        raise
    return [done[i] for i in range(len(rows))]
