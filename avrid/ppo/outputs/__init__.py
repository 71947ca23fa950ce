"""What a run leaves on disk, each written so that a crash never leaves half a file.

Read in this order:

1. outdir.py      one run per directory (a lock), preflight checks, atomic publishing
2. checkpoint.py  per-rank model/optimizer shards and RNG states with a sha256 manifest; resume
3. manifest.py    a checkpoint's manifest: its format, the sha256 of each file, verifying them
4. shards.py      the shards' layout on disk (DCP), and reading a model's shards back whole
5. metrics.py     metrics as JSON lines, the sample dump, TensorBoard and W&B
6. progress.py    the progress bar: started with the first step, other lines printed above it
7. plots.py       reward and per-phase time curves
8. export.py      a checkpoint as a Hugging Face model directory vLLM or transformers loads
9. export_dest.py  where an export may go: never over a run, never over the user's own files
10. export_lora.py  a LoRA run's export: the rebuilt base, the adapters merged onto it, and
                    the adapter as a PEFT directory that names that base
11. eval_files.py  what `avrid eval` writes: eval.jsonl (a row per prompt) and its summary

No Ray here, and nothing here trains: `driver/run.py` decides what to write and when.
"""
