"""axon4d export-hf CHECKPOINT OUT: write a checkpoint's model in Hugging Face's format.

OUT gets what transformers' save_pretrained writes — config.json, model.safetensors (or shards of
at most --max-shard-size and model.safetensors.index.json) and the tokenizer's files — so that
AutoModelForCausalLM.from_pretrained(OUT) loads it. axon4d's GPT and Llama become GPT2LMHeadModel
and LlamaForCausalLM; a Hugging Face model fine-tuned by axon4d train --hf keeps its class and
names. One process, no launcher; one tensor in memory at a time. OUT must be new or empty unless
--overwrite; the export appears there only when complete.
"""

from __future__ import annotations

import argparse
import sys

from axon4d.export.from_checkpoint import export_checkpoint
from axon4d.export.output import MAX_SHARD_SIZE
from axon4d.files import ckptfiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="an axon4d checkpoint directory (step_<N>, with meta.json)")
    parser.add_argument("out", help="the directory to write the Hugging Face model into (new or empty)")
    parser.add_argument(
        "--max-shard-size", default=MAX_SHARD_SIZE, help="largest safetensors file (default %(default)s; e.g. 500MB)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a directory whose tokenizer files to copy (default: the run's --hf model's)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    # a refused input raises: the axon4d command prints its one message, status 2 (axon4d.reliability.errors)
    meta = ckptfiles.read_meta(args.checkpoint)
    print(f"checking {args.checkpoint} (step {meta['step']}): meta.json, DCP's index, every file's checksum")
    with tqdm(unit="B", unit_scale=True, desc=f"writing {args.out}", file=sys.stdout, mininterval=1.0) as bar:

        def advance(nbytes: int, total: int) -> None:
            bar.total = total
            bar.update(nbytes)

        written = export_checkpoint(
            args.checkpoint,
            args.out,
            max_shard_size=args.max_shard_size,
            tokenizer=args.tokenizer,
            overwrite=args.overwrite,
            progress=advance,
        )
    shards = [n for n in written if n.endswith(".safetensors")]
    rest = [n for n in written if n not in shards]
    print(f"wrote {args.out}: {len(shards)} safetensors file{'s' * (len(shards) > 1)}, {', '.join(rest)}")
    return 0
