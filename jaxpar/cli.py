"""Command-line pieces that several commands share (jaxpar.sample and jaxpar.eval read a model the same
way). Argument parsing lives here and in the commands' own modules, never in the layers below.
"""

from jaxpar.core.errors import ArgumentParser
from jaxpar.core.paths import given


def add_model_source(parser: ArgumentParser) -> None:
    """--ckpt RUN_DIR or --hf HF_DIR, and the mesh to run on."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--ckpt", type=given("--ckpt"), help="a training run's --out directory, or its checkpoints folder")
    source.add_argument("--hf", metavar="HF_DIR", type=given("--hf"), help="a Hugging Face directory (GPT-2 or Llama), "
                        "as save_pretrained writes it: used as it is, without training")
    parser.add_argument("--block-size", type=int, help="with --hf: the window in tokens (default: "
                        "max_position_embeddings, at most 1024)")
    parser.add_argument("--mesh", default="dp=1", help="e.g. tp=2 (default: one device)")
