"""Chapter 5 — a packed forward reads the sequence boundaries back from the device once, not
once per layer (issue 41, item 9).

Every value a CPU kernel reads back from a tensor to decide what to do next (`.item()`,
`int(t)`, `bool(t)`, `.tolist()`, a `nonzero` or a boolean-mask index, whose output size only
the data knows) is, on a GPU, the host waiting for the device: the queue of kernels drains.
Under `TorchDispatchMode` those reads are the ops `aten._local_scalar_dense` (every scalar
read) and `aten.nonzero` (data-dependent sizes, masked indexing included), so counting them
on the CPU counts the syncs a GPU forward would make.

A packed micro-batch (`columns.packed_inputs`) carries its boundaries (`cu_seqlens`,
`longest`) made once, and `forward.run_model` passes them to every layer as transformers'
flash-attention keyword arguments (`packed_attention.varlen_kwargs`). So a tiny Qwen2 with
2 layers and one with 6 make the same number of syncs per forward, and per forward + backward
with activation checkpointing (whose recompute runs every layer's forward again); reading the
boundaries from the position ids in each layer made a few per layer. The kwargs change no
value: the trainer's log-probs, values and gradients are bit for bit those of the kernel
working the boundaries out itself.

flash-attn 2 itself (CUDA only) gets the same kwargs: `test_flash_attention_takes_the_
boundaries_once_on_cuda`, gpu-marked.

Not here: the kernel's equality with one-sequence-at-a-time attention (test_packed_attention.py),
packed == padded for the trainer's outputs (test_ppo_packed_logprobs.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from avrid.ppo.data.columns import ModelInputs, packed_inputs
from avrid.ppo.engines.models import TinyModelSpec, build_tiny_critic, build_tiny_policy
from avrid.ppo.engines.packed_attention import register, sequence_bounds
from avrid.ppo.roles.forward import response_logprobs, response_values, run_model
from avrid.ppo.roles.trained import checkpoint_activations
from tests.helpers import ragged_batch

pytestmark = pytest.mark.chapter(5)

VOCAB = 40
PROMPT_LENS = [3, 1, 5, 2, 4]
RESPONSE_LENS = [2, 9, 1, 3, 6]
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero")
"""The ops through which a value goes from a tensor to the host (see the module docstring)."""


class HostSyncs(TorchDispatchMode):
    """Counts the ops of `SYNC_OPS` run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func._overloadpacket._qualified_op_name.replace("::", ".")
        if name in SYNC_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def spec(layers: int) -> TinyModelSpec:
    return TinyModelSpec(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2,
                         num_layers=layers)


def policy(layers: int, *, checkpointing: bool = False) -> torch.nn.Module:
    model = build_tiny_policy(spec(layers), seed=0)
    model.set_attn_implementation(register())
    if checkpointing:  # as the trainer turns it on: non-reentrant, recompute in backward
        checkpoint_activations(model)
    return model


def batch():  # noqa: ANN201 - a Batch
    return ragged_batch(PROMPT_LENS, RESPONSE_LENS, vocab=VOCAB, sample_ids=range(5),
                        columns={})


def syncs_of_forward(layers: int) -> int:
    """Host syncs of running the model on one packed micro-batch (its inputs built before)."""
    model, x = policy(layers), packed_inputs(batch(), pad_id=0)
    with torch.no_grad(), HostSyncs() as seen:
        run_model(model, x)
    return seen.total


def syncs_of_training_step(layers: int) -> int:
    """Host syncs of building the inputs, a forward + backward of the log-probs, activation
    checkpointing on."""
    model, b = policy(layers, checkpointing=True), batch()
    model.train()
    with HostSyncs() as seen:
        logp, _ = response_logprobs(model, packed_inputs(b, pad_id=0), 1.0)
        logp.sum().backward()
    return seen.total


def test_a_packed_forward_syncs_with_the_host_a_fixed_number_of_times_whatever_the_depth(
        ) -> None:
    shallow, deep = syncs_of_forward(2), syncs_of_forward(6)
    assert shallow == deep, (f"host syncs per forward grow with the layers: {shallow} with "
                             f"2 layers, {deep} with 6")
    assert deep <= 1  # `run_model`'s look at the attention mask (all ones: left out)


def test_activation_checkpoint_recompute_adds_no_sync_per_layer() -> None:
    shallow, deep = syncs_of_training_step(2), syncs_of_training_step(6)
    assert shallow == deep, (f"host syncs per forward + backward grow with the layers: "
                             f"{shallow} with 2 layers, {deep} with 6")


def without_bounds(x: ModelInputs) -> ModelInputs:
    """`x` as it was before the boundaries travelled with it: every layer's kernel reads them
    from the position ids."""
    return replace(x, cu_seqlens=None, longest=0)


def test_passing_the_bounds_down_changes_no_value_and_no_gradient() -> None:
    b = batch()
    x = packed_inputs(b, pad_id=0)
    cu, longest = sequence_bounds(x.position_ids)
    assert torch.equal(cu, x.cu_seqlens) and longest == x.longest == max(
        p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True))
    outputs, grads = [], []
    for inputs in (x, without_bounds(x)):
        actor = policy(3, checkpointing=True)
        critic = build_tiny_critic(spec(3), seed=1)
        critic.set_attn_implementation(register())
        logp, ent = response_logprobs(actor, inputs, 0.7, with_entropy=True)
        values = response_values(critic, inputs)
        (logp.sum() + ent.sum() + values.sum()).backward()
        outputs.append((logp, ent, values))
        grads.append({n: p.grad for m in (actor, critic) for n, p in m.named_parameters()})
    for got, want in zip(*outputs, strict=True):
        assert torch.equal(got, want)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.gpu(duration_s=60, memory_gb=2)
def test_flash_attention_takes_the_boundaries_once_on_cuda() -> None:
    # flash-attn 2's varlen path: with the kwargs it runs `flash_attn_varlen_func` on them as
    # given; without, `_is_packed_sequence` and `prepare_fa_kwargs_from_position_ids` read the
    # position ids in every layer. Same output, and the syncs stop growing with the layers.
    pytest.importorskip("flash_attn")
    x = packed_inputs(batch().to(torch.device("cuda")), pad_id=0)
    outs, syncs = [], []
    for layers in (2, 6):
        model = build_tiny_policy(spec(layers), seed=0, dtype=torch.bfloat16).cuda()
        model.set_attn_implementation("flash_attention_2")
        with torch.no_grad(), HostSyncs() as seen:
            out = run_model(model, x).logits
        syncs.append(seen.total)
        with torch.no_grad():
            outs.append((out, run_model(model, without_bounds(x)).logits))
    assert syncs[0] == syncs[1]
    for with_bounds, from_positions in outs:
        assert torch.equal(with_bounds, from_positions)
