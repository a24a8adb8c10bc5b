"""`pretrain generate`: sample text from a checkpoint or an export with the KV cache."""

from __future__ import annotations

from pretrain.errors import UserError


def generate_cli(args) -> None:
    import torch

    from pretrain.hf.export import load_for_inference
    from pretrain.model.generate import sample

    model, tokenizer, eot = load_for_inference(args.model, "cuda" if torch.cuda.is_available() else "cpu")
    prompt = tokenizer.encode(args.prompt).ids if args.prompt else [eot]
    if len(prompt) + args.max_new_tokens > model.args.max_seq_len:
        raise UserError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {args.max_new_tokens} exceeds the "
                        f"model's max_seq_len {model.args.max_seq_len}: shorten one")
    new = sample(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, seed=args.seed, eos_id=eot)
    print(args.prompt + tokenizer.decode(new), flush=True)
