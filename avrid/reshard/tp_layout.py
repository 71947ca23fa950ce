"""Chapter 4 — the tensor-parallel layout vLLM gives a transformers decoder.

`decoder_shapes(...)` lists a decoder's parameters from its config; `decoder_tp_layout(shapes,
tp)` reads parameter names of a Qwen2/Llama-family model and says,
for each, which rows or columns every tensor-parallel rank holds: column-parallel q/k/v and
gate/up, row-parallel o/down, vocab-parallel embeddings and lm_head (padded to a multiple of
64 as vLLM does), replicated norms. It builds `ModelLayout`s (`layout.py`); it does not plan
transfers or touch tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from avrid.reshard.layout import (
    DType,
    LayoutError,
    ModelLayout,
    ParamLayout,
    Region,
    Shapes,
    check_world_size,
    first_dim_size,
)

_ATTN = frozenset({"q_proj", "k_proj", "v_proj"})
_COLUMN = _ATTN | {"gate_proj", "up_proj"}
_ROW = frozenset({"o_proj", "down_proj"})
_VOCAB = frozenset({"embed_tokens", "lm_head"})
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def decoder_shapes(*, layers: int, hidden: int, intermediate: int, heads: int,
                   kv_heads: int, vocab: int, dtype: DType = "float32") -> Shapes:
    """Name -> (shape, dtype) of every parameter of a Qwen2-style decoder, from its config,
    without building it: q/k/v with biases, o, gate/up/down, two norms per layer, the final
    norm, embeddings and an untied lm_head — the names transformers uses.

    Example:
        >>> s = decoder_shapes(layers=1, hidden=8, intermediate=16, heads=2, kv_heads=1,
        ...                    vocab=64)
        >>> s["model.layers.0.self_attn.k_proj.weight"], len(s)
        (((4, 8), 'float32'), 15)
    """
    kv = kv_heads * (hidden // heads)
    shapes: dict[str, tuple[tuple[int, ...], DType]] = {
        "model.embed_tokens.weight": ((vocab, hidden), dtype)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": ((hidden, hidden), dtype),
            f"{p}.self_attn.q_proj.bias": ((hidden,), dtype),
            f"{p}.self_attn.k_proj.weight": ((kv, hidden), dtype),
            f"{p}.self_attn.k_proj.bias": ((kv,), dtype),
            f"{p}.self_attn.v_proj.weight": ((kv, hidden), dtype),
            f"{p}.self_attn.v_proj.bias": ((kv,), dtype),
            f"{p}.self_attn.o_proj.weight": ((hidden, hidden), dtype),
            f"{p}.mlp.gate_proj.weight": ((intermediate, hidden), dtype),
            f"{p}.mlp.up_proj.weight": ((intermediate, hidden), dtype),
            f"{p}.mlp.down_proj.weight": ((hidden, intermediate), dtype),
            f"{p}.input_layernorm.weight": ((hidden,), dtype),
            f"{p}.post_attention_layernorm.weight": ((hidden,), dtype),
        })
    shapes["model.norm.weight"] = ((hidden,), dtype)
    shapes["lm_head.weight"] = ((vocab, hidden), dtype)
    return shapes


def decoder_tp_layout(shapes: Shapes, tp: int, *, head_dim: int | None = None,
                      default: Literal["error", "replicated"] = "error") -> ModelLayout:
    """The tensor-parallel layout vLLM gives a Qwen2/Llama-family transformers decoder.

    By the module name before ``.weight``/``.bias``:
    - q/k/v_proj, gate/up_proj: column-parallel, dim 0 of the [out, in] weight and the bias;
    - o_proj, down_proj: row-parallel, dim 1 of the weight; a bias is replicated;
    - embed_tokens, lm_head: vocab-parallel on dim 0 as vLLM's VocabParallelEmbedding: the
      vocab is padded to a multiple of 64, each rank owns padded/tp rows and holds the real
      ones among them (vocab 100 over 2 ranks: rows 0:64 and 64:100);
    - any module with "norm" in its name: replicated.

    vLLM fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj parameter; the vLLM
    adapter maps names, which does not change which elements each TP rank needs, so layouts
    use transformers' names. With `head_dim`, q/k/v split by whole heads and, as in vLLM, a
    kv head is replicated on tp / kv_heads ranks when tp exceeds the kv heads (without it k/v
    rows are split evenly, right when tp divides the kv heads). Unknown parameters are an
    error listing them, unless ``default="replicated"``.

    Example:
        >>> m = decoder_tp_layout({"model.layers.0.mlp.down_proj.weight":
        ...                        ((64, 128), "bfloat16")}, tp=2)
        >>> [str(r) for r in m["model.layers.0.mlp.down_proj.weight"].regions]
        ['[0:64, 0:64]', '[0:64, 64:128]']
    """
    check_world_size(tp)
    if default not in ("error", "replicated"):
        raise LayoutError(f"default must be 'error' or 'replicated', got {default!r}")
    out: list[tuple[str, ParamLayout]] = []
    unknown = []
    for name, (shape, dtype) in shapes.items():
        module, _, leaf = name.rpartition(".")
        module = module.rpartition(".")[2]
        if module in _COLUMN and leaf in ("weight", "bias"):
            p = (_heads(name, shape, dtype, tp, head_dim, module != "q_proj")
                 if head_dim and module in _ATTN else
                 ParamLayout.split(shape, dtype, tp, 0, name=name))
        elif module in _ROW and leaf == "weight":
            p = ParamLayout.split(shape, dtype, tp, 1, name=name)
        elif module in _VOCAB and leaf == "weight":
            p = _vocab(name, shape, dtype, tp)
        elif "norm" in module or (module in _ROW and leaf == "bias") or default != "error":
            p = ParamLayout.replicated(shape, dtype, tp)
        else:
            unknown.append(name)
            continue
        out.append((name, p))
    if unknown:
        raise LayoutError(f"decoder_tp_layout does not know how vLLM shards {unknown}; "
                          f"known modules: {sorted(_COLUMN | _ROW | _VOCAB)} and *norm*; "
                          f"pass default='replicated' to replicate the rest")
    return ModelLayout(world_size=tp, params=tuple(out))


def _vocab(name: str, shape: Sequence[int], dtype: DType, tp: int) -> ParamLayout:
    vocab = first_dim_size(shape, "vocab-parallel", tp)
    padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp:
        raise LayoutError(f"parameter {name!r}: vLLM pads the vocab ({vocab}) to {padded}, "
                          f"which {tp} ranks cannot split evenly")
    per, rest = padded // tp, tuple((0, int(n)) for n in shape[1:])
    regions = [Region(bounds=((min(r * per, vocab), min((r + 1) * per, vocab)), *rest))
               for r in range(tp)]
    return ParamLayout(shape=tuple(shape), dtype=dtype, regions=tuple(regions), kind="vocab")


def _heads(name: str, shape: Sequence[int], dtype: DType, tp: int, head_dim: int,
           kv: bool) -> ParamLayout:
    rows = first_dim_size(shape, "tensor-parallel", tp)
    heads, odd = divmod(rows, head_dim)
    if odd or heads == 0:
        raise LayoutError(f"parameter {name!r}: {rows} rows are not whole heads of {head_dim}")
    if heads % tp == 0:
        return ParamLayout.split(shape, dtype, tp, 0, name=name)
    if not kv or tp % heads:
        raise LayoutError(f"parameter {name!r}: vLLM needs its {heads} heads divisible by tp="
                          f"{tp}" + (" or tp divisible by them (kv heads)" if kv else ""))
    # Grouped-query attention with fewer kv heads than ranks: rank r holds head r // copies.
    copies, rest = tp // heads, tuple((0, int(n)) for n in shape[1:])
    regions = tuple(Region(bounds=(((r // copies) * head_dim, (r // copies + 1) * head_dim),
                                   *rest)) for r in range(tp))
    return ParamLayout(shape=tuple(shape), dtype=dtype, regions=regions, allow_overlap=True,
                       kind=f"column x{copies}")
