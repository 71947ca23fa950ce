"""Chapter 5 — exporting the trained policy in Hugging Face format, to load and to serve.

A checkpoint (`checkpoint.py`) is for resuming: optimizer moments, RNG state, our own layout.
An export is for using the policy: a directory that ``transformers`` and vLLM read as they
read any model on the Hub::

    dest/
      config.json              the architecture, ``dtype``/``torch_dtype`` = the run's model.dtype
      model.safetensors        the actor's weights in that dtype (a tied LM head written once)
      generation_config.json   eos_token_id (every stop id of the run) and pad_token_id
      tokenizer files          only for a Hugging Face tokenizer (saved from its local directory)
      avrid_tokenizer.json     only for the char tokenizer: its alphabet and id -> token table

A LoRA run's export is three folders side by side, so that nothing in it leads the adapter
onto the merged model (that adds (alpha / r) B A twice: it is what loading ``dest/adapter``
onto ``dest`` did when the merged model sat at the top, with the adapter inside it)::

    dest/
      merged/    the policy with the adapters merged in, laid out as above (with ``merged``,
                 and in a run's own export/)
      adapter/   the PEFT adapter: adapter_config.json (its ``base_model_name_or_path`` is
                 the absolute path of base/, or of the run's model.path) and
                 adapter_model.safetensors
      base/      the base the adapter goes onto, laid out as above: a tiny model's (built
                 from the run's seed, on no disk) is written here; a pretrained run's base
                 is its own ``model.path`` checkpoint, recorded, not copied (a second copy of
                 a large model for an export that already holds the merged one)

``AutoPeftModelForCausalLM.from_pretrained(dest / "adapter")`` loads the base it names and
the adapter; so does ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
dest / "adapter")``. A moved export keeps working with the second form (the path recorded
is absolute: pass the moved base/ yourself).

Load it (a LoRA run's: ``dest/merged``) with ``AutoModelForCausalLM.from_pretrained(dest)``;
serve it with ``vllm.LLM(model=dest)``, or ``vllm.LLM(model=dest, skip_tokenizer_init=True)``
(token ids in and out) when there are no tokenizer files. The char tokenizer is not a Hugging
Face tokenizer, so nothing can load it by name: read ``alphabet`` from avrid_tokenizer.json and
decode with ``avrid.ppo.setup.tokenizer.load_tokenizer("char:" + alphabet)``, or by its
``id_to_token`` table.

Where the architecture comes from: a tiny model (``model.path`` unset) is rebuilt from the saved
config (`models.tiny_spec`, `models.tiny_config`) and the tokenizer's vocabulary size and
eos/pad ids; a pretrained one (``model.path``) keeps that checkpoint's own ``config.json``. The
tokenizer is described by a `tokenizer_record`, which `saving.save` puts in each checkpoint's
state.json; for a checkpoint without one the tokenizer is rebuilt from the saved config.

The weights: a sharded checkpoint's actor shards are put together here, in this one process
with no process group (`shards.read_model_weights`: the one place a whole fp32 copy is made);
a checkpoint written before sharding holds them whole already.

Writes are atomic, like checkpoints: everything goes into a hidden sibling ``.tmp-<dest>-*``
directory first and is renamed into place at the end, so a failure leaves no half-written export.
Where it may go is checked first (`export_dest.py`): never over the source run, inside any run
directory (but the run's own ``export/``), or over a folder that is not an earlier export.

Not here: sharded safetensors (one file; fine for the models this project trains), the critic
(only the policy is served), uploading to the Hub. A LoRA run's merge: `export_lora.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from avrid.ppo.engines.models import tiny_config, tiny_spec
from avrid.ppo.outputs.checkpoint import latest_checkpoint, load_checkpoint, savable
from avrid.ppo.outputs.export_dest import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    BASE_DIR,
    MERGED_DIR,
    check_export_dest,
)
from avrid.ppo.outputs.export_lora import (
    adapter_files,
    base_policy,
    is_lora_checkpoint,
    merged_policy,
)
from avrid.ppo.outputs.outdir import fsync_dir, move_into_place, write_file  # as checkpoints
from avrid.ppo.outputs.shards import read_model_weights
from avrid.ppo.setup.config import PPOConfig
from avrid.ppo.setup.config_file import config_from_dict
from avrid.ppo.setup.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer

WEIGHTS_FILE = "model.safetensors"
CHAR_TOKENIZER_FILE = "avrid_tokenizer.json"
_CKPT_HELP = ("a run directory (holding checkpoints/; its latest checkpoint is used), a "
              "checkpoint root (holding step_* directories) or a step directory (holding "
              "manifest.json)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Exported:
    """What `export_checkpoint` wrote."""

    dest: Path
    checkpoint: Path
    """The step directory the weights came from."""
    step: int
    files: tuple[str, ...]
    """File names in `dest`, sorted."""


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """What an export needs to know about the run's tokenizer, as JSON (saved in state.json).

    Example:
        >>> tokenizer_record(CharTokenizer("ab"))["stop_token_ids"]
        [1]
    """
    record: dict[str, Any] = {"vocab_size": int(tokenizer.vocab_size),
                              "eos_token_id": int(tokenizer.eos_token_id),
                              "pad_token_id": int(tokenizer.pad_token_id),
                              # Every id the rollout stops at (`PolicyWorker.generate`).
                              "stop_token_ids": [int(t) for t in tokenizer.stop_token_ids]}
    if isinstance(tokenizer, CharTokenizer):
        record.update(kind="char", alphabet=tokenizer.alphabet)
    elif isinstance(tokenizer, HFTokenizer):
        # Absolute: `avrid export` may run from another directory than the training did.
        record.update(kind="hf", path=os.path.abspath(tokenizer.path))
    else:  # a user's own tokenizer: the ids are exported, no vocabulary
        record.update(kind=type(tokenizer).__name__)
    return record


def resolve_checkpoint(source: str | os.PathLike[str]) -> Path:
    """The step directory `source` names: a run directory (its latest checkpoint), a
    checkpoint root (its latest step) or a step directory.

    Raises:
        FileNotFoundError: `source` does not exist, or holds no complete checkpoint.
        ValueError: `source` exists but is none of the accepted kinds.
    """
    src = Path(source)
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist; expected {_CKPT_HELP}")
    if (src / "manifest.json").is_file():
        return src
    for root in (src / "checkpoints", src):
        if root.is_dir() and (found := latest_checkpoint(root)) is not None:
            return found
    if (src / "checkpoints").is_dir():
        raise FileNotFoundError(f"{src / 'checkpoints'} holds no complete checkpoint yet")
    raise ValueError(f"{src} is not a checkpoint: expected {_CKPT_HELP}")


def export_checkpoint(source: str | os.PathLike[str], dest: str | os.PathLike[str], *,
                      overwrite: bool = False, merged: bool = True) -> Exported:
    """Export the policy of a checkpoint (see `resolve_checkpoint`) to `dest`, atomically.

    A LoRA checkpoint gives a PEFT adapter directory (``dest/adapter``) and the base it goes
    onto (``dest/base``, or the run's ``model.path`` recorded in the adapter's config), and
    with `merged` also the merged model (``dest/merged``: the rebuilt base with the adapters
    merged in); see the module docstring. Any other checkpoint gives the model in `dest`.

    Raises:
        ExportDestError: (a FileExistsError) `dest` is, contains or lies inside the source
            run or any run directory; or it is not empty and `overwrite` is False; or it is
            not an earlier export (`export_dest.py`: nothing else is ever replaced).
        FileNotFoundError / ValueError: `source` is not a checkpoint (the message says what is
            accepted), or the tokenizer directory a pretrained run used is gone.
    """
    step_dir = resolve_checkpoint(source)
    # Before anything is read: a destination over the run (or the user's files) is refused.
    target = check_export_dest(Path(dest), step_dir, overwrite=overwrite)
    ckpt = load_checkpoint(step_dir, models=("actor",), training_state=False)
    if "config" not in ckpt.state:
        raise ValueError(f"{step_dir / 'state.json'} has no 'config': not written by "
                         "`avrid ppo`, so the model's architecture is unknown")
    tokenizer = ckpt.state.get("tokenizer") or _rebuilt_tokenizer_record(ckpt.state["config"])
    weights = (read_model_weights(ckpt.sharded["actor"]) if "actor" in ckpt.sharded
               else ckpt.weights["actor"])
    adapter = base = None
    if is_lora_checkpoint(weights):  # adapters only: kept, and merged onto the rebuilt base
        cfg = _ppo_config(ckpt.state["config"])
        base = base_policy(cfg, tokenizer)
        # The adapter names its base by an absolute path: `avrid export` may run elsewhere.
        pretrained = cfg.model.path
        base_path = os.path.abspath(pretrained) if pretrained else str(target / BASE_DIR)
        adapter = adapter_files(cfg, weights, base_path=base_path)
        weights = merged_policy(cfg, base, weights) if merged else None
        base = None if pretrained else base  # on disk already: recorded, not copied
    out = export_policy(dest, weights, config=ckpt.state["config"], tokenizer=tokenizer,
                        overwrite=overwrite, source=step_dir, adapter=adapter, base=base)
    return Exported(dest=out, checkpoint=step_dir, step=ckpt.step,
                    files=tuple(sorted(p.name for p in out.iterdir())))


def export_policy(dest: str | os.PathLike[str], weights: Mapping[str, torch.Tensor] | None, *,
                  config: Mapping[str, Mapping[str, Any]], tokenizer: Mapping[str, Any],
                  overwrite: bool = False, source: Path | None = None,
                  adapter: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None,
                  base: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write `weights` (the actor's full state dict, HF names) as a Hugging Face model, or a
    LoRA run's merged model, adapter and base in their three folders (module docstring).

    Args:
        dest: the export directory; must not exist or be empty unless `overwrite`.
        weights: parameter name -> tensor, as `Trainer.state` gathers them; with an
            `adapter`, the merged model's (written to ``dest/merged``), or None for none.
        config: the run's config as `config_file.config_to_dict` makes it (state.json's "config").
        tokenizer: a `tokenizer_record`.
        overwrite: replace an earlier export in `dest` (the old one is removed only once the
            new one is in place).
        source: the checkpoint step directory the weights come from, if any: `dest` may not
            be, contain or lie inside its run (`export_dest.check_export_dest`).
        adapter: a LoRA run's (adapter_config, tensors) (`export_lora.adapter_files`),
            written as a PEFT adapter directory ``dest/adapter``; its config's
            ``base_model_name_or_path`` should name ``dest/base`` or the run's model.path.
        base: with an `adapter`, the base model's weights (`export_lora.base_policy`),
            written as a model to ``dest/base``; None where the base is on disk already.

    Returns:
        `dest` as a Path.

    Raises:
        ExportDestError: (a FileExistsError) `dest` would destroy a run or files that are
            not an earlier export, or is not empty and `overwrite` is False.
    """
    if weights is None and adapter is None:
        raise ValueError("nothing to export: no weights and no adapter")
    if base is not None and adapter is None:
        raise ValueError("a base model is exported only beside a LoRA adapter")
    dest = check_export_dest(Path(dest), source, overwrite=overwrite)
    model = config["model"]
    dtype = getattr(torch, model["dtype"])
    hf_config = _hf_config(config, tokenizer)
    tensors = None if weights is None else _weights_for(hf_config, weights, dtype)
    base_tensors = None if base is None else _weights_for(hf_config, base, dtype)
    hf_config.dtype = dtype
    text = hf_config.to_dict()
    # Transformers 5 writes "dtype", 4.x (and older vLLM) read "torch_dtype": give both.
    text["dtype"] = text["torch_dtype"] = model["dtype"]
    eos = [int(i) for i in tokenizer["stop_token_ids"]]
    gen = GenerationConfig(eos_token_id=eos, pad_token_id=int(tokenizer["pad_token_id"]),
                           bos_token_id=getattr(hf_config, "bos_token_id", None))

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
    try:
        if adapter is None:
            _write_model(tmp, text, tensors, gen, tokenizer)
        else:  # three folders: the adapter sits beside the merged model, never inside it
            if tensors is not None:
                _write_model(tmp / MERGED_DIR, text, tensors, gen, tokenizer)
            _write_adapter(tmp / ADAPTER_DIR, *adapter)
            if base_tensors is not None:
                _write_model(tmp / BASE_DIR, text, base_tensors, gen, tokenizer)
        # mkdtemp (and safetensors, for its file) make owner-only entries; a served model is
        # often read by another user or container.
        for p in tmp.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        for folder in [*(p for p in tmp.iterdir() if p.is_dir()), tmp]:
            fsync_dir(folder)
        move_into_place(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _write_model(directory: Path, text: dict[str, Any], tensors: dict[str, torch.Tensor] | None,
                 gen: GenerationConfig, tokenizer: Mapping[str, Any]) -> None:
    """One Hugging Face model directory: config, weights, generation config, tokenizer."""
    directory.mkdir(exist_ok=True)
    write_file(directory / "config.json",
               lambda p: p.write_text(json.dumps(text, indent=2, sort_keys=True) + "\n"))
    if tensors is not None:
        write_file(directory / WEIGHTS_FILE, lambda p: save_file(tensors, str(p),
                                                                  metadata={"format": "pt"}))
    write_file(directory / "generation_config.json", lambda p: gen.to_json_file(p))
    _write_tokenizer(directory, tokenizer)


def _write_adapter(directory: Path, config: dict[str, Any],
                   tensors: dict[str, torch.Tensor]) -> None:
    directory.mkdir()
    write_file(directory / ADAPTER_CONFIG, lambda p: p.write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"))
    write_file(directory / ADAPTER_WEIGHTS, lambda p: save_file(tensors, str(p),
                                                                metadata={"format": "pt"}))


def _hf_config(config: Mapping[str, Mapping[str, Any]],
               tokenizer: Mapping[str, Any]) -> PretrainedConfig:
    """The architecture: the pretrained checkpoint's own config, or the tiny model's."""
    model = config["model"]
    if model.get("path") is not None:
        path = Path(model["path"])
        if not path.is_dir():
            raise FileNotFoundError(f"the run's model.path {str(path)!r} is gone; its "
                                    "config.json describes the architecture (nothing is "
                                    "downloaded)")
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    spec = tiny_spec(_ppo_config(config), int(tokenizer["vocab_size"]))
    return tiny_config(spec, eos_token_id=int(tokenizer["eos_token_id"]),
                       pad_token_id=int(tokenizer["pad_token_id"]))


def _weights_for(hf_config: PretrainedConfig, weights: Mapping[str, torch.Tensor],
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors to write, checked against the architecture (names and shapes), in `dtype`.

    The model is built on the meta device (no memory, no init) only to list its tensors; a
    tied alias (the LM head of a ``tie_word_embeddings`` model) is listed once, under the name
    that comes first, so it is written once and transformers/vLLM re-tie it on load.
    """
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    hf_config.architectures = [type(meta).__name__]  # vLLM picks its model class by this
    expected: dict[str, torch.Tensor] = {}
    aliases: set[str] = set()
    seen: set[int] = set()
    for name, t in meta.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases.add(name)
            continue
        seen.add(id(t))
        expected[name] = t
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected) - aliases)
    bad = [f"{n}: {tuple(weights[n].shape)} != {tuple(t.shape)}" for n, t in expected.items()
           if n in weights and tuple(weights[n].shape) != tuple(t.shape)]
    if missing or unexpected or bad:
        raise ValueError(f"the checkpoint's actor weights do not fit {type(meta).__name__} "
                         f"({hf_config.model_type}): missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}, wrong shapes {bad[:5]}")
    return savable({n: weights[n].to(dtype) if weights[n].is_floating_point() else weights[n]
                     for n in expected})


def _write_tokenizer(tmp: Path, tokenizer: Mapping[str, Any]) -> None:
    kind = tokenizer.get("kind")
    if kind == "char":
        alphabet = tokenizer["alphabet"]
        table = ["<pad>", "<eos>", *alphabet]  # CharTokenizer's ids: 0 pad, 1 eos, 2.. alphabet
        doc = {"type": "avrid.ppo.setup.tokenizer.CharTokenizer", "alphabet": alphabet,
               "pad_token_id": tokenizer["pad_token_id"],
               "eos_token_id": tokenizer["eos_token_id"], "id_to_token": table,
               "load_with": f"avrid.ppo.setup.tokenizer.load_tokenizer({'char:' + alphabet!r})"}
        write_file(tmp / CHAR_TOKENIZER_FILE,
                    lambda p: p.write_text(json.dumps(doc, indent=2) + "\n"))
    elif kind == "hf":
        path = Path(tokenizer["path"])
        if not path.exists():
            raise FileNotFoundError(f"the run's tokenizer directory {str(path)!r} is gone; "
                                    "the export copies its files from there")
        from transformers import AutoTokenizer  # heavy import: only for real tokenizers

        # save_pretrained writes every file the tokenizer needs (vocab, merges, chat template).
        AutoTokenizer.from_pretrained(str(path), local_files_only=True).save_pretrained(tmp)
        for p in tmp.iterdir():
            if p.is_file():
                write_file(p, lambda _: None)  # fsync what save_pretrained wrote


def _rebuilt_tokenizer_record(config: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """For a checkpoint saved before state.json held a tokenizer record: rebuild the run's
    tokenizer from its config (the char tokenizer needs the task, for its alphabet)."""
    from avrid.ppo.setup.catalog import load_task
    from avrid.ppo.setup.tokenizer import make_tokenizer

    cfg = _ppo_config(config)
    m, t = cfg.model, cfg.task
    spec = m.tokenizer or ("char" if m.path is None else m.path)  # as make_tokenizer picks
    if spec != "char":  # a local directory: no need to load the task (or its data file)
        return tokenizer_record(load_tokenizer(spec, chat_template=m.chat_template))
    task = load_task(t.name, **t.kwargs)
    return tokenizer_record(make_tokenizer(cfg, task))


def _ppo_config(config: Mapping[str, Mapping[str, Any]]) -> PPOConfig:
    """A `PPOConfig` back from the checkpoint's config (`config_file.config_to_dict` output)."""
    try:
        return config_from_dict(config)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the checkpoint's config does not match this version of avrid "
                         f"({e}); export it with the version that trained it") from e
