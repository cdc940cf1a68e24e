"""`python -m jaxpar.sample --ckpt DIR` (or `--hf HF_DIR`): generate text on any mesh, with a KV cache
(jaxpar.inference.sample generates it)."""

import math
import sys

try:
    from jaxpar.cli import add_model_source
    from jaxpar.core.errors import (
        ArgumentParser,
        UserError,
        exit_on_interrupt,
        exit_on_user_error,
        out_of_memory_as_user_error,
    )
    from jaxpar.inference.loading import load_source, source_name
    from jaxpar.inference.sample import Streamer, end_of_text, generate, prompt_ids
except KeyboardInterrupt:  # Ctrl-C while JAX loads: one line and 130, as main's own
    print("jaxpar.sample: interrupted", file=sys.stderr)
    sys.exit(130)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="jaxpar.sample", description="Generate text from a checkpoint.")
    add_model_source(parser)
    parser.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy decoding")
    parser.add_argument("--top-k", type=int, default=200, help="sample from the k likeliest; 0: all")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--stop-at-eot", action="store_true",
                        help="end each sample at its end-of-text token")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the whole window for every token (to compare speed)")
    return parser


def check_numbers(args) -> None:
    """The numeric flags' ranges, before the model loads."""
    for name, least in [("max_new_tokens", 1), ("temperature", 0), ("top_k", 0),
                        ("num_samples", 1)]:
        if getattr(args, name) < least:
            raise UserError(f"--{name.replace('_', '-')} must be at least {least}, "
                            f"got {getattr(args, name)}")
    if not math.isfinite(args.temperature):  # nan passes `< 0`, and inf turns every logit into 0
        raise UserError(f"--temperature must be a finite number (0: greedy), got {args.temperature}")
    if not -2**31 <= args.seed < 2**31:  # the seed enters the jitted decoders as an int32
        raise UserError(f"--seed must fit in 32 bits (from {-2**31} to {2**31 - 1}), got {args.seed}")


def main(argv: list[str] | None = None) -> None:
    with exit_on_interrupt("jaxpar.sample"):
        run_command(argv)


def run_command(argv: list[str] | None) -> None:
    """The command itself: the model loaded, the text generated and printed."""
    with exit_on_user_error("jaxpar.sample"):
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        check_numbers(args)
        model = load_source(args, "jaxpar.sample")
        if model.tokenizer is None:
            raise UserError(f"'{args.hf}' has no tokenizer.json, which jaxpar.sample needs to read the "
                            "prompt and write text; copy the model's tokenizer.json into it")
        prompt_ids(model.tokenizer, args.prompt)  # before anything is printed
        eot = end_of_text(model.tokenizer) if args.stop_at_eot else None
        single = args.num_samples == 1
        if single:
            print(args.prompt, end="", flush=True)
        streamer = Streamer(model.tokenizer, eot) if single else None
        with out_of_memory_as_user_error("lower --num-samples"):
            result = generate(model, args.prompt, args.max_new_tokens, args.temperature,
                              args.top_k, args.seed, args.num_samples, not args.no_cache,
                              streamer, args.stop_at_eot)
        if streamer is not None:
            streamer.finish()
    print("" if single else "\n---------------\n".join(result.texts))
    print(f"jaxpar.sample: {source_name(args, model)}, {args.num_samples} x "
          f"{result.new_tokens} tokens in {result.seconds:.2f} s: {result.tokens_per_s:,.0f} "
          f"tokens/s ({'full recomputation, no cache' if args.no_cache else 'KV cache'}; "
          f"compile {result.compile_seconds:.1f} s not counted)", file=sys.stderr)


if __name__ == "__main__":
    main()
